"""BLAS threads chosen while running (``localchat/cpu/threads.py``) against fixed counts, on a
quiet machine and beside one busy-looping process per core.

For each machine state (quiet; loaded: the busy processes started before and killed after), a
child process loads the default model (or -m MODEL) once and runs greedy turns (``generate``,
prompt lookup off, a fresh cache each) under each setting in turn — 1 thread pinned, all
cores pinned (OpenBLAS's default, today's), and ``auto`` (a fresh controller each turn, so
its learning is in the figure) — rotating the order each trial; median of the trials. Then
``auto, kept``: one controller over three turns, the later two timed (the app, ``serve`` and a
resident model keep theirs: a decode move carries over to the next turn's prefill). The
table gives decode and prefill tok/s side by side, ``auto`` over the better fixed count, and
over all cores (quiet: what the controller costs where it should change nothing).

Usage: python scripts/bench_threads.py [--quick | --smoke] [-m MODEL]
``--quick``: 2 trials, 64-token prompt, 48 tokens decoded. ``--smoke``: the quickest run that
takes every step, on a tiny model (``tests/test_scripts.py``); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402
from bench_blas import busy  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper and the ships she guides. "


def measure(model: str | None, trials: int, prompt: int, tokens: int) -> dict:
    """In this process: each setting's decode and prefill tok/s (median of ``trials``), its
    replies, and what the controller chose and why."""
    import localchat.cpu.backend as backend
    from localchat.cpu import threads

    path = backend.prepare().path
    from localchat.model.engine import Engine
    from localchat.session.generation import Cancel, Run, TurnOptions, generate
    from localchat.session.turncache import Start

    engine = Engine.load(model)
    cores = threads.OpenBlas(path).get() if path else 1
    settings = [("1 thread", "1"), (f"{cores} threads", str(cores)), ("auto", "auto")]
    ids = engine.render([{"role": "user", "content": PROMPT * 8}])
    ids = ids[:max(0, prompt - 16)] + ids[-16:]  # (the end: the template's reply opening)

    def turn(value: str, tokens: int = tokens, fresh: bool = True) -> dict:
        os.environ[threads.ENV] = value
        if fresh:
            threads.install(path)
        run = Run()
        list(generate(engine, ids, Start(engine.new_cache(), 0, {}), tokens,
                      TurnOptions(max_tokens=tokens, speculate="off"), Cancel(), run))
        decode_s = (run.t_last or 0) - (run.t_ready or 0)
        got = threads.summary()
        return {"decode_tps": (len(run.generated) - 1) / decode_s if decode_s > 0 else 0.0,
                "prefill_tps": len(ids) / run.prefill_s if run.prefill_s else 0.0,
                "tokens": run.generated, "choice": {k: got[k] for k in ("decode", "prefill")},
                "last_change": got["last_change"]}

    turn("1", 4)  # warm-up (one thread: all cores beside busy processes takes minutes)
    got: dict[str, list[dict]] = {name: [] for name, _ in settings}
    for trial in range(trials):
        shift = trial % len(settings)
        for name, value in settings[shift:] + settings[:shift]:
            got[name].append(turn(value))
    # The app, `serve` and a resident model keep one controller over their turns: the turns
    # after the first, once it has learnt (decode's move carries over to the next prefill).
    kept = []
    for _ in range(trials):
        turn("auto")
        kept += [turn("auto", fresh=False) for _ in range(2)]
    got["auto, kept"] = kept
    out = {}
    for name, runs in got.items():
        out[name] = {"decode_tps": benchlib.median([r["decode_tps"] for r in runs]),
                     "prefill_tps": benchlib.median([r["prefill_tps"] for r in runs]),
                     "decode_each": [round(r["decode_tps"], 2) for r in runs],
                     "choice": runs[-1]["choice"], "last_change": runs[-1]["last_change"]}
    same = [all(got[n][t]["tokens"] == got[settings[1][0]][t]["tokens"] for n in got)
            for t in range(trials)]
    return {"cores": cores, "settings": [n for n, _ in settings] + ["auto, kept"], "figures": out,
            "same_text": all(same)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials, 64-token prompt, 48 tokens decoded")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    trials, prompt, tokens = benchlib.pick(args, (3, 256, 128), (2, 64, 48), (1, 16, 6))
    if args.child:
        print(json.dumps(measure(args.model, trials, prompt, tokens)))
        return
    benchlib.scratch_home()
    cores = os.cpu_count() or 1
    states = {}
    for loaded in (False, True):
        others = busy(cores) if loaded else []
        try:
            cmd = [sys.executable, __file__, "--child", *benchlib.size_flags(args)] + \
                (["-m", args.model] if args.model else [])
            out = benchlib.run(cmd, {**os.environ, "LOCALCHAT_BLAS_THREADS": "auto"})
            states["loaded" if loaded else "quiet"] = json.loads(
                out.stdout.strip().splitlines()[-1])
        finally:
            for p in others:
                p.kill()
                p.wait()
    rows, summary = [], {}
    for state, found in states.items():
        fig = found["figures"]
        one, all_, auto, kept = (fig[n] for n in found["settings"])
        best = max(one["decode_tps"], all_["decode_tps"])
        summary[state] = {"auto_vs_best_fixed": benchlib.ratio(auto["decode_tps"], best),
                          "auto_vs_all_cores": benchlib.ratio(auto["decode_tps"],
                                                              all_["decode_tps"])}
        rows.append([state, one["decode_tps"], all_["decode_tps"], auto["decode_tps"],
                     summary[state]["auto_vs_best_fixed"], summary[state]["auto_vs_all_cores"],
                     one["prefill_tps"], all_["prefill_tps"], auto["prefill_tps"],
                     kept["decode_tps"], kept["prefill_tps"],
                     f"decode {auto['choice']['decode']}, prefill {auto['choice']['prefill']}",
                     "yes" if found["same_text"] else "no"])
    print(f"# BLAS threads · {benchlib.machine()} · {prompt}-token prompt, {tokens} tokens "
          f"decoded (greedy, lookup off), median of {trials}; loaded = {cores} busy-looping "
          "processes beside it")
    n = states["quiet"]["settings"][1]
    benchlib.print_table(["machine", "decode 1 thread", f"decode {n}", "decode auto",
                          "auto / best fixed", f"auto / {n}", "prefill 1", f"prefill {n}",
                          "prefill auto", "decode auto kept", "prefill auto kept",
                          "auto chose", "same text"], rows)
    for state, found in states.items():
        if change := found["figures"]["auto"]["last_change"]:
            print(f"# {state}: auto's last change: {change}")
    benchlib.print_json({"bench": "threads", "mode": benchlib.mode(args),
                         "machine": benchlib.machine(), "model": args.model or "default",
                         "states": states, "ratios": summary})


if __name__ == "__main__":
    main()
