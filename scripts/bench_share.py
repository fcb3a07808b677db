"""Shared prefixes and forks: what a new conversation or a branch costs, side by side.

On the default model (or -m MODEL), in one run:
- a new conversation whose ~2k-token system prompt another conversation already stored:
  time to first token and cached tokens, vs the same first turn with nothing stored
  (``--no-cache``), median of several trials;
- forking a ~4k-token conversation (``localchat fork``): bytes written, and the fork's next
  turn: cached vs prefilled tokens.

Usage: python scripts/bench_share.py [--quick | --smoke] [-m MODEL]
``--quick``: 2 trials. ``--smoke``: 1 trial, a ~128-token system prompt and a ~256-token
conversation to fork: every step in seconds on a tiny model (``tests/test_scripts.py`` runs
it); its figures mean nothing.
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
    benchlib.add_flags(ap, "2 trials")
    args = ap.parse_args()
    trials = benchlib.pick(args, 3, 2, 1)
    system_tokens = benchlib.pick(args, 2048, 2048, 128)
    long_tokens = benchlib.pick(args, 4096, 4096, 256)
    benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    from localchat.session.session import Session, TurnOptions, open_session

    session = open_session(args.model)
    engine = session.engine

    def fresh() -> Session:
        return Session(session.store, engine, session.kv_root, session.locks_dir)

    system = benchlib.filler_messages(engine, system_tokens)[0]["content"]
    donor = session.conversation("donor", system=system)
    # The donor's turn stores the system prompt's cache, and warms up.
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
    for m in benchlib.filler_messages(engine, long_tokens):
        session.store.add_message(long, m["role"], m["content"])
    list(fresh().turn(long, "Noted?", TurnOptions(max_tokens=4)))
    fork, written = session.fork(session.store.get("long"), "long-fork")
    nxt = list(fresh().turn(fork, "And the next day?", TurnOptions(max_tokens=4)))[-1].usage
    s, a = benchlib.median(shared), benchlib.median(alone)
    print(f"# shared prefixes and forks · {engine.ref.name} · ~{system_tokens}-token system "
          f"prompt · {benchlib.machine()} · median of {trials}")
    benchlib.print_table(
        ["case", "prompt tokens", "cached", "TTFT", "vs nothing stored"],
        [["new conversation, its system prompt stored by another", prompt_tokens,
          cached, f"{s:.3f} s", f"{benchlib.ratio(a, s):.1f}x faster"],
         ["same first turn, nothing stored (--no-cache)", prompt_tokens, 0, f"{a:.3f} s",
          "1.0x"],
         [f"fork of a {nxt.prompt_tokens - nxt.prefilled_tokens}-token conversation: "
          f"{written:,} B written; next turn", nxt.prompt_tokens, nxt.cached_tokens,
          f"{nxt.ttft_s:.3f} s", ""]])
    benchlib.print_json({"bench": "share", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "system_tokens": system_tokens,
                         "machine": benchlib.machine(), "prompt_tokens": prompt_tokens,
                         "shared_cached_tokens": cached, "shared_ttft_s": s,
                         "alone_ttft_s": a, "fork_bytes_written": written,
                         "fork_next_turn": nxt.public()})


if __name__ == "__main__":
    main()
