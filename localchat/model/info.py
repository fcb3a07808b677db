"""``ModelInfo``: what the KV cache of a loaded model costs (``Engine.info``), and ``measure``,
which reads it from one token through the model (MLX imported there only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the KV cache of a model costs; shown by ``localchat inspect`` and the status bar.

    Read from the real cache objects (``kvcache/kinds.py``). ``kv_heads`` and ``head_dim`` are
    those of the first growing layer (for MLA: one latent "head" of the latent width).
    """

    name: str
    path: str
    model_digest: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_bytes_per_token: int  # growing layers only: what each token adds on disk
    state_bytes: int  # bounded layers: the size of one checkpoint, whatever the history
    layer_mix: str  # e.g. "26 layers: 22 sliding (window 512), 4 global"
    context_length: int
    cut_anywhere: bool  # growing layers only: the cache can be cut at any position
    unknown: tuple[str, ...]  # cache classes localchat does not know: no disk cache
    thinking_switch: bool = False  # the chat template turns a reasoning model's thinking off
    tokenizer: str = ""  # the tokenizer's path: "tokenizers + jinja2 (…)" or "transformers (…)"
    # How far back the attending layers look (``kinds.attention_windows``): () all the way
    attention: tuple[tuple[int, float], ...] = ()


def measure(engine, cache: list) -> tuple[ModelInfo, object, tuple]:
    """What one token through ``engine``'s model into a new ``cache`` (``make_prompt_cache``)
    shows of it (a ``ModelInfo``), its compute dtype, and its cache layers' specs."""
    import mlx.core as mx

    from ..kvcache import kinds as ck
    from .resolve import model_digest

    engine.model(mx.array([[0]]), cache=cache)  # one token reveals shapes and dtypes
    found = ck.leaves(cache)
    unknown = tuple(ck.unknown_classes(cache))
    known = [(path, obj) for path, obj in found if ck.kind_of(obj) is not None]
    specs = [ck.spec_of(path, obj) for path, obj in known]
    first = next((obj for _, obj in known if getattr(obj, "keys", None) is not None), None)
    compute_dtype = first.keys.dtype if first is not None else mx.float32
    # float32 K/V (the CPU path) are rounded to float16 as they enter the cache.
    kept = mx.float16 if compute_dtype == mx.float32 else compute_dtype
    per_token = sum(s.k_shape[0] * s.k_shape[1] + s.v_shape[0] * s.v_shape[1]
                    for s in specs if s.kind == ck.GROWING) * kept.size
    state = 0
    for (_, obj), spec in zip(known, specs):
        if spec.cls in ("RotatingKVCache", "ChunkedKVCache"):
            k, v = obj.keys, obj.values
            state += (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * spec.window \
                * kept.size
        elif spec.kind == ck.BOUNDED:
            state += obj.nbytes
    grow = next((s for s in specs if s.kind == ck.GROWING), None)
    head = grow.k_shape if grow else (0, 0)
    heads = int(engine.config.get("num_attention_heads", head[0]))
    ctx = engine.config.get("max_position_embeddings") or getattr(
        engine.tokenizer, "model_max_length", 4096
    )
    info = ModelInfo(
        name=engine.ref.name,
        path=str(engine.ref.path),
        model_digest=model_digest(engine.ref.path),
        layers=len(cache),
        heads=heads,
        kv_heads=int(head[0]),
        head_dim=int(head[1]),
        kv_dtype=str(kept).replace("mlx.core.", ""),
        kv_bytes_per_token=int(per_token),
        state_bytes=int(state),
        layer_mix=ck.describe_mix(specs, len(cache)),
        context_length=int(ctx),
        cut_anywhere=all(s.kind == ck.GROWING for s in specs),
        unknown=unknown,
        thinking_switch=engine.thinking_switch,
        tokenizer=engine.tokenizer_plan, attention=ck.attention_windows(specs))
    return info, compute_dtype, tuple(specs)
