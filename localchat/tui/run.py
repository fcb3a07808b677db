"""Running the chat app in the terminal: its exit status, the line a bug leaves, and the
split model's lost rank (the app gives the terminal back before the one line)."""

from __future__ import annotations

import asyncio
import os
import sys

from .. import crashlog, paths
from .app import LocalchatApp


def run_app(conversation: str | None = None, model: str | None = None,
            kv_bits: int | None = None, kv_group: int | None = None, group=None,
            context_overflow: str | None = None, speculate: str = "lookup") -> int:
    app = LocalchatApp(conversation=conversation, model=model, kv_bits=kv_bits,
                       kv_group=kv_group, group=group, context_overflow=context_overflow,
                       speculate=speculate)
    if group is not None:
        import threading

        closed = threading.Event()

        def lost(why: str) -> None:  # the cluster watchdog's thread: leave the screen first
            app.lost = why
            app.call_from_thread(app.exit)
            closed.wait(3.0)

        async def run() -> None:
            try:
                await app.run_async()
            finally:
                # The terminal is back now; ``app.run()`` would return only after the
                # worker thread, which a lost rank can block in a collective for good.
                closed.set()

        group.on_lost.append(lost)
        asyncio.run(run())
        crashed(app)
        if app.lost:
            from ..cluster.launch import write_stderr

            group.exiting = True
            write_stderr(f"localchat: error: {app.lost}\n")
            os._exit(1)  # the MLX thread may be blocked in a collective for good
        return 1 if app.crashed else 0
    app.run()
    return 1 if crashed(app) else 0


def crashed(app: LocalchatApp) -> bool:
    """After the app: one line when a bug ended it (the terminal is back by now)."""
    if app.crashed is None:
        return False
    kept = " Your unsent message will be back in the message box." if os.path.exists(
        paths.data_home() / crashlog.UNSENT) else ""
    print(f"localchat: error: {crashlog.one_line(app.crashed, app.crash_log)}.{kept}",
          file=sys.stderr)
    return True
