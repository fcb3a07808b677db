"""Where localchat keeps its data: one function per location, all under ``data_home()``.

``LOCALCHAT_HOME`` overrides the platform's user data folder (``platformdirs``). Nothing is
created at import; callers create folders when they first write.

Privacy: conversations are private. The entry points (``cli.main``, the follower) call
``keep_private`` first, so whatever the user's umask every folder localchat creates is 0700
and every file 0600 (database and WAL, caches, logs, sidecars, converted models); a data
folder that already exists and is open to others gets a one-line notice
(``privacy_notice``), never a silent chmod of a folder the user chose.
"""

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
USER_UMASK: int | None = None  # the umask the process started with (files the user names)


def keep_private() -> None:
    """Create everything from here on owner-only (0700 folders, 0600 files), whatever the
    umask; remembers the user's own for files outside the data folder (``user_mode``)."""
    global USER_UMASK
    old = os.umask(PRIVATE_UMASK)
    if USER_UMASK is None:
        USER_UMASK = old


def user_mode(mode: int = 0o666) -> int:
    """``mode`` under the user's own umask: for files the user names (``batch -o``)."""
    return mode & ~(USER_UMASK if USER_UMASK is not None else 0o022)


def ensure(folder: Path) -> Path:
    """``folder``, created owner-only if missing."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def privacy_notice() -> str | None:
    """One line when the data folder exists and others may read or enter it, else None."""
    home = data_home()
    try:
        mode = stat.S_IMODE(home.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (f"{home} can be read by other users (mode {mode:o}); your conversations are in "
            f"it: `chmod 700 {home}` keeps them private")


def data_home() -> Path:
    """The root of everything localchat writes (database, KV caches, converted models)."""
    env = os.environ.get("LOCALCHAT_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localchat", appauthor=False))


def database_path() -> Path:
    return data_home() / "localchat.db"


def kv_root() -> Path:
    """Folder holding one sub-folder of KV cache segments per conversation."""
    return data_home() / "kv"


def kv_folder(conversation_id: int) -> Path:
    """The KV cache folder of one conversation."""
    return kv_root() / str(conversation_id)


def images_dir() -> Path:
    """Folder holding the images of conversations, one file per image content hash."""
    return data_home() / "images"


def models_dir() -> Path:
    """Folder holding models localchat converted itself (the embedded default)."""
    return data_home() / "models"


def logs_dir() -> Path:
    """Crash logs (``crashlog.py``) and the follower ranks' output (``launch.py``)."""
    return data_home() / "logs"


def locks_dir() -> Path:
    return data_home() / "locks"


def cpu_weights_dir() -> Path:
    """Float32 copies of quantized weights for the Linux CPU path (derived; safe to delete)."""
    return data_home() / "cpu-weights"


def runtime_dir() -> Path:
    """Runtime libraries localchat derives from its wheels (see ``cpu/backend.py``)."""
    return data_home() / "cpu-runtime"


def digests_path() -> Path:
    """Memoised sha256 of model weight files, keyed by path, size and mtime."""
    return data_home() / "digests.json"


def tokenizer_checks_path() -> Path:
    """Which models' tokenizers transformers was seen to build as the fast path does."""
    return data_home() / "tokenizer-checks.json"


def code_cache_dir() -> Path:
    """mlx-lm's modules compiled without their transformers imports (``model/mlxlm.py``)."""
    return data_home() / "code-cache"


def prefill_models_dir() -> Path:
    """Each model's measured prefill cost on this machine (``cacheview/prefillmodel.py``;
    derived)."""
    return data_home() / "prefill-models"
