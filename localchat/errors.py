"""Errors localchat raises deep down and translates at the edge.

Every error here carries a message fit to show a user as one line; the CLI prints it and exits
non-zero, the TUI shows it with ``notify``. Nothing here imports MLX.
"""


class LocalchatError(Exception):
    """Base of every error a user may see; ``str(err)`` is the one-line message."""

    exit_code = 1


class ModelNotFound(LocalchatError):
    """The model name is neither the default, a local folder nor a cached Hub repo."""


class ModelBroken(LocalchatError):
    """A model folder exists but cannot be loaded (missing or damaged files)."""


class ConversationNotFound(LocalchatError):
    """No saved conversation has that name."""


class ConversationBusy(LocalchatError):
    """Another process holds the conversation's lock."""


class ContextFull(LocalchatError):
    """The rendered conversation does not fit the model's context window."""


class BadInput(LocalchatError):
    """A prompt, file or batch line that cannot be used (empty, not UTF-8, malformed)."""

    exit_code = 2


class StorageError(LocalchatError):
    """The data folder cannot be written (permissions, full disk)."""
