"""Cache load benchmark: what loading a conversation's K/V from disk costs, step by step.

On the default model (or -m MODEL), a history of about 4k tokens (``--length``) is answered
once so its cache is on disk; then, side by side in one run:
- ``load_growing`` (read + check + parse + convert, what a resumed turn runs), timed whole and
  per step (``CacheFolder.load_growing(steps=...)``): the files read, their checksums, the
  safetensors headers and token ids, the buffers allocated, the K/V converted into them;
- the whole turn: time to first token of a new message after a restart (a fresh Session, the
  cache from disk) at the long history and at a 256-token one, and their ratio.
The files are in the page cache (read just before), as after a quit and restart; a cold disk
adds its own read time on top.

Usage: python scripts/bench_load.py [--quick | --smoke] [-m MODEL] [--length N] [--trials N]
``--quick``: 3 trials. ``--smoke``: a 256-token history on a tiny model, 1 trial: every step in
seconds (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

STEPS = ("read", "check", "parse", "allocate", "convert")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "3 trials")
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--trials", type=int, default=None)
    args = ap.parse_args()
    length = args.length or benchlib.pick(args, 4096, 4096, 256)
    short = 256 if length > 256 else length // 2
    trials = args.trials or benchlib.pick(args, 7, 3, 1)

    benchlib.scratch_home()
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    import time

    from localchat.events import TurnFinished
    from localchat.model.engine import Engine
    from localchat.session.session import Session, TurnOptions
    from localchat.store.database import Store

    engine = Engine.load(args.model)
    store = Store.open(paths.database_path())
    dtype = engine.compute_dtype()

    def session() -> Session:  # a fresh one per run: nothing of the cache left in memory
        return Session(store, engine, paths.kv_root(), paths.locks_dir())

    def turn(conv, prompt):
        for ev in session().turn(conv, prompt, TurnOptions(max_tokens=1)):
            if isinstance(ev, TurnFinished):
                return ev.usage
        raise RuntimeError("no reply")

    warm = store.create("warm", engine.ref.name)
    turn(warm, "Hello")
    convs = {}
    for n in sorted({short, length}):
        conv = store.create(f"h{n}", engine.ref.name)
        for m in benchlib.filler_messages(engine, n):
            store.add_message(conv, m["role"], m["content"])
        turn(conv, "Thanks.")  # the history's cache on disk
        convs[n] = (conv, len(store.messages(conv)))

    conv, _ = convs[length]
    folder = session().cache_folder(conv)
    man = folder.manifest()
    upto = len(man.tokens)
    nbytes = sum(s.nbytes for s in man.segments)
    whole, steps = [], {k: [] for k in STEPS}
    for _ in range(trials):
        got: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            layers = folder.load_growing(man, upto, dtype, steps=got)
        except TypeError:  # an older localchat (run side by side): the whole load only
            layers = folder.load_growing(man, upto, dtype)
        whole.append(time.perf_counter() - t0)
        del layers
        for k in STEPS:
            steps[k].append(got.get(k, 0.0))

    ttft = {n: [] for n in convs}
    for i in range(trials):
        for n in sorted(convs) if i % 2 == 0 else sorted(convs, reverse=True):
            c, base = convs[n]
            ttft[n].append(turn(c, f"Question {i}: what should I pack for the trip?").ttft_s)
            store.delete_messages_from(c, base + 1)

    load = benchlib.median(whole)
    step_ms = {k: 1e3 * benchlib.median(v) for k, v in steps.items()}
    long_s, short_s = benchlib.median(ttft[length]), benchlib.median(ttft[short])
    stored, to = man.layout.dtype, str(dtype).replace("mlx.core.", "")
    print(f"# cache load · {engine.ref.name} · {upto} tokens in {len(man.segments)} segment "
          f"file(s), {nbytes / 1e6:.1f} MB {stored} -> {to} · {benchlib.machine()} · "
          f"median of {trials}")
    benchlib.print_table(["step", "ms"], [["load_growing (wall)", 1e3 * load]]
                         + [[f"  {k} (summed over threads)", step_ms[k]] for k in STEPS
                            if step_ms[k]])
    print()
    benchlib.print_table(["resumed turn after a restart", "TTFT s", "ratio"],
                         [[f"{length}-token history", long_s, benchlib.ratio(long_s, short_s)],
                          [f"{short}-token history", short_s, 1.0]])
    benchlib.print_json({"bench": "load", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "machine": benchlib.machine(),
                         "history_tokens": upto, "segments": len(man.segments),
                         "segment_bytes": nbytes, "stored_dtype": stored, "to_dtype": to,
                         "load_s": load, "steps_ms": step_ms, "ttft_long_s": long_s,
                         "ttft_short_s": short_s,
                         "ttft_ratio": benchlib.ratio(long_s, short_s), "trials": trials})


if __name__ == "__main__":
    main()
