"""The README's screenshot: the chat app after two turns, as an SVG (``docs/app.svg``).

Runs the real app headless (Textual's ``App.run_test()``) on the UI tests' scripted engine
(``tests/fakes.py``: the tiny random model of ``tests/tiny.py``, replies taken from a queue),
in a scratch data folder. It types two messages with real key presses, lets each scripted
Markdown reply stream through the real model, cache and store, and saves what the terminal
shows with Textual's own ``export_screenshot()``. No download, no real model; a few seconds.

What stays the same from run to run: the size (100 x 32 cells), the messages, the replies, the
conversation's name, the cache figures (tokens cached and prefilled: the tiny model and the
scripted text fix them), and the SVG's element ids (Rich derives them from a hash of the whole
screen; they are replaced by a fixed one, so that a diff shows only what changed on screen).
What does not: the timing figures on the status bar (TTFT, tok/s) are measured in the run, on
the tiny model, so they differ a little from run to run. The SVG is kept current by rerunning
this script after a change to the app's look, and committing it; ``tests/test_docs.py`` runs
it on every test run so that it keeps working.

Usage: python scripts/screenshot.py [--out PATH]
``--out``: where to write the SVG (default: docs/app.svg beside this script's repository).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZE = (100, 32)  # columns, rows: wide enough for the sidebar and the status bar's hit
CONVERSATION = "Paris trip"
TURNS = [  # (what is typed, the scripted reply it gets)
    ("What is the capital of France?", "The capital of France is **Paris**."),
    ("Plan two days there, as a list.",
     "## Two days in Paris\n\n"
     "1. **Day one**: the Louvre in the morning, a walk along the *Seine*, Notre-Dame.\n"
     "2. **Day two**: Montmartre and the Sacré-Cœur, then the Eiffel Tower at dusk.\n\n"
     "Book the Louvre ahead: `louvre.fr`."),
]


def scripted_engine(base, delay: float = 0.005):
    """The UI tests' ``ScriptedEngine`` over ``base`` (a loaded tiny model), with the replies.

    Args:
        base: an ``Engine`` loaded from a tiny model folder (``tests/tiny.py``).
        delay: seconds between streamed tokens, so the reply streams as it would.
    Returns:
        The scripted engine: real prefill and K/V, the replies' tokens chosen from ``TURNS``.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import ScriptedEngine

    return ScriptedEngine(base, [reply for _, reply in TURNS], delay)


async def shoot(engine, out: Path, size: tuple[int, int] = SIZE) -> str:
    """Run the app on ``engine``, type each message of ``TURNS``, save the screen as an SVG.

    The data folder is whatever ``LOCALCHAT_HOME`` names (``main`` makes a scratch one).

    Args:
        engine: the engine the app loads (``scripted_engine``).
        out: the SVG file to write (its folder is created).
        size: the terminal's columns and rows.
    Returns:
        The SVG text written.
    """
    from localchat.tui.app import LocalchatApp
    from localchat.tui.composer import Composer

    app = LocalchatApp(conversation=CONVERSATION, load_engine=lambda name, progress: engine,
                       draft_prefill=False)  # (a prefill mid-typing would move the figures)
    async with app.run_test(size=size) as pilot:
        await app.workers.wait_for_complete()  # the model loaded
        await pilot.pause()
        for message, _ in TURNS:
            await pilot.press(*message)
            await pilot.press("enter")
            await app.workers.wait_for_complete()
            await pilot.pause()
            await pilot.pause()
        app.query_one(Composer).cursor_blink = False  # the cursor drawn, whatever the moment
        await pilot.pause()
        svg = app.export_screenshot(title="localchat")
    svg = re.sub(r"terminal-\d+", "terminal-localchat", svg)  # (see the module docstring)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg, encoding="utf-8")
    return svg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "app.svg",
                    help="where to write the SVG (default: docs/app.svg)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="localchat-screenshot-"))
    try:
        os.environ["LOCALCHAT_HOME"] = str(home / "home")
        from localchat.cpu import backend

        backend.prepare()  # as the app does, before anything imports mlx.core
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import build_tiny_model

        from localchat.model.engine import Engine

        base = Engine.load(str(build_tiny_model(home / "tiny-llama")))
        asyncio.run(shoot(scripted_engine(base), args.out))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
