"""One turn's sampler: the next token from the model's logits, and the check of a draft.

What it is: ``Sampler`` — the single place a reply's tokens are chosen, for the plain decode
(``Engine.decode``: one token a step) and for speculative decoding (``session/speculative.py``: a
draft of several tokens verified against the same distribution). Greedy when the temperature
is 0; otherwise mlx-lm's sampler chain (``make_sampler``: top-p, min-p, top-k, then the
temperature), so a plain turn draws exactly what mlx-lm would. Control tokens that are not
ends (``<|im_start|>`` in a reply) are never chosen: their logits are -inf everywhere, so a
stored reply renders back to the ids that were fed. A repetition penalty weighs the last 20
chosen tokens, as mlx-lm's does.

Seeded turns: each draw starts from a state of its own (the seed and the draw's index), so a
turn samples the same whether it runs alone or batched with other turns that draw between its
steps (MLX's global random state cannot be swapped out, only reseeded).

A constrained turn (``constraint.py``: a JSON Schema, a regex, a grammar) masks every row
before anything else sees it, so the distribution drawn from is the constrained one, and
advances the grammar with each kept token (``note``). A reasoning model's thinking stays free:
where the turn starts inside it, the grammar waits for the end marker's tokens.

What it is not: the defaults a turn's settings come from (``defaults.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .constraint import Matcher

PENALTY_WINDOW = 20  # tokens a repetition penalty looks back at (mlx-lm's default)


class Sampler:
    """Chooses tokens for one turn; ``note`` each chosen token (the penalty's history)."""

    def __init__(self, temp: float = 0.0, top_p: float = 1.0, *, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 banned: Sequence[int] = (), root: Callable | None = None,
                 grammar: Matcher | None = None, free_until: Sequence[int] = (),
                 opens: int | None = None):
        from mlx_lm.sample_utils import apply_top_p, make_logits_processors, make_sampler

        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p
        self.penalty = repetition_penalty
        self.seed = seed
        self.banned = sorted(set(banned))
        self.root = root or (lambda y: y)  # split over ranks: every rank takes rank 0's token
        # mlx-lm's chain (top-p, min-p, top-k, then the temperature), its top-p ours: the
        # same filter with a faster sort (``top_p_filter``).
        rest = make_sampler(temp, top_p=0.0, min_p=min_p, top_k=top_k)
        self._top_p = top_p_filter if _host_sort() else apply_top_p  # (asked once a turn)
        self._chain = (lambda x: rest(self._top_p(x, top_p))) if temp != 0 and \
            0 < top_p < 1.0 else rest
        self._penalize = make_logits_processors(
            None, repetition_penalty if repetition_penalty != 1.0 else None)
        self._mask = None
        self.seen: list[int] = []
        self.drawn = 0
        self.grammar = grammar  # the turn's constraint, advanced by ``note``
        self.free_until = tuple(free_until)  # the thinking's end marker: the grammar after it
        self.opens = opens  # the thinking's start marker, which the first token may be
        self.thinking = bool(self.free_until) and opens is None  # inside the thinking now

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def verifiable(self) -> bool:
        """Whether a draft can be checked against this sampler's distribution: every row of a
        verify pass must see the same settings, and a penalty changes with each token."""
        return self.penalty == 1.0

    @property
    def constrained(self) -> bool:
        """Whether the grammar masks the next token (it waits while the model thinks)."""
        return self.grammar is not None and not self.thinking

    def note(self, tok: int) -> None:
        """A token was kept (drawn, or a draft token the verify pass accepted)."""
        self.seen.append(tok)
        if self.grammar is None:
            return
        if self.thinking:  # the answer is constrained once the end marker is through
            self.thinking = tuple(self.seen[-len(self.free_until):]) != self.free_until
        elif self.opens is not None and len(self.seen) == 1 and tok == self.opens:
            self.thinking = True  # the model opened its thinking: free until its end marker
        else:
            self.grammar.consume(tok)

    def admissible(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` may be verified: the grammar's valid prefix,
        or while thinking, up to the end marker (the rows after it would need its masks)."""
        if self.grammar is None:
            return len(draft)
        if self.thinking:
            return next((i for i, t in enumerate(draft) if t in self.free_until), len(draft))
        return self.grammar.validate(draft)

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone next (a free draft), ends left out."""
        if not self.constrained:
            return []
        forced = self.grammar.forced()
        return forced[:next((i for i, t in enumerate(forced) if t in self.grammar.ends),
                            len(forced))]

    def _reseed(self) -> None:
        import mlx.core as mx

        if self.seed is not None:
            mx.random.seed((self.seed * 1_000_003 + self.drawn) % 2**63)
        self.drawn += 1

    def masked(self, logits):
        """``logits`` with the banned tokens at -inf."""
        if not self.banned:
            return logits
        import mlx.core as mx

        width = logits.shape[-1]
        if self._mask is None or self._mask.shape[-1] != width:
            ids = [t for t in self.banned if t < width]
            mask = mx.zeros((width,), dtype=logits.dtype)
            self._mask = mask.at[mx.array(ids)].add(-float("inf")) if ids else mask
        return logits + self._mask

    def draw(self, logits):
        """The next token (an array of shape [1]) from ``logits`` [1, vocab]."""
        import mlx.core as mx

        self._reseed()
        scores = self.masked(logits)
        if self.constrained:
            mask = self.grammar.allowed_mask()
            if self.opens is not None and not self.seen:  # (the first token may open it)
                mask.view("uint32")[self.opens // 32] |= 1 << (self.opens % 32)
            scores = self.grammar.apply(scores, mask)
        if self._penalize:
            history = mx.array(self.seen[-PENALTY_WINDOW:], dtype=mx.uint32)
            for process in self._penalize:
                scores = process(history, scores)
        return self.root(self._chain(scores))

    def probs(self, logits):
        """The distribution ``draw`` samples from, per row of ``logits`` (masked already)."""
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k

        if 0 < self.top_p < 1.0:
            logits = self._top_p(logits, self.top_p)
        if self.min_p != 0.0:
            logits = apply_min_p(logits, self.min_p)
        if self.top_k > 0:
            logits = apply_top_k(logits, self.top_k)
        return mx.softmax(logits.astype(mx.float32) * (1.0 / self.temp), axis=-1)

    def verify(self, logits, draft: Sequence[int]) -> tuple[int, int]:
        """(draft tokens accepted, the next token) for ``logits`` [len(draft) + 1, vocab],
        row i being the model's distribution after the pending token and ``draft[:i]``.

        Greedy: the longest prefix the argmax agrees with. Sampled: the speculative-sampling
        rule for a deterministic draft (accept x with probability p(x); on a rejection draw from
        p without x, renormalised), so the tokens are distributed as ``draw``'s.
        """
        import mlx.core as mx

        assert self.verifiable, "a penalised turn decodes plain"
        k = len(draft)
        logits = self.masked(logits)
        if self.constrained:  # each row masked by the grammar's state after draft[:i]
            logits = self.grammar.apply(logits, self.grammar.masks(draft))
        if self.greedy:
            choice = mx.argmax(logits, axis=-1).tolist()
            a = next((i for i in range(k) if draft[i] != choice[i]), k)
            return a, int(choice[a])
        self._reseed()
        p = self.probs(logits)
        px = p[mx.arange(k), mx.array(list(draft))]
        u = mx.random.uniform(shape=(k,))
        mx.eval(px, u)
        px, u = px.tolist(), u.tolist()
        a = next((i for i in range(k) if u[i] >= px[i]), k)
        if a == k:  # every draft token accepted: the next one is a plain draw
            return a, int(self._chain(logits[k:k + 1]).item())
        # Rejected x: draw from p without x, renormalised (the residual of p - q, q = δx).
        rest = mx.where(mx.arange(p.shape[-1]) == draft[a], 0.0, p[a])
        return a, int(mx.random.categorical(mx.log(rest)).item())


def top_p_filter(logprobs, top_p: float):
    """mlx-lm's ``apply_top_p``, to the bit, with its sort done by NumPy where the scores are
    float32: MLX's CPU sort of a 49,152-token vocabulary took 4.6 ms a sampled token (~5% of a
    decode step of the default model), NumPy's 0.3 ms. Sorting is exact, so every later step
    sees the very values mlx-lm's does. A ``Sampler`` takes it on the CPU path only
    (``_host_sort``); other dtypes and calls inside ``mx.compile`` get mlx-lm's own."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    if logprobs.dtype != mx.float32:
        return apply_top_p(logprobs, top_p)
    try:
        mx.eval(logprobs)
    except ValueError:  # under a function transformation: nothing may be evaluated
        return apply_top_p(logprobs, top_p)
    import numpy as np

    sorted_logprobs = mx.array(np.sort(np.array(logprobs, copy=False), axis=-1))
    sorted_probs = mx.exp(sorted_logprobs)
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def _host_sort() -> bool:
    from ..cpu import backend

    return backend.cpu_path()

