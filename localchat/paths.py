"""Where localchat keeps its data: one function per location, all under ``data_home()``.

``LOCALCHAT_HOME`` overrides the platform's user data folder (``platformdirs``). Nothing is
created at import; callers create folders when they first write.
"""

import os
from pathlib import Path


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


def models_dir() -> Path:
    """Folder holding models localchat converted itself (the embedded default)."""
    return data_home() / "models"


def locks_dir() -> Path:
    return data_home() / "locks"


def cpu_weights_dir() -> Path:
    """Float32 copies of quantized weights for the Linux CPU path (derived; safe to delete)."""
    return data_home() / "cpu-weights"


def runtime_dir() -> Path:
    """Runtime libraries localchat derives from its wheels (see ``backend.py``)."""
    return data_home() / "cpu-runtime"


def fingerprints_path() -> Path:
    """Memoised sha256 of model weight files, keyed by path, size and mtime."""
    return data_home() / "fingerprints.json"
