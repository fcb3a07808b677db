"""Draft prefill: time to first token of a long pasted message, and typing while it prefills.

In the chat app itself (Textual's headless Pilot: real paste and key events, the app's own
workers), on the default model (or -m MODEL), side by side in one run:
- one word: a short history, then "Thanks" — the floor of a turn on a resumed history;
- paste and wait: a ~1,000-token travel note pasted in the same conversation, the status bar
  waited on until it says ``draft N/M prefilled``, then Enter;
- one word after the note: "Thanks" again, the same conversation now ~1,200 tokens long —
  the floor at the same context length (attention and the app's screen cost more there);
- paste and send at once: the same note in a fresh conversation with the same history, Enter
  pressed right after the paste (the draft's 0.3 s timer never fires).
Each TTFT is shown two ways: the turn's own ``ttft_s`` (turn start to first token) and Enter
to the first reply character in the app (which also counts waiting for a draft's chunk).

Typing: with the note in the message box, N characters typed one at a time, each 0.4 s after
the last, so that each lands while a draft prefill runs (0.3 s after the last change); the
latency of a key is from posting its key event to the app until the message box renders a
line with the character (its ``render_line``), with draft prefill on and then off. (Keys and
Enter are posted as the terminal driver posts them, not through ``Pilot.press``: that waits
until the process's CPU time stops advancing, up to a second while a worker computes.)

Usage: python scripts/bench_draft.py [--quick | --smoke] [-m MODEL] [--tokens N] [--trials N]
       [--keys N]
``--quick``: 1 trial, 10 keys (~1 min). ``--smoke``: 1 trial, the shortest note (one day of
it), a 3-character history, 2 keys each way: every step in seconds on a tiny model
(``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

NOTE = (
    "Day {n}: we took the early train from Seoul to Busan and watched the rice fields go by. "
    "The hotel near Haeundae beach let us leave the bags before check-in, so we walked to the "
    "fish market, ate grilled mackerel and bought dried squid for the family. "
    "부산역 근처의 시장은 아침 일찍부터 사람들로 붐볐습니다. "
    "In the afternoon it rained, and we spent two hours in a small museum about the war "
    "refugees who built the hillside villages; the guide spoke slowly and answered every "
    "question. Tomorrow we want to see Gamcheon, then take the ferry or the bus to Geoje. "
)


def travel_note(engine, n_tokens: int) -> str:
    text, day = "", 1
    while engine.count_tokens(text) < n_tokens:
        text += NOTE.format(n=day) + "\n\n"
        day += 1
    return text.rstrip() + "\n\nWhat should we change in this plan, and what did we miss?"


class Driver:
    """Drives one app through Pilot and measures what the user waits for."""

    def __init__(self, app, pilot):
        self.app, self.pilot = app, pilot

    def status(self) -> str:
        from localchat.tui.statusbar import StatusBar

        return str(self.app.query_one(StatusBar).render())

    def replies(self) -> list[str]:
        return [m.source for m in self.app.query("AssistantMessage")]

    async def settle(self) -> None:
        await self.app.workers.wait_for_complete()
        await self.pilot.pause()

    async def new_conversation(self, history: str) -> None:
        await self.pilot.press("ctrl+n")
        await self.settle()
        await self.send(history)

    async def send(self, text: str | None = None, paste: str | None = None,
                   wait_draft: bool = False):
        """Type or paste a message, maybe wait for its draft, press Enter; return (usage,
        seconds from Enter to the first reply character on screen, seconds from the paste
        until the draft was prefilled)."""
        from textual import events

        from localchat.tui.statusbar import StatusBar

        t_paste = time.perf_counter()
        if paste is not None:
            self.app.post_message(events.Paste(paste))
            await self.pilot.pause()
        else:
            await self.pilot.press(*text)
        waited = 0.0
        if wait_draft:
            await self.wait_draft()
            waited = time.perf_counter() - t_paste
        n = len(self.replies())
        bar = self.app.query_one(StatusBar)
        before = bar.usage
        t0 = time.perf_counter()
        self.app.post_message(events.Key("enter", "\r"))
        # Until the reply shows, or the turn ends without text (a tiny model's first token
        # can be its end of text).
        while not (len(self.replies()) > n and self.replies()[-1]) and bar.usage is before:
            await asyncio.sleep(0.002)
        shown = time.perf_counter() - t0
        await self.settle()
        return self.app.query_one(StatusBar).usage, shown, waited

    async def wait_draft(self) -> str:
        from localchat.tui.composer import Composer

        while True:
            found = re.search(r"draft \d+/\d+ prefilled", self.status())
            if found and self.app.drafts.text == self.app.query_one(Composer).text:
                return found.group(0)
            await asyncio.sleep(0.01)

    async def keystrokes(self, note: str, keys: int) -> list[float]:
        """Latencies of ``keys`` characters typed after ``note`` is pasted."""
        from textual import events

        from localchat.tui.composer import Composer

        composer = self.app.query_one(Composer)
        rendered: list[tuple[float, int]] = []  # (when, the text's length then)
        render_line = composer.render_line

        def recorded(y: int):
            rendered.append((time.perf_counter(), len(composer.text)))
            return render_line(y)

        composer.render_line = recorded
        self.app.post_message(events.Paste(note))
        await self.pilot.pause()
        out = []
        for ch in ("and one more thing " * 10)[:keys]:
            await asyncio.sleep(0.4)  # past the 0.3 s timer: a draft prefill is running
            n = len(composer.text) + 1
            t0 = time.perf_counter()
            self.app.post_message(events.Key("space" if ch == " " else ch, ch))
            while not any(t > t0 and length >= n for t, length in rendered):
                await asyncio.sleep(0.001)
            out.append(min(t for t, length in rendered if t > t0 and length >= n) - t0)
            rendered.clear()
        composer.render_line = render_line
        composer.clear()
        await self.settle()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "1 trial, 10 keys (~1 min)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="the pasted note's length (default 1000)")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--keys", type=int, default=None)
    args = ap.parse_args()
    trials = args.trials or benchlib.pick(args, 3, 1, 1)
    keys = args.keys or benchlib.pick(args, 30, 10, 2)
    note_tokens = args.tokens or benchlib.pick(args, 1000, 1000, 64)

    benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from localchat.model.engine import Engine
    from localchat.tui.app import LocalchatApp

    engine = Engine.load(args.model)
    note = travel_note(engine, note_tokens)
    # Typed key by key (Pilot.press waits for the app to idle after each): short when smoke.
    history = "Hi!" if args.smoke else "Hi! I am planning a trip to Korea."
    results: dict[str, list] = {"one_word": [], "paste_wait": [], "one_word_after": [],
                                "paste_at_once": []}
    keystrokes: dict[bool, list[float]] = {True: [], False: []}

    async def run() -> None:
        app = LocalchatApp(load_engine=lambda name, progress: engine, max_tokens=8)
        async with app.run_test(size=(160, 40)) as pilot:
            d = Driver(app, pilot)
            await d.settle()
            for trial in range(trials + 1):  # trial 0 warms up
                await d.new_conversation(history)
                one = await d.send("Thanks")
                wait = await d.send(paste=note, wait_draft=True)
                after = await d.send("Thanks")
                await d.new_conversation(history)
                await d.send("Thanks")
                at_once = await d.send(paste=note)
                if trial:
                    for name, r in [("one_word", one), ("paste_wait", wait),
                                    ("one_word_after", after), ("paste_at_once", at_once)]:
                        results[name].append(r)
            await d.new_conversation(history)
            for on in (True, False):
                app.drafts.enabled = on
                keystrokes[on] = await d.keystrokes(note, keys)

    asyncio.run(run())

    def med(name: str, i: int) -> float:
        return benchlib.median([r[0].ttft_s if i == 0 else r[1] for r in results[name]])

    u_wait = results["paste_wait"][-1][0]
    u_once = results["paste_at_once"][-1][0]
    # The floor: a one-word message in the same conversation at the same length.
    floor, floor_shown = med("one_word_after", 0), med("one_word_after", 1)
    rows = []
    for label, name in [("one word (\"Thanks\"), short history", "one_word"),
                        ("paste and wait, then Enter", "paste_wait"),
                        ("one word after the note (the floor)", "one_word_after"),
                        ("paste and send at once", "paste_at_once")]:
        u = results[name][-1][0]
        rows.append([label, u.prefilled_tokens, u.draft_tokens, med(name, 0),
                     f"{med(name, 0) / floor:.2f}x", med(name, 1),
                     f"{med(name, 1) / floor_shown:.2f}x"])
    print(f"# draft prefill · {engine.ref.name} · ~{u_once.prefilled_tokens}-token pasted "
          f"note · {benchlib.machine()} · median of {trials}")
    benchlib.print_table(["message", "prefilled after Enter", "draft tokens", "TTFT s",
                          "vs one word", "Enter to screen s", "vs one word"], rows)
    waited = benchlib.median([r[2] for r in results["paste_wait"]])
    once_tps = benchlib.median([r[0].prefill_tps for r in results["paste_at_once"]])
    print(f"\nThe draft was prefilled {waited:.1f} s after the paste "
          f"({u_wait.draft_tokens / waited:.0f} tok/s in chunks of 64, the 0.3 s timer "
          f"included); sent at once, the note prefilled at {once_tps:.0f} tok/s.")
    on, off = keystrokes[True], keystrokes[False]
    pct = 90

    def p(xs: list[float], q: int) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(len(xs) * q / 100))]

    print()
    benchlib.print_table(
        ["typing (ms per key)", "median", f"p{pct}", "max"],
        [["draft prefill on (a prefill runs as each key lands)", benchlib.median(on) * 1e3,
          p(on, pct) * 1e3, max(on) * 1e3],
         ["draft prefill off", benchlib.median(off) * 1e3, p(off, pct) * 1e3,
          max(off) * 1e3]])
    benchlib.print_json({
        "bench": "draft", "mode": benchlib.mode(args), "machine": benchlib.machine(),
        "model": engine.ref.name,
        "note_tokens": u_once.prefilled_tokens, "trials": trials,
        "ttft_one_word_short_history_s": med("one_word", 0),
        "ttft_one_word_s": floor, "ttft_paste_wait_s": med("paste_wait", 0),
        "ttft_paste_at_once_s": med("paste_at_once", 0),
        "enter_to_screen_one_word_s": floor_shown,
        "enter_to_screen_paste_wait_s": med("paste_wait", 1),
        "enter_to_screen_paste_at_once_s": med("paste_at_once", 1),
        "paste_wait_vs_one_word": med("paste_wait", 0) / floor,
        "draft_tokens": u_wait.draft_tokens, "prefilled_after_enter": u_wait.prefilled_tokens,
        "paste_to_prefilled_s": waited, "send_at_once_prefill_tps": once_tps,
        "ttft_trials_s": {name: [round(r[0].ttft_s, 4) for r in rs]
                          for name, rs in results.items()},
        "key_ms_median_draft_on": benchlib.median(on) * 1e3,
        "key_ms_median_draft_off": benchlib.median(off) * 1e3,
        "key_ms_p90_draft_on": p(on, pct) * 1e3, "key_ms_p90_draft_off": p(off, pct) * 1e3,
    })


if __name__ == "__main__":
    main()
