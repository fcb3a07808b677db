"""BLAS libraries and thread settings, alone and beside a competing CPU-bound load.

For each library (every candidate ``backend.prepare`` would try, plus ``--lib PATH``), each
thread setting (1 thread; all cores with OpenBLAS's default spin-wait; all cores with its
threads put to sleep at once, ``OPENBLAS_THREAD_TIMEOUT=4``) and each machine state (quiet;
one busy-looping process per core, started before and killed after), a child process loads the
default model (or -m MODEL) with that library and measures prefill tok/s (a fresh cache) and
greedy decode tok/s, median of the trials. Each library is first run through the probe
(``localchat/cpu/probe.py``): a refused one gets a row saying why, and is not timed.

Usage: python scripts/bench_blas.py [--quick | --smoke] [-m MODEL] [--lib PATH ...]
``--quick``: 1 trial, 256-token prefill, 16 tokens decoded. ``--smoke``: the quickest run
that takes every step, on a tiny model (``tests/test_scripts.py``); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

SETTINGS = [("1 thread", {"OPENBLAS_NUM_THREADS": "1"}),
            ("all cores, spin", {"OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1)}),
            ("all cores, sleep", {"OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1),
                                  "OPENBLAS_THREAD_TIMEOUT": "4"})]


def measure(model: str | None, trials: int, prompt: int, tokens: int) -> dict:
    """In this process (the library and threads set by the environment): prefill and decode
    tok/s of ``model``, median of ``trials`` after a warm-up."""
    import localchat.cpu.backend as backend

    backend.prepare()
    import mlx.core as mx

    from localchat.model.engine import Engine

    engine = Engine.load(model)
    ids = engine.encode(benchlib.FILLER * (prompt // 20 + 1))[:prompt]
    prefill, decode = [], []
    for i in range(trials + 1):
        cache = engine.new_cache()
        t = time.perf_counter()
        logits = benchlib.prefill(engine, [(x + i) % 1000 for x in ids], cache)
        mx.eval(logits)
        t1 = time.perf_counter()
        n = sum(1 for _ in engine.decode(cache, logits, tokens))
        t2 = time.perf_counter()
        if i:
            prefill.append(len(ids) / (t1 - t))
            decode.append(n / (t2 - t1))
    return {"prefill_tps": benchlib.median(prefill), "decode_tps": benchlib.median(decode),
            "blas": backend.blas_in_use()}


def busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin a core each until killed (or this script ends: each stops
    once its parent is gone, so a killed benchmark leaves nothing spinning)."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "1 trial, 256-token prefill, 16 tokens decoded")
    ap.add_argument("--lib", action="append", default=[], metavar="PATH",
                    help="another BLAS library to compare (repeatable)")
    ap.add_argument("--child-timeout", type=float, default=900, metavar="S",
                    help="seconds one setting may take before its row says so (default 900)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    trials, prompt, tokens = benchlib.pick(args, (3, 512, 32), (1, 256, 16), (1, 16, 4))
    if args.child:
        print(json.dumps(measure(args.model, trials, prompt, tokens)))
        return
    benchlib.scratch_home()
    import localchat.cpu.backend as backend
    import localchat.cpu.probe as probe

    libs = list(dict.fromkeys(args.lib + backend.candidates()))
    settings = benchlib.pick(args, SETTINGS, SETTINGS, SETTINGS[:2])
    cores = os.cpu_count() or 1
    rows, results = [], []
    for lib in libs:
        verdict = probe.check(lib)
        if not verdict.ok:
            rows.append([lib, verdict.reason, "", "", "", "", ""])
            results.append({"lib": lib, "refused": verdict.reason})
            continue
        for name, env in settings:
            figures = {}
            for loaded in (False, True):
                others = busy(cores) if loaded else []
                try:
                    cmd = [sys.executable, __file__, "--child", *benchlib.size_flags(args)] + \
                        (["-m", args.model] if args.model else [])
                    out = benchlib.run(cmd, {**os.environ, "LOCALCHAT_BLAS": lib, **env},
                                       timeout=args.child_timeout)
                    figures[loaded] = json.loads(out.stdout.strip().splitlines()[-1])
                except SystemExit as err:  # one setting that fails or hangs is a row, not the end
                    figures[loaded] = {"error": str(err), "prefill_tps": "", "decode_tps": ""}
                finally:
                    for p in others:
                        p.kill()
                        p.wait()
                print(f"bench_blas: {Path(lib).parent.parent.name} · {name} · "
                      f"{'loaded' if loaded else 'quiet'}: {figures[loaded]}", file=sys.stderr)
            quiet, load = figures[False], figures[True]
            rows.append([f"{Path(lib).parent.parent.name}/{verdict.core}", name,
                         quiet["prefill_tps"], quiet["decode_tps"], load["prefill_tps"],
                         load["decode_tps"],
                         benchlib.ratio(load["decode_tps"], quiet["decode_tps"])
                         if "error" not in quiet and "error" not in load else "failed"])
            results.append({"lib": lib, "core": verdict.core, "config": verdict.config,
                            "setting": name, "env": env, "quiet": quiet, "loaded": load})
    print(f"# BLAS benchmark · {benchlib.machine()} · {prompt}-token prefill, {tokens} tokens "
          f"decoded, median of {trials}; loaded = {cores} busy-looping processes beside it")
    benchlib.print_table(["library", "threads", "prefill tok/s", "decode tok/s",
                          "prefill loaded", "decode loaded", "decode kept"], rows)
    benchlib.print_json({"bench": "blas", "mode": benchlib.mode(args),
                         "machine": benchlib.machine(), "model": args.model or "default",
                         "results": results})


if __name__ == "__main__":
    main()
