"""Which temperature suits a model's sampled replies: how often they end, how long, how right.

What the app and ``serve`` use when nothing is set (``model/defaults.py``) decides whether a user's
first question ends on its own. For each temperature (top-p 0.9) and each of a few ordinary
chat prompts (English and Korean), this runs the prompt in a new conversation over many seeds,
plus one greedy run as the control, on the default model (or -m MODEL) in a scratch data
folder, one model load, each a lone turn through ``Session.turn`` as ``ask --temp T --seed S``
runs it (seed by seed over the temperatures, so a run stopped early is balanced). Per
temperature and prompt: how many replies ended on their own (EOS, finish ``stop``) within the
cap, the median and largest length in tokens, how many the loop cut ended (``session/generation.py``
``looping``), and how many name the expected answer where the prompt has one (France → Paris,
Korea → 서울/Seoul).

Usage: python scripts/bench_sampling.py [--quick | --smoke] [-m MODEL]
       [--temps 0.2,0.7] [--seeds N] [--max-tokens N] [--prompts LABEL,...] [--log FILE]
       [--repetition-penalty P] [--uncut]
``--uncut``: the loop check is off while the replies run, and then asked of each reply token
by token: where it would have cut the replies that ran to the cap, and whether it would have
cut any reply that ended on its own (it must not).
Full: the first four prompts (``--prompts`` names any, e.g. the three that repeat by nature:
count,days,hello), 20 seeds per temperature and prompt, 512-token cap; ``--quick``: 5
seeds; ``--smoke``: 2 seeds, 2 prompts, 16 tokens, for a tiny model
(``tests/test_scripts.py``; figures mean nothing). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def names_any(*words: str):
    return lambda reply: any(w.lower() in reply.lower() for w in words)


def counts_to(n: int):
    """1, 2, ..., n in that order (what a repetition penalty could break: digits and commas
    recur in every item)."""
    def check(reply: str) -> bool:
        found = [int(x) for x in re.findall(r"\d+", reply)]
        said = [x for i, x in enumerate(found) if not i or x != found[i - 1]]  # "1. 1" is 1
        return said[:n] == list(range(1, n + 1))
    return check


def names_all(*words: str):
    return lambda reply: all(w.lower() in reply.lower() for w in words)


def repeats(word: str, times: int):
    return lambda reply: reply.lower().count(word) >= times


# (label, prompt, what a right reply does; None where there is no one answer). The last three
# repeat by nature: a reply that must say the same tokens again is where a penalty would hurt.
PROMPTS = (
    ("france", "What is the capital of France?", names_any("Paris")),
    ("korea", "한국의 수도는 어디인가요?", names_any("서울", "Seoul")),
    ("sleep", "Give me three tips for sleeping better.", None),
    ("python", "How do I reverse a list in Python?", None),
    ("count", "Count from 1 to 20, separated by commas.", counts_to(20)),
    ("days", "List the seven days of the week, one per line.", names_all(*DAYS)),
    ("hello", "Write the word hello five times.", repeats("hello", 5)),
)


def run_prompt(session, prompt: str, temp: float, seed: int | None, cap: int,
               penalty: float = 1.0) -> dict:
    """One turn in a new conversation, as ``ask --temp T --seed S`` runs it: finish, tokens,
    loop cut, reply."""
    from localchat.session.session import Notice, TurnFinished, TurnOptions

    conv = session.conversation(None)
    options = TurnOptions(max_tokens=cap, temp=temp, top_p=0.9 if temp > 0 else 1.0,
                          seed=seed, repetition_penalty=penalty if temp > 0 else 1.0)
    cut, done = False, None
    for event in session.turn(conv, prompt, options):
        if isinstance(event, Notice) and event.text.startswith("reply cut"):
            cut = True
        elif isinstance(event, TurnFinished):
            done = event
    session.delete(conv)
    return {"finish": done.finish, "tokens": done.usage.completion_tokens, "loop_cut": cut,
            "reply": done.reply, "ids": list(done.tokens)}


def would_cut_at(ids: list[int], looping) -> int | None:
    """How many tokens into ``ids`` the loop check would cut, or None."""
    return next((n for n in range(1, len(ids) + 1) if looping(ids[:n])), None)


def summary(temp: float, label: str, right_reply, runs: list[dict]) -> dict:
    """One row: runs, ended on their own, loop cuts, at the cap, lengths, right answers."""
    lengths = [r["tokens"] for r in runs]
    right = sum(bool(right_reply(r["reply"])) for r in runs) if right_reply else None
    return {"temp": temp, "prompt": label, "runs": len(runs),
            "ended": sum(r["finish"] == "stop" for r in runs),
            "loop_cut": sum(r["loop_cut"] for r in runs),
            "at_cap": sum(r["finish"] == "length" and not r["loop_cut"] for r in runs),
            "median_tokens": statistics.median(lengths), "max_tokens": max(lengths),
            "right": right}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "5 seeds per temperature and prompt")
    ap.add_argument("--temps", default="0.2,0.7", help="temperatures, comma-separated")
    ap.add_argument("--seeds", type=int, default=0, help="seeds per temperature and prompt")
    ap.add_argument("--max-tokens", type=int, default=0, metavar="N", help="each reply's cap")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                    help="mlx-lm's repetition penalty for the sampled runs (1: off)")
    ap.add_argument("--prompts", default="", metavar="LABEL,...",
                    help=f"only these prompts (of {', '.join(p[0] for p in PROMPTS)})")
    ap.add_argument("--uncut", action="store_true",
                    help="run replies past the loop check; say where it would cut")
    ap.add_argument("--log", default="", metavar="FILE",
                    help="append each run (temperature, seed, prompt, finish, reply) as JSON")
    args = ap.parse_args()
    seeds = args.seeds or benchlib.pick(args, 20, 5, 2)
    cap = args.max_tokens or benchlib.pick(args, 512, 512, 16)
    prompts = benchlib.pick(args, PROMPTS[:4], PROMPTS[:4], PROMPTS[:2])
    if args.prompts:
        prompts = [p for p in PROMPTS if p[0] in args.prompts.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    benchlib.scratch_home()
    import localchat.session.generation as generation
    from localchat.session.session import open_session

    looping = generation.looping
    if args.uncut:
        generation.looping = lambda ids, *a, **k: 0
    session = open_session(args.model)
    runs: dict[tuple[float, str], list[dict]] = {}
    log = open(args.log, "a", encoding="utf-8") if args.log else None
    t0 = time.perf_counter()
    # Seed by seed over every temperature and prompt, so a run stopped early is balanced.
    plan = [(0.0, None)] + [(temp, seed) for seed in range(seeds) for temp in temps]
    try:
        for temp, seed in plan:
            for label, prompt, _ in prompts:
                r = run_prompt(session, prompt, temp, seed, cap, args.repetition_penalty)
                if args.uncut and temp > 0:
                    r["would_cut_at"] = would_cut_at(r["ids"], looping)
                del r["ids"]
                runs.setdefault((temp, label), []).append(r)
                if log:
                    print(json.dumps({"temp": temp, "seed": seed, "prompt": label, **r},
                                     ensure_ascii=False), file=log, flush=True)
    finally:
        session.close()
        if log:
            log.close()
    results = [summary(temp, label, answers, runs[temp, label])
               for temp in [0.0, *temps] for label, _, answers in prompts]
    rows = [[r["temp"], r["prompt"], r["runs"], r["ended"], r["loop_cut"], r["at_cap"],
             r["median_tokens"], r["max_tokens"], "-" if r["right"] is None else r["right"]]
            for r in results]
    totals = {}
    for temp in temps:
        mine = [r for r in results if r["temp"] == temp]
        count = sum(r["runs"] for r in mine)
        totals[str(temp)] = {"runs": count, "ended": sum(r["ended"] for r in mine),
                             "loop_cut": sum(r["loop_cut"] for r in mine),
                             "at_cap": sum(r["at_cap"] for r in mine)}
    print(f"# {benchlib.machine()}; cap {cap} tokens, top-p 0.9, repetition penalty "
          f"{args.repetition_penalty}, {seeds} seeds; "
          f"{time.perf_counter() - t0:.0f} s")
    benchlib.print_table(["temp", "prompt", "runs", "ended (EOS)", "loop cut", "at cap",
                          "median tokens", "longest", "right"], rows)
    for temp, t in totals.items():
        print(f"temp {temp}: {t['ended']}/{t['runs']} ended on their own, {t['loop_cut']} loop "
              f"cuts, {t['at_cap']} at the cap")
    if args.uncut:  # (the check was off: every loop ran to the cap)
        for temp in temps:
            mine = [r for (t, _), rs in runs.items() if t == temp for r in rs]
            at = sorted(r["would_cut_at"] for r in mine if r["finish"] != "stop"
                        and r["would_cut_at"] is not None)
            wrong = sum(r["finish"] == "stop" and r["would_cut_at"] is not None for r in mine)
            totals[str(temp)].update(would_cut_at=at, would_cut_ended=wrong)
            print(f"temp {temp}, loop check off: it would cut {len(at)} of the replies at the "
                  f"cap, at {at} tokens, and {wrong} of those that ended on their own")
    benchlib.print_json({"bench": "sampling", "mode": benchlib.mode(args),
                         "model": args.model or "default", "machine": benchlib.machine(),
                         "cap": cap, "seeds": seeds, "top_p": 0.9,
                         "repetition_penalty": args.repetition_penalty, "results": results,
                         "totals": totals})


if __name__ == "__main__":
    main()
