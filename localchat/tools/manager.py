"""Running MCP servers and calling their tools, through the official SDK, from plain threads.

What it is: ``Tools`` starts the configured servers (``config.py``) as the SDK's ``Client``s
on one background asyncio loop thread, lists their tools and calls them with a timeout; the
model thread and the app's UI thread call it synchronously. What it is not: deciding whether
a call may run (``turns.py`` and the front ends) or what the model sees (``turns.py``).

Failures never escape as tracebacks: a server that does not start, dies, hangs past its
``timeout``, writes something that is not MCP or whose tool raises comes back as a
``ServerState`` with an ``error`` or a ``ToolResult`` with ``error`` set — one line each. A
server's stderr goes to ``$LOCALCHAT_HOME/logs/mcp-<name>.log``, never to the screen.

Why one loop thread: the SDK is asyncio (anyio) and a client must be entered and left in the
same task; each server gets a task that holds its client open until ``close``, and each call
is a task of its own on that loop, so a hanging call can be cancelled (Esc) without the
server. Each stdio server runs on a leash (``leash.py``): whatever of it the SDK's shutdown
leaves alive is killed by ``close``, or at exit when ``close`` never ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from .config import ServerSpec
from .leash import Leash

MAX_RESULT_CHARS = 20_000  # a result longer than this reaches the model cut, with a notice


class ToolStopped(Exception):
    """A call the user stopped (Esc) before it answered."""


@dataclass(frozen=True)
class ToolInfo:
    """One tool a server offers."""

    server: str
    name: str
    description: str
    schema: dict

    def as_function(self) -> dict:
        """The tool as chat templates take it (OpenAI's function shape)."""
        return {"type": "function", "function": {
            "name": self.name, **({"description": self.description} if self.description else {}),
            "parameters": self.schema or {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ServerState:
    """A server after ``start``: its tools, or the one line that says why it has none."""

    name: str
    where: str
    tools: tuple[ToolInfo, ...] = ()
    error: str = ""
    disabled: bool = False

    @property
    def running(self) -> bool:
        return not self.error and not self.disabled


@dataclass(frozen=True)
class ToolResult:
    """What a call returned: ``text`` for the model (cut to ``MAX_RESULT_CHARS``), ``full``
    the whole text; ``error`` a one-line reason when the call failed (the model is told)."""

    tool: str
    text: str
    full: str = ""
    error: str = ""
    seconds: float = 0.0

    @property
    def cut(self) -> bool:
        return len(self.full) > len(self.text) and not self.error


@dataclass
class _Server:
    spec: ServerSpec
    client: object = None
    stop: asyncio.Event | None = None
    task: asyncio.Task | None = None
    state: ServerState | None = None
    log: object = None
    dead: str = ""  # set when the server's client ended on its own (the process exited)
    calls: set = field(default_factory=set)
    pidfile: Path | None = None  # a stdio server's pid (``leash.py``)


class Tools:
    """The servers of one config, started on demand; safe to call from any thread."""

    def __init__(self, specs: list[ServerSpec], log_dir: Path | None = None):
        self.specs = list(specs)
        self.log_dir = log_dir
        self._servers: dict[str, _Server] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._leash = Leash()  # no stdio server outlives us (``close``, or at exit)

    # -- the loop thread ---------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._quiet_sdk()
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="localchat-mcp", daemon=True)
                self._thread.start()
            return self._loop

    def _quiet_sdk(self) -> None:
        """The SDK logs a server's bad output with a traceback through ``logging``: into
        ``logs/mcp.log``, never onto the screen (the app's, or a script's stderr)."""
        import logging

        log = logging.getLogger("mcp")
        if not any(getattr(h, "localchat", False) for h in log.handlers):
            path = self.log_path("sdk").with_name("mcp.log")
            paths.ensure(path.parent)
            handler = logging.FileHandler(path, encoding="utf-8", delay=True)
            handler.localchat = True  # type: ignore[attr-defined]
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
            log.addHandler(handler)
        log.propagate = False

    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    # -- starting ------------------------------------------------------------------------------

    def start(self, names: list[str] | None = None) -> list[ServerState]:
        """Start the servers named (all when None) that are not running, in parallel; each
        one's state, in the config's order. Never raises for a server's failure."""
        wanted = [s for s in self.specs if names is None or s.name in names]
        futures = {}
        for spec in wanted:
            known = self._servers.get(spec.name)
            if known is not None and known.state is not None and known.state.running \
                    and not known.dead:
                continue
            if spec.disabled:
                self._servers[spec.name] = _Server(spec, state=ServerState(
                    spec.name, spec.where, disabled=True))
                continue
            futures[spec.name] = self._submit(self._start(spec))
        for name, fut in futures.items():
            spec = next(s for s in wanted if s.name == name)
            try:
                fut.result(spec.start_timeout + 5)  # (_start times itself out first)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                self._servers[name] = _Server(spec, state=ServerState(
                    name, spec.where, error=f"did not start in {spec.start_timeout:g} s"))
        return [self._servers[s.name].state for s in wanted]

    async def _start(self, spec: ServerSpec) -> None:
        srv = _Server(spec)
        self._servers[spec.name] = srv
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        srv.stop = asyncio.Event()
        srv.task = asyncio.create_task(self._hold(srv, ready))
        try:
            tools = await asyncio.wait_for(asyncio.shield(ready), spec.start_timeout)
            srv.state = ServerState(spec.name, spec.where, tools=tuple(tools))
        except asyncio.TimeoutError:
            ready.cancel()  # (nobody waits for it any more)
            srv.task.cancel()
            srv.state = ServerState(spec.name, spec.where, error=(
                f"did not start in {spec.start_timeout:g} s (its log: "
                f"{self.log_path(spec.name)})"))
        except Exception as err:  # noqa: BLE001 - whatever the SDK raised, as one line
            srv.state = ServerState(spec.name, spec.where, error=(
                f"did not start: {one_line(err)} (its log: {self.log_path(spec.name)})"))

    async def _hold(self, srv: _Server, ready: asyncio.Future) -> None:
        """The server's client, entered and left in this one task (anyio's rule)."""
        from mcp import Client

        try:
            srv.log = self._log_file(srv.spec.name)
            # (Each call is timed by ``_call``; the SDK's own timeout only backs it up.)
            wait = max(srv.spec.timeout, srv.spec.start_timeout)
            async with Client(self._transport(srv), read_timeout_seconds=wait,
                              cache=None) as client:
                listed = await client.list_tools()
                ready.set_result([ToolInfo(srv.spec.name, t.name, t.description or "",
                                           dict(t.input_schema or {})) for t in listed.tools])
                srv.client = client
                await srv.stop.wait()
        except BaseException as err:  # noqa: BLE001 - told to the caller, as one line
            srv.dead = one_line(err) if not isinstance(err, asyncio.CancelledError) else \
                "stopped"
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else
                                    RuntimeError(srv.dead))
            if isinstance(err, asyncio.CancelledError):
                raise
        finally:
            srv.dead = srv.dead or "the server closed"
            srv.client = None
            for call in list(srv.calls):  # calls waiting on a server that is gone
                call.cancel()
            # The SDK's shutdown is over (or was cancelled): whatever is left of the process
            # group (a server stuck in a call, its children) is killed.
            self._leash.release(srv.pidfile)
            if srv.log is not None:
                srv.log.close()

    def _transport(self, srv: _Server):
        spec = srv.spec
        if spec.url:
            if spec.headers:
                import httpx
                from mcp.client.streamable_http import streamable_http_client

                return streamable_http_client(spec.url, http_client=httpx.AsyncClient(
                    headers=spec.headers, timeout=spec.timeout))
            return spec.url
        from mcp.client.stdio import StdioServerParameters, stdio_client

        command, args, srv.pidfile = self._leash.wrap(
            spec.name, spec.command, list(spec.args),
            {"PATH": os.environ.get("PATH", os.defpath), **spec.env}, spec.cwd)
        params = StdioServerParameters(command=command, args=args, env=spec.env or None,
                                       cwd=spec.cwd)
        return stdio_client(params, errlog=srv.log)

    def log_path(self, name: str) -> Path:
        """Where server ``name``'s stderr goes."""
        return (self.log_dir or paths.logs_dir()) / f"mcp-{name}.log"

    def _log_file(self, name: str):
        path = self.log_path(name)
        paths.ensure(path.parent)
        return open(path, "a", encoding="utf-8", errors="replace")

    # -- using -----------------------------------------------------------------------------

    def states(self) -> list[ServerState]:
        """The servers started so far (a dead one with its reason)."""
        out = []
        for srv in self._servers.values():
            state = srv.state
            if state is not None and state.running and srv.dead:
                state = ServerState(state.name, state.where, error=f"stopped: {srv.dead}")
            if state is not None:
                out.append(state)
        return out

    def tools(self, servers: list[str] | None = None) -> list[ToolInfo]:
        """The tools of the running servers (of ``servers`` only, when given); a name two
        servers offer is the first one's (the model calls tools by name)."""
        seen, out = set(), []
        for state in self.states():
            if state.running and (servers is None or state.name in servers):
                for t in state.tools:
                    if t.name not in seen:
                        seen.add(t.name)
                        out.append(t)
        return out

    def find(self, name: str) -> ToolInfo | None:
        return next((t for t in self.tools() if t.name == name), None)

    def call(self, name: str, arguments: dict, stop: threading.Event | None = None,
             limit: int = MAX_RESULT_CHARS) -> ToolResult:
        """Call tool ``name``; never raises for the server's failures (``ToolResult.error``).

        Args:
            stop: set from another thread (Esc) to give up on the call at once.
            limit: the characters of the result the model gets (``ToolResult.text``).
        Raises:
            ToolStopped: ``stop`` was set before the call answered.
        """
        import time

        tool = self.find(name)
        t0 = time.monotonic()
        if tool is None:
            return ToolResult(name, "", error=f"no running server offers a tool {name!r}")
        srv = self._servers[tool.server]
        fut = self._submit(self._call(srv, name, arguments))
        timeout = srv.spec.timeout
        while True:
            try:
                text, error = fut.result(0.1)
                break
            except concurrent.futures.TimeoutError:
                if stop is not None and stop.is_set():
                    fut.cancel()
                    raise ToolStopped(f"{name}: stopped") from None
                if time.monotonic() - t0 > timeout + 5:  # (_call times itself out first)
                    fut.cancel()
                    text, error = "", f"{tool.server} did not answer in {timeout:g} s"
                    break
            except concurrent.futures.CancelledError:
                text, error = "", f"{tool.server} stopped: {srv.dead or 'the server closed'}"
                break
        took = time.monotonic() - t0
        if error:
            return ToolResult(name, "", error=error, seconds=took)
        return ToolResult(name, text[:limit], text, seconds=took)

    async def _call(self, srv: _Server, name: str, arguments: dict) -> tuple[str, str]:
        if srv.client is None:
            return "", f"{srv.spec.name} is not running ({srv.dead or 'not started'})"
        task = asyncio.current_task()
        srv.calls.add(task)
        try:
            result = await asyncio.wait_for(srv.client.call_tool(name, arguments),
                                            srv.spec.timeout)
        except asyncio.TimeoutError:
            return "", f"{srv.spec.name} did not answer in {srv.spec.timeout:g} s"
        except asyncio.CancelledError:
            if srv.dead:
                return "", f"{srv.spec.name} stopped: {srv.dead}"
            raise
        except Exception as err:  # noqa: BLE001 - the server's failure, as one line
            return "", f"{srv.spec.name}: {one_line(err)}"
        finally:
            srv.calls.discard(task)
        text = result_text(result)
        if getattr(result, "is_error", False):
            return "", f"{name} failed: {first_line(text) or 'the tool reported an error'}"
        return text, ""

    def close(self) -> None:
        """Stop every server and the loop: each stdio server is given the SDK's graceful
        shutdown, then whatever is left of its process group is killed."""
        if self._loop is None:
            self._leash.release_all()
            return

        async def stop_all() -> None:
            tasks = []
            for srv in self._servers.values():
                if srv.stop is not None:
                    srv.stop.set()
                if srv.task is not None:
                    tasks.append(srv.task)
            if tasks:
                # Room for the SDK's own shutdown of a stdio server (stdin closed, 2 s, then
                # SIGTERM, 2 s, then SIGKILL), which lets a server end cleanly; a task cancelled
                # in it can abandon the process, which the leash then kills.
                _, pending = await asyncio.wait(tasks, timeout=12)
                for t in pending:
                    t.cancel()

        try:
            asyncio.run_coroutine_threadsafe(stop_all(), self._loop).result(15)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # (a server that will not stop: the loop thread is a daemon)
        self._leash.release_all()  # (the graceful wait is over: no server outlives us)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None
        self._servers.clear()


def result_text(result) -> str:
    """A ``CallToolResult``'s content as text: text parts as they are, other parts named."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'unknown'} content not shown]")
    if not parts and getattr(result, "structured_content", None) is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""


def one_line(err: BaseException) -> str:
    """An exception (the SDK's, perhaps an exception group) as one short line."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    text = first_line(str(err)) or type(err).__name__
    return text if len(text) < 200 else text[:197] + "..."
