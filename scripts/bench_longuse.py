"""A year of use: search, `list` and the app's sidebar with thousands of conversations.

In one run, on a scratch data folder holding N conversations of ten messages each (English and
Korean, as our users write): a search for a Korean and an English phrase (in the store, and
`localchat search` from process start to exit), `localchat list`, and the chat app through
Textual's Pilot: time to its first frame with the sidebar filled, and to show the next page of
the sidebar ("more…"). No model work: the app loads a tiny model.

Usage: python scripts/bench_longuse.py [--quick | --smoke] [--conversations N]
``--quick``: 3 trials. ``--smoke``: 200 conversations, 1 trial (``tests/test_scripts.py``).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

KOREAN = "한라산 등반"
ENGLISH = "violet umbrella parade"


def fill(store, n: int) -> None:
    """``n`` conversations of ten messages, in one transaction (the chains computed after)."""
    from localchat.store.migrations import rechain

    now = time.time()
    with store._tx():  # noqa: SLF001 - setting up a large folder fast, not a use of the API
        for i in range(n):
            cur = store.db.execute(
                "INSERT INTO conversations (name, model, created, updated) VALUES (?, ?, ?, ?)",
                (f"chat-{i:05d}", "m", now - n + i, now - n + i))
            cid = cur.lastrowid
            rows = []
            for seq in range(1, 11):
                text = benchlib.FILLER[(i * 7 + seq * 13) % 120:] + f" (conversation {i})"
                if i == n // 2 and seq == 5:
                    text += f" 다음에는 {KOREAN}을 해요. Then the {ENGLISH}."
                rows.append((cid, seq, "user" if seq % 2 else "assistant", text, now))
            store.db.executemany("INSERT INTO messages (conversation_id, seq, role, content,"
                                 " created) VALUES (?, ?, ?, ?, ?)", rows)
            rechain(store.db, cid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "3 trials", model=False)
    ap.add_argument("--conversations", type=int, default=None, metavar="N")
    args = ap.parse_args()
    n = args.conversations or benchlib.pick(args, 5000, 5000, 200)
    trials = benchlib.pick(args, 5, 3, 1)
    home = benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from localchat import paths
    from localchat.store.database import Store

    store = Store.open(paths.database_path())
    t = time.perf_counter()
    fill(store, n)
    filled = time.perf_counter() - t
    rows, record = [], {"conversations": n, "messages": n * 10, "fill_s": filled}
    for name, phrase in (("korean", KOREAN), ("english", ENGLISH)):
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            found = store.search(phrase)
            times.append(time.perf_counter() - t)
        assert [c.name for c, _ in found] == [f"chat-{n // 2:05d}"], len(found)
        record[f"search_{name}_s"] = benchlib.median(times)
        rows.append([f"search {phrase!r} (in the store)", f"{benchlib.median(times) * 1000:.1f} ms",
                     len(found)])
    store.close()

    def wall(*cmd: str) -> float:
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            subprocess.run(benchlib.localchat(*cmd), capture_output=True, check=True)
            times.append(time.perf_counter() - t)
        return benchlib.median(times)

    record["cli_search_s"] = wall("search", KOREAN)
    record["cli_list_s"] = wall("list")
    rows += [[f"`localchat search {KOREAN}` (process start to exit)",
              f"{record['cli_search_s'] * 1000:.0f} ms", ""],
             ["`localchat list` (process start to exit)",
              f"{record['cli_list_s'] * 1000:.0f} ms", ""]]
    first, page = asyncio.run(app_times(home, trials))
    record.update(app_first_frame_s=first, app_next_page_s=page)
    rows += [["the app: start to first frame, sidebar filled", f"{first * 1000:.0f} ms", ""],
             ["the app: next page of the sidebar (more…)", f"{page * 1000:.0f} ms", ""]]
    print(f"# long use · {n} conversations, {n * 10} messages · {benchlib.machine()} · "
          f"median of {trials}")
    benchlib.print_table(["case", "time", "found"], rows)
    benchlib.print_json({"bench": "longuse", "mode": benchlib.mode(args),
                         "model": "none", "machine": benchlib.machine(), **record})


async def app_times(home: Path, trials: int) -> tuple[float, float]:
    """(start to the first frame with the sidebar filled, a page of "more…") of the app."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from tiny import build_tiny_model

    from localchat.model.engine import Engine
    from localchat.tui.app import LocalchatApp
    from localchat.tui.sidebar import ConversationItem, MoreItem, Sidebar

    engine = Engine.load(str(build_tiny_model(home / "tiny")))
    firsts, pages = [], []
    for _ in range(trials):
        t = time.perf_counter()
        app = LocalchatApp(load_engine=lambda name, progress: engine, draft_prefill=False)
        async with app.run_test(size=(120, 40)) as pilot:
            view = app.query_one("#conversations")
            while not view.query(ConversationItem):
                await pilot.pause(0.005)
            firsts.append(time.perf_counter() - t)
            await app.workers.wait_for_complete()
            shown = len(view.query(ConversationItem))
            t = time.perf_counter()
            app.query_one(Sidebar).pick(view.query_one(MoreItem))
            while len(view.query(ConversationItem)) == shown:
                await pilot.pause(0.005)
            await pilot.pause()
            pages.append(time.perf_counter() - t)
    return benchlib.median(firsts), benchlib.median(pages)


if __name__ == "__main__":
    main()
