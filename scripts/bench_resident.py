"""The resident model process (issue 48): ``localchat ask`` from process start to exit when a
resident answers, side by side with the same ask run in its own process, in one run.

On the default model (or -m MODEL), each conversation a ~1k-token history, 4 tokens a turn
(``--tokens N``; 1: the turn is its time to first token):
- in-process: ``ask`` with ``--keep-alive 0`` (what every ask was before: it loads the model);
- first ask: no resident yet (``localchat stop`` before each trial), so this ask runs its
  turn itself and starts one as it ends (the bench waits until it has loaded); compared with an
  in-process ask in the same state (no resident alive, the two in alternating order);
- resident: the second and later asks of a conversation, answered by the warm resident
  (trials alternating with the in-process ones, so each sees the same machine);
- eight at once: eight asks on eight conversations spawned together, each its own process
  (``--keep-alive 0``: eight models) vs through one resident (its scheduler decodes them
  together): wall time until the last exits, and how many models were in memory;
- keep-alive: an ask with ``--keep-alive 2s`` answered by the resident: seconds from the
  ask's exit to the resident's exit, past its keep-alive.
Medians of several trials, in a scratch data folder; every resident is stopped at the end.

Usage: python scripts/bench_resident.py [--quick | --smoke] [-m MODEL] [--history N] [--tokens N]
``--quick``: 3 trials. ``--smoke``: one trial, a 128-token history, two at once, on a tiny
model (``tests/test_scripts.py`` runs it); its figures mean nothing.
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

KEEP = "5m"  # the resident's keep-alive while timing (the default)


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """Seconds from spawning ``cmd`` to its first byte on stdout and to its exit."""
    return benchlib.first_byte(cmd, env)[:2]


def at_once(cmds: list[list[str]], env: dict) -> float:
    """Seconds from spawning all of ``cmds`` together to the last one's exit."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for c in cmds]
    for p, c in zip(procs, cmds):
        _, err = p.communicate()
        if p.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            raise SystemExit(f"{' '.join(c[3:])}: exit status {p.returncode}: {last}")
    return time.perf_counter() - t0


def residents(env: dict) -> list[dict]:
    out = benchlib.run(benchlib.localchat("ps", "--json"), env).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def ready(env: dict, timeout: float = 120) -> None:
    """Wait until the data folder's resident has loaded (a first ask starts it as it ends)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if any(r.get("ready") for r in residents(env)):
            return
        time.sleep(0.1)
    raise SystemExit(f"no resident was ready within {timeout:.0f} s")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie (its parent has not reaped it yet) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchlib.add_flags(ap, "3 trials")
    ap.add_argument("--history", type=int, default=None, help="tokens (default 1024)")
    ap.add_argument("--tokens", type=int, default=4, help="a reply's tokens (default 4)")
    args = ap.parse_args()
    trials = benchlib.pick(args, 5, 3, 1)
    history = args.history or benchlib.pick(args, 1024, 1024, 128)
    crowd = benchlib.pick(args, 8, 8, 2)
    home = benchlib.scratch_home()
    env = {k: v for k, v in os.environ.items() if k != "LOCALCHAT_KEEP_ALIVE"}
    env["LOCALCHAT_HOME"] = str(home)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (a user's Python keeps its bytecode)
    os.chdir(home)  # (``python -m`` puts the working folder first on the path)
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from localchat.model.engine import Engine
    from localchat.store.database import Store

    engine = Engine.load(args.model)
    model = engine.ref.name
    messages = benchlib.filler_messages(engine, history)
    del engine
    names = ["here", "first", "resident"] + [f"crowd{i}" for i in range(crowd)]
    store = Store.open(paths.database_path())
    for name in names:
        conv = store.create(name, model)
        for m in messages:
            store.add_message(conv, m["role"], m["content"])
    store.close()
    exe = benchlib.localchat("ask", "-m", model, "--max-tokens", str(args.tokens))
    here = [*exe, "--keep-alive", "0"]
    there = [*exe, "--keep-alive", KEEP]
    stop = benchlib.localchat("stop")
    try:
        # Warm-up: every conversation's cache on disk, the bytecode written.
        for name in names:
            benchlib.run([*here, "-c", name, "Thanks."], env)
        benchlib.run([*there, "-c", "resident", "Warm?"], env)
        ready(env)
        runs = {"in-process": [], "first ask": [], "resident": []}
        for i in range(trials):  # alternating: each kind sees the same machine
            for kind, cmd, name in (("in-process", here, "here"), ("resident", there, "resident")):
                runs[kind].append(timed([*cmd, "-c", name, f"Question {i}?"], env))
        served = residents(env)
        # No resident: the first ask runs its turn and starts one; beside it, in the same
        # state (none alive, the order alternating), an ask in its own process.
        again = {"in-process": [], "first ask": []}
        for i in range(trials):
            benchlib.run(stop, env)
            pair = [("in-process", here, "here"), ("first ask", there, "first")]
            for kind, cmd, name in pair if i % 2 == 0 else pair[::-1]:
                again[kind].append(timed([*cmd, "-c", name, f"Alone {i}?"], env))
            ready(env)
        runs["first ask"] = again["first ask"]
        # Eight at once: eight processes with a model each, then through the warm resident.
        crowd_here, crowd_there, models_there = [], [], []
        for i in range(max(1, trials // 2)):
            crowd_here.append(at_once([[*here, "-c", f"crowd{j}", f"At once {i}?"]
                                       for j in range(crowd)], env))
            crowd_there.append(at_once([[*there, "-c", f"crowd{j}", f"Together {i}?"]
                                        for j in range(crowd)], env))
            models_there.append(len(residents(env)))
        # Keep-alive: how long past it the resident lives.
        benchlib.run(stop, env)
        benchlib.run([*there, "-c", "resident", "Start?"], env)
        ready(env)
        benchlib.run([*exe, "--keep-alive", "2s", "-c", "resident", "Expire?"], env)
        asked = time.perf_counter()
        [row] = residents(env)
        while not gone(row["pid"]) and time.perf_counter() - asked < 60:
            time.sleep(0.05)
        overshoot = time.perf_counter() - asked - 2.0
    finally:
        subprocess.run(stop, env=env, capture_output=True)
    med = benchlib.median
    first = {k: med([x[0] for x in v]) for k, v in runs.items()}
    ended = {k: med([x[1] for x in v]) for k, v in runs.items()}
    base = ended["in-process"]
    alone = benchlib.median([x[1] for x in again["in-process"]])
    print(f"# resident model · {model} · ~{history}-token history · {args.tokens} tokens · "
          f"{benchlib.machine()} · median of {trials} · trials alternating")
    benchlib.print_table(
        ["ask resumed", "process start to first token s", "to exit s", "exit vs in-process"],
        [[k, first[k], ended[k], f"{benchlib.ratio(ended[k], base):.2f}x"] for k in runs]
        + [["in-process, no resident alive", benchlib.median([x[0] for x in again["in-process"]]),
            alone, f"{benchlib.ratio(alone, base):.2f}x"]])
    print()
    here_s, there_s = med(crowd_here), med(crowd_there)
    benchlib.print_table(
        [f"{crowd} asks at once, 8 conversations", "wall s", "models in memory", "speed-up"],
        [["each in its own process", here_s, crowd, "1.00x"],
         ["through the resident", there_s, max(models_there),
          f"{benchlib.ratio(here_s, there_s):.2f}x"]])
    print()
    print(f"keep-alive 2 s: the resident exited {overshoot:.2f} s after it (limit 5 s)")
    benchlib.print_json({
        "bench": "resident", "mode": benchlib.mode(args), "model": model,
        "machine": benchlib.machine(), "history_tokens": history, "trials": trials,
        "reply_tokens": args.tokens,
        "first_token_s": first, "exit_s": ended,
        "resident_vs_in_process": benchlib.ratio(ended["resident"], base),
        "first_ask_minus_in_process_s": ended["first ask"] - alone,
        "in_process_no_resident_exit_s": alone,
        "turns_served": served[0]["turns"] if served else 0,
        "crowd": crowd, "crowd_in_process_s": here_s, "crowd_resident_s": there_s,
        "crowd_speedup": benchlib.ratio(here_s, there_s), "crowd_models": max(models_there),
        "keep_alive_overshoot_s": overshoot})


if __name__ == "__main__":
    main()
