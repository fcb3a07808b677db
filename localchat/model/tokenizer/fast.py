"""A model's tokenizer through the ``tokenizers`` library alone, as transformers builds it.

What it is: ``FastTokenizer``, the part of transformers' ``TokenizersBackend`` that mlx-lm's
``TokenizerWrapper`` and localchat use (``encode``, ``decode``, ``apply_chat_template``, the
special tokens, the vocabulary), made from a model folder's ``tokenizer.json`` and
``tokenizer_config.json`` the way transformers 5 makes it for a plain
``PreTrainedTokenizerFast``/``TokenizersBackend`` class: the same Rust tokenizer file, then
the config's added tokens and named special tokens added where the file lacks them, no
truncation or padding. ``read_settings`` says whether a folder is such a plain one (and why
not); other folders go through transformers (``tokenizer/__init__.py``). A request the chat
template renderer does not handle (``template.Unsupported``) is answered by transformers,
loaded then.

What it is not: a general transformers replacement. Equality with transformers (token ids,
the Rust tokenizer's whole configuration, rendered prompts) is tested in
``tests/model/test_fast_tokenizer.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import template as chat

PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Model types whose hub tokenizer class transformers replaces by its own (transformers'
# ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``; tests/model/test_fast_tokenizer.py keeps it equal).
REPLACED_CLASS_TYPES = frozenset({
    "arctic", "chatlm", "ernie4_5", "ernie4_5_moe", "fuyu", "h2ovl_chat", "hyperclovax",
    "hyperclovax_vlm", "hyperclovax_vision_v2", "internlm2", "internlm3", "iquestcoder", "jamba",
    "llava", "llava_next", "minicpm3", "minicpmv", "minimax_m2", "modernbert",
    "modernbert-decoder", "molmo", "molmo2", "nemotron", "nvfp4", "opencua", "openvla",
    "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen4_exp", "step3_vl", "vipllava", "cohere_asr", "camembertv2-base",
    "siglip2", "smolvlm"})
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
         "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the config has none


class NotPlain(Exception):
    """The folder's tokenizer is one transformers builds its own way (the reason)."""


@dataclass(frozen=True)
class Settings:
    """What transformers reads from a plain folder besides ``tokenizer.json``."""

    folder: Path
    config: dict  # tokenizer_config.json as read (``init_kwargs``)
    special: dict[str, Any] = field(default_factory=dict)  # name -> str or AddedToken fields
    extra: tuple = ()  # extra special tokens (str or AddedToken fields)
    added: tuple = ()  # the config's added_tokens_decoder entries, by id
    chat_template: str | dict | None = None
    model_max_length: int = VERY_LARGE_INTEGER
    clean_up: bool = False
    split_special_tokens: bool = False


def read_settings(folder: Path, *, any_class: bool = False) -> Settings:
    """The settings of a plain folder (``any_class``: of any tokenizer class, for ``check``).

    Raises:
        NotPlain: no ``tokenizer.json``, or a class, code or file transformers treats apart.
    """
    if not (folder / "tokenizer.json").is_file():
        raise NotPlain("no tokenizer.json")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        model = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise NotPlain(f"cannot read tokenizer_config.json or config.json ({err})") from None
    if not isinstance(config, dict) or not isinstance(model, dict):
        raise NotPlain("tokenizer_config.json or config.json is not an object")
    cls = config.get("tokenizer_class")
    if cls not in PLAIN_CLASSES and not any_class:
        raise NotPlain(f"tokenizer class {cls} (transformers builds it its own way)")
    if model.get("model_type") in REPLACED_CLASS_TYPES and not any_class:
        raise NotPlain(f"model type {model.get('model_type')} (transformers picks its class)")
    for key in ("auto_map", "chat_template_type", "gguf_file", "tokenizer_file",
                "init_inputs",
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        if key in config:
            raise NotPlain(f"tokenizer_config.json sets {key}")
    for name in ("added_tokens.json", "special_tokens_map.json", "tokenizer.model",
                 "additional_chat_templates"):
        if (folder / name).exists():
            raise NotPlain(f"the folder has {name}")
    added = config.get("added_tokens_decoder") or {}
    if not isinstance(added, dict) or not all(_token_fields(v) for v in added.values()):
        raise NotPlain("added_tokens_decoder is not a map of tokens")
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, dict):
        special_extra: dict = extra
        extra = []
    else:
        special_extra = {}
    if not isinstance(extra, list) or not all(_token_value(t) for t in extra):
        raise NotPlain("extra special tokens are not a list of tokens")
    special: dict[str, Any] = {}
    by_content = {v["content"]: v for v in added.values()}
    for key, value in config.items():
        if key in NAMED or (key.endswith("_token") and isinstance(value, str)):
            if value is None:
                continue
            if not _token_value(value):
                raise NotPlain(f"{key} is not a token")
            special[key] = value
    for key, value in special_extra.items():
        if not _token_value(value):
            raise NotPlain(f"{key} is not a token")
        special[key] = value
    # A named token that is also an added token is that added token (flags included); the
    # named ones first, in transformers' order, then the model's own (``image_token``…).
    order = [k for k in NAMED if k in special] + [k for k in special if k not in NAMED]
    special = {k: by_content.get(_content(special[k]), special[k]) for k in order}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):
        try:
            template = {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError):
            raise NotPlain("chat_template is a list without names") from None
    if template is not None and not isinstance(template, (str, dict)):
        raise NotPlain("chat_template is neither text nor named templates")
    limit = config.get("model_max_length", config.get("max_len"))
    return Settings(
        folder=folder, config=config, special=special,
        extra=tuple(by_content.get(_content(t), t) for t in extra),
        added=tuple(added[k] for k in sorted(added, key=int)),
        chat_template=template,
        model_max_length=int(limit) if limit is not None else VERY_LARGE_INTEGER,
        clean_up=bool(config.get("clean_up_tokenization_spaces", False)),
        split_special_tokens=bool(config.get("split_special_tokens", False)))


def _token_fields(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("content"), str)


def _token_value(value) -> bool:
    """A str, or a serialized AddedToken (``{"__type": "AddedToken", "content": …}``)."""
    return isinstance(value, str) or (_token_fields(value) and value.get("__type") ==
                                      "AddedToken")


def _content(value) -> str:
    return value if isinstance(value, str) else value["content"]


def _added_token(value, special: bool | None = None):
    from tokenizers import AddedToken

    if isinstance(value, str):
        return AddedToken(value, special=True if special is None else special)
    fields = {k: v for k, v in value.items() if k in ("content", "single_word", "lstrip",
                                                       "rstrip", "normalized", "special")}
    return AddedToken(**fields)


def build_backend(settings: Settings):
    """The Rust tokenizer transformers' ``TokenizersBackend.__init__`` ends up with."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(settings.folder / "tokenizer.json"))
    backend.no_truncation()  # transformers sets these per call; off for every call here
    backend.no_padding()
    present = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    to_add = [_added_token(t) for t in settings.added if repr(_added_token(t)) not in present]
    encoder = [t.content for t in backend.get_added_tokens_decoder().values()] + \
        [t.content for t in to_add]
    for value in list(settings.special.values()) + list(settings.extra):
        if _content(value) not in encoder and _content(value) not in [t.content
                                                                       for t in to_add]:
            to_add.append(_added_token(value))
    named = {_content(v) for v in settings.special.values()}
    for token in to_add:
        if not token.special and token.content in named:
            token.special = True
    if to_add:
        backend.add_tokens(to_add)
    backend.encode_special_tokens = settings.split_special_tokens
    if backend.post_processor is None:
        # transformers' update_post_processor with neither BOS nor EOS added: ids unchanged
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(single="$A:0",
                                                               pair="$A:0 $B:1")
    return backend


class Vocab(Mapping):
    """The vocabulary as ``get_vocab()`` gives it (added tokens included), answering ``in``
    and ``[]`` from the tokenizer itself: building the whole dict costs ~70 ms on a 50k
    vocabulary, and mlx-lm only asks for a few marker tokens."""

    def __init__(self, backend):
        self._backend = backend
        self._whole: dict[str, int] | None = None

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self._backend.token_to_id(token) is not None

    def __getitem__(self, token: str) -> int:
        found = self._backend.token_to_id(token) if isinstance(token, str) else None
        if found is None:
            raise KeyError(token)
        return found

    def get(self, token, default=None):
        found = self._backend.token_to_id(token) if isinstance(token, str) else None
        return default if found is None else found

    def _all(self) -> dict[str, int]:
        if self._whole is None:
            self._whole = self._backend.get_vocab(with_added_tokens=True)
        return self._whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class FastTokenizer:
    """transformers' tokenizer for a plain folder, without transformers (see the module)."""

    def __init__(self, settings: Settings, backend=None):
        self.settings = settings
        self.backend_tokenizer = backend if backend is not None else build_backend(settings)
        self.init_kwargs = dict(settings.config)
        self.name_or_path = str(settings.folder)
        self.chat_template = settings.chat_template
        self.model_max_length = settings.model_max_length
        self.clean_up_tokenization_spaces = settings.clean_up
        self.split_special_tokens = settings.split_special_tokens
        self._transformers = None
        self._vocab = Vocab(self.backend_tokenizer)

    # -- special tokens (as transformers names them) ---------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: _content(v) for k, v in self.settings.special.items()}

    def __getattr__(self, name: str):
        # bos_token, eos_token_id, image_token… as transformers answers them
        if name.endswith("_token") and not name.startswith("_"):
            value = self.settings.special.get(name)
            return None if value is None else _content(value)
        if name.endswith("_token_id") and not name.startswith("_"):
            token = self.__getattr__(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def all_special_tokens(self) -> list[str]:
        seen, out = set(), []
        for value in list(self.settings.special.values()) + list(self.settings.extra):
            token = _content(value)
            if token not in seen:
                seen.add(token)
                out.append(token)
        return out

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # -- vocabulary ------------------------------------------------------------------------

    def get_vocab(self) -> Vocab:
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if i not in special]

    # -- text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """Token ids of ``text`` (``verbose`` and the like are accepted and ignored: no
        truncation or padding here, as transformers does by default)."""
        if kwargs.get("truncation") or kwargs.get("padding") or kwargs.get("text_pair"):
            return self._fallback().encode(text, add_special_tokens=add_special_tokens,
                                           **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":
            # (transformers skips the clean-up for BPE: it would corrupt the text)
            text = (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!")
                    .replace(" ,", ",").replace(" ' ", "'").replace(" n't", "n't")
                    .replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
                    .replace(" 're", "'re"))
        return text

    def batch_decode(self, sequences, **kwargs) -> list[str]:
        return [self.decode(s, **kwargs) for s in sequences]

    def apply_chat_template(self, conversation, tools=None, documents=None,
                            chat_template=None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True,
                            enable_thinking=None, **kwargs):
        """transformers' ``apply_chat_template`` for what localchat and mlx-lm ask of it
        (a single conversation, text or ids); anything else is transformers' own."""
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        unusual = {"continue_final_message", "return_assistant_tokens_mask",
                   "sanitize_control_tokens", "padding", "truncation", "max_length",
                   "return_tensors", "tokenizer_kwargs"}
        if (tokenize and return_dict) or any(kwargs.get(k) for k in unusual) or \
                not isinstance(conversation, list) or \
                (conversation and not isinstance(conversation[0], dict)):
            return self._fallback_template(conversation, tools, documents, chat_template,
                                           add_generation_prompt, tokenize, return_dict,
                                           kwargs)
        for key in unusual:
            kwargs.pop(key, None)
        try:
            text = chat.render(self._template(chat_template, tools), conversation,
                               tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt,
                               special_tokens=self.special_tokens_map, **kwargs)
        except chat.Unsupported:
            return self._fallback_template(conversation, tools, documents, chat_template,
                                           add_generation_prompt, tokenize, return_dict,
                                           kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def compile_template(self) -> None:
        """Compile the chat template a plain render takes, now rather than at the first render
        (the engine does it while the CPU weights are still being read). A template that does
        not compile is left for that render to report."""
        from jinja2 import TemplateError

        try:
            template = self._template(None, None)
            if isinstance(template, str):
                chat.compiled(template)
        except (ImportError, ValueError, TemplateError):
            pass

    def _template(self, name: str | None, tools) -> str:
        """transformers' ``get_chat_template``."""
        if isinstance(self.chat_template, dict):
            if name is not None and name in self.chat_template:
                return self.chat_template[name]
            if name is None:
                if tools is not None and "tool_use" in self.chat_template:
                    return self.chat_template["tool_use"]
                if "default" in self.chat_template:
                    return self.chat_template["default"]
                raise ValueError("This model has multiple chat templates with no default "
                                 f"specified! ({sorted(self.chat_template)})")
        if name is not None:
            return name
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because "
                             "tokenizer.chat_template is not set")
        return self.chat_template

    # -- transformers, for what this does not do -------------------------------------------

    def _fallback(self):
        """transformers' own tokenizer of this folder (loaded once, on first need)."""
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(self.settings.folder)
        return self._transformers

    def _fallback_template(self, conversation, tools, documents, chat_template,
                           add_generation_prompt, tokenize, return_dict, kwargs):
        return self._fallback().apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=tokenize,
            return_dict=return_dict, **kwargs)
