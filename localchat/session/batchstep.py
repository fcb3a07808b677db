"""One batched model call over several turns' steps: ``run_steps`` and the split caches.

What it is: the model sees one batch; each row is one token at one position of one turn. A
decode step is one row, a prompt chunk or a prompt-lookup verify pass is several rows (its
consecutive positions). Layer ``i`` gets a ``SplitCache`` over the turns' layer-``i`` caches:
its ``offset`` is one position per row (``mx.fast.rope`` takes an array), ``update_and_fetch``
appends each turn's rows to its own cache, and attention (``mx.fast.scaled_dot_product_attention``,
wrapped by ``install_split_attention``) runs per turn over exactly that turn's keys with its own
mask — no padding, no merge or extract. Recurrent state (``ArraysCache``) goes through
``SplitArrays``, which stacks the rows' states for a step of one row each. ``batch_refusal`` and
``fusion_refusal`` try a model once: whether its steps batch, and whether a chunk can run
beside decode rows. What it is not: the scheduling (``scheduler.py``).
"""

from __future__ import annotations

import functools
import itertools
import weakref

from ..events import Step
from ..kvcache import kinds as ck

# -- one batched step ---------------------------------------------------------------------------


class SplitKV:
    """Keys (or values) of several sequences, each its own array: what ``SplitCache``
    returns; ``sizes``: how many rows of the batch (consecutive positions) each one fed."""

    def __init__(self, parts: list, sizes: list[int]):
        self.parts = parts
        self.sizes = sizes


class SplitMask:
    """One attention mask per row (a row's own cache made it)."""

    def __init__(self, parts: list):
        self.parts = parts


def split_layer(caches: list, sizes: list[int], offsets: dict | None = None):
    """One layer's caches of several turns as one batch cache: ``SplitArrays`` for recurrent
    state (``ArraysCache``), else ``SplitCache``. ``sizes``: the rows each turn feeds;
    ``offsets``: the call's row positions made so far, shared by its layers."""
    if hasattr(caches[0], "cache") and hasattr(caches[0], "advance") and \
            not hasattr(caches[0], "offset"):
        if any(n != 1 for n in sizes):  # a recurrence runs along its sequence, not across rows
            raise ValueError("a recurrent state cannot take a prompt chunk beside steps")
        return SplitArrays(caches)
    return SplitCache(caches, sizes, offsets)


class SplitArrays:
    """Recurrent state (conv, SSM) of several turns: read as one array along the batch axis,
    written back row by row. The recurrence of each row depends on that row alone."""

    def __init__(self, caches: list):
        self.caches = caches
        if any(c.lengths is not None or c.left_padding is not None for c in caches):
            raise ValueError("a padded recurrent state")  # (made by batch caches only)

    lengths = None
    left_padding = None

    def __getitem__(self, i: int):
        import mlx.core as mx

        parts = [c[i] for c in self.caches]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError("recurrent state set for some rows only")
        return mx.concatenate(parts, axis=0)

    def __setitem__(self, i: int, value) -> None:
        for j, c in enumerate(self.caches):
            c[i] = value[j:j + 1]

    def advance(self, n: int) -> None:
        for c in self.caches:
            c.advance(n)

    def make_mask(self, n: int, **kw):
        masks = [c.make_mask(n, **kw) for c in self.caches]
        if any(m is not None for m in masks):
            raise ValueError("a recurrent state's mask")
        return None


class SplitCache:
    """One layer's caches of several turns, seen by the model as one batch cache.

    Every row of the batch is one token at one position. A turn that decodes feeds one row; a
    turn whose prompt is being prefilled feeds a chunk of ``n`` rows, its consecutive
    positions (``sizes``): its keys go into its cache as one (1, heads, n, dim) update and its
    queries attend as one causal block (``install_split_attention``), so the chunk costs its
    tokens' compute inside the same pass, not a pass of its own (issue 32)."""

    def __init__(self, caches: list, sizes: list[int], offsets: dict | None = None):
        self.caches = caches
        self.sizes = sizes
        self._offsets = {} if offsets is None else offsets

    def __getitem__(self, i: int):  # a CacheList's parts
        return split_layer([c[i] for c in self.caches], self.sizes, self._offsets)

    @property
    def keys(self):
        # Read only to order evaluation (``mx.depends`` in qwen3_next): the first row stands
        # for the batch.
        return self.caches[0].keys

    @keys.setter
    def keys(self, value) -> None:
        self.caches[0].keys = value

    @property
    def offset(self):
        import mlx.core as mx

        # Every layer of a call usually asks the same: made once per call (``offsets``).
        at = tuple(c.offset for c in self.caches)
        if at not in self._offsets:
            self._offsets[at] = mx.array([o + j for o, n in zip(at, self.sizes)
                                          for j in range(n)])
        return self._offsets[at]

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        updates = [c.update_and_fetch for c in self.caches]
        bases = [ck.half_base(c) for c in self.caches]
        if all(b is not None for b in bases):
            # Rounded to float16 once for every row (what each half-stored cache would do to
            # its own rows: the same values), then appended as they are.
            keys = keys.astype(mx.float16).astype(keys.dtype)
            values = values.astype(mx.float16).astype(values.dtype)
            updates = [functools.partial(b.update_and_fetch, c)
                       for b, c in zip(bases, self.caches)]
        cuts = list(itertools.accumulate(self.sizes[:-1]))
        ks, vs = [], []
        for update, k, v, n in zip(updates, mx.split(keys, cuts), mx.split(values, cuts),
                                   self.sizes):
            if n > 1:  # (n, heads, 1, dim) rows -> one (1, heads, n, dim) sequence
                k, v = k.swapaxes(0, 2), v.swapaxes(0, 2)
            k, v = update(k, v)
            ks.append(k)
            vs.append(v)
        return SplitKV(ks, self.sizes), SplitKV(vs, self.sizes)

    def make_mask(self, n: int, **kw):
        from mlx_lm.models.base import create_attention_mask

        # (``n`` is 1, the model's view: each turn's mask is for the rows it feeds)
        masks = [c.make_mask(size, **kw) if hasattr(c, "make_mask") else
                 create_attention_mask_rows(create_attention_mask, size, **kw)
                 for c, size in zip(self.caches, self.sizes)]
        return None if all(m is None for m in masks) else SplitMask(masks)


def create_attention_mask_rows(make, n: int, **kw):
    """What ``create_attention_mask`` gives a cache without ``make_mask`` (one row)."""
    import mlx.core as mx

    return make(mx.zeros((1, n)), None, **kw)


def install_split_attention() -> None:
    """Wrap the attention every model reaches (``mx.fast.scaled_dot_product_attention``, or
    localchat's CPU one in its place): ``SplitKV`` keys run row by row. Checked before each
    batched step: whatever was put in place since (``cpu.attention.install``) is wrapped."""
    import mlx.core as mx

    inner = mx.fast.scaled_dot_product_attention
    if getattr(inner, "split_rows", False):
        return

    def attention(queries, keys, values, *args, mask=None, **kw):
        if not isinstance(keys, SplitKV):
            return inner(queries, keys, values, *args, mask=mask, **kw)
        rows = []
        qs = mx.split(queries, list(itertools.accumulate(keys.sizes[:-1])))
        for i, (q, k, v, n) in enumerate(zip(qs, keys.parts, values.parts, keys.sizes)):
            m = mask.parts[i] if isinstance(mask, SplitMask) else mask
            if n > 1:  # a prompt chunk: its rows attend as one causal sequence
                rows.append(inner(q.swapaxes(0, 2), k, v, *args, mask=m, **kw).swapaxes(0, 2))
            else:
                rows.append(inner(q, k, v, *args, mask=m, **kw))
        return mx.concatenate(rows, axis=0)

    attention.split_rows = True
    mx.fast.scaled_dot_product_attention = attention


def run_steps(model, steps: list[Step]) -> None:
    """One model call for every ``Step`` (decode steps and prompt chunks); each gets the
    logits of its last row. A single step runs exactly as a lone turn's (its own cache, no
    split; a chunk without ``head`` through the transformer body only): where a per-sequence
    step (prompt lookup, ``speculative.py``) could take over a batch of one."""
    import mlx.core as mx

    if len(steps) == 1:
        s = steps[0]
        body = getattr(model, "model", None)
        if not s.head and body is not None:
            body(s.token[None], cache=s.cache)
            s.logits = None
        else:
            out = model(s.token[None], cache=s.cache)
            s.logits = out[0] if s.rows else out[:, -1, :]
        return
    install_split_attention()
    sizes = [s.token.shape[0] for s in steps]
    tokens = mx.concatenate([s.token for s in steps])[:, None]
    offsets: dict = {}
    split = [split_layer([s.cache[i] for s in steps], sizes, offsets)
             for i in range(len(steps[0].cache))]
    logits = model(tokens, cache=split)[:, -1, :]
    row = 0
    for s, n in zip(steps, sizes):
        row += n
        s.logits = logits[row - n:row] if s.rows else logits[row - 1:row]


def remembered(trial):
    """A trial run once per engine (its model does not change): every scheduler of a
    ``batch --parallel`` run (one per group) and of a server asks the same engine."""
    verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(trial)
    def once(engine) -> str:
        try:
            return verdicts[engine]
        except (KeyError, TypeError):  # (TypeError: an engine no weak reference can name)
            pass
        verdict = trial(engine)
        try:
            verdicts[engine] = verdict
        except TypeError:
            pass
        return verdict

    return once


@remembered
def batch_refusal(engine) -> str:
    """Why this model's turns cannot be batched ("" when they can): a cache kind that does
    not split by row, or one batched step of two short sequences that does not match their
    lone steps (logits within 1e-3: batched matmuls round differently, a wrong row does not)."""
    import mlx.core as mx

    prompts = [[3 + i for i in range(5)], [1 + 5 * i for i in range(9)]]  # ids every vocab has
    try:
        caches, alone, steps = [], [], []
        for p in prompts:
            c = engine.new_cache()
            engine.model(mx.array(p)[None], cache=c)
            caches.append(c)
        nxt = mx.array([1])
        for p in prompts:
            c = engine.new_cache()
            engine.model(mx.array(p)[None], cache=c)
            alone.append(engine.model(nxt[:, None], cache=c)[:, -1, :])
        steps = [Step(nxt, c) for c in caches]
        run_steps(engine.model, steps)
        mx.eval(alone, [s.logits for s in steps])
        for a, s in zip(alone, steps):
            if s.logits.shape != a.shape or not mx.allclose(s.logits, a, atol=1e-3).item():
                return "a batched step does not match its lone steps"
    except Exception as err:  # noqa: BLE001 - any failure of the trial means "run alone"
        return f"a batched step failed ({type(err).__name__}: {str(err)[:80]})"
    return ""


@remembered
def fusion_refusal(engine) -> str:
    """Why this model's prompt chunks cannot run in the same call as other turns' decode steps
    ("" when they can): one fused call (a decode step beside a 7-token chunk) and the batched
    step after it must match the lone model's logits (within 1e-3 plus 1e-4 of their scale).
    A model whose layers see across positions other than through attention (a recurrent
    state, a convolution) or place positions by their own rule fails here; its chunks then run
    as passes of their own between the batched steps."""
    import mlx.core as mx

    a, b = [3 + i for i in range(5)], [1 + 5 * i for i in range(9)]  # ids every vocab has
    nxt = mx.array([1])
    model = engine.model
    try:
        def fed(tokens):
            c = engine.new_cache()
            model(mx.array(tokens)[None], cache=c)
            return c

        lone_a = [model(nxt[:, None], cache=(ca := fed(a)))[:, -1, :]]
        lone_a.append(model(nxt[:, None], cache=ca)[:, -1, :])
        # (the same chunks alone: a cache that stores K/V in float16 makes a chunked prefill
        # differ from one pass by more than the tolerance, fused or not)
        lone_b = [model(mx.array(b[2:])[None], cache=(cb := fed(b[:2])))[:, -1, :]]
        lone_b.append(model(nxt[:, None], cache=cb)[:, -1, :])
        ca, cb = fed(a), fed(b[:2])
        got_a, got_b = [], []
        for second in (False, True):
            steps = [Step(nxt, ca), Step(nxt if second else mx.array(b[2:]), cb)]
            run_steps(model, steps)
            got_a.append(steps[0].logits)
            got_b.append(steps[1].logits)
        mx.eval(lone_a, lone_b, got_a, got_b)
        for want, got in zip(lone_a + lone_b, got_a + got_b):
            # Rounding grows with the logits' scale (~30 on the default model: 2e-3 seen on
            # a right row); a wrong row is off by the scale itself.
            tol = 1e-3 + 1e-4 * mx.abs(want).max().item()
            if got.shape != want.shape or not mx.allclose(got, want, atol=tol).item():
                return "a prompt chunk beside a decode step does not match the lone model"
    except Exception as err:  # noqa: BLE001 - any failure of the trial means "not fused"
        return f"a fused step failed ({type(err).__name__}: {str(err)[:80]})"
    return ""
