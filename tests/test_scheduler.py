"""The scheduler's admission without a model: the batch width, the memory budget (a job that
would pass it waits, never fails), oldest first, errors to their job's owner, and a turn that
waits for a conversation's lock another turn here holds."""

from __future__ import annotations

from localchat.errors import BadInput
from localchat.events import Notice, PrefillProgress, ReplyChunk
from localchat.scheduler import Scheduler, Work, batch_memory


class Stub:
    engine = None
    stepped = False


def run(works: list[Work], **kw) -> tuple[Scheduler, list[int]]:
    """Run ``works``; the number of turns running at each round."""
    s = Scheduler(Stub(), **kw)
    s.refusal = ""  # (batchable: no model to try)
    seen = []
    for w in works:
        s.put(w)
    while s.running or s.queued:
        s.admit(block=False)
        seen.append(len(s.running))
        s.round()
    return s, seen


def turn(name: str, log: list, chunks: int = 3, fail: bool = False):
    def events(session):
        for i in range(chunks):
            yield PrefillProgress(i, chunks)
        if fail:
            raise BadInput(f"{name} is refused")
        yield ReplyChunk(name)
    return events


def works(n: int, cost: int, log: list, **kw) -> list[Work]:
    return [Work(turn(f"t{i}", log, **kw), log.append, cost=cost,
                 done=lambda i=i: log.append(f"done {i}")) for i in range(n)]


def test_the_memory_budget_queues_what_would_pass_it():
    log: list = []
    _, seen = run(works(4, 60, log), max_batch=8, memory=100)
    assert max(seen) == 1  # 60 + 60 > 100: one at a time, none refused
    assert [x for x in log if isinstance(x, ReplyChunk)] == [ReplyChunk(f"t{i}")
                                                              for i in range(4)]
    log2: list = []
    _, seen = run(works(4, 60, log2), max_batch=8, memory=250)
    assert max(seen) == 4  # the control: 4 x 60 fits
    assert sorted(str(x) for x in log2 if isinstance(x, str)) == [f"done {i}" for i in range(4)]


def test_max_batch_bounds_the_running_set_and_a_job_over_the_budget_runs_alone():
    log: list = []
    _, seen = run(works(5, 10, log), max_batch=2, memory=1000)
    assert max(seen) == 2
    log = []
    _, seen = run(works(2, 5000, log), max_batch=8, memory=1000)
    assert max(seen) == 1 and log.count("done 0") == log.count("done 1") == 1


def test_a_failing_turn_goes_to_its_owner_and_the_others_go_on():
    log: list = []
    ws = works(3, 1, log)
    ws[1] = Work(turn("t1", log, fail=True), log.append, done=lambda: log.append("done 1"))
    run(ws, max_batch=4, memory=100)
    errors = [x for x in log if isinstance(x, BadInput)]
    assert len(errors) == 1 and "t1 is refused" in str(errors[0])
    assert ReplyChunk("t0") in log and ReplyChunk("t2") in log and ReplyChunk("t1") not in log


def test_a_turn_waiting_for_a_lock_resumes_once_the_others_are_done():
    log: list = []

    def locked(session):
        yield Notice("waiting for another localchat using 'x'", waiting=True)
        log.append("lock taken")
        yield ReplyChunk("late")

    ws = works(2, 1, log, chunks=4) + [Work(locked, log.append)]
    run(ws, max_batch=4, memory=100)
    assert log.index("lock taken") > max(log.index("done 0"), log.index("done 1"))


def test_the_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCALCHAT_BATCH_MEMORY", "2G")
    assert batch_memory() == 2 * 2**30
    monkeypatch.delenv("LOCALCHAT_BATCH_MEMORY")
    assert batch_memory() > 2**20
