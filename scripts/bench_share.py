"""Shared prefixes and forks: what a new conversation or a branch costs, side by side.

On the default model (or -m MODEL), in one run:
- a new conversation whose ~2k-token system prompt another conversation already stored:
  time to first token and cached tokens, vs the same first turn with nothing stored
  (``--no-cache``), median of several trials;
- forking a ~4k-token conversation (``localchat fork``): bytes written, and the fork's next
  turn: cached vs prefilled tokens.

Usage: python scripts/bench_share.py [--quick] [-m MODEL]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-m", "--model", default=None)
    args = ap.parse_args()
    trials = 2 if args.quick else 3
    benchlib.scratch_home()
    from localchat import backend

    backend.prepare()
    from localchat.session import Session, TurnOptions, open_session

    session = open_session(args.model)
    engine = session.engine

    def fresh() -> Session:
        return Session(session.store, engine, session.kv_root, session.locks_dir)

    system = benchlib.filler_messages(engine, 2048)[0]["content"]
    donor = session.conversation("donor", system=system)
    list(fresh().turn(donor, "Summarise this in one line.", TurnOptions(max_tokens=8)))
    shared, alone = [], []
    cached = 0
    for i in range(trials):
        for out, no_cache in ((shared, False), (alone, True)):
            conv = session.conversation(f"new-{i}-{no_cache}", system=system)
            done = list(fresh().turn(conv, "What should I see first?",
                                     TurnOptions(max_tokens=4, no_cache=no_cache)))[-1]
            out.append(done.usage.ttft_s)
            if not no_cache:
                cached = done.usage.cached_tokens
    prompt_tokens = done.usage.prompt_tokens
    # A ~4k-token conversation, forked.
    long = session.conversation("long")
    for m in benchlib.filler_messages(engine, 4096):
        session.store.add_message(long, m["role"], m["content"])
    list(fresh().turn(long, "Noted?", TurnOptions(max_tokens=4)))
    fork, written = session.conversations.fork(session.store.get("long"), "long-fork")
    nxt = list(fresh().turn(fork, "And the next day?", TurnOptions(max_tokens=4)))[-1].usage
    s, a = benchlib.median(shared), benchlib.median(alone)
    print(f"# shared prefixes and forks · {engine.ref.name} · {benchlib.machine()} · "
          f"median of {trials}")
    benchlib.print_table(
        ["case", "prompt tokens", "cached", "TTFT", "vs nothing stored"],
        [["new conversation, ~2k-token system prompt stored by another", prompt_tokens,
          cached, f"{s:.3f} s", f"{a / s:.1f}x faster"],
         ["same first turn, nothing stored (--no-cache)", prompt_tokens, 0, f"{a:.3f} s",
          "1.0x"],
         [f"fork of a {nxt.prompt_tokens - nxt.prefilled_tokens}-token conversation: "
          f"{written:,} B written; next turn", nxt.prompt_tokens, nxt.cached_tokens,
          f"{nxt.ttft_s:.3f} s", ""]])
    benchlib.print_json({"bench": "share", "model": engine.ref.name,
                         "machine": benchlib.machine(), "prompt_tokens": prompt_tokens,
                         "shared_cached_tokens": cached, "shared_ttft_s": s,
                         "alone_ttft_s": a, "fork_bytes_written": written,
                         "fork_next_turn": nxt.public()})


if __name__ == "__main__":
    main()
