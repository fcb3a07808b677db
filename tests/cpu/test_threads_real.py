"""The BLAS thread controller beside real competitors: one busy-looping process per core
(each ends on its own after a bound, or with this test's process, and is killed at the end).

A random-weight llama wide enough that its matmuls run on every OpenBLAS thread (768 wide:
the suite's tiny models are small enough for OpenBLAS to run them on one thread whatever
the setting), greedy, prompt lookup off.
"""

import subprocess
import sys

import pytest
from tiny import build_tiny_model

from localchat.cpu import backend, threads
from localchat.model.engine import Engine
from localchat.session.generation import Cancel, Run, TurnOptions, generate
from localchat.session.turncache import Start

pytestmark = [pytest.mark.cpu_only,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

TOKENS = 64
BOUND_S = 120  # the busy processes end by themselves after this


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Engine:
    folder = build_tiny_model(tmp_path_factory.mktemp("wide") / "wide-llama", hidden=768,
                              layers=4, heads=12, kv_heads=4)
    return Engine.load(str(folder))


def spinners(n: int) -> list[subprocess.Popen]:
    code = ("import os, time\nparent, end = os.getppid(), time.monotonic() + %d\n"
            "while os.getppid() == parent and time.monotonic() < end: pass" % BOUND_S)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def reply(engine: Engine, setting: str, monkeypatch) -> list[int]:
    monkeypatch.setenv(threads.ENV, setting)
    threads.install(backend.blas_in_use())
    ids = engine.render([{"role": "user", "content": "Tell me about lighthouses. " * 6}])
    run = Run()
    list(generate(engine, ids, Start(engine.new_cache(), 0, {}), TOKENS,
                  TurnOptions(max_tokens=TOKENS, speculate="off"), Cancel(), run))
    return run.generated


def test_beside_a_busy_process_per_core_it_drops_threads_and_replies_the_same(wide,
                                                                            monkeypatch):
    path = backend.blas_in_use()
    if not path or threads.OpenBlas(path).get() < 2:
        pytest.skip("one BLAS thread here: nothing to choose")
    cores = threads.OpenBlas(path).get()
    try:
        quiet = reply(wide, str(cores), monkeypatch)
        assert len(quiet) > 20  # (a reply long enough for the controller to act in)
        busy = spinners(cores)
        try:
            loaded = reply(wide, "auto", monkeypatch)
            meter = threads.meter()
        finally:
            for p in busy:
                p.kill()
                p.wait()
        assert loaded == quiet
        changes = meter.controller.changes
        assert changes and changes[0].after < cores, changes
        own = meter.controller.last()  # (a move of its own; the prefill's follow is not one)
        assert own is not None and not own.follows
        assert threads.summary()["last_change"] == own.describe()
    finally:
        monkeypatch.setenv(threads.ENV, "off")
        threads.install(path)  # OpenBLAS's own count again, as the rest of the suite runs
