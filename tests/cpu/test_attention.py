"""CPU attention without MLX's ``exp``: same results as MLX's own, same greedy replies.

``MIN_SCORES`` is set to 0 here so that every call, however small, takes our path (the tiny
model's score matrices are below the production threshold).
"""

import os

import mlx.core as mx
import numpy as np
import pytest

from localchat.cpu import attention

REFERENCE = attention.mlx_attention()  # MLX's own, taken before any test replaces it


LAYOUTS = {
    "one block": {},
    # one query row per block, and K @ qᵀ (host transpose) for every block
    "row blocks, transposed": {"BLOCK_SCORES": 1, "MIN_ROWS": 1, "FEW_ROWS": 1 << 30},
    # three query rows per block with the 2 x 8 x 33 inputs, q @ Kᵀ always
    "3-row blocks": {"BLOCK_SCORES": 3 * 2 * 8 * 33, "MIN_ROWS": 1, "FEW_ROWS": 0},
    # blocks of BLOCK_SCORES would be one row: MIN_ROWS makes them two
    "2-row blocks at least": {"BLOCK_SCORES": 1, "MIN_ROWS": 2, "FEW_ROWS": 0},
}


@pytest.fixture(params=list(LAYOUTS))
def ours(request, monkeypatch):
    """Our attention for every call (one per block layout), installed; MLX's own must not be
    reached from it."""
    was = attention.installed()
    attention.install()
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    for name, value in LAYOUTS[request.param].items():
        monkeypatch.setattr(attention, name, value)

    def mlx_called(*args, **kwargs):
        raise AssertionError("fell back to MLX's attention")

    monkeypatch.setattr(attention, "_original", mlx_called)
    yield attention.scaled_dot_product_attention
    monkeypatch.setattr(attention, "_original", REFERENCE)
    if not was:
        attention.uninstall()


def _inputs(B=2, Hq=8, Hkv=2, L=7, S=33, D=16, Dv=None, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, Hq, L, D))
    k = mx.random.normal((B, Hkv, S, D))
    v = mx.random.normal((B, Hkv, S, Dv or D))
    return q, k, v


def _max_diff(a, b) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


CASES = {
    "no mask": ({}, {}),
    "causal": ({}, {"mask": "causal"}),
    "one query, causal": ({"L": 1}, {"mask": "causal"}),
    "one query, no mask": ({"L": 1, "S": 300}, {}),
    "as many queries as keys": ({"L": 33}, {"mask": "causal"}),
    "multi-head (no GQA)": ({"Hkv": 8}, {"mask": "causal"}),
    "multi-query": ({"Hkv": 1}, {"mask": "causal"}),
    "MLA: values narrower than keys": ({"D": 24, "Dv": 16}, {"mask": "causal"}),
    "MLA: values wider than keys": ({"D": 16, "Dv": 40}, {}),
    "sinks (gpt-oss)": ({}, {"mask": "causal", "sinks": "sinks"}),
    "sinks, one query": ({"L": 1}, {"sinks": "sinks"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_mlx_attention(ours, case):
    shape, kw = CASES[case]
    q, k, v = _inputs(**shape)
    if kw.get("sinks") == "sinks":
        kw = {**kw, "sinks": mx.random.normal((q.shape[1],)) * 3}
    got = ours(q, k, v, scale=0.3, **kw)
    want = REFERENCE(q, k, v, scale=0.3, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _max_diff(got, want) < 2e-6


@pytest.mark.parametrize("mask_shape", [(7, 33), (2, 1, 7, 33), (2, 8, 7, 33), (8, 7, 33)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_array_masks_match(ours, mask_shape, kind):
    q, k, v = _inputs()
    mx.random.seed(1)
    if kind == "bool":
        mask = mx.random.uniform(shape=mask_shape) > 0.3
    else:
        mask = mx.random.normal(mask_shape) * 2
    for sinks in (None, mx.random.normal((8,))):
        got = ours(q, k, v, scale=0.3, mask=mask, sinks=sinks)
        assert _max_diff(got, REFERENCE(q, k, v, scale=0.3, mask=mask, sinks=sinks)) < 2e-6


def test_fully_masked_rows_and_window_masks_match(ours):
    """A row with every key masked (left padding in a batch) and a sliding-window mask."""
    q, k, v = _inputs(B=1)
    nothing = mx.zeros((7, 33), dtype=mx.bool_)
    window = (mx.arange(26, 33)[:, None] >= mx.arange(33)[None]) & (
        mx.arange(26, 33)[:, None] < mx.arange(33)[None] + 4)
    for mask in (nothing, window):
        got = ours(q, k, v, scale=0.3, mask=mask)
        assert _max_diff(got, REFERENCE(q, k, v, scale=0.3, mask=mask)) < 2e-6


def test_rows_with_every_key_at_minus_infinity_are_nan_without_warnings(ours):
    import warnings

    q, k, v = _inputs(B=1)
    mask = mx.where(mx.arange(7)[:, None] < 2, -mx.inf, mx.zeros((7, 33)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(q, k, v, scale=0.3, mask=mask)
    want = REFERENCE(q, k, v, scale=0.3, mask=mask)
    assert mx.isnan(got[:, :, :2]).all() and mx.isnan(want[:, :, :2]).all()
    assert _max_diff(got[:, :, 2:], want[:, :, 2:]) < 2e-6


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs_keep_their_dtype(ours, dtype):
    q, k, v = (x.astype(dtype) for x in _inputs())
    got = ours(q, k, v, scale=0.3, mask="causal")
    want = REFERENCE(q, k, v, scale=0.3, mask="causal")
    assert got.dtype == dtype
    assert _max_diff(got, want) <= 2 * float(np.finfo(np.float16).eps if dtype == mx.float16
                                             else 2.0**-7)


def test_strided_cache_views_match(ours):
    """K/V as mlx-lm's KVCache hands them out: a slice of a larger preallocated buffer."""
    q, _, _ = _inputs()
    kbuf, vbuf = mx.random.normal((2, 2, 256, 16)), mx.random.normal((2, 2, 256, 16))
    k, v = kbuf[..., :33, :], vbuf[..., :33, :]
    got = ours(q, k, v, scale=0.3, mask="causal")
    assert _max_diff(got, REFERENCE(q, k, v, scale=0.3, mask="causal")) < 2e-6


def test_small_calls_and_compiled_calls_use_mlx(monkeypatch):
    """Below MIN_SCORES, and under mx.compile (nothing may be evaluated there), MLX's own
    attention runs; the result is MLX's exactly."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return REFERENCE(*args, **kwargs)

    monkeypatch.setattr(attention, "_original", spy)
    q, k, v = _inputs()
    small = attention.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert calls and mx.array_equal(small, REFERENCE(q, k, v, scale=0.3, mask="causal"))
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    calls.clear()
    compiled = mx.compile(lambda q, k, v: attention.scaled_dot_product_attention(
        q, k, v, scale=0.3, mask="causal"))
    assert _max_diff(compiled(q, k, v), REFERENCE(q, k, v, scale=0.3, mask="causal")) == 0
    assert calls


def test_unusual_or_invalid_calls_go_to_mlx(monkeypatch):
    """An explicit stream, or inputs MLX would reject, are MLX's to handle (and to reject
    with its own message)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return REFERENCE(*args, **kwargs)

    monkeypatch.setattr(attention, "_original", spy)
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    q, k, v = _inputs()
    attention.scaled_dot_product_attention(q, k, v, scale=0.3, stream=mx.cpu)
    assert len(calls) == 1
    for bad in ({"sinks": mx.zeros((3,))}, {"mask": mx.zeros((2, 8, 7, 34), dtype=mx.bool_)},
                {"mask": "sliding"}):
        with pytest.raises(ValueError):
            attention.scaled_dot_product_attention(q, k, v, scale=0.3, **bad)
    assert len(calls) == 4


@pytest.mark.cpu_only
def test_install_is_cpu_only_and_can_be_turned_off(monkeypatch):
    was = attention.installed()
    try:
        attention.uninstall()
        monkeypatch.setenv(attention.ENV, "mlx")
        assert attention.install() is False
        assert mx.fast.scaled_dot_product_attention is REFERENCE
        monkeypatch.delenv(attention.ENV)
        assert attention.install() is True  # this test process runs on the CPU
        assert mx.fast.scaled_dot_product_attention is attention.scaled_dot_product_attention
        assert attention.mlx_attention() is REFERENCE
        attention.uninstall()
        assert mx.fast.scaled_dot_product_attention is REFERENCE
    finally:
        attention.uninstall()
        if was:
            attention.install()


@pytest.mark.cpu_only
@pytest.mark.skipif(os.environ.get(attention.ENV, "").lower() == "mlx", reason="turned off")
def test_engine_load_installs_it(engine):
    assert attention.installed()
    assert mx.fast.scaled_dot_product_attention is attention.scaled_dot_product_attention


# -- whole model -----------------------------------------------------------------------------

PROMPTS = ["Hello, how are you today?", "What is the capital of France?",
           "안녕하세요. 서울은 어때요?", "def main():\n    print('hello world')"]


def _greedy(engine, tokens: list[int], n: int = 16) -> list[int]:
    cache = engine.new_cache()
    logits = None
    gen = engine.prefill(tokens, cache)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            logits = done.value
            break
    return list(engine.decode(cache, logits, n))


def _with(fn, engine, prompt):
    """Greedy reply and all-position logits of ``prompt`` with ``fn`` as the attention."""
    saved = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = fn
    try:
        tokens = engine.render([{"role": "user", "content": prompt}])
        logits = engine.model(mx.array(tokens)[None])
        return _greedy(engine, tokens), logits
    finally:
        mx.fast.scaled_dot_product_attention = saved


def test_tiny_model_greedy_replies_agree_with_mlx_attention(ours, engine):
    worst = 0.0
    for prompt in PROMPTS:
        ours_reply, ours_logits = _with(ours, engine, prompt)
        mlx_reply, mlx_logits = _with(REFERENCE, engine, prompt)
        assert len(ours_reply) >= 8 and ours_reply == mlx_reply
        worst = max(worst, _max_diff(ours_logits, mlx_logits))
    assert worst < 1e-4, worst


def test_negative_control_a_wrong_attention_changes_the_reply(ours, engine):
    """The comparison above can fail: attention that ignores the causal mask, or that
    softmaxes slightly too sharply, gives other replies on the same prompts."""

    def no_mask(q, k, v, *, scale, mask=None, sinks=None):
        return ours(q, k, v, scale=scale, mask=None, sinks=sinks)

    def sharper(q, k, v, *, scale, mask=None, sinks=None):
        return ours(q, k, v, scale=scale * 1.3, mask=mask, sinks=sinks)

    for wrong in (no_mask, sharper):
        replies = [(_with(wrong, engine, p)[0], _with(ours, engine, p)[0]) for p in PROMPTS]
        assert any(a != b for a, b in replies), wrong.__name__


def _prefill(engine, tokens, cache):
    gen = engine.prefill(tokens, cache, chunk=24)  # several chunks: causal blocks at offsets
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def test_resumed_cache_equals_full_prefill_on_this_path(ours, engine, tmp_path):
    """What a resumed turn does, on this path: the history's K/V go to disk (float16, as
    the store keeps them) and come back into a fresh cache, only the new message is
    prefilled; the greedy reply equals that of a full prefill of the whole conversation."""
    history = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": "Fine."},
               {"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": "네."}]
    after = engine.render(history + [{"role": "user", "content": "Tell me more."}])
    k = next(i for i, (a, b) in enumerate(zip(engine.render(history), after)) if a != b)
    before = after[:k]  # what the previous turn left in the cache, as the session reuses it
    assert len(before) > 24

    cache = engine.new_cache()
    _prefill(engine, before, cache)
    arrays = {}
    for i, c in enumerate(cache):
        arrays[f"{i}.k"] = c.keys[..., :c.offset, :].astype(mx.float16)
        arrays[f"{i}.v"] = c.values[..., :c.offset, :].astype(mx.float16)
    mx.save_safetensors(str(tmp_path / "history.safetensors"), arrays)

    loaded = mx.load(str(tmp_path / "history.safetensors"))
    resumed = engine.new_cache()
    for i, c in enumerate(resumed):
        c.update_and_fetch(loaded[f"{i}.k"].astype(engine.compute_dtype()),
                           loaded[f"{i}.v"].astype(engine.compute_dtype()))
    reply = list(engine.decode(resumed, _prefill(engine, after[len(before):], resumed), 12))

    full = engine.new_cache()
    reference = list(engine.decode(full, _prefill(engine, after, full), 12))
    assert len(reply) == 12 and reply == reference

    # Negative control: the same route with wrong values in the restored cache differs.
    wrong = engine.new_cache()
    for i, c in enumerate(wrong):
        c.update_and_fetch(loaded[f"{i}.k"].astype(engine.compute_dtype()),
                           -loaded[f"{i}.v"].astype(engine.compute_dtype()))
    assert list(engine.decode(wrong, _prefill(engine, after[len(before):], wrong), 12)) != reply


@pytest.fixture
def windowed_engine(tmp_path_factory):
    from tiny import build_tiny_model

    from localchat.model.engine import Engine

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-sw") / "tiny-sw", layers=2,
                            sliding_window=8)
    return Engine.load(str(path))


def test_sliding_window_model_agrees_with_mlx_attention(ours, windowed_engine):
    """Rotating caches pass array masks (window) rather than "causal"."""
    for prompt in PROMPTS[:2]:
        ours_reply, ours_logits = _with(ours, windowed_engine, prompt)
        mlx_reply, mlx_logits = _with(REFERENCE, windowed_engine, prompt)
        assert ours_reply == mlx_reply
        assert _max_diff(ours_logits, mlx_logits) < 1e-4
