"""The BLAS thread controller (``localchat/cpu/threads.py``) on scripted traces: a fake library
records each count it is set to, a simulated machine gives each step's seconds (per kind, per
count, with and without a competitor, with noise) and what other processes used."""

import random

import pytest

from localchat.cpu import threads
from localchat.cpu.threads import Controller, Meter, Policy

# tok/s of each (kind, threads, competitor) on a 2-core machine, from measurements here
# (decode: 13.9 / 9.6 quiet, 1.0 / 5.8 beside a busy process per core); prefill is
# compute-bound: made to keep 2 threads under load, so the kinds part.
RATES = {("decode", 2, False): 13.9, ("decode", 1, False): 9.6,
         ("decode", 2, True): 1.0, ("decode", 1, True): 5.8,
         ("prefill", 2, False): 300.0, ("prefill", 1, False): 160.0,
         ("prefill", 2, True): 120.0, ("prefill", 1, True): 90.0}


class FakeLib:
    def __init__(self, count: int = 2):
        self.count, self.history = count, []

    def get(self) -> int:
        return self.count

    def set(self, n: int) -> None:
        self.count = n
        self.history.append(n)


def drive(ctl: Controller, loaded, steps: int, kind="decode", noise=0.05, seed=0,
          rates=RATES, start=0, others_noise=0.0):
    """Run ``steps`` steps of ``kind``; ``loaded(i)``: a competitor at step i. Returns the
    count each step ran at."""
    rng = random.Random(seed)
    ran = []
    for i in range(start, start + steps):
        n = ctl.before(kind)
        busy = loaded(i)
        tokens = 1 if kind == "decode" else 64
        wall = tokens / rates[(kind, n, busy)] * rng.lognormvariate(0, noise)
        others = (2.0 if busy else 0.1) + rng.uniform(-others_noise, others_noise)
        cpu = wall * min(n, 2 - others if busy else n)
        ctl.observe(kind, tokens, wall, cpu, max(0.0, others), cores=2)
        ran.append(n)
    return ran


def test_drops_to_one_thread_under_a_competitor_and_comes_back_when_it_leaves():
    lib = FakeLib()
    ctl = Controller(lib)
    ran = drive(ctl, lambda i: 300 <= i < 900, 1500)
    # Quiet: 2 threads, but for short trials of 1.
    assert ran[:300].count(2) >= 290
    # The competitor comes at 300: within 30 steps it runs one thread, and keeps it.
    assert ran[330:900].count(1) >= 0.97 * 570
    # It leaves at 900: two threads again within 30 steps.
    assert ran[930:].count(2) >= 0.97 * 570
    moves = [(c.kind, c.before, c.after, c.follows) for c in ctl.changes]
    # The prefill follows each decode move at once (it ran no step here to learn from).
    assert moves == [("decode", 2, 1, ""), ("prefill", 2, 1, "decode"),
                     ("decode", 1, 2, ""), ("prefill", 1, 2, "decode")]
    assert ctl.changes[1].describe() == ("prefill 2 → 1 threads: with decode (other "
                                         f"processes used {ctl.changes[0].others:.1f} cores)")
    assert ctl.last() is ctl.changes[2]  # (what describe() names: decode's own move)
    assert ctl.changes[0].rate_after > 1.5 * ctl.changes[0].rate_before
    assert ctl.changes[0].describe().startswith("decode 2 → 1 threads: 5.")
    assert " tok/s vs 3.2 " in ctl.changes[0].describe()
    assert "(other processes used 1." in ctl.changes[0].describe()
    assert lib.count == 2
    # Without the machine's word (no /proc/stat, no CPU time): periodic trials alone find
    # it, later.
    blind = Controller(FakeLib())
    rng = random.Random(1)
    ran = []
    for i in range(1500):
        n = blind.before("decode")
        wall = 1 / RATES[("decode", n, 300 <= i < 900)] * rng.lognormvariate(0, 0.05)
        blind.observe("decode", 1, wall)
        ran.append(n)
    assert ran[500:900].count(1) >= 0.95 * 400 and ran[1000:].count(2) >= 0.95 * 500


def test_decode_and_prefill_choose_apart():
    ctl = Controller(FakeLib())
    for block in range(40):  # turns: a few prefill chunks, then decode steps, under load
        drive(ctl, lambda i: True, 4, kind="prefill", seed=block, start=block * 100)
        drive(ctl, lambda i: True, 40, kind="decode", seed=1000 + block, start=block * 100)
    assert ctl.choices() == {"decode": 1, "prefill": 2}
    # The prefill kind tried 1 (the decode kind's move hinted it) and measured it slower.
    assert ctl.kinds["prefill"].fails >= 1


def test_the_next_turns_prefill_runs_on_the_count_decode_moved_to():
    """A turn's prefill is a step or two: too few to run a trial in. Once decode has dropped
    a thread beside a competitor, every later turn's prefill runs on one thread from its first
    step (measured here: 110 tok/s on one, 15-21 on two). The prefill had tried one thread
    while the machine was quiet and kept two, so the machine's word waits (``dwell``)."""
    rates = {**RATES, ("prefill", 2, True): 18.0, ("prefill", 1, True): 110.0}

    def turns(ctl: Controller) -> list[int]:
        firsts = []
        for turn in range(80):  # quiet for 70 turns (a periodic prefill trial), then loaded
            loaded = (lambda i: True) if turn >= 70 else (lambda i: False)
            firsts += drive(ctl, loaded, 1, kind="prefill", rates=rates, seed=turn)
            drive(ctl, loaded, 40, rates=rates, seed=100 + turn)
        return firsts

    ctl = Controller(FakeLib())
    firsts = turns(ctl)
    assert firsts[:70].count(2) >= 68  # quiet: two threads (a trial of one, kept two)
    assert firsts[71:] == [1] * 9  # decode moved during the first loaded turn
    # Negative control: a prefill that only tries the decode's count (a trial of its own
    # steps, as it did) runs the next loaded turn's first step on two threads.
    class Hinting(Controller):
        def _follow(self, kind, change):
            self.kinds[kind].hint = change.after
    assert turns(Hinting(FakeLib()))[71] == 2


def flips(ctl: Controller, steps: int = 3000) -> int:
    # Both counts equally fast; step times and the machine's figures noisy, other processes
    # hovering about the threshold.
    same = {k: 10.0 for k in RATES}
    drive(ctl, lambda i: False, steps, noise=0.1, rates=same, others_noise=0.6)
    return len(ctl.changes)


def test_no_flapping_on_noise():
    steady = Controller(FakeLib())
    assert flips(steady) <= 1
    assert steady.kinds["decode"].fails >= 3  # it did try the other count, and kept its own
    # Negative control: without hysteresis (no margin, one-step rates and trials, no dwell,
    # a trial every step) the same trace flaps.
    eager = Policy(margin=0.0, window=1, abort=float("inf"), dwell=0, interval=1,
                   max_interval=1)
    assert flips(Controller(FakeLib(), eager)) >= 200


def test_a_clearly_slower_trial_ends_after_one_step():
    ctl = Controller(FakeLib())
    ran = drive(ctl, lambda i: False, 2000)
    trials = sum(1 for a, b in zip(ran, ran[1:]) if a == 2 and b == 1)
    assert trials >= 3  # it keeps looking
    assert ran.count(1) == trials  # each one step long (9.6 vs 13.9 tok/s: past abort)
    assert not ctl.changes


def test_wider_machines_step_through_counts():
    ctl = Controller(FakeLib(8))
    assert ctl.counts == [1, 2, 4, 8]
    assert ctl._neighbours(4) == (2, 8) and ctl._neighbours(1) == (None, 2)


class ScriptedClock:
    """A machine on a script: the test sets the wall time; this process uses ``mine`` cores
    and the whole machine ``machine`` cores (None: no /proc/stat)."""

    def __init__(self, mine=1.0, machine=2.5, cores=2):
        self.now, self.mine, self.machine, self.cores = 0.0, mine, machine, cores

    def wall(self):
        return self.now

    def cpu(self):
        return self.now * self.mine

    def machine_busy(self):
        return None if self.machine is None else self.now * self.machine


def test_meter_times_steps_and_measures_what_other_processes_use():
    seen = []

    class Recording(Controller):
        def observe(self, *args, **kw):
            seen.append((args, kw))

    # Steps of 0.3 s; this process uses 1 core, the machine 2.5: other processes 1.5 cores
    # (measured once 0.5 s have passed).
    clock = ScriptedClock()
    meter = Meter(Recording(FakeLib()), clock)
    for _ in range(3):
        meter.begin("decode")
        clock.now += 0.3
        meter.end(1)
    (a1, _), (a2, _), (a3, _) = seen
    assert a1[:2] == ("decode", 1) and a1[2] == pytest.approx(0.3) and a1[4:] == (-1.0, 0)
    assert a1[3] == pytest.approx(0.3)
    assert a2[4:] == (-1.0, 0)  # 0.3 s into the span: not yet
    assert a3[4] == pytest.approx(1.5) and a3[5] == 2
    # Started ahead (at install), the first step already knows; beside busy processes it
    # runs on fewer threads from its first step (control: a quiet machine keeps them all).
    for machine, want in ((3.0, 1), (1.2, 2)):
        clock = ScriptedClock(machine=machine)
        early = Meter(Controller(FakeLib()), clock)
        early.start()
        clock.now += 2.0  # the model loads
        early.begin("prefill")
        assert early.controller.current == want and early.others == pytest.approx(machine - 1)
    # That move has no rate at the count it left: said so, not as 0 tok/s.
    for _ in range(4):
        early = Meter(Controller(FakeLib()), clock := ScriptedClock(machine=3.0))
        early.start()
        clock.now += 2.0
    for _ in range(4):
        early.begin("decode")
        clock.now += 0.2
        early.end(1)
    said = early.controller.last().describe()
    assert said.startswith("decode 2 → 1 threads: 5.0 tok/s (from its first step: none at 2")
    assert "0.0" not in said


def test_timed_passes_items_and_the_return_value_and_closes_what_it_wraps():
    closed = []

    def steps():
        try:
            yield 5
            yield 6
            return "logits"
        finally:
            closed.append(True)

    meter = Meter(Controller(FakeLib()), ScriptedClock(machine=None))
    counted = []
    wrapped = meter.timed("prefill", steps(), lambda item: counted.append(item) or 1)
    assert next(wrapped) == 5 and next(wrapped) == 6
    with pytest.raises(StopIteration) as fin:
        next(wrapped)
    assert fin.value.value == "logits" and counted == [5, 6, None] and closed == [True]
    half = meter.timed("decode", steps(), lambda item: 1)
    next(half)
    half.close()
    assert closed == [True, True]


@pytest.mark.parametrize("env, want", [
    ({}, ("auto", 0, "")),
    ({"LOCALCHAT_BLAS_THREADS": "auto"}, ("auto", 0, "")),
    ({"LOCALCHAT_BLAS_THREADS": "off"}, ("off", 0, "LOCALCHAT_BLAS_THREADS=off")),
    ({"LOCALCHAT_BLAS_THREADS": "3"}, ("pinned", 3, "LOCALCHAT_BLAS_THREADS=3")),
    ({"OPENBLAS_NUM_THREADS": "1"}, ("pinned", 1, "OPENBLAS_NUM_THREADS=1")),
    ({"OPENBLAS_NUM_THREADS": "1", "LOCALCHAT_BLAS_THREADS": "2"},
     ("pinned", 2, "LOCALCHAT_BLAS_THREADS=2")),
])
def test_settings(env, want):
    assert threads.read_setting(env) == want


def test_install_pins_refuses_a_bad_value_in_one_line_and_says_the_state(monkeypatch):
    lib = FakeLib(2)
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "1")
    assert threads.install("unused", lib) is None
    assert lib.history == [1] and threads.meter() is None
    assert threads.describe() == "1 (LOCALCHAT_BLAS_THREADS=1)"
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "lots")
    lib = FakeLib(2)
    notice = threads.install("unused", lib)
    assert notice == ("LOCALCHAT_BLAS_THREADS='lots' is not a thread count, 'auto' or 'off'; "
                      "OpenBLAS's own thread count is used")
    assert lib.history == [] and threads.summary()["mode"] == "off"
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "auto")
    lib = FakeLib(2)
    assert threads.install("unused", lib) is None
    monkeypatch.setattr(threads, "_on_cpu", True)  # (asked of MLX once, else)
    meter = threads.meter()
    assert meter is not None and threads.meter() is meter
    assert threads.note() == "" and threads.describe().startswith("auto: decode 2, prefill 2")
    drive(meter.controller, lambda i: True, 60)
    assert threads.note().startswith("BLAS 1 thread: 5.")
    assert " tok/s vs " in threads.note()
    assert "with 2, other processes using 2.0 cores" in threads.note()
    assert "last change decode 2 → 1 threads" in threads.describe()
    assert threads.summary()["decode"] == 1
    # Auto again after a pin (a benchmark's settings in turn): from OpenBLAS's own count.
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "1")
    threads.install("unused")
    assert lib.count == 1
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "auto")
    threads.install("unused")
    assert lib.count == 2 and threads.meter().controller.choices()["decode"] == 2
    monkeypatch.setenv("LOCALCHAT_BLAS_THREADS", "off")
    threads.install("unused", FakeLib(2))  # as the suite runs
    assert threads.meter() is None
