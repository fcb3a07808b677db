"""Cold start: process start to first reply byte (and to exit) of ``localchat ask`` resumed.

Side by side in one run, on the default model (or -m MODEL), with a ~1k-token history:
- resumed: ``localchat ask -c NAME "…"`` (the cache comes from disk);
- full prefill: the same with ``--no-cache`` on a copy of the conversation.
Each figure is the time from spawning the process to the first byte on stdout (model loading,
imports and cache loading included) and to its exit (4 tokens generated), median of several
trials, in a scratch data folder. The chat app too: ``localchat chat -c NAME`` in a
pseudo-terminal, process start to its first frame and to the model being ready (the status bar
shows the context). Then what ``ask`` imports, alone under ``python -X
importtime`` (localchat's CLI, then mlx-lm as ``Engine.load`` imports it; a run of ``ask`` itself
would mix in the thread that reads the CPU weights meanwhile): seconds per top-level package.

Usage: python scripts/bench_coldstart.py [--quick | --smoke] [-m MODEL] [--history N]
``--quick``: 2 trials. ``--smoke``: one trial on a 128-token history, every step in seconds on
a tiny model (``tests/test_scripts.py`` runs it); its figures mean nothing.
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


def first_byte(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """Seconds from spawning ``cmd`` to its first byte on stdout and to its exit (it must
    succeed), and its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    elapsed = time.perf_counter() - t0
    _, err = proc.communicate()
    ended = time.perf_counter() - t0
    text = err.decode(errors="replace")
    if proc.returncode != 0:
        lines = text.strip().splitlines() or ["no message"]
        raise SystemExit(f"{' '.join(cmd[3:])}: exit status {proc.returncode}: {lines[-1]}")
    return elapsed, ended, text


def chat_start(cmd: list[str], env: dict, timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from spawning the app ``cmd`` in an 40x120 pty to its first frame (the
    alternate screen taken) and to the model ready (``ctx `` in the status bar); then killed."""
    import fcntl
    import pty
    import signal
    import struct
    import termios

    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.environ.update(env, TERM="xterm-256color")
        os.execv(cmd[0], cmd)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    seen, marks = bytearray(), {}
    try:
        while len(marks) < 2 and time.perf_counter() - t0 < timeout:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
            for name, what in (("frame", b"\x1b[?1049h"), ("ready", b"ctx ")):
                if name not in marks and what in seen:
                    marks[name] = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
    if len(marks) < 2:
        raise SystemExit(f"the app showed no {'frame' if not marks else 'model'} in "
                         f"{timeout:.0f} s: {bytes(seen[-300:])!r}")
    return marks["frame"], marks["ready"]


def imports(stderr: str) -> dict[str, float]:
    """Seconds of import per top-level package, from ``-X importtime`` lines (self times)."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            us, _, name = (x.strip() for x in line[len("import time:"):].split("|"))
            top = name.split(".")[0]
            out[top] = out.get(top, 0.0) + int(us) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials")
    ap.add_argument("--history", type=int, default=None, help="tokens (default 1024)")
    args = ap.parse_args()
    trials = benchlib.pick(args, 5, 2, 1)
    history = args.history or benchlib.pick(args, 1024, 1024, 128)
    home = benchlib.scratch_home()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from localchat.engine import Engine
    from localchat.store import Store

    engine = Engine.load(args.model)
    store = Store.open(paths.database_path())
    for name in ("resumed", "full"):
        conv = store.create(name, engine.ref.name)
        for m in benchlib.filler_messages(engine, history):
            store.add_message(conv, m["role"], m["content"])
    store.close()
    # The conversations know their model; -m again is for the reader of the command line.
    exe = benchlib.localchat("ask", "-m", engine.ref.name, "--max-tokens", "4")
    # Warm-up, and the resumed conversation's cache written to disk.
    benchlib.run(exe + ["-c", "resumed", "Thanks."], env)
    resumed, full = [], []
    for i in range(trials):
        resumed.append(first_byte(exe + ["-c", "resumed", f"Question {i}?"], env)[:2])
        full.append(first_byte(exe + ["-c", "full", "--no-cache", f"Question {i}?"], env)[:2])
    r, f = (benchlib.median([x[0] for x in resumed]), benchlib.median([x[0] for x in full]))
    r_end, f_end = (benchlib.median([x[1] for x in resumed]),
                    benchlib.median([x[1] for x in full]))
    app = benchlib.localchat("chat", "-c", "resumed")
    chat = [chat_start(app, env) for _ in range(trials)]
    frame, ready = (benchlib.median([x[0] for x in chat]), benchlib.median([x[1] for x in chat]))
    code = ("import localchat.cli; from localchat.cpu import backend; backend.prepare(); "
            "import mlx_lm.tokenizer_utils, mlx_lm.utils")
    took = imports(subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                                  capture_output=True, text=True, check=True).stderr)
    print(f"# cold start · {engine.ref.name} · ~{history}-token history · "
          f"{benchlib.machine()} · median of {trials}")
    benchlib.print_table(["run", "process start to first token s", "to exit s", "ratio"],
                         [["localchat ask, resumed from disk", r, r_end, "1.00x"],
                          ["localchat ask --no-cache (full prefill)", f, f_end,
                           f"{f / r:.1f}x"]])
    print()
    benchlib.print_table(["localchat chat -c NAME", "process start to first frame s",
                          "to the model ready s"], [["the app, in a pty", frame, ready]])
    print()
    top = list(took.items())[:8]
    benchlib.print_table(["package (-X importtime, what ask imports)", "import s"],
                         [[name, secs] for name, secs in top]
                         + [["all", sum(took.values())]])
    benchlib.print_json({"bench": "coldstart", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "machine": benchlib.machine(),
                         "history": history, "trials": trials, "resumed_s": r,
                         "full_prefill_s": f, "ratio": f / r, "resumed_exit_s": r_end,
                         "full_prefill_exit_s": f_end, "chat_first_frame_s": frame,
                         "chat_model_ready_s": ready, "imports_s": took})


if __name__ == "__main__":
    main()
