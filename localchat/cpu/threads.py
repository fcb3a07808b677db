"""The BLAS thread count, chosen while the model runs (the Linux CPU path).

OpenBLAS runs every core by default: best on a quiet machine, worst beside other CPU-bound
work, where its threads wait for each other on cores someone else holds (measured here, a
2-core EPYC beside two busy processes: decode 0.45-1.15 tok/s with 2 threads, 5.6-5.8 with
one). What this does instead:

- ``Controller`` is fed each model step — its kind (``decode`` / ``prefill``: they may want
  different counts), tokens, wall seconds, and what the machine did meanwhile (how many cores
  other processes used: the machine's busy time from ``/proc/stat`` less this process's CPU
  time) — and keeps each thread count's recent rate per kind. It tries another count for a few
  steps now and then (soon when the machine says so: other processes use half a core or more
  while it runs several threads, or a core is free while it runs fewer), and moves to it only
  when that count was faster by a clear margin over several steps; a trial that is clearly
  slower ends after one step; after a move it stays a while; trials that keep the count come
  ever less often (hysteresis: it does not flap on noise).
- ``Meter`` times the steps (``clock.MachineClock``: wall, CPU and ``/proc/stat``) and
  sets the count before each one through ``openblas_set_num_threads`` of the loaded library
  (``OpenBlas``); ``session/generation.py`` and ``session/scheduler.py`` call it.
- ``install(path)`` (``backend.prepare``, after loading the library) reads the settings:
  ``LOCALCHAT_BLAS_THREADS=N`` pins N threads, ``off`` leaves OpenBLAS's own count alone (as
  does ``OPENBLAS_NUM_THREADS``, which pins it), unset or ``auto``: the controller.

Not here: which library is loaded (``backend.py``). Metal and CUDA runs never get a meter.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from .clock import MachineClock

ENV = "LOCALCHAT_BLAS_THREADS"
KINDS = ("decode", "prefill")


class Library(Protocol):
    """What the controller needs of a BLAS: its thread count, read and set."""

    def get(self) -> int: ...

    def set(self, n: int) -> None: ...


class OpenBlas:
    """``openblas_get_num_threads`` / ``openblas_set_num_threads`` of the library at ``path``
    (the one ``backend.prepare`` loaded, so the one MLX's ``cblas_sgemm`` runs in)."""

    def __init__(self, path: str) -> None:
        import ctypes

        lib = ctypes.CDLL(path)
        self._get, self._set = lib.openblas_get_num_threads, lib.openblas_set_num_threads
        self._get.restype, self._get.argtypes = ctypes.c_int, []
        self._set.restype, self._set.argtypes = None, [ctypes.c_int]

    def get(self) -> int:
        return int(self._get())

    def set(self, n: int) -> None:
        import mlx.core as mx

        # Between steps nothing should be queued on the CPU path (each step's token is read
        # back); the wait makes sure no sgemm runs while OpenBLAS resizes its pool.
        mx.synchronize()
        self._set(n)


@dataclass(frozen=True)
class Policy:
    """How eagerly the controller moves (steps are counted per kind)."""

    margin: float = 0.15  # a count replaces the current one only when this much faster
    window: int = 4  # steps a rate is taken over (and a trial's length)
    abort: float = 1.25  # a trial this much slower than the current count after one step ends
    dwell: int = 16  # steps after a move or a trial before the machine's word starts a trial
    interval: int = 64  # steps between trials the machine did not ask for (doubles, up to:)
    max_interval: int = 1024
    busy_cores: float = 0.5  # other processes use this much CPU: fewer threads may be faster
    free_cores: float = 0.6  # this much CPU lies idle: more threads may be faster
    low_share: float = 0.7  # threads got less of a core each: fewer may be faster


@dataclass(frozen=True)
class Change:
    """A move of one kind's count, and why."""

    kind: str
    before: int
    after: int
    rate_before: float  # tokens/s over the last steps at ``before``
    rate_after: float  # over the trial at ``after``
    others: float  # cores other processes used meanwhile (-1: not known)
    follows: str = ""  # the kind whose move this one followed (no trial of its own)

    def describe(self) -> str:
        """E.g. 'decode 2 → 1 threads: 5.8 tok/s vs 1.0 (other processes used 1.4 cores)';
        a followed move: 'prefill 2 → 1 threads: with decode (…)'."""
        why = ""
        if self.others >= 0:
            why = f" (other processes used {self.others:.1f} cores)"
        if self.follows:
            return f"{self.kind} {self.before} → {self.after} threads: with {self.follows}{why}"
        was = f" vs {self.rate_before:.1f}" if self.rate_before else \
            f" (from its first step: none at {self.before} yet)"
        return f"{self.kind} {self.before} → {self.after} threads: {self.rate_after:.1f}" \
            f" tok/s{was}{why}"


@dataclass
class _Kind:
    """One kind's state: the count it runs, each count's recent steps, a trial under way."""

    choice: int
    samples: dict[int, deque] = field(default_factory=dict)  # count -> (tokens, wall)
    trial: int | None = None
    trial_steps: int = 0
    since: int = 0  # steps since the last move or trial
    fails: int = 0  # trials in a row that kept the count (each doubles the wait)
    others: float = -1.0  # moving average of the cores other processes use (-1: unknown)
    free: float = -1.0  # ... and of the cores left idle
    share: float = -1.0  # ... and of the CPU this process got of what its threads could use
    hint: int | None = None  # the other kind moved to this count: try it soon
    tried: bool = False  # a trial has run

    def rate(self, count: int, last: int) -> float:
        """Tokens per second over the last ``last`` steps at ``count`` (0: none yet)."""
        steps = list(self.samples.get(count, ()))[-last:]
        wall = sum(w for _, w in steps)
        return sum(t for t, _ in steps) / wall if steps and wall > 0 else 0.0


def ema(old: float, new: float, weight: float = 0.25) -> float:
    return new if old < 0 else (1 - weight) * old + weight * new


class Controller:
    """Chooses each kind's thread count from the steps it is told of (no clock of its own:
    every figure comes in through ``observe``, so a scripted trace drives it in tests).

    Args:
        lib: the BLAS whose count is set (its count at the start is the most tried).
        policy: the margins and waits (``Policy``).
        counts: the counts to choose among (default: 1, powers of two, and the start count).
    """

    def __init__(self, lib: Library, policy: Policy | None = None,
                 counts: list[int] | None = None) -> None:
        self.lib, self.policy = lib, policy or Policy()
        top = max(1, lib.get())
        self.counts = sorted(set(counts or [1, top, *(2**i for i in range(1, 8) if 2**i < top)]))
        self.kinds = {k: _Kind(choice=max(self.counts)) for k in KINDS}
        self.current = top
        self.changes: list[Change] = []
        self.steps = 0

    # -- per step

    def before(self, kind: str, others: float = -1.0) -> int:
        """The count the next ``kind`` step runs with (set in the library now). ``others``:
        the cores other processes use, when known; before the first ``kind`` step, a busy
        machine starts it on fewer threads (a one-step prefill has no later step to learn
        in, and beside busy processes a step on every thread costs several)."""
        state = self.kinds[kind]
        down = self._neighbours(state.choice)[0]
        if not state.tried and not state.samples and others >= self.policy.busy_cores and \
                down is not None:
            state.trial, state.trial_steps, state.tried, state.others = down, 0, True, others
        want = state.trial if state.trial is not None else state.choice
        if want != self.current:
            self.lib.set(want)
            self.current = want
        return want

    def observe(self, kind: str, tokens: int, wall: float, cpu: float = -1.0,
                others: float = -1.0, cores: int = 0) -> None:
        """A ``kind`` step of ``tokens`` tokens ran at the count ``before`` gave and took
        ``wall`` seconds, ``cpu`` of this process's CPU seconds; other processes used
        ``others`` cores meanwhile, of the machine's ``cores`` (-1 / 0: not known)."""
        if tokens <= 0 or wall <= 0:
            return
        self.steps += 1
        p, state, count = self.policy, self.kinds[kind], self.current
        steps = state.samples.setdefault(count, deque(maxlen=p.window))
        steps.append((tokens, wall))
        state.since += 1
        if others >= 0 and cores:
            state.others = ema(state.others, others)
            if cpu >= 0:
                state.free = ema(state.free, cores - others - cpu / wall)
        if cpu >= 0 and count > 1:
            # Threads that get much less CPU than they could: another process holds cores
            # (the sign where /proc/stat says nothing). One thread's share says too little.
            state.share = ema(state.share, cpu / wall / count)
        if state.trial is not None:
            self._judge(kind, state)
        elif (want := self._wanted(state)) is not None:
            state.trial, state.trial_steps, state.since, state.hint = want, 0, 0, None
            state.tried = True
            state.samples.pop(want, None)  # a trial measures afresh

    def _wanted(self, state: _Kind) -> int | None:
        """The count to try next, or None. The count the other kind moved to: at once. The
        one the machine points to (fewer while other processes take cores, more while one
        is free): at once the first time (a loaded machine makes every step at the wrong
        count cost several), then not before ``dwell`` steps after the last trial or move
        (doubled for each trial that kept the count). Otherwise, once the current count has
        a rate over ``window`` steps, every ``interval`` steps (doubled likewise)."""
        p = self.policy
        if state.hint is not None and state.hint != state.choice:
            return state.hint
        have = len(state.samples.get(state.choice, ()))
        if not have:
            return None
        wait = 2 ** min(state.fails, 10)
        down, up = self._neighbours(state.choice)
        busy = state.others >= p.busy_cores or 0 <= state.share < p.low_share
        pointed = down if down is not None and busy else \
            up if up is not None and state.free >= p.free_cores else None
        if pointed is not None and (not state.tried or
                                    state.since >= min(p.dwell * wait, p.max_interval)):
            return pointed
        if have >= p.window and state.since >= min(p.interval * wait, p.max_interval):
            return down if down is not None and (up is None or busy) else up
        return None

    def _judge(self, kind: str, state: _Kind) -> None:
        """A trial step ran: end the trial when it is clearly slower or has run ``window``
        steps; move when it was faster than the current count by ``margin``."""
        p = self.policy
        state.trial_steps += 1
        tried, had = state.rate(state.trial, p.window), state.rate(state.choice, p.window)
        if state.trial_steps < p.window and not tried * p.abort < had:
            return
        trial, state.trial, state.since = state.trial, None, 0
        if tried > had * (1 + p.margin):
            change = Change(kind, state.choice, trial, had, tried, state.others)
            self.changes.append(change)
            state.choice, state.fails, state.share = trial, 0, -1.0
            if kind == "decode":
                self._follow("prefill", change)
            elif (other := self.kinds["decode"]).choice != trial:
                other.hint = trial  # the machine changed for it too: it tries soon
        else:
            state.fails += 1

    def _follow(self, kind: str, change: Change) -> None:
        """``kind`` (the prefill) takes ``change`` (the decode's move) at once: the machine
        changed for it too, and a turn's prefill is one or two steps, too few to learn in (a
        trial would run the next turn's first chunk on the old count: beside a busy process
        per core, 15-21 tok/s on two threads where one gives 110). Its own trials move it
        back where its steps say otherwise."""
        state = self.kinds[kind]
        if state.choice == change.after:
            state.trial = None
            return
        self.changes.append(Change(kind, state.choice, change.after, 0.0, 0.0, change.others,
                                   follows=change.kind))
        state.samples.pop(change.after, None)  # (measured afresh: the machine changed)
        state.choice, state.trial, state.hint = change.after, None, None
        state.fails, state.since, state.share = 0, 0, -1.0

    def _neighbours(self, count: int) -> tuple[int | None, int | None]:
        i = self.counts.index(count)
        return (self.counts[i - 1] if i else None,
                self.counts[i + 1] if i + 1 < len(self.counts) else None)

    # -- what it says

    def choices(self) -> dict[str, int]:
        return {k: s.choice for k, s in self.kinds.items()}

    def last(self) -> Change | None:
        """The last move a kind's own steps made (not one it followed)."""
        return next((c for c in reversed(self.changes) if not c.follows), None)


class Meter:
    """Times each step and feeds the controller: ``begin(kind)`` before a model call sets
    its count, ``end(tokens)`` after it. The machine's busy time is read over a few steps
    at a time (``/proc/stat`` counts in 10 ms ticks: one 100 ms step is too coarse)."""

    SPAN_S = 0.5  # the shortest stretch the cores other processes used are measured over

    def __init__(self, controller: Controller, clock: MachineClock | None = None) -> None:
        self.controller, self.clock = controller, clock or MachineClock()
        self._kind: str | None = None
        self._t = self._c = 0.0
        self._span: tuple[float, float, float] | None = None  # wall, cpu, machine busy
        self.others = -1.0

    def start(self) -> None:
        """Begin measuring what other processes use now (``install``: by the first step,
        the model's loading has given the measure time)."""
        self._measure_others(self.clock.wall(), self.clock.cpu())

    def begin(self, kind: str) -> None:
        if self.others < 0 and self._span is not None:  # (known since ``start``, once due)
            self._measure_others(self.clock.wall(), self.clock.cpu())
        self.controller.before(kind, self.others)
        self._kind, self._t, self._c = kind, self.clock.wall(), self.clock.cpu()

    def end(self, tokens: int) -> None:
        """The step begun last ran ``tokens`` tokens (none: not counted)."""
        if self._kind is None:
            return
        wall, cpu = self.clock.wall(), self.clock.cpu()
        self._measure_others(wall, cpu)
        self.controller.observe(self._kind, tokens, wall - self._t, cpu - self._c,
                                self.others, self.clock.cores if self.others >= 0 else 0)
        self._kind = None

    def timed(self, kind: str, steps: Iterator, tokens: Callable[[object], int]) -> Generator:
        """``steps`` (a generator) as it is, each ``next`` timed as a ``kind`` step of
        ``tokens(item)`` tokens (0: not counted; the stretch that ends it: ``tokens(None)``);
        its return value returned, and closing this closes it (a decoder that feeds its last
        token when closed still does)."""
        try:
            while True:
                self.begin(kind)
                try:
                    item = next(steps)
                except StopIteration as fin:
                    self.end(tokens(None))
                    return fin.value
                self.end(tokens(item))
                yield item
        finally:
            steps.close()

    def _measure_others(self, wall: float, cpu: float) -> None:
        if self._span is None:
            busy = self.clock.machine_busy()
            self._span = None if busy is None else (wall, cpu, busy)
            return
        w0, c0, b0 = self._span
        if wall - w0 < self.SPAN_S:
            return
        busy = self.clock.machine_busy()
        if busy is None:
            return
        self.others = max(0.0, (busy - b0 - (cpu - c0)) / (wall - w0))
        self._span = (wall, cpu, busy)


# -- the process's setting ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """How this process's BLAS threads are set: ``auto`` (the controller), ``pinned`` (a count
    from ``LOCALCHAT_BLAS_THREADS`` or ``OPENBLAS_NUM_THREADS``), ``off`` (OpenBLAS's own
    count), or ``none`` (no OpenBLAS loaded, or it cannot set its count)."""

    mode: str
    threads: int  # the count at the start (0: not known)
    why: str = ""  # where a pinned count or an off comes from


_setting: Setting = Setting("none", 0)
_meter: Meter | None = None  # made by ``install`` in auto mode; ``meter`` hands it out
_on_cpu: bool | Callable[[], bool] = False  # the CPU path, or how to ask (once MLX is loaded)
_lib: Library | None = None
_native: tuple[str, int] = ("", 0)  # the library's path and its own count, at the first install


def read_setting(env: dict | None = None) -> tuple[str, int, str]:
    """(mode, pinned count, why) from the environment; raises ValueError for a value that is
    neither a count, ``auto`` nor ``off``."""
    env = os.environ if env is None else env
    text = env.get(ENV, "").strip().lower()
    if text in ("off", "0", "no"):
        return "off", 0, f"{ENV}=off"
    if text.isdigit():
        return "pinned", int(text), f"{ENV}={text}"
    if text not in ("", "auto"):
        raise ValueError(f"{ENV}={env.get(ENV)!r} is not a thread count, 'auto' or 'off'")
    pinned = env.get("OPENBLAS_NUM_THREADS", "").strip()
    if pinned:
        return "pinned", int(pinned) if pinned.isdigit() else 0, \
            f"OPENBLAS_NUM_THREADS={pinned}"
    return "auto", 0, ""


def install(path: str, lib: Library | None = None,
            on_cpu: Callable[[], bool] | None = None) -> str | None:
    """Apply this process's setting to the library ``backend.prepare`` loaded at ``path``
    (again: a setting changed since, e.g. by a benchmark; ``auto`` and ``off`` start from
    OpenBLAS's own count, as it was at the first call). Returns a one-line notice for a
    setting it cannot take (then: OpenBLAS's own count). ``on_cpu``: whether MLX runs on
    the CPU (``backend.cpu_path``, asked at the first ``meter()``; given once is enough)."""
    global _setting, _meter, _lib, _native, _on_cpu
    _meter = None
    if on_cpu is not None:
        _on_cpu = on_cpu
    try:
        lib = lib or (_lib if _lib is not None and _native[0] == path else OpenBlas(path))
    except (OSError, AttributeError):  # (not an OpenBLAS: nothing to set, nothing to say)
        _setting, _lib = Setting("none", 0), None
        return None
    if _lib is not lib:
        _lib, _native = lib, (path, lib.get())
    native = _native[1]
    try:
        mode, count, why = read_setting()
    except ValueError as err:
        mode, count, why = "off", 0, ""
        notice = f"{err}; OpenBLAS's own thread count is used"
    else:
        notice = None
    if not (mode == "pinned" and why.startswith(ENV)):
        count = native
    if lib.get() != count:
        lib.set(count)
    _setting = Setting(mode, lib.get(), why)
    if mode == "auto" and _setting.threads > 1:
        _meter = Meter(Controller(lib))
        _meter.start()
    return notice


def meter() -> Meter | None:
    """The process's meter while the controller runs (``auto``, the CPU path), else None."""
    global _meter, _on_cpu
    if _meter is None:
        return None
    if not isinstance(_on_cpu, bool):
        _on_cpu = bool(_on_cpu())
    return _meter if _on_cpu else None


def describe() -> str:
    """One line for ``inspect``: the mode, the counts now and the last move, e.g. 'auto: 2
    threads (decode 2, prefill 2); drops to fewer when other processes take cores'."""
    s = _setting
    if s.mode == "none":
        return "not set (no OpenBLAS loaded)"
    if s.mode != "auto":
        return f"{s.threads} ({s.why})" if s.mode == "pinned" else \
            f"{s.threads}, OpenBLAS's own count ({s.why})"
    found = _meter.controller if _meter is not None else None
    now = found.choices() if found else {k: s.threads for k in KINDS}
    line = (f"auto: decode {now['decode']}, prefill {now['prefill']} of {s.threads} "
            f"(fewer while other processes take cores; {ENV}=N pins)")
    if found and (last := found.last()):
        line += f"; last change {last.describe()}"
    return line


def summary() -> dict:
    """``describe`` as a dict (``inspect --json``'s ``blas_threads``)."""
    s = _setting
    found = _meter.controller if _meter is not None else None
    last = found.last() if found else None
    return {"mode": s.mode, "threads": s.threads, "why": s.why,
            "decode": found.choices()["decode"] if found else s.threads,
            "prefill": found.choices()["prefill"] if found else s.threads,
            "last_change": last.describe() if last else ""}


def note() -> str:
    """For the status bar: '' while the controller runs every thread for decode, else e.g.
    'BLAS 1 thread: 5.8 tok/s vs 1.0 with 2, other processes using 1.4 cores'."""
    found = _meter.controller if _meter is not None else None
    if not found or found.choices()["decode"] >= _setting.threads:
        return ""
    n = found.choices()["decode"]
    head = f"BLAS {n} thread{'s' * (n != 1)}"
    last = next((c for c in reversed(found.changes) if c.kind == "decode"), None)
    if last is None or last.after != n:
        return head
    why = f", other processes using {last.others:.1f} cores" if last.others >= 0 else ""
    was = f" vs {last.rate_before:.1f} with {last.before}" if last.rate_before else ""
    return f"{head}: {last.rate_after:.1f} tok/s{was}{why}"
