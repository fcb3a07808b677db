"""Figures benchmark: is the time saved that the cache view and ``inspect -c`` show true?

On the default model (or -m MODEL), as a new user would: a conversation of three short
turns (``localchat ask -c NAME --json``), then ``inspect -c NAME --json`` (its estimates come
from the prefill model, ``localchat/cacheview/prefillmodel.py``: here a calibration, as three short
turns cannot say). For each turn with a cache, the truth it is checked against: the same turn
answered with ``--no-cache`` on copies of the conversation before it (``localchat fork``; the
median of the trials' TTFT) less the turn's own TTFT. Then one full prefill of a long prompt
(``--no-cache``) against the model's estimate of it.

Usage: python scripts/bench_figures.py [--quick | --smoke] [-m MODEL] [--trials N]
``--quick``: 2 trials and a ~1,000-token long prompt (~1.5 min idle). ``--smoke``: 1 trial,
a short "long" prompt: every step in seconds on a tiny model; its figures mean nothing.
Prints a table (estimated vs measured, their ratio), then one JSON line; ``within_25pct``
says whether every saved figure is within 25% of the measured one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

from localchat.cacheview.prefillfit import PrefillModel  # noqa: E402 (no MLX: the estimate's formula)

PROMPTS = ("What is the capital of France?", "And of Germany?", "And of Italy?")


def ask(model: list[str], name: str, prompt: str, *flags: str) -> dict:
    out = benchlib.run(benchlib.localchat("ask", "-c", name, *model, "--max-tokens", "16",
                                          "--json", *flags, prompt))
    return json.loads(out.stdout.strip().splitlines()[-1])["usage"]


def full_ttft(model: list[str], base: str, prompt: str, trials: int, turn: int) -> float:
    """Median TTFT of ``prompt`` answered with no cache on copies of ``base``."""
    times = []
    for j in range(trials):
        copy = f"{base}-copy{turn}-{j}"
        benchlib.run(benchlib.localchat("fork", base, copy))
        times.append(ask(model, copy, prompt, "--no-cache")["ttft_s"])
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials, a ~1,000-token long prompt (~1.5 min idle)")
    ap.add_argument("--trials", type=int, default=None)
    args = ap.parse_args()
    trials = args.trials or benchlib.pick(args, 3, 2, 1)
    long_words = benchlib.pick(args, 600, 250, 10)  # ~4 tokens each
    benchlib.scratch_home()
    model = ["-m", args.model] if args.model else []
    name = "figures"
    if not args.smoke:  # a warm-up turn elsewhere: the first process caches derived files
        ask(model, "warm-up", "Hello.")
    usages, truths = [], []
    for i, prompt in enumerate(PROMPTS):
        truths.append(full_ttft(model, name, prompt, trials, i) if i else 0.0)
        usages.append(ask(model, name, prompt))
    # A long prompt, before the view: a view of a conversation past the calibrated lengths
    # measures the attention term (the deep run) and keeps it, so the view of the short one
    # after it has it too, as a user's would once a long conversation was viewed.
    long_prompt = " ".join(benchlib.FILLER.split()[: 30]) + " " + " ".join(
        f"item {k}" for k in range(long_words))
    lu = ask(model, "long", long_prompt, "--no-cache")
    benchlib.run(benchlib.localchat("inspect", "-c", "long", *model, "--json"))
    found = json.loads(benchlib.run(benchlib.localchat(
        "inspect", "-c", name, *model, "--json")).stdout)
    rows, checks = [], []
    for i, (u, t, est) in enumerate(zip(usages, truths, found["turns"]), 1):
        measured = max(0.0, t - u["ttft_s"]) if i > 1 else 0.0
        ratio = benchlib.ratio(est["saved_s"], measured) if i > 1 else float("nan")
        if i > 1:
            checks.append(ratio)
        rows.append([i, u["prompt_tokens"], u["cached_tokens"], u["ttft_s"], t,
                     est["full_prefill_s"], est["saved_s"], measured, ratio])
    # The long prompt: the model's estimate of its full prefill against the one measured.
    m = found["prefill_model"]
    est_long = PrefillModel(**{**m, "points": tuple(map(tuple, m["points"]))}).full(
        lu["prompt_tokens"]) if m else 0.0
    print(f"prefill model: {m['source'] if m else 'none'}; machine: {benchlib.machine()}")
    benchlib.print_table(["turn", "prompt", "cached", "TTFT s", "full TTFT s (measured)",
                          "full s (est.)", "saved s (est.)", "saved s (measured)", "ratio"],
                         rows + [["long", lu["prompt_tokens"], 0, lu["ttft_s"], lu["ttft_s"],
                                  est_long, 0.0, 0.0, benchlib.ratio(est_long, lu["ttft_s"])]])
    benchlib.print_json({
        "bench": "figures", "mode": benchlib.mode(args), "model": args.model or "default",
        "machine": benchlib.machine(), "trials": trials,
        "prefill_model": m,
        "turns": [{"prompt_tokens": r[1], "cached_tokens": r[2], "ttft_s": r[3],
                   "full_ttft_s": r[4], "est_full_s": r[5], "est_saved_s": r[6],
                   "measured_saved_s": r[7], "ratio": r[8]} for r in rows],
        "saved_ratios": checks,
        "within_25pct": bool(checks) and all(0.75 <= r <= 1.25 for r in checks),
        "long_prompt_tokens": lu["prompt_tokens"], "long_ttft_s": lu["ttft_s"],
        "long_est_s": est_long, "long_ratio": benchlib.ratio(est_long, lu["ttft_s"]),
    })


if __name__ == "__main__":
    main()
