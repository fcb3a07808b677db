"""The MCP servers a user configured: the ``mcpServers`` JSON other apps use, checked whole.

What it is: ``load_config`` reads ``$LOCALCHAT_HOME/mcp.json`` (or the file ``--mcp`` names)
into ``ServerSpec`` records — a stdio server is ``command`` with ``args`` and ``env``, a
streamable HTTP server is ``url``. Every field is checked before anything starts; a bad file
is one line (``BadInput``) naming the field. What it is not: starting or calling servers
(``manager.py``).

The format, as Claude Desktop, Cursor and oterm read it::

    {"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time"]},
        "web":  {"url": "http://127.0.0.1:8000/mcp"}}}

localchat also reads ``"timeout"`` (seconds a call may take; default 30),
``"start_timeout"`` (seconds to start and list tools; default 30) and ``"disabled": true``
(listed, never started), which other apps ignore.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from ..errors import BadInput

DEFAULT_TIMEOUT = 30.0
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a server's name shows in notices and logs' names
KNOWN = {"command", "args", "env", "cwd", "url", "headers", "timeout", "start_timeout",
         "disabled", "type"}


@dataclass(frozen=True)
class ServerSpec:
    """One configured server: ``command`` (stdio) or ``url`` (streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT  # seconds a call may take
    disabled: bool = False
    start_timeout: float = DEFAULT_TIMEOUT  # seconds to start and list its tools

    @property
    def where(self) -> str:
        """How the server is reached, for ``localchat mcp list``."""
        return self.url or " ".join([self.command or "", *self.args])


def default_path() -> Path:
    """Where the app and ``ask`` look when no ``--mcp`` is given."""
    return paths.data_home() / "mcp.json"


def load_config(path: Path | None = None, *, required: bool = False) -> list[ServerSpec]:
    """The servers of ``path`` (default: ``default_path()``), in the file's order.

    Args:
        required: a missing file is an error (``--mcp FILE``), not "no servers".
    Raises:
        BadInput: unreadable, not JSON, or a field that is not what the format says.
    """
    path = path or default_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if required:
            raise BadInput(f"{path}: no such MCP config file") from None
        return []
    except OSError as err:
        raise BadInput(f"{path}: cannot read the MCP config: {err.strerror}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"{path}: the MCP config is not UTF-8") from None
    except ValueError as err:
        raise BadInput(f"{path}: the MCP config is not JSON ({err})") from None
    return parse_config(doc, str(path))


def parse_config(doc: object, where: str = "mcp.json") -> list[ServerSpec]:
    """``doc`` (a parsed config) checked into servers; raises BadInput naming the field."""
    if not isinstance(doc, dict) or not isinstance(doc.get("mcpServers"), dict):
        raise BadInput(f'{where}: needs an object "mcpServers" of servers by name')
    return [_server(name, body, f"{where}: mcpServers.{name}")
            for name, body in doc["mcpServers"].items()]


def _server(name: str, body: object, at: str) -> ServerSpec:
    if not NAME.match(name):
        raise BadInput(f"{at}: a server's name is 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(body, dict):
        raise BadInput(f"{at}: must be an object")
    extra = sorted(set(body) - KNOWN)
    if extra:
        raise BadInput(f"{at}.{extra[0]}: unknown field (known: {', '.join(sorted(KNOWN))})")
    command, url = body.get("command"), body.get("url")
    if (command is None) == (url is None):
        raise BadInput(f"{at}: needs either \"command\" (a stdio server) or \"url\" "
                       "(streamable HTTP), not both")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise BadInput(f"{at}.command: must be a non-empty string")
    if url is not None and (not isinstance(url, str) or
                            not url.startswith(("http://", "https://"))):
        raise BadInput(f"{at}.url: must be an http:// or https:// address")
    args = body.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise BadInput(f"{at}.args: must be a list of strings")
    env = _strings(body.get("env", {}), f"{at}.env")
    headers = _strings(body.get("headers", {}), f"{at}.headers")
    cwd = body.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise BadInput(f"{at}.cwd: must be a string")
    timeout = _seconds(body.get("timeout", DEFAULT_TIMEOUT), f"{at}.timeout")
    start_timeout = _seconds(body.get("start_timeout", DEFAULT_TIMEOUT), f"{at}.start_timeout")
    disabled = body.get("disabled", False)
    if not isinstance(disabled, bool):
        raise BadInput(f"{at}.disabled: must be true or false")
    return ServerSpec(name, command, tuple(args), env, cwd, url, headers, timeout, disabled,
                      start_timeout)


def _seconds(value: object, at: str) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or not 0 < value <= 3600):
        raise BadInput(f"{at}: must be seconds, more than 0 and at most 3600")
    return float(value)


def _strings(value: object, at: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadInput(f"{at}: must be an object of strings")
    return dict(value)
