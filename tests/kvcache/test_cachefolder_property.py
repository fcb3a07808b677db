"""Property test: random appends, trims, reloads and corruptions of a CacheFolder behave like an
in-memory reference (a list of tokens with their K/V rows)."""


import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from localchat.kvcache.folder import CacheFolder, CacheInvalid, Layout, common_prefix
from localchat.kvcache.format import file_sum
from localchat.kvcache.kinds import LeafSpec


def layout(dtype: str = "float16", layers: int = 2) -> Layout:
    return Layout("test-fingerprint", dtype, tuple(
        LeafSpec(str(i), "KVCache", "growing", (1, 4), (1, 4)) for i in range(layers)))


GEOM = layout()
LAYERS = 2


def load(store: CacheFolder, lay: Layout = GEOM, **kw):
    """(tokens, per-layer (keys, values)) as the session reads them, or None."""
    man = store.checked_manifest(lay)
    if man is None:
        return None
    return man.tokens, store.load_growing(man, len(man.tokens), **kw)

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 9)),
    st.tuples(st.just("trim"), st.integers(0, 40)),
    st.tuples(st.just("reload"), st.just(0)),
    st.tuples(st.just("corrupt"), st.integers(0, 10_000)),
), min_size=1, max_size=25)


def cache_from(rows: list[np.ndarray]) -> list:
    """A cache whose positions hold ``rows`` (each [2 (k/v), layers, heads, dim])."""
    cache = [KVCache() for _ in range(LAYERS)]
    if rows:
        arr = np.stack(rows)  # [n, 2, L, H, D]
        for layer, c in enumerate(cache):
            k = mx.array(arr[:, 0, layer].transpose(1, 0, 2)[None]).astype(mx.float16)
            v = mx.array(arr[:, 1, layer].transpose(1, 0, 2)[None]).astype(mx.float16)
            c.state = (k, v, len(rows))
    return cache


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, seed=st.integers(0, 2**31 - 1))
def test_store_behaves_like_a_list(tmp_path_factory, ops, seed):
    rng = np.random.default_rng(seed)
    folder = tmp_path_factory.mktemp("kv")
    store = CacheFolder(folder)
    tokens: list[int] = []  # the reference
    rows: list[np.ndarray] = []
    for op, arg in ops:
        if op == "append":
            new = rng.integers(0, 50, arg).tolist()
            tokens += new
            rows += [rng.standard_normal((2, LAYERS, 1, 4)).astype(np.float16)
                     for _ in new]
            store.commit(GEOM, tokens, cache_from(rows))
        elif op == "trim":
            k = min(arg, len(tokens))
            # An edit: keep k tokens, then token 99 continues the list. With causal attention
            # the same tokens at the same positions have the same K/V, so rows up to the common
            # prefix stay; only later positions get new K/V.
            new_tokens = tokens[:k] + [99]
            same = common_prefix(tokens, new_tokens)
            rows = rows[:same] + [rng.standard_normal((2, LAYERS, 1, 4)).astype(np.float16)
                                  for _ in new_tokens[same:]]
            tokens = new_tokens
            old = store.manifest()
            before = {s.file: (folder / s.file).read_bytes() for s in old.segments} if old \
                else {}
            store.commit(GEOM, tokens, cache_from(rows))
            # Segments wholly inside the kept prefix are untouched, byte for byte.
            if old:
                kept = common_prefix(old.tokens, tokens)
                for s in old.segments:
                    if s.end <= kept:
                        assert (folder / s.file).read_bytes() == before[s.file]
        elif op == "reload":
            loaded = load(CacheFolder(folder))
            if not tokens:
                assert loaded is None or loaded[0] == []
                continue
            got_tokens, layers = loaded
            assert got_tokens == tokens
            ref = cache_from(rows)
            for (k, v), c in zip(layers, ref):
                assert mx.array_equal(k, c.state[0]) and mx.array_equal(v, c.state[1])
        elif op == "corrupt" and tokens:
            segs = store.manifest().segments
            seg = segs[arg % len(segs)]
            path = folder / seg.file
            data = bytearray(path.read_bytes())
            data[arg % len(data)] ^= 0x01
            path.write_bytes(bytes(data))
            assert file_sum(bytes(data), seg.sum_kind) != seg.sum
            try:
                load(CacheFolder(folder))
                raise AssertionError("a flipped bit must not load")
            except CacheInvalid:
                pass
            # The session's answer to damage: forget the cache, rebuild from nothing.
            store.clear()
            tokens, rows = [], []
        disk = sum(s.nbytes for s in (store.manifest().segments if store.manifest() else []))
        per_token = 2 * LAYERS * 1 * 4 * 2
        assert disk <= 1.05 * len(tokens) * per_token + 400 * len(
            store.manifest().segments if store.manifest() else [])


def test_bfloat16_and_float32_segments_round_trip(tmp_path):
    """Metal/CUDA models usually cache bfloat16, which numpy cannot hold: bits go through."""
    for dtype in ("bfloat16", "float32"):
        geom = layout(dtype)
        cache = [KVCache() for _ in range(2)]
        for c in cache:
            k = mx.random.normal((1, 1, 5, 4)).astype(getattr(mx, dtype))
            c.state = (k, k * 2, 5)
        store = CacheFolder(tmp_path / dtype)
        store.commit(geom, [1, 2, 3, 4, 5], cache)
        tokens, layers = load(store, geom, headroom=3)
        assert tokens == [1, 2, 3, 4, 5]
        for (k, v), c in zip(layers, cache):
            assert k.dtype == getattr(mx, dtype) and k.shape == (1, 1, 8, 4)
            assert mx.array_equal(k[..., :5, :], c.state[0])
            assert mx.array_equal(v[..., :5, :], c.state[1])
            assert not mx.any(k[..., 5:, :]).item()
        _, as_f32 = load(store, geom, dtype=mx.float32)
        assert as_f32[0][0].dtype == mx.float32
        assert mx.array_equal(as_f32[0][0], cache[0].state[0].astype(mx.float32))
