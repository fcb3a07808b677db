"""The deep cache (``kvcache/synthetic.py``) the prefill model's calibration times tokens
after: for every tiny family, where a real prefill of that length leaves each leaf."""

import pytest

from localchat.cacheview import prefillmodel


def test_a_deep_cache_is_one_a_real_model_prefills_after(tmp_path, family_engine):
    """Every family and cache class (growing, MLA, the sparse indexer's CacheList, sliding
    windows, attention chunks, recurrent states): the deep cache is at ``depth`` in every
    leaf, its arrays in the shapes and dtypes a prefill of that length leaves (the control:
    a real prefill of 700 tokens, captured), and tokens fed after it give finite logits and
    leave every leaf where that prefill's next tokens would; the calibration measures the
    deep run wherever a layer grows (a context of 4,096 made for it)."""
    import mlx.core as mx

    from localchat.kvcache import kinds as ck

    name, engine = family_engine
    depth = 700
    cache = prefillmodel.deep_cache(engine, depth)
    real = engine.new_cache()
    ids = [3 + i % 400 for i in range(depth)]
    prefillmodel._drain(engine.prefill(ids, real))
    assert ck.position(cache) == ck.position(real) == (depth if name != "mamba2" else 0)
    for (_, made), (_, seen) in zip(ck.leaves(cache), ck.leaves(real)):
        assert made.offset == seen.offset if hasattr(seen, "offset") else True
        if ck.kind_of(seen) == ck.GROWING:
            assert made.keys.shape[1::2] == seen.keys.shape[1::2]
            assert made.values.shape[1::2] == seen.values.shape[1::2]
            assert made.keys.dtype == seen.keys.dtype
    made_snap, seen_snap = ck.capture(cache, depth), ck.capture(real, depth)
    assert same_but_ring(made_snap.meta, seen_snap.meta)
    for a, b in zip(made_snap.arrays, seen_snap.arrays):
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == \
            {k: (v.shape, v.dtype) for k, v in b.items()}
    more = list(range(3, 40))
    logits = prefillmodel._drain(engine.prefill(more, cache))
    assert bool(mx.all(mx.isfinite(logits)))
    prefillmodel._drain(engine.prefill(more, real))
    assert same_but_ring(ck.capture(cache, 0).meta, ck.capture(real, 0).meta)
    assert ck.position(cache) == ck.position(real) == (depth + len(more) if name != "mamba2" else 0)
    samples = prefillmodel.measure_prefills(engine, lengths=(16, 64), repeats=1)
    deep = [(prefillmodel.DEPTH_TOKENS, prefillmodel.DEPTH)] if name != "mamba2" else []
    assert [(s.tokens, s.start) for s in samples] == [(16, 0), (64, 0)] + deep


def same_but_ring(a, b) -> bool:
    """Leaf metadata equal but for where a full sliding window's ring writes next (``idx``:
    a prefill's last token, fed alone, leaves it at 1; a window made full leaves it at the
    end, in temporal order; the same window, the same cost)."""
    def drop(meta):
        return [{k: v for k, v in m.items() if k != "idx"} for m in meta]

    return drop(a) == drop(b)


@pytest.fixture(params=sorted(__import__("families").FAMILIES))
def family_engine(request, tmp_path):
    """(family, engine) of a tiny model of each family, its context made 4,096."""
    import json as _json

    from families import build_family

    from localchat.model.engine import Engine

    folder = build_family(request.param, tmp_path / request.param)
    config = _json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(_json.dumps({**config, "max_position_embeddings": 4096}))
    return request.param, Engine.load(str(folder))


def test_each_family_says_how_far_its_layers_look_back(family_engine):
    """``ModelInfo.attention`` (what the prefill model spreads the attention term over): the
    sliding windows and attention chunks with their share of the attention's width; () where
    every attending layer keeps every position (MLA, the sparse indexer's keys, recurrent
    hybrids) or none attends (Mamba 2). The cost model's pieces are the engine's."""
    from families import WINDOW

    from localchat.cacheview import prefillfit
    from localchat.model import engine as engine_module

    name, engine = family_engine
    windowed = {"baichuan_m1": ((0, 1 / 2), (WINDOW, 1 / 2)),
                "gemma3_text": ((0, 1 / 3), (WINDOW, 2 / 3)),
                "gpt_oss": ((0, 1 / 2), (WINDOW, 1 / 2)),
                "llama4": ((0, 1 / 4), (WINDOW, 3 / 4))}
    got = engine.info().attention
    want = windowed.get(name, ())
    assert [w for w, _ in got] == [w for w, _ in want]
    assert [share for _, share in got] == pytest.approx([share for _, share in want])
    assert prefillfit.CHUNK == engine_module.PREFILL_CHUNK
