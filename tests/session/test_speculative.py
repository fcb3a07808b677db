"""Prompt-lookup decoding (``localchat/session/speculative.py``) against plain decoding.

Tiny random models copy little, so besides the real n-gram lookup the equality tests also run
with an oracle drafter (``Oracle``: the plain run's own next tokens, every third draft with one
token changed) that makes long drafts get accepted, cut and rewound on every cache family.
"""

import pytest
from families import FAMILIES

from localchat import paths
from localchat.kvcache import kinds as ck
from localchat.model.engine import Engine
from localchat.model.sampler import Sampler
from localchat.session import speculative
from localchat.session.generation import Cancel, Run, TurnOptions, generate
from localchat.session.session import Session
from localchat.session.turncache import Start

COPY = ("def main():\n    print('hello world')\n    return 0\n" * 3
        + "Numbers 0 1 2 3 4 5 6 7 8 9 and lists: - one - two - three - one - two - three")
FREE = "The capital of France is Paris. What is the capital of Korea?"


@pytest.fixture(scope="module")
def built(family_engine):
    return family_engine


def oracle(future: list[int], context: int, wrong_every: int = 3):
    """An NgramIndex whose drafts are ``future`` (the plain reply) from the current position,
    with the last token of every ``wrong_every``-th draft changed."""
    calls = [0]

    class Oracle(speculative.NgramIndex):
        def draft(self, length, min_ngram=2, stop=frozenset()):
            at = len(self.tokens) - context
            out = list(future[at:at + length])
            cut = next((i for i, t in enumerate(out) if t in stop), len(out))
            out = out[:cut]
            calls[0] += 1
            if out and calls[0] % wrong_every == 0:
                out[-1] = (out[-1] + 1) % 400
            return out
    return Oracle


def decode_run(engine, prompt: str, speculate: str, max_tokens: int = 40, **kw):
    """(run, cache) of one turn from an empty cache, through ``generate``."""
    tokens = engine.encode(prompt)
    cache = engine.new_cache()
    run = Run()
    options = TurnOptions(max_tokens=max_tokens, speculate=speculate, **kw)
    list(generate(engine, tokens, Start(cache, 0, {}), max_tokens, options, Cancel(), run))
    return run, cache, tokens


def next_logits(engine, cache, tok: int):
    import mlx.core as mx

    out = engine.model(mx.array([[tok]]), cache=cache)[0, -1]
    mx.eval(out)
    return out


def assert_same_cache(engine, a, b, tol=1e-3):
    """Both caches hold the same tokens: equal positions and the same logits for one more
    (fed into both: neither is used afterwards)."""
    import mlx.core as mx

    assert ck.position(a) == ck.position(b)
    la, lb = next_logits(engine, a, 5), next_logits(engine, b, 5)
    assert mx.abs(la - lb).max().item() < tol * max(1.0, mx.abs(la).max().item())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_lookup_equals_plain_on_every_family(built, family, monkeypatch):
    engine = built(family)
    for prompt in (COPY, FREE):
        plain, pc, tokens = decode_run(engine, prompt, "off")
        assert plain.lookup.drafted == 0
        got, gc, _ = decode_run(engine, prompt, "lookup")
        assert got.generated == plain.generated and got.fed == plain.fed
        assert_same_cache(engine, pc, gc)
        # Oracle drafts: long accepted runs, cut drafts, rewinds of every cache kind.
        with monkeypatch.context() as m:
            m.setattr(speculative, "NgramIndex",
                      oracle(plain.generated, len(tokens), wrong_every=2))
            forced, fc, _ = decode_run(engine, prompt, "lookup")
        assert forced.lookup.accepted >= len(plain.generated) // 3, forced.lookup
        assert forced.lookup.accepted < forced.lookup.drafted
        assert forced.generated == plain.generated and forced.fed == plain.fed
        assert_same_cache(engine, decode_run(engine, prompt, "off")[1], fc)


def test_accepting_a_wrong_draft_token_is_detected(built, monkeypatch):
    """Negative control: a verifier that keeps one rejected token changes the reply."""
    engine = built("llama")
    plain, _, tokens = decode_run(engine, COPY, "off")
    real = Sampler.verify

    def sloppy(self, logits, draft):
        a, nxt = real(self, logits, draft)
        return (a + 1, draft[a + 1] if a + 1 < len(draft) else nxt) if a < len(draft) else (
            a, nxt)

    monkeypatch.setattr(Sampler, "verify", sloppy)
    monkeypatch.setattr(speculative, "NgramIndex", oracle(plain.generated, len(tokens)))
    bad, _, _ = decode_run(engine, COPY, "lookup")
    assert bad.generated != plain.generated


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mamba2", "baichuan_m1"])
def test_a_reply_cut_short_leaves_exactly_its_tokens(built, family, monkeypatch):
    """Closed in the middle of an accepted draft (a stop string, Ctrl-C), the generator gives
    back the draft tokens the caller did not take."""
    engine = built(family)
    plain, _, tokens = decode_run(engine, COPY, "off")
    monkeypatch.setattr(speculative, "NgramIndex", oracle(plain.generated, len(tokens), 99))
    for take in (3, 7):
        cache = engine.new_cache()
        logits = yield_logits(engine, tokens, cache)
        steps = speculative.decode(engine, cache, logits, 40, TurnOptions(), tokens,
                                   speculative.LookupStats())
        got = [next(steps) for _ in range(take)]
        steps.close()
        assert got == plain.generated[:take]
        ref = engine.new_cache()
        yield_logits(engine, tokens + got, ref)
        assert_same_cache(engine, ref, cache)


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("speculate", ["off", "lookup"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mamba2"])
def test_a_token_goes_out_before_the_next_model_call_where_calls_are_eager(
        built, family, speculate, eager, monkeypatch):
    """Where a model call computes as it is made (the CPU attention), a decoder hands a token
    out before the call that feeds it (plain step or verify pass), so the first token does not
    wait for a second model call; elsewhere the call is queued first (MLX async). Either way a
    caller that stops after any token finds the cache holding exactly the tokens it took,
    and the reply is the plain decode's."""
    import mlx.core as mx

    engine = built(family)
    plain, _, tokens = decode_run(engine, COPY, "off")
    monkeypatch.setattr(type(engine), "eager", property(lambda self: eager))
    if speculate == "lookup":  # drafts at every token: each token is followed by a verify
        monkeypatch.setattr(speculative, "NgramIndex", oracle(plain.generated, len(tokens),
                                                              99))
    calls = [0]
    model = engine.model

    class Counted:
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *a, **k):
            calls[0] += 1
            return model(*a, **k)

    for take in (1, 2, 5):
        cache = engine.new_cache()
        logits = yield_logits(engine, tokens, cache)
        monkeypatch.setattr(engine, "model", Counted())
        calls[0] = 0
        steps = speculative.decode(engine, cache, logits, 40,
                                   TurnOptions(speculate=speculate), tokens,
                                   speculative.LookupStats())
        first = next(steps)
        assert calls[0] == (0 if eager else 1)  # the token before any further model call
        got = [first] + [next(steps) for _ in range(take - 1)]
        steps.close()
        monkeypatch.setattr(engine, "model", model)
        assert got == plain.generated[:take]
        ref = engine.new_cache()
        yield_logits(engine, tokens + got, ref)
        short = engine.new_cache()
        yield_logits(engine, tokens + got[:-1], short)
        with pytest.raises(AssertionError):  # control: one token fewer is told apart
            assert_same_cache(engine, short, cache)
        cache = engine.new_cache()  # (the control fed a token into it: redo the run)
        logits = yield_logits(engine, tokens, cache)
        steps = speculative.decode(engine, cache, logits, 40,
                                   TurnOptions(speculate=speculate), tokens,
                                   speculative.LookupStats())
        assert [next(steps) for _ in range(take)] == got
        steps.close()
        mx.eval(ck.state_arrays(cache))
        assert_same_cache(engine, ref, cache)


def yield_logits(engine, tokens, cache):
    steps = engine.prefill(tokens, cache)
    while True:
        try:
            next(steps)
        except StopIteration as fin:
            return fin.value


def test_quantized_leaves_are_cut_back(tmp_path):
    """QuantizedKVCache (``to_quantized``; CacheLists are covered by the families above): a
    verify pass with a wrong draft leaves the same cache as feeding the accepted token alone."""
    import mlx.core as mx
    from tiny import build_tiny_model

    # head_dim 32: mx.quantize needs a group of 32 or more
    engine = Engine.load(str(build_tiny_model(tmp_path / "m", hidden=128, heads=4)))
    tokens = engine.encode(COPY)

    def quantized():
        cache = [c.to_quantized(group_size=32, bits=8) for c in engine.new_cache()]
        yield_logits(engine, tokens, cache)
        return cache

    plain = quantized()
    first = int(mx.argmax(next_logits(engine, plain, tokens[-1])).item())
    second = int(mx.argmax(next_logits(engine, plain, first)).item())
    spec = quantized()
    step = speculative.speculative_step(engine.model, spec, tokens[-1],
                                        [first, (second + 1) % 400, 7], Sampler(0, 1))
    assert (step.accepted, step.next) == (1, second)
    assert_same_cache(engine, plain, spec)
    assert type(spec[0]).__name__ == "QuantizedKVCache"


def test_engines_that_script_their_tokens_decode_plain(engine):
    from fakes import ScriptedEngine

    assert engine.can_verify()
    assert not ScriptedEngine(engine, ["hi"]).can_verify()


def test_ngram_index_finds_the_latest_longest_match():
    idx = speculative.NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert idx.draft(2) == [4, 9]  # "1 2 3" (longest) wins over the later "2 3" -> 5 6
    idx.tokens[-3:] = [7, 2, 3]  # (only "2 3" matches now: its latest continuation)
    assert speculative.NgramIndex(idx.tokens).draft(2, min_ngram=2) == [5, 6]
    assert speculative.NgramIndex(idx.tokens).draft(2, min_ngram=3) == []
    idx = speculative.NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3, 4])
    assert idx.draft(3) == [9, 2, 3]
    assert idx.draft(3, stop={2}) == [9]
    assert speculative.NgramIndex([1, 2, 3]).draft(4) == []


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_next_turn_resumed_from_disk_equals_a_full_prefill(home, store, built, family):
    engine = built(family)
    conv, twin = store.create("r", engine.ref.name), store.create("t", engine.ref.name)
    options = TurnOptions(max_tokens=24)
    for prompt in (COPY, "Copy the list again: - one - two - three", FREE):
        got = list(Session(store, engine, paths.kv_root(), paths.locks_dir())
                   .turn(conv, prompt, options))[-1]
        ref = list(Session(store, engine, paths.kv_root(), paths.locks_dir())
                   .turn(twin, prompt, TurnOptions(max_tokens=24, no_cache=True,
                                                   speculate="off")))[-1]
        assert got.tokens == ref.tokens
    assert got.usage.cached_tokens > 0


# -- sampled turns: the acceptance rule keeps the distribution ------------------------------


def chi_square_ok(counts: dict, probs: dict, n: int) -> bool:
    """Whether ``counts`` (n draws) fit ``probs`` at p = 0.001: bins of expected count >= 5,
    the rest pooled (Wilson-Hilferty approximation of the chi-square quantile)."""
    bins = [t for t in probs if probs[t] * n >= 5]
    pooled_p = 1.0 - sum(probs[t] for t in bins)
    pooled_c = n - sum(counts.get(t, 0) for t in bins)
    stat = sum((counts.get(t, 0) - probs[t] * n) ** 2 / (probs[t] * n) for t in bins)
    df = len(bins) - 1
    if pooled_p * n >= 5:
        stat += (pooled_c - pooled_p * n) ** 2 / (pooled_p * n)
        df += 1
    elif pooled_c > 10:
        return False
    assert df >= 1, "too few draws for this distribution"
    crit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    return stat < crit


def emitted(picker, logits, draft, n: int, seed: int = 0) -> tuple[dict, dict]:
    """Counts of the first token a verify pass gives, and of the second where the first was
    the draft's: each must follow the model's distribution at its row."""
    import mlx.core as mx

    mx.random.seed(seed)
    first, second = {}, {}
    for _ in range(n):
        a, nxt = picker.verify(logits, draft)
        toks = [*draft[:a], nxt]
        first[toks[0]] = first.get(toks[0], 0) + 1
        if toks[0] == draft[0] and len(toks) > 1:
            second[toks[1]] = second.get(toks[1], 0) + 1
    return first, second


def sharp_rows(engine, draft):
    """The tiny model's logits after a prompt and ``draft``, scaled so a handful of tokens
    carry most of the mass (bins the chi-square can test)."""
    import mlx.core as mx

    cache = engine.new_cache()
    tokens = engine.encode(FREE)
    yield_logits(engine, tokens[:-1], cache)
    return engine.model(mx.array([[tokens[-1], *draft]]), cache=cache)[0] * 4.0


def test_the_acceptance_rule_keeps_the_distribution(engine):
    import mlx.core as mx

    picker = Sampler(1.0, 1.0)
    probe = sharp_rows(engine, [])
    p0 = mx.softmax(probe[0]).tolist()
    ranked = sorted(range(len(p0)), key=lambda t: -p0[t])
    # A draft whose first token is likely (often accepted) and one that is a long shot.
    for x0 in (ranked[0], ranked[2]):
        logits = sharp_rows(engine, [x0, 11])
        p = [dict(enumerate(mx.softmax(row).tolist())) for row in logits[:2]]
        n = 3000
        first, second = emitted(picker, logits, [x0, 11], n)
        assert chi_square_ok(first, p[0], n), (x0, first)
        assert 0 < first[x0] < n  # both branches ran
        if x0 == ranked[0]:  # accepted often enough to test what follows it
            assert chi_square_ok(second, p[1], first[x0])


def test_a_wrong_acceptance_rule_fails_the_same_check(engine):
    """Negative controls: always accepting, or resampling from p itself (x not removed)."""
    import mlx.core as mx

    class AlwaysAccept(Sampler):
        def verify(self, logits, draft):
            return len(draft), int(self.draw(logits[-1:]).item())

    class KeepsX(Sampler):
        def verify(self, logits, draft):
            a, _ = super().verify(logits, draft)
            return a, int(self.draw(logits[a:a + 1]).item())

    probe = sharp_rows(engine, [])
    p0 = mx.softmax(probe[0]).tolist()
    x0 = sorted(range(len(p0)), key=lambda t: -p0[t])[0]
    logits = sharp_rows(engine, [x0, 11])
    p = dict(enumerate(mx.softmax(logits[0]).tolist()))
    for wrong in (AlwaysAccept(1.0, 1.0), KeepsX(1.0, 1.0)):
        first, _ = emitted(wrong, logits, [x0, 11], 3000)
        assert not chi_square_ok(first, p, 3000), type(wrong).__name__


def test_top_k_and_min_p_drafts_keep_the_filtered_distribution(engine):
    """A turn with top-k or min-p speculates too: the rule checks the draft against the
    filtered distribution (negative control: a verifier that forgets the filter fails)."""
    import mlx.core as mx

    class ForgetsFilters(Sampler):
        def probs(self, logits):
            return mx.softmax(logits.astype(mx.float32) * (1.0 / self.temp), axis=-1)

    probe = sharp_rows(engine, [])[:1] / 4.0
    x0 = int(mx.argmax(probe[0]).item())
    logits = sharp_rows(engine, [x0, 11]) / 4.0  # a broad distribution: the filters bite
    for settings in ({"top_k": 3}, {"min_p": 0.6}):
        right = Sampler(1.0, 1.0, **settings)
        p = dict(enumerate(right.probs(logits[:1])[0].tolist()))
        assert sum(1 for v in p.values() if v > 0) < 50  # the filter removed the tail
        first, _ = emitted(right, logits, [x0, 11], 3000)
        assert chi_square_ok(first, p, 3000), settings
        first, _ = emitted(ForgetsFilters(1.0, 1.0, **settings), logits, [x0, 11], 3000)
        assert not chi_square_ok(first, p, 3000), settings


def test_sampled_turns_speculate_and_stay_reproducible(engine, monkeypatch):
    plain, _, tokens = decode_run(engine, COPY, "off")
    monkeypatch.setattr(speculative, "NgramIndex", oracle(plain.generated, len(tokens)))
    a, _, _ = decode_run(engine, COPY, "lookup", temp=0.7, seed=3)
    b, _, _ = decode_run(engine, COPY, "lookup", temp=0.7, seed=3)
    assert a.lookup.drafted > 0 and a.generated == b.generated


def test_drafting_backs_off_after_misses_and_warms_up_while_copying():
    p = speculative.Policy(start=4, most=10, min_ngram=3, floor=3)
    assert (p.want(), p.min_ngram) == (4, 3)
    p.update(4, 4)
    assert (p.want(), p.min_ngram) == (8, 2)  # whole draft kept: longer, shorter matches
    p.update(8, 8)
    assert p.want() == 10
    p.update(10, 3)
    assert (p.want(), p.min_ngram) == (4, 2)
    p.update(4, 1)
    assert p.want() == 3  # (the floor: a copy that changed a word goes on)
    skipped = []
    for _ in range(3):  # misses in a row: 1, 2, then 4 plain steps before drafting again
        p.update(p.length, 0)
        n = 0
        while p.want() == 0:
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4] and p.min_ngram == 3
    assert speculative.Policy(min_ngram=2, floor=1).min_ngram == 2
    hot = speculative.Policy(min_ngram=2)
    hot.update(4, 4)
    assert hot.min_ngram == 2  # never single tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("gate", ["drafting", "never"])
def test_greedy_turns_under_the_scheduler_verify_drafts_together_and_give_the_plain_reply(
        built, family, gate, store, monkeypatch):
    """``serve`` and ``batch --parallel`` run turns on the scheduler: two greedy turns at once
    each draft, their verify passes run as rows of the same model call as the other turn's
    step, and each gives the plain reply; the control gate (never drafting) decodes plain
    batched steps — no drafts, the same replies."""
    from localchat.events import TurnFinished
    from localchat.session import scheduler as sch
    from localchat.session.scheduler import Scheduler, Work

    engine = built(family)
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    off = list(session.turn(session.conversation(f"off-{family}-{gate}"), COPY,
                            TurnOptions(max_tokens=30, speculate="off")))[-1]
    monkeypatch.setattr(speculative, "NgramIndex",
                        oracle(off.tokens, off.usage.prompt_tokens))
    sched = Scheduler(session, max_batch=4, memory=2**30)
    if gate == "never":
        monkeypatch.setattr(sched, "may_draft", lambda: False)
    calls: list[tuple[int, bool]] = []  # (steps in the call, a verify pass among them)
    run_steps = sch.run_steps

    def recording(model, steps):
        calls.append((len(steps), any(s.rows for s in steps)))
        return run_steps(model, steps)
    monkeypatch.setattr(sch, "run_steps", recording)
    got: list = []
    convs = [session.conversation(f"on-{family}-{gate}-{i}") for i in range(2)]
    sched.run_all([Work(lambda s, c=c: s.turn(c, COPY, TurnOptions(max_tokens=30)),
                        lambda ev: got.append(ev)) for c in convs])
    done = [ev for ev in got if isinstance(ev, TurnFinished)]
    assert len(done) == 2 and sched.widest == 2
    for d in done:
        assert d.tokens == off.tokens
        if gate == "drafting":
            assert d.usage.lookup_drafted > 0 and d.usage.lookup_accepted > 0
        else:
            assert d.usage.lookup_drafted == 0
    together = [n for n, verify in calls if verify and n >= 2]
    assert (len(together) > 0) == (gate == "drafting"), calls
    assert not any(type(ev).__name__ == "Step" for ev in got)
