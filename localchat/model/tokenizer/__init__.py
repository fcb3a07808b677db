"""A model's tokenizer and chat template: without transformers where that gives the same ids.

What it is: ``load_tokenizer`` — mlx-lm's ``TokenizerWrapper`` (reasoning markers, tool-call
parser, EOS ids, ``detokenizer``: every attribute localchat and mlx-lm use) around one of:
- the fast path (``fast.FastTokenizer``): ``tokenizers`` + jinja2, ~0.1 s, for a folder
  whose ``tokenizer.json`` transformers uses as it is (a plain ``PreTrainedTokenizerFast``
  class: the embedded default model, Llama 3.x, gpt-oss and most conversions), and for any
  other folder once transformers has been seen to build the very same tokenizer from it
  (``check``: recorded in ``paths.tokenizer_checks_path()`` keyed by the tokenizer files'
  digest and the library versions, so a changed file or an upgrade checks again);
- transformers (mlx-lm's own ``load``, as before) for the rest: a SentencePiece
  ``tokenizer.model`` only, a tokenizer class that builds its own pipeline and has not been
  checked yet, custom code, a Python chat template. Loaded only then.
``plan`` says which path a folder takes and why (``localchat inspect`` shows it).

What it is not: the model (``model/mlxlm.py``) or the rendering of a conversation
(``model/engine.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from ...files import read_memo, write_memo
from ...paths import tokenizer_checks_path
from .. import mlxlm
from .fast import FastTokenizer, NotPlain, read_settings
from .stream import StreamDetokenizer

FAST = "tokenizers + jinja2"
SLOW = "transformers"
CHECK_VERSION = 1  # bump when what the fast path builds changes: every folder checks again
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                    "chat_template.jinja", "special_tokens_map.json", "added_tokens.json")


@dataclass(frozen=True)
class Plan:
    """Which path a model folder's tokenizer takes, and why."""

    path: str  # FAST or SLOW
    reason: str  # e.g. "plain tokenizer.json", "tokenizer class Qwen2Tokenizer (…)"

    def describe(self) -> str:
        return f"{self.path} ({self.reason})"


def plan(folder: Path) -> Plan:
    """The path ``load_tokenizer`` takes for ``folder``."""
    try:
        read_settings(folder)
        return Plan(FAST, "tokenizer.json as transformers uses it")
    except NotPlain as why:
        if _checked(folder):
            return Plan(FAST, f"checked against transformers: {why}")
        return Plan(SLOW, str(why))


def load_tokenizer(folder: Path, eos_token_ids=None):
    """The model's tokenizer, wrapped as mlx-lm wraps it (see the module docstring).

    Raises:
        whatever the files raise when they are broken (the engine reports it in one line).
    """
    choice = plan(folder)
    if choice.path == FAST:
        try:
            settings = read_settings(folder, any_class=choice.reason.startswith("checked"))
            return wrap(FastTokenizer(settings), eos_token_ids), choice
        except (NotPlain, ImportError) as why:  # files changed since the check, mlx-lm moved
            choice = Plan(SLOW, str(why))
    from mlx_lm.tokenizer_utils import load as load_with_transformers

    wrapper = load_with_transformers(folder, eos_token_ids=eos_token_ids)
    check(folder, wrapper._tokenizer)  # the next start may take the fast path
    return wrapper, choice


def wrap(tokenizer: FastTokenizer, eos_token_ids=None):
    """mlx-lm's ``TokenizerWrapper`` around ``tokenizer``, set up as mlx-lm's ``load`` sets it
    up (tool parser from the config or inferred, EOS ids), with ``StreamDetokenizer``."""
    tu = mlxlm.tokenizer_utils()
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    parser_type = tokenizer.init_kwargs.get("tool_parser_type") or \
        tu._infer_tool_parser(tokenizer)
    parser = start = end = None
    if parser_type is not None:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_type}")
        parser, start, end = module.parse_tool_call, module.tool_call_start, module.tool_call_end
        tokenizer.init_kwargs["tool_parser_type"] = parser_type
    return tu.TokenizerWrapper(tokenizer, detokenizer_for, eos_token_ids=eos_token_ids,
                               tool_parser=parser, tool_call_start=start, tool_call_end=end)


def detokenizer_for(tokenizer) -> StreamDetokenizer:
    """The streaming detokenizer of a tokenizer: its exact decode (specials kept, no clean-up)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        hold = frozenset()
        decoder = backend.decoder.__getstate__() if backend.decoder is not None else b""
        if b'"ByteFallback"' in decoder:
            found = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
            hold = frozenset(i for i in found if i is not None)
        return StreamDetokenizer(functools.partial(backend.decode, skip_special_tokens=False),
                                 hold)
    return StreamDetokenizer(functools.partial(tokenizer.decode, skip_special_tokens=False,
                                               clean_up_tokenization_spaces=False))


# -- checking a folder against transformers ---------------------------------------------------


def same_as(fast: FastTokenizer, hf) -> str | None:
    """Why ``fast`` is not ``hf`` (transformers' tokenizer of the same folder), or None when
    they are the same: the same Rust tokenizer (pipeline, vocabulary, added tokens), special
    tokens, chat template and decode settings, and transformers' own encode and decode."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(hf)
    if not isinstance(hf, TokenizersBackend):
        return f"{cls.__name__} is not a tokenizers backend"
    for name in ("encode", "decode", "_decode", "_encode_plus", "apply_chat_template",
                 "convert_tokens_to_ids", "tokenize"):
        if getattr(cls, name, None) is not getattr(TokenizersBackend, name, None):
            return f"{cls.__name__} has its own {name}"
    ours = json.loads(fast.backend_tokenizer.to_str())
    theirs = json.loads(hf.backend_tokenizer.to_str())
    for key in set(ours) | set(theirs):
        if ours.get(key) != theirs.get(key):
            return f"the tokenizer's {key} differs"
    pairs = {"special tokens": (fast.special_tokens_map, hf.special_tokens_map),
             "special ids": (fast.all_special_ids, hf.all_special_ids),
             "chat template": (fast.chat_template, hf.chat_template),
             "model_max_length": (fast.model_max_length, hf.model_max_length),
             "clean-up": (fast.clean_up_tokenization_spaces, hf.clean_up_tokenization_spaces),
             "split specials": (fast.split_special_tokens, hf.split_special_tokens),
             "encode_special_tokens": (fast.backend_tokenizer.encode_special_tokens,
                                       hf.backend_tokenizer.encode_special_tokens)}
    for what, (a, b) in pairs.items():
        if a != b:
            return f"{what} differ"
    return None


def check(folder: Path, hf) -> bool:
    """Record whether transformers' tokenizer ``hf`` of ``folder`` is the one the fast path
    builds (ignoring the class name); True when it is."""
    try:
        fast = FastTokenizer(read_settings(folder, any_class=True))
        why = same_as(fast, hf)
    except (NotPlain, ImportError, OSError, ValueError) as err:
        why = str(err) or type(err).__name__
    key = _key(folder)
    if key is None:
        return False
    memo = read_memo(tokenizer_checks_path())
    verdict = why or "same"
    memo[key] = [verdict, _entry_check(key, verdict)]
    try:
        write_memo(tokenizer_checks_path(), memo)
    except OSError:
        pass  # (a read-only data folder: checked again next time)
    return why is None


def _checked(folder: Path) -> bool:
    """Whether the memo holds a sound "same" for the folder's files (an entry that is not
    ``[verdict, its check]`` counts as no check: transformers then, and checked again)."""
    key = _key(folder)
    if key is None:
        return False
    entry = read_memo(tokenizer_checks_path()).get(key)
    return entry == ["same", _entry_check(key, "same")]


def _entry_check(key: str, verdict: str) -> str:
    return hashlib.sha256(f"{key}\0{verdict}".encode()).hexdigest()[:16]


def _key(folder: Path) -> str | None:
    """The tokenizer files' digest with the versions that read them."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256(f"v{CHECK_VERSION}".encode())
    try:
        for package in ("transformers", "tokenizers", "jinja2", "mlx-lm"):
            digest.update(f"{package}={version(package)}\0".encode())
        for name in _TOKENIZER_FILES:
            f = folder / name
            if f.is_file():
                digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    except (OSError, PackageNotFoundError):
        return None
    return digest.hexdigest()
