"""Cold start: process start to first reply byte (and to exit) of ``localchat ask`` resumed,
step by step, side by side with another version of localchat in the same run.

On the default model (or -m MODEL), with a ~1k-token history, each version (this tree, and
``--against REV``, default ``HEAD~1``, exported with ``git archive`` into a scratch folder and
put first on ``PYTHONPATH``) runs, trials alternating between the versions:
- resumed: ``localchat ask -c NAME "…"`` (the cache comes from disk): time from spawning the
  process to its first byte on stdout and to its exit (4 tokens generated);
- the same once more under a driver that times each step inside the process (wall clock from
  the spawn): Python and localchat's CLI imports, the database, the model's folder and
  digest, the model and tokenizer (their imports included), the CPU weights, the turn
  (render, cache from disk, prefill, decode, persist), the exit;
- full prefill: ``--no-cache`` on a copy of the conversation (this version only);
- the chat app, ``localchat chat -c NAME`` in a pseudo-terminal: process start to its first
  frame and to the model being ready (the status bar shows the context);
- what ``ask`` imports, per top-level package (``python -X importtime -m localchat ask``), and
  whether transformers is among them.
Medians of several trials, in a scratch data folder.

Usage: python scripts/bench_coldstart.py [--quick | --smoke] [-m MODEL] [--history N]
       [--against REV | --against none]
``--quick``: 2 trials. ``--smoke``: one trial on a 128-token history, every step in seconds on
a tiny model, against HEAD (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402


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
    """Seconds of import per top-level package from ``-X importtime`` lines: the cumulative
    time of the imports made at the outermost level, by the package they belong to (what it
    cost to import it, the packages it imports included); ``seen`` lists every package
    imported at any depth."""
    out: dict[str, float] = {}
    seen: set[str] = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            _, cumulative, name = line[len("import time:"):].split("|")
            top = name.strip().split(".")[0]
            seen.add(top)
            if name[1:] == name.strip():  # outermost (nested ones are indented)
                out[top] = out.get(top, 0.0) + int(cumulative) / 1e6
    return {**dict(sorted(out.items(), key=lambda kv: -kv[1])), "seen": sorted(seen)}


ROOT = Path(__file__).resolve().parent.parent

# The steps of a start, as functions the driver times (those a version lacks are left out):
# (step, "module:qualified name"). Engine.load's own time, less the steps inside it, is the
# model and tokenizer with their imports.
STEPS = [("database", "localchat.store.database:Store.open"),
         ("model folder", "localchat.model.engine:resolve"),
         ("model digest", "localchat.model.engine:model_digest"),
         ("CPU weights", "localchat.cpu.backend:tune"),
         ("load (all)", "localchat.model.engine:Engine.load"),
         ("turn", "localchat.session.session:Session.turn")]

DRIVER = r"""
import json, os, sys, time, importlib, functools, inspect
t_spawn = float(sys.argv[1]); argv = sys.argv[2:]
marks = {"imports": None}
spent = {}
def timed(step, fn, gen):
    @functools.wraps(fn)
    def inner(*a, **k):
        t = time.time()
        try:
            if gen:
                return (yield from fn(*a, **k))
            return fn(*a, **k)
        finally:
            spent[step] = spent.get(step, 0.0) + time.time() - t
    if not gen:
        def plain(*a, **k):
            t = time.time()
            try:
                return fn(*a, **k)
            finally:
                spent[step] = spent.get(step, 0.0) + time.time() - t
        return functools.wraps(fn)(plain)
    return inner
import localchat.cli.main as cli
marks["imports"] = time.time() - t_spawn
for step, where in json.loads(os.environ["STEPS"]):
    mod, _, name = where.partition(":")
    try:
        owner = importlib.import_module(mod)
    except ImportError:
        continue
    *path, last = name.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    fn = getattr(owner, last, None) if owner is not None else None
    if fn is None:
        continue
    static = inspect.getattr_static(owner, last)
    kind = type(static) if isinstance(static, (classmethod, staticmethod)) else None
    raw = static.__func__ if kind else fn
    wrapped = timed(step, raw, inspect.isgeneratorfunction(raw))
    setattr(owner, last, kind(wrapped) if kind else wrapped)
code = cli.main(argv)
sys.stdout.flush()
marks["main"] = time.time() - t_spawn
print("STEPS " + json.dumps({"marks": marks, "spent": spent}), file=sys.stderr)
getattr(cli, "exit_now", sys.exit)(code)  # as ``localchat`` exits (versions before: sys.exit)
"""


SEED = """
import json, sys
import localchat.paths as paths
from localchat.store.database import Store
store = Store.open(paths.database_path())
conv = store.create("resumed", sys.argv[1])
for m in json.loads(sys.argv[2]):
    store.add_message(conv, m["role"], m["content"])
store.close()
"""


def version_env(env: dict, tree: Path | None) -> dict:
    """``env`` with ``tree`` (a version of localchat) first on the path (None: this tree)."""
    path = str(tree or ROOT)
    return {**env, "PYTHONPATH": os.pathsep.join(
        [path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])}


def export(rev: str) -> Path:
    """The tree of commit ``rev`` in a scratch folder (removed at exit with the home)."""
    out = Path(tempfile.mkdtemp(prefix="localchat-rev-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "localchat"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"cannot export {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    import atexit

    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return out


def steps(argv: list[str], env: dict) -> dict[str, float]:
    """Seconds of each step of ``localchat ARGV`` (see ``STEPS``), timed inside the process."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", DRIVER, str(t0), *argv],
                         env={**env, "STEPS": json.dumps(STEPS)}, capture_output=True,
                         text=True, timeout=600)
    end = time.time() - t0
    if out.returncode != 0:
        raise SystemExit(f"driver: {out.stderr.strip()[-1500:]}")
    line = next(x for x in out.stderr.splitlines() if x.startswith("STEPS "))
    got = json.loads(line[6:])
    spent, marks = got["spent"], got["marks"]
    inside = sum(spent.get(k, 0.0) for k in ("model folder", "model digest", "CPU weights"))
    row = {"python + CLI imports": marks["imports"], "database": spent.get("database", 0.0),
           "model folder": spent.get("model folder", 0.0),
           "model digest": spent.get("model digest", 0.0),
           "model + tokenizer (with imports)": spent.get("load (all)", 0.0) - inside,
           "CPU weights": spent.get("CPU weights", 0.0), "turn": spent.get("turn", 0.0)}
    row["rest of main"] = marks["main"] - marks["imports"] - sum(
        v for k, v in row.items() if k != "python + CLI imports")
    row["exit"] = end - marks["main"]
    row["total"] = end
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "2 trials")
    ap.add_argument("--history", type=int, default=None, help="tokens (default 1024)")
    ap.add_argument("--against", default=None, metavar="REV",
                    help="the other version to run side by side: a git revision (default "
                         "HEAD~1; HEAD under --smoke) or 'none'")
    args = ap.parse_args()
    args.against = args.against or benchlib.pick(args, "HEAD~1", "HEAD~1", "HEAD")
    trials = benchlib.pick(args, 5, 2, 1)
    history = args.history or benchlib.pick(args, 1024, 1024, 128)
    home = benchlib.scratch_home()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    # A user's Python keeps compiled bytecode (warm-up runs write it): a shell that turns that
    # off would time the compiling of every module at every start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # ``python -m``/``-c`` put the working folder first on the path: a folder without a
    # localchat in it, so that PYTHONPATH says which version runs.
    os.chdir(home)
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from localchat.model.engine import Engine
    from localchat.store.database import Store

    engine = Engine.load(args.model)
    messages = benchlib.filler_messages(engine, history)
    store = Store.open(paths.database_path())
    for name in ("resumed", "full"):
        conv = store.create(name, engine.ref.name)
        for m in messages:
            store.add_message(conv, m["role"], m["content"])
    store.close()
    # The conversations know their model; -m again is for the reader of the command line.
    versions = {"this tree": version_env(env, None)}
    if args.against != "none":
        # The other version gets a data folder of its own, its database written by itself
        # (an older localchat refuses a newer schema), with the same conversation in it.
        other = home / "other"
        other.mkdir()
        venv = version_env({**env, "LOCALCHAT_HOME": str(other)}, export(args.against))
        subprocess.run([sys.executable, "-c", SEED, engine.ref.name, json.dumps(messages)],
                       env=venv, check=True)
        versions[args.against] = venv
    exe = benchlib.localchat("ask", "-m", engine.ref.name, "--max-tokens", "4")
    # Warm-up, and the resumed conversation's cache written to disk (by each version: the
    # same cache format, so each resumes it).
    for venv in versions.values():
        benchlib.run(exe + ["-c", "resumed", "Thanks."], venv)
    resumed = {v: [] for v in versions}
    stepped = {v: [] for v in versions}
    full = []
    chat = {v: [] for v in versions}
    app = benchlib.localchat("chat", "-c", "resumed")
    for i in range(trials):
        for name, venv in versions.items():  # alternating: both see the same machine
            resumed[name].append(benchlib.first_byte(exe + ["-c", "resumed", f"Question {i}?"],
                                            venv)[:2])
            stepped[name].append(steps(exe[3:] + ["-c", "resumed", f"Step {i}?"], venv))
            chat[name].append(chat_start(app, venv))
        full.append(benchlib.first_byte(exe + ["-c", "full", "--no-cache", f"Question {i}?"],
                               versions["this tree"])[:2])
    med = benchlib.median
    first = {v: med([x[0] for x in resumed[v]]) for v in versions}
    ended = {v: med([x[1] for x in resumed[v]]) for v in versions}
    frame = {v: med([x[0] for x in chat[v]]) for v in versions}
    ready = {v: med([x[1] for x in chat[v]]) for v in versions}
    step_med = {v: {k: med([r[k] for r in stepped[v]]) for k in stepped[v][0]}
                for v in versions}
    took = {v: imports(subprocess.run(
        [sys.executable, "-X", "importtime", *exe[1:], "-c", "resumed", "Imports?"],
        env=versions[v], capture_output=True, text=True, check=True).stderr) for v in versions}
    names = list(versions)
    base = names[-1]
    print(f"# cold start · {engine.ref.name} · ~{history}-token history · "
          f"{benchlib.machine()} · median of {trials} · trials alternating between versions")
    rows = []
    for v in names:
        rows.append([f"ask resumed · {v}", first[v], ended[v],
                     f"{benchlib.ratio(ended[v], ended[base]):.2f}x"])
    full_exit = med([x[1] for x in full])
    rows.append(["ask --no-cache (full prefill) · this tree", med([x[0] for x in full]),
                 full_exit, f"{benchlib.ratio(full_exit, ended[base]):.2f}x"])
    benchlib.print_table(["run", "process start to first token s", "to exit s",
                          f"exit vs {base}"], rows)
    print()
    benchlib.print_table(["step of `ask` resumed (timed inside)"] + [f"{v} s" for v in names],
                         [[k] + [step_med[v][k] for v in names] for k in step_med[names[0]]])
    print()
    benchlib.print_table(["localchat chat -c NAME, in a pty", "first frame s",
                          "model ready s"], [[v, frame[v], ready[v]] for v in names])
    print()
    seen = {v: took[v].pop("seen") for v in names}
    top = sorted({k for v in names for k in list(took[v])[:8]},
                 key=lambda k: -max(took[v].get(k, 0.0) for v in names))
    benchlib.print_table(["package (ask -X importtime, cumulative)"] + [f"{v} s" for v in names],
                         [[k] + [took[v].get(k, 0.0) for v in names] for k in top]
                         + [["all"] + [sum(took[v].values()) for v in names],
                            ["transformers imported?"] + ["transformers" in seen[v]
                                                          for v in names]])
    benchlib.print_json({"bench": "coldstart", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "machine": benchlib.machine(),
                         "history": history, "trials": trials, "against": args.against,
                         "resumed_s": first["this tree"],
                         "full_prefill_s": med([x[0] for x in full]),
                         "ratio": benchlib.ratio(med([x[0] for x in full]), first["this tree"]),
                         "resumed_exit_s": ended["this tree"],
                         "full_prefill_exit_s": med([x[1] for x in full]),
                         "chat_first_frame_s": frame["this tree"],
                         "chat_model_ready_s": ready["this tree"],
                         "imports_s": took["this tree"],
                         "transformers_imported": {v: "transformers" in seen[v] for v in names},
                         "steps_s": step_med,
                         "versions": {v: {"resumed_s": first[v], "resumed_exit_s": ended[v],
                                          "chat_first_frame_s": frame[v],
                                          "chat_model_ready_s": ready[v]} for v in names}})


if __name__ == "__main__":
    main()
