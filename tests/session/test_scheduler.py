"""The scheduler: its admission without a model (the batch width, the memory budget — a job
that would pass it waits, never fails —, oldest first, errors to their job's owner, a turn that
waits for a conversation's lock another turn here holds), and one batched step on tiny models
of each cache family against the same steps taken alone."""

from __future__ import annotations

import pytest

from localchat.errors import BadInput
from localchat.events import Notice, PrefillProgress, ReplyChunk
from localchat.session.scheduler import Scheduler, Work, batch_memory


class Stub:
    engine = None
    stepped = False


def run(works: list[Work], **kw) -> tuple[Scheduler, list[int]]:
    """Run ``works``; the number of turns running at each round."""
    s = Scheduler(Stub(), **kw)
    s.refusal = s.unfused = ""  # (batchable, chunks fused: no model to try)
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


# -- a batched step on tiny models of each family ----------------------------------------------

STEPPED = ["llama", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "mamba2", "falcon_h1",
           "baichuan_m1"]
ALONE = ["deepseek_v3", "llama4", "deepseek_v32"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from families import build_family

    from localchat.model.engine import Engine

    root = tmp_path_factory.mktemp("stepped")
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = Engine.load(str(build_family(name, root / name)))
        return made[name]
    return get


def prefilled(engine, tokens: list[int]):
    import mlx.core as mx

    cache = engine.new_cache()
    engine.model(mx.array(tokens)[None], cache=cache)
    return cache


@pytest.mark.parametrize("name", STEPPED)
def test_a_batched_step_gives_each_row_its_own_logits(family, name):
    """Three histories of different lengths (past a 16-token window), two steps batched: each
    row's logits are its lone steps' (to batched rounding), and its cache the lone cache."""
    import mlx.core as mx

    from localchat.events import Step
    from localchat.kvcache import kinds as ck
    from localchat.session.batchstep import batch_refusal, run_steps

    engine = family(name)
    assert batch_refusal(engine) == ""
    prompts = [[5 + (i * 7) % 300 for i in range(n)] for n in (9, 23, 40)]
    lone, batched = [prefilled(engine, p) for p in prompts], [prefilled(engine, p)
                                                               for p in prompts]
    for tok in (11, 42):
        want = [engine.model(mx.array([[tok]]), cache=c)[:, -1, :] for c in lone]
        steps = [Step(mx.array([tok]), c) for c in batched]
        run_steps(engine.model, steps)
        for w, s in zip(want, steps):
            assert mx.allclose(w, s.logits, atol=1e-4).item()
            assert mx.argmax(w).item() == mx.argmax(s.logits).item()
        # The control: another row's logits are not these.
        assert not mx.allclose(want[0], steps[1].logits, atol=1e-2).item()
    for a, b in zip(lone, batched):
        assert ck.position(a) == ck.position(b)
        for x, y in zip(ck.state_arrays(a), ck.state_arrays(b)):
            assert mx.allclose(x, y, atol=1e-4).item()


FUSED = ["llama", "qwen3", "gemma3_text", "gpt_oss"]
UNFUSED = ["qwen3_next", "lfm2", "mamba2", "falcon_h1", "baichuan_m1"]


@pytest.mark.parametrize("name", FUSED)
def test_a_prompt_chunk_beside_decode_steps_gives_each_its_lone_result(family, name):
    """Two histories decode while a third takes a 14-token prompt chunk (past a 16-token
    window) in the same model call, then all three decode one step batched: each row's
    logits and cache are the lone model's (to batched rounding, 1e-3). Controls: the chunk's logits
    are not those of its last token fed without the rest of the chunk, nor another row's."""
    import mlx.core as mx

    from localchat.events import Step
    from localchat.kvcache import kinds as ck
    from localchat.session.batchstep import fusion_refusal, run_steps

    engine = family(name)
    assert fusion_refusal(engine) == ""
    prompts = [[5 + (i * 7) % 300 for i in range(n)] for n in (9, 23, 10)]
    chunk = [40 + (i * 11) % 250 for i in range(14)]
    lone = [prefilled(engine, p) for p in prompts]
    fused = [prefilled(engine, p) for p in prompts]
    want = [engine.model(mx.array([[11]]), cache=c)[:, -1, :] for c in lone[:2]]
    want.append(engine.model(mx.array(chunk)[None], cache=lone[2])[:, -1, :])
    steps = [Step(mx.array([11]), fused[0]), Step(mx.array([11]), fused[1]),
             Step(mx.array(chunk), fused[2])]
    run_steps(engine.model, steps)
    for w, s in zip(want, steps):
        assert mx.allclose(w, s.logits, atol=1e-3).item()
    skipped = prefilled(engine, prompts[2])  # the control: the chunk's last token alone
    wrong = engine.model(mx.array([chunk[-1:]]), cache=skipped)[:, -1, :]
    assert not mx.allclose(wrong, steps[2].logits, atol=1e-2).item()
    assert not mx.allclose(want[0], steps[2].logits, atol=1e-2).item()
    want = [engine.model(mx.array([[42]]), cache=c)[:, -1, :] for c in lone]
    steps = [Step(mx.array([42]), c) for c in fused]
    run_steps(engine.model, steps)
    for w, s in zip(want, steps):
        assert mx.allclose(w, s.logits, atol=1e-3).item()
        assert mx.argmax(w).item() == mx.argmax(s.logits).item()
    for a, b in zip(lone, fused):
        assert ck.position(a) == ck.position(b)
        for x, y in zip(ck.state_arrays(a), ck.state_arrays(b)):
            assert mx.allclose(x, y, rtol=2e-3, atol=1e-3).item()  # (float16 K/V: one ulp)


@pytest.mark.parametrize("name", UNFUSED)
def test_a_recurrent_model_runs_its_prompt_chunks_as_passes_of_their_own(family, name):
    from localchat.session.batchstep import fusion_refusal

    assert fusion_refusal(family(name)).startswith("a fused step failed")


@pytest.mark.parametrize("name", ALONE)
def test_a_model_whose_batched_step_fails_runs_alone(family, name):
    from localchat.session.batchstep import batch_refusal

    assert batch_refusal(family(name)).startswith("a batched step")


def arrive_late(sched: Scheduler, early: list[Work], late: Work) -> None:
    """Run ``early`` to their decode steps (their prompts in one round), then queue
    ``late`` — a prompt arriving while they decode — and run everything to its end."""
    sched._drive(True)
    try:
        for w in early:
            sched.put(w)
        for _ in range(50):  # (one round, or one prompt a round where chunks run apart)
            sched.admit(block=False)
            sched.round()
            if all(t.step is not None for t in sched.running):
                break
        assert len(sched.running) == len(early)
        assert all(t.step is not None for t in sched.running)  # (decoding now)
        sched.put(late)
        while sched.running or sched.queued:
            sched.admit(block=False)
            sched.round()
    finally:
        sched._drive(False)


@pytest.mark.parametrize("unfused", [None, "a pass of its own (the test says so)"])
def test_a_long_prompt_is_prefilled_between_the_running_streams_steps(session, unfused):
    """Three turns decode while a ~700-token prompt arrives: decode steps run beside its
    prefill chunks (no timing asserted; the gaps are measured by scripts/bench_serve.py), and
    every turn ends with the reply it gives alone — with each chunk in the decode steps'
    model call, and with each chunk as a pass of its own (a model that cannot fuse them)."""
    from localchat.events import TurnFinished
    from localchat.session.session import TurnOptions

    prompts = [f"Question {i}: tell me about Seoul." for i in range(3)] + ["Seoul is big. " * 100]
    convs = [session.conversation(f"c{i}-{bool(unfused)}") for i in range(4)]
    sched = Scheduler(session, max_batch=4, memory=2**30)
    sched.unfused = unfused
    at_chunk: list[int] = []
    done: dict[int, str] = {}

    def work(i: int) -> Work:
        def emit(ev) -> None:
            if isinstance(ev, PrefillProgress) and i == 3:
                at_chunk.append(sched.steps)
            if isinstance(ev, TurnFinished):
                done[i] = ev.reply
            assert not isinstance(ev, BaseException), ev
        return Work(lambda s: s.turn(convs[i], prompts[i], TurnOptions(max_tokens=40)), emit)

    arrive_late(sched, [work(i) for i in range(3)], work(3))
    assert sched.widest >= 2 and len(at_chunk) >= 2
    assert at_chunk == sorted(at_chunk) and at_chunk[-1] > at_chunk[0]  # steps in between
    assert not session.stepped  # (given back once the group ran)
    for i in range(4):  # the control: each reply again, alone
        alone = [ev for ev in session.turn(session.conversation(f"alone{i}"), prompts[i],
                                           TurnOptions(max_tokens=40))][-1]
        assert alone.reply == done[i]


@pytest.mark.parametrize("share", [1e-9, 1e9])
def test_a_long_prompt_takes_chunks_the_size_of_a_share_of_a_decode_step(session, share):
    """While other turns decode, a long prompt's chunks are sized by ``Pace``: with a tiny
    share of a step they are the smallest chunk; with a huge one (the control) the whole
    ``Engine.prefill`` chunk — the same prompt in a few chunks."""
    from localchat.events import TurnFinished
    from localchat.model.engine import PREFILL_CHUNK
    from localchat.session.scheduler import MIN_CHUNK
    from localchat.session.session import TurnOptions

    prompts = [f"Question {i}: tell me about Seoul." for i in range(3)] + ["Seoul is big. " * 80]
    convs = [session.conversation(f"pace{share}-{i}") for i in range(4)]
    sched = Scheduler(session, max_batch=4, memory=2**30)
    sched.pace.share = share
    ended: set[int] = set()
    chunks: list[tuple[int, bool]] = []  # (done, another turn still decoding)

    def work(i: int) -> Work:
        def emit(ev) -> None:
            if isinstance(ev, PrefillProgress) and i == 3:
                chunks.append((ev.done, len(ended) < 3))
            if isinstance(ev, TurnFinished):
                ended.add(i)
            assert not isinstance(ev, BaseException), ev
        return Work(lambda s: s.turn(convs[i], prompts[i], TurnOptions(max_tokens=120)), emit)

    arrive_late(sched, [work(i) for i in range(3)], work(3))
    done = [d for d, _ in chunks]
    sizes = [(b - a, busy) for a, b, busy in zip([0, *done], done, [b for _, b in chunks])]
    assert done[-1] > 300 and max(n for n, _ in sizes) <= PREFILL_CHUNK
    busy = [n for n, b in sizes[2:-1] if b]
    if share < 1:
        assert len(busy) >= 5 and set(busy) == {MIN_CHUNK}, sizes
    else:
        assert len(sizes) <= 4 and max(n for n, _ in sizes) == PREFILL_CHUNK, sizes


def test_pace_sizes_a_chunk_to_a_share_of_a_decode_round():
    from localchat.model.engine import PREFILL_CHUNK
    from localchat.session.scheduler import MIN_CHUNK, Pace

    p = Pace()
    assert p.chunk() == PREFILL_CHUNK  # no one waits to decode: the whole chunk
    p.busy = True
    assert p.chunk() == 4 * MIN_CHUNK  # not measured yet: small, to measure
    p.stepped(0.1)  # a decode round: 100 ms
    p.stepped(0.2, chunk_tokens=100)  # 100 prompt tokens beside it added 100 ms: 1 ms each
    assert p.chunk() == 70  # 0.7 x 100 ms / 1 ms
    p.stepped(0.05, chunk_tokens=100)  # (a round faster than a plain one says nothing)
    assert p.chunk() == 70
    p.stepped(0.2, chunk_tokens=200, decoding=False)  # a chunk alone: all its time is its own
    assert p.chunk() == round(0.7 * 0.1 / (0.7 * 1e-3 + 0.3 * 1e-3))
    p.stepped(10.0)  # a slow round (a big batch): bounded by the whole chunk
    assert p.chunk() == PREFILL_CHUNK
    q = Pace(busy=True, step_s=0.001, token_s=0.1)
    assert q.chunk() == MIN_CHUNK


def test_the_batching_trials_run_once_per_engine(monkeypatch):
    """Each ``batch --parallel`` group makes a scheduler of its own: the trials (model calls,
    ~1 s on the default model) are not run again for the same engine; another engine gets its
    own verdict."""
    from localchat.session import batchstep

    calls = []

    class Engine:
        def __init__(self, verdict):
            self.verdict = verdict

    @batchstep.remembered
    def trial(engine):
        calls.append(engine)
        return engine.verdict

    a, b = Engine(""), Engine("a batched step failed")
    assert [trial(a), trial(a), trial(b), trial(b), trial(a)] == ["", "", b.verdict,
                                                                   b.verdict, ""]
    assert calls == [a, b]
    assert batchstep.batch_refusal.__wrapped__ is not batchstep.batch_refusal  # (wrapped)


@pytest.mark.parametrize("unfused", [None, "a pass of its own (the test says so)"])
def test_turns_admitted_together_prefill_in_one_model_call(session, unfused, monkeypatch):
    """Four turns admitted while none decodes: the first model call holds all four prompts
    (the weights read once for them), and each reply is the one it gives alone. Control: a
    model whose chunks cannot share a call takes one prompt a round."""
    import localchat.session.scheduler as scheduler
    from localchat.events import TurnFinished
    from localchat.session.scheduler import is_chunk
    from localchat.session.session import TurnOptions

    calls: list[list] = []
    real = scheduler.run_steps

    def spy(model, steps):
        calls.append([is_chunk(s) for s in steps])
        return real(model, steps)

    monkeypatch.setattr(scheduler, "run_steps", spy)
    prompts = [f"Question {i}: what is the river of Seoul called?" for i in range(4)]
    convs = [session.conversation(f"t{i}-{bool(unfused)}") for i in range(4)]
    sched = Scheduler(session, max_batch=4, memory=2**30)
    sched.unfused = unfused
    done: dict[int, str] = {}

    def work(i: int) -> Work:
        def emit(ev) -> None:
            assert not isinstance(ev, BaseException), ev
            if isinstance(ev, TurnFinished):
                done[i] = ev.reply
        return Work(lambda s: s.turn(convs[i], prompts[i], TurnOptions(max_tokens=12)), emit)

    sched.run_all([work(i) for i in range(4)])
    assert calls[0] == ([True] * 4 if not unfused else [True])
    for i in range(4):
        alone = [ev for ev in session.turn(session.conversation(f"alone-t{i}-{bool(unfused)}"),
                                           prompts[i], TurnOptions(max_tokens=12))][-1]
        assert alone.reply == done[i]
