"""Run the chat app headless as rank 0 of a 2-rank loopback cluster; print what it showed.

Used by ``test_cluster.py`` in a subprocess (a process joins one MLX ring only once).
argv: MODEL SHARD PROMPT... (one turn per prompt, in conversation "app"); a prompt "F3"
opens the cache view instead (waits for it up to 60 s), records its text and closes it.
Prints one JSON object: the replies shown, the stored messages, the status bar, the views.
"""

from __future__ import annotations

import asyncio
import json
import sys

from localchat.cpu import backend

backend.prepare()

from localchat import paths  # noqa: E402
from localchat.cli.main import build_parser  # noqa: E402
from localchat.cli.start import start_cluster  # noqa: E402
from localchat.cluster import launch  # noqa: E402
from localchat.store.database import Store  # noqa: E402
from localchat.tui.app import LocalchatApp  # noqa: E402
from localchat.tui.cachescreen import CacheScreen  # noqa: E402
from localchat.tui.chatview import AssistantMessage  # noqa: E402
from localchat.tui.statusbar import StatusBar  # noqa: E402


async def run(app: LocalchatApp, prompts: list[str]) -> dict:
    views = []
    async with app.run_test(size=(120, 40)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        for prompt in prompts:
            if prompt == "F3":
                await pilot.press("f3")
                for _ in range(300):
                    await pilot.pause(0.2)
                    if isinstance(app.screen, CacheScreen):
                        break
                views.append("\n".join(str(w.render()) for w in app.screen.query("Static"))
                             if isinstance(app.screen, CacheScreen) else None)
                await pilot.press("escape")
                await pilot.pause()
                continue
            await pilot.press(*prompt)
            await pilot.press("enter")
            await pilot.pause()
            await app.workers.wait_for_complete()
            await pilot.pause()
        shown = [m.source for m in app.query(AssistantMessage)]
        status = str(app.query_one(StatusBar).render())
    store = Store.open(paths.database_path())
    stored = [(m.role, m.content) for m in store.messages(store.get("app"))]
    store.close()
    return {"shown": shown, "stored": stored, "status": status, "views": views}


def main() -> None:
    model, shard, *prompts = sys.argv[1:]
    args = build_parser().parse_args(["chat", "-m", model, "--hosts", "127.0.0.1,127.0.0.1",
                                      "--shard", shard])
    group = start_cluster(args, model)
    # Greedy, as the single-process ``ask`` it is compared with (the app samples by default).
    app = LocalchatApp(conversation="app", model=model, group=group, max_tokens=12, temp=0.0,
                       draft_prefill=False)  # (the hit is compared with ask's: no draft)
    try:
        print(json.dumps(asyncio.run(run(app, prompts))))
    finally:
        launch.shutdown()


if __name__ == "__main__":
    main()
