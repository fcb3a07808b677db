"""Prompt-lookup speculative decoding: draft the next tokens from the context, verify them at once.

What it is: ``decode`` — a drop-in for ``Engine.decode`` with the same contract (every yielded
token is fed before the next one is yielded, an EOS is never fed, the last allowed token is fed
only when the caller reads on, and a caller that stops reading finds the cache holding exactly
the tokens it was given). At each step the last few tokens (an n-gram of 3-5) are looked up in
the context (prompt + reply so far, ``NgramIndex``); where they occurred before, the tokens that
followed are the draft. One forward pass over the pending token and the draft gives the model's
choice after each of them (``speculative_step``): the longest agreeing prefix is kept, plus the
model's own next token. Greedy turns produce exactly the plain decode's tokens; sampled turns
use the speculative-sampling acceptance rule for a deterministic draft (accept draft token x
with probability p(x); on rejection sample from p with x removed and renormalised), so the
distribution is unchanged (Leviathan et al. 2023 with q = one-hot).

Rejected draft tokens leave the cache as if never fed (``Mark`` / ``rewind``):
- growing leaves (KVCache, MLA, QuantizedKVCache, the growing parts of a CacheList) are trimmed;
- bounded leaves (RotatingKVCache, ChunkedKVCache, ArraysCache — recurrent state, sliding
  windows) cannot be cut, so their small state is captured before verifying
  (``kvcache.kinds.capture``); after a rejection it is restored, the growing leaves are cut back
  to the same position, and the accepted tokens are fed again (one more forward pass, which is
  why drafting backs off harder after misses on such models).

A constrained turn (``model/constraint.py``) drafts for free where its grammar allows one
continuation alone (field names, quotes, braces: ``Sampler.forced``), cuts a lookup draft at
the first token the grammar refuses, and verifies with every row masked by the grammar's state
there, so a greedy constrained turn is token for token its plain constrained decode.

What it is not: a draft model, or anything a model split over ranks runs
(``Engine.can_verify`` is False there and for engines that script their tokens: they decode
plain). Turns with sampling settings other than temperature and top-p decode plain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..events import Step
from ..kvcache import kinds as ck
from ..model.sampler import Sampler

MIN_NGRAM = 2  # shortest suffix looked up (3 on bounded caches, where a miss costs a re-feed)
MAX_NGRAM = 5  # longest suffix looked up; a longer match is found through its last 5 tokens
MAX_DRAFT = 16  # most tokens verified at once
START_DRAFT = 8
FLOOR_DRAFT = 4  # shortest draft after a partial miss: a copy that changed a word goes on
MAX_FORCED = 32  # most forced tokens (a grammar's only choice) verified at once
# (The policy was chosen by replaying the default model's plain replies to bench_decode's
# copy-heavy and free-form tasks through each candidate offline, verify passes costed as
# measured — a forward of k tokens ~ 1 + 0.08 + 0.025·k single steps: on the copy task 110
# passes for 200 tokens with 3-grams, floor 1 and at most 10, 69 with these; free-form
# unchanged at ~190. Measured end to end in scripts/bench_decode.py.)


@dataclass
class LookupStats:
    """Draft tokens proposed and accepted in one turn (``Usage.lookup_*``)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify passes
    forced: int = 0  # tokens a grammar allowed alone, verified as a draft (``constraint.py``)


class NgramIndex:
    """The context's n-grams (2..MAX_NGRAM long), each mapped to the position of the
    token after its latest occurrence; extended as tokens come. Lookups cost O(MAX_NGRAM)."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}
        for t in tokens:
            self.append(t)

    def append(self, tok: int) -> None:
        toks, end = self.tokens, len(self.tokens)
        # The n-grams ending just before ``tok`` now have a continuation: ``tok``.
        for n in range(2, min(MAX_NGRAM, end) + 1):
            self.table[tuple(toks[end - n:end])] = end
        toks.append(tok)

    def draft(self, length: int, min_ngram: int = MIN_NGRAM,
              stop: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Up to ``length`` tokens that followed the longest recent match of the context's
        suffix, cut before the first of ``stop`` (an EOS is never drafted: it is never fed)."""
        toks = self.tokens
        for n in range(min(MAX_NGRAM, len(toks)), min_ngram - 1, -1):
            at = self.table.get(tuple(toks[-n:]))
            if at is None:
                continue
            out = toks[at:at + length]
            for i, t in enumerate(out):
                if t in stop:
                    return out[:i]
            return out
        return []


class Policy:
    """How long the next draft is. Doubles after a fully accepted draft (copying), falls to
    what was accepted + 1 (at least ``floor``) otherwise, and after a draft with nothing
    accepted skips drafting for 1, 2, 4 … 16 steps as misses come in a row (free-form text
    then costs ~nothing; each miss costs a wider forward pass, and on bounded caches one more
    forward to re-feed)."""

    def __init__(self, start: int = START_DRAFT, most: int = MAX_DRAFT,
                 min_ngram: int = MIN_NGRAM, floor: int = FLOOR_DRAFT):
        self.length, self.most, self.floor = start, most, floor
        self.misses = 0
        self.skip = 0
        self.base = min_ngram
        self.hot = False  # the last draft kept tokens: the reply is copying

    @property
    def min_ngram(self) -> int:
        """Shortest match that drafts: one token shorter while the reply is copying (never
        below 2: single tokens recur everywhere), so a copy that changed a word is picked up
        again a token sooner."""
        return max(2, self.base - 1) if self.hot else self.base

    def want(self) -> int:
        if self.skip:
            self.skip -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        self.hot = accepted > 0
        if accepted == drafted:
            self.length = min(self.most, self.length * 2)
            self.misses = 0
        else:
            self.length = min(self.most, max(self.floor, accepted + 1))
            self.misses = self.misses + 1 if accepted == 0 else 0
            self.skip = min(16, 2 ** (self.misses - 1)) if self.misses else 0


@dataclass(frozen=True)
class Mark:
    """What a cache held before a verify pass: ``pos`` tokens, and the bounded leaves' state
    then (None when every leaf can be cut)."""

    pos: int
    snap: ck.Captured | None


def mark(cache: list) -> Mark:
    """Remember the cache's state before feeding draft tokens (copies only bounded state)."""
    pos = ck.position(cache)
    return Mark(pos, ck.capture(cache, pos) if ck.bounded(cache) else None)


def rewind(model, cache: list, at: Mark, keep: Sequence[int]) -> None:
    """Make ``cache`` hold what it held at ``at`` plus ``keep``, as if nothing else was fed.

    Growing leaves are trimmed; bounded ones are restored from ``at.snap`` and ``keep`` is fed
    again (with the growing leaves first cut back to ``at.pos``, so they take it once).
    """
    import mlx.core as mx

    target = at.pos if at.snap is not None else at.pos + len(keep)
    for _, obj in ck.leaves(cache):
        if ck.kind_of(obj) != ck.BOUNDED and obj.offset > target:
            obj.trim(obj.offset - target)
    if at.snap is not None:
        ck.restore(cache, at.snap)
        if keep:
            model(mx.array(list(keep))[None], cache=cache)
        mx.eval(ck.state_arrays(cache))


@dataclass(frozen=True)
class Verified:
    """One verify pass: of the draft, ``accepted`` tokens were kept; ``next`` is the model's
    token after them (pending: not fed); ``mark`` is the cache before the pass."""

    accepted: int
    next: int
    mark: Mark


def speculative_step(model, cache: list, pending: int, draft: Sequence[int],
                     sampler: Sampler) -> Verified:
    """Feed ``pending`` and ``draft`` in one forward pass, keep the agreeing prefix.

    Afterwards the cache holds ``pending`` and the accepted draft tokens, exactly as if fed one
    by one (reusable for one sequence of a batch: ``model`` and ``cache`` are its own).
    """
    import mlx.core as mx

    at = mark(cache)
    logits = model(mx.array([pending, *draft])[None], cache=cache)[0]
    return settle(model, cache, at, pending, draft, logits, sampler)


def settle(model, cache: list, at: Mark, pending: int, draft: Sequence[int], logits,
           sampler: Sampler) -> Verified:
    """After a verify pass from ``at`` (``logits``: one row per token fed), keep the agreeing
    prefix of ``draft`` and give the rest back to the cache."""
    accepted, nxt = sampler.verify(logits, draft)
    if accepted < len(draft):
        rewind(model, cache, at, [pending, *draft[:accepted]])
    return Verified(accepted, nxt, at)


def can_speculate(engine, options) -> bool:
    """Whether a turn may decode with lookup: asked for, an engine that can verify, and no
    sampling settings a draft cannot be checked against (a penalty changes p with every token
    it weighs; top-k and min-p are the same filter on every row, so they can)."""
    if (options.speculate or "lookup") != "lookup" or not engine.can_verify():
        return False
    neutral = {"repetition_penalty": (None, 1.0), "presence_penalty": (None, 0.0),
               "frequency_penalty": (None, 0.0), "logit_bias": (None, {})}
    return all(getattr(options, name, None) in ok for name, ok in neutral.items())


def decode(engine, cache: list, logits, max_tokens: int, options, context: Sequence[int],
           stats: LookupStats, stepped: bool = False,
           may_draft: Callable[[], bool] | None = None, grammar=None,
           **gate) -> Iterator:
    """``Engine.decode`` with prompt lookup where ``can_speculate`` says so, else plain.

    ``context``: the tokens the cache holds (drafts are looked up in them and in the reply).
    ``stepped``: a scheduler drives the turn (``Engine.decode``'s ``stepped``). A greedy turn
    then drafts while ``may_draft()`` says so: each verify pass is a ``Step`` (every row's
    logits) that the scheduler runs in the same model call as the other turns' steps; other
    steps are plain ``Step`` events. A sampled turn decodes plain there: its draws then do not
    depend on what else runs. ``grammar`` and ``gate`` (``free_until``, ``opens``): a
    constrained turn's (``Sampler``'s).
    """
    constrained = {"grammar": grammar, **gate} if grammar is not None else {}
    plain = not can_speculate(engine, options) or (
        stepped and (may_draft is None or options.temp != 0))
    if plain:
        return engine.decode(cache, logits, max_tokens, options.temp, options.seed,
                             options.top_p, **options.sampling_extras(), **constrained,
                             **({"stepped": True} if stepped else {}))
    return _lookup_decode(engine, cache, logits, max_tokens, options, context, stats,
                          may_draft if stepped else None, constrained)


def _lookup_decode(engine, cache, logits, max_tokens, options, context, stats,
                   may_draft=None, constrained=None):
    """Prompt-lookup decoding; under a scheduler (``may_draft`` given) every model call is
    yielded as a ``Step``."""
    import mlx.core as mx

    if max_tokens <= 0:
        return
    model, eos = engine.model, frozenset(engine.eos_ids)
    sampler = engine.sampler(options.temp, options.top_p, seed=options.seed,
                             **options.sampling_extras(), **(constrained or {}))
    index = NgramIndex(context)
    stepped = may_draft is not None
    # A rejection on bounded layers costs a second forward pass: look up longer matches only.
    policy = Policy(min_ngram=MIN_NGRAM + 1 if ck.bounded(cache) else MIN_NGRAM)
    y = int(sampler.draw(logits).item())
    sampler.note(y)  # (a constrained turn's grammar advances with every kept token)
    # Where model calls compute as they are made (``Engine.eager``), a verify pass would hold
    # back the token before it: that token goes out first.
    eager = engine.eager
    n = 0  # tokens yielded
    while True:
        if y in eos:
            yield y
            return
        if n == max_tokens - 1:
            yield y
            if stepped:
                yield Step(mx.array([y]), cache)
            else:
                engine.feed(cache, y)
            return
        index.append(y)
        # Drafts stay before the last allowed token, which is fed only when read on. What a
        # grammar allows alone next (field names, quotes) is the draft where there is some: no
        # model call has to propose it; else prompt lookup, cut where the grammar refuses.
        room = max_tokens - 2 - n if not stepped or may_draft() else 0
        draft = forced = sampler.forced()[:min(MAX_FORCED, room)] if room > 0 else []
        if not forced:
            want = min(policy.want(), room) if room > 0 else 0
            draft = index.draft(want, policy.min_ngram, eos) if want > 0 else []
            draft = draft[:sampler.admissible(draft)]
        if eager:
            yield from engine.hand_out(y, cache)
        if not draft:  # a plain step, queued before ``y`` is yielded as Engine.decode does
            # (after it where calls are eager)
            if stepped:  # the scheduler runs it, in a batch with others' steps
                step = Step(mx.array([y]), cache)
                yield step
                nxt = sampler.draw(step.logits)
            else:
                nxt = sampler.draw(model(mx.array([[y]]), cache=cache)[:, -1, :])
            mx.async_eval(nxt)
            if not eager:
                yield y
            n += 1
            y = int(nxt.item())
            sampler.note(y)
            continue
        if stepped:  # the verify pass as rows of the scheduler's next model call
            at = mark(cache)
            step = Step(mx.array([y, *draft]), cache, rows=True)
            yield step
            ver = settle(model, cache, at, y, draft, step.logits, sampler)
        else:
            ver = speculative_step(model, cache, y, draft, sampler)
        if forced:
            stats.forced += ver.accepted
        else:
            stats.drafted += len(draft)
            stats.accepted += ver.accepted
            policy.update(len(draft), ver.accepted)
        stats.steps += 1
        for tok in draft[:ver.accepted]:
            sampler.note(tok)
        sampler.note(ver.next)
        out = [y, *draft[:ver.accepted]]
        for j, tok in enumerate(out):
            if j == 0 and eager:  # out already
                n += 1
                continue
            try:
                yield tok
            except GeneratorExit:
                # The caller stopped after out[j]: give back what it did not take.
                if j + 1 < len(out):
                    rewind(model, cache, ver.mark, out[:j + 1])
                raise
            n += 1
            if j:
                index.append(tok)
        y = ver.next
