"""Cold start: process start to first reply byte of ``localchat ask`` on a resumed conversation.

Side by side in one run, on the default model (or -m MODEL), with a ~1k-token history:
- resumed: ``localchat ask -c NAME "…"`` (the cache comes from disk);
- full prefill: the same with ``--no-cache`` on a copy of the conversation.
Each figure is the time from spawning the process to the first byte on stdout (model loading,
imports and cache loading included), median of several trials.

Usage: python scripts/bench_coldstart.py [--quick] [-m MODEL] [--history N]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402


def first_byte(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    elapsed = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd} failed")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--history", type=int, default=1024)
    args = ap.parse_args()
    trials = 2 if args.quick else 5
    home = benchlib.scratch_home()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    from localchat import backend, paths

    backend.prepare()
    from localchat.engine import Engine
    from localchat.store import Store

    engine = Engine.load(args.model)
    store = Store.open(paths.database_path())
    for name in ("resumed", "full"):
        conv = store.create(name, engine.ref.name)
        for m in benchlib.filler_messages(engine, args.history):
            store.add_message(conv, m["role"], m["content"])
    exe = [sys.executable, "-m", "localchat", "ask", "--max-tokens", "4"]
    subprocess.run(exe + ["-c", "resumed", "Thanks."], env=env, capture_output=True, check=True)
    resumed, full = [], []
    for i in range(trials):
        resumed.append(first_byte(exe + ["-c", "resumed", f"Question {i}?"], env))
        full.append(first_byte(exe + ["-c", "full", "--no-cache", f"Question {i}?"], env))
    r, f = benchlib.median(resumed), benchlib.median(full)
    print(f"# cold start · {engine.ref.name} · ~{args.history}-token history · "
          f"{benchlib.machine()} · median of {trials}")
    benchlib.print_table(["run", "process start to first token s", "ratio"],
                         [["localchat ask, resumed from disk", r, "1.00x"],
                          ["localchat ask --no-cache (full prefill)", f, f"{f / r:.1f}x"]])
    benchlib.print_json({"bench": "coldstart", "machine": benchlib.machine(),
                         "history": args.history, "resumed_s": r, "full_prefill_s": f,
                         "ratio": f / r})


if __name__ == "__main__":
    main()
