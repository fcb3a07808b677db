"""Shared bits of the benchmark scripts: their common flags, a scratch data folder, filler
text, child processes, a table printer and the JSON line.

Not a library for the app; imported by ``scripts/bench_*.py`` only.

Every script takes the same three size flags (``add_flags``): none for the full run,
``--quick`` for about a minute on the default model, ``--smoke`` for the quickest run that
still takes every step (warm-up, each kind of trial, the table, the JSON line): what
``tests/test_scripts.py`` runs on a tiny model (``-m FOLDER``) so that no script rots. A smoke
run's figures mean nothing; its JSON line says ``"mode": "smoke"``.

The scripts name localchat's modules by their dotted paths (``import localchat.cpu.backend as
backend``, ``from localchat.model.engine import Engine``), so a module that moves is one search and
replace away.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# English and Korean sentences, so histories look like what our users write.
FILLER = (
    "The museum opens at nine and the guided tour starts at ten. "
    "서울의 날씨는 오늘 맑고 따뜻합니다. "
    "We discussed the budget, the schedule and who will book the train tickets. "
    "다음 주에는 부산에 가서 바다를 볼 계획입니다. "
)

SMOKE_HELP = ("the quickest run that takes every step (warm-up, each trial kind, the table, "
              "the JSON line), in seconds on a tiny model (-m FOLDER); its figures mean nothing")


def add_flags(ap: argparse.ArgumentParser, quick: str, *, model: bool = True) -> None:
    """``--quick`` (described by ``quick``), ``--smoke`` and, unless ``model`` is False,
    ``-m/--model``."""
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if model:
        ap.add_argument("-m", "--model", default=None, metavar="MODEL",
                        help="a model name or folder (default: localchat's default model)")


def pick(args: argparse.Namespace, full: T, quick: T, smoke: T) -> T:
    """The value for the run's size: ``smoke`` wins over ``quick``, which wins over ``full``."""
    return smoke if args.smoke else quick if args.quick else full


def mode(args: argparse.Namespace) -> str:
    """"smoke", "quick" or "full": for the JSON line, so a smoke figure is never taken for a
    measurement."""
    return pick(args, "full", "quick", "smoke")


def size_flags(args: argparse.Namespace) -> list[str]:
    """The size flag of this run, to pass on to a child process of the same script."""
    return pick(args, [], ["--quick"], ["--smoke"])


def scratch_home(keep_models_from: str | None = None) -> Path:
    """A fresh LOCALCHAT_HOME (set in ``os.environ``, so child processes inherit it) that
    shares the converted models (and CPU weights) of the user's own data folder, so
    benchmarks do not convert the default model again. Removed when the script exits."""
    home = Path(tempfile.mkdtemp(prefix="localchat-bench-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    src = Path(keep_models_from or os.environ.get("LOCALCHAT_HOME") or _default_home())
    for name in ("models", "cpu-weights", "digests.json"):
        if (src / name).exists():
            (home / name).symlink_to((src / name).resolve())
    os.environ["LOCALCHAT_HOME"] = str(home)
    return home


def _default_home() -> str:
    import platformdirs

    return platformdirs.user_data_dir("localchat", appauthor=False)


def run(cmd: list[str], env: dict | None = None, timeout: float = 1800
        ) -> subprocess.CompletedProcess:
    """Run a child process (``localchat …`` or this script's ``--child``), output captured.

    Raises:
        SystemExit: with the command and the last line of its stderr, if it fails.
    """
    shown = " ".join(c if len(c) < 60 else c[:57] + "..." for c in cmd[1:])
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{shown}: no result in {timeout:.0f} s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"{shown}: exit status {out.returncode}: {last}")
    return out


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


def localchat(*args: str) -> list[str]:
    """The command line of ``localchat ARGS`` run by this Python."""
    return [sys.executable, "-m", "localchat", *args]


def prefill(engine, tokens: list[int], cache: list):
    """``engine.prefill`` run to its end; the last position's logits."""
    gen = engine.prefill(tokens, cache)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def filler_messages(engine, n_tokens: int) -> list[dict]:
    """A user message of about ``n_tokens`` tokens (rendered) and a short reply."""
    text = ""
    while engine.count_tokens(text) < n_tokens - 40:
        text += FILLER
    return [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (a smoke run's tiny model can finish before a clock ticks)."""
    return a / b if b else float("nan")


@functools.cache
def machine() -> str:
    """The machine in one line: OS, cores, CPU, and what runs the matmuls (measured once)."""
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    import localchat.cpu.backend as backend

    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {cpu}, "
            f"matmuls: {backend.describe()}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def print_json(obj: dict) -> None:
    """The run's one JSON line, last on stdout."""
    print(json.dumps(obj, ensure_ascii=False), flush=True)
