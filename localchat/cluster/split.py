"""Which models split over ranks how, and the split itself (mlx-lm's ``model.shard`` by
heads, ``model.model.pipeline`` by layers)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..errors import BadInput
from .group import SHARDS, Ring


def shard_support(config: dict) -> dict[str, str]:
    """For a model's ``config.json``: why each way of splitting is impossible ("" if it is
    possible), from the mlx-lm model class (``shard``: heads; ``PipelineMixin``: layers)."""
    from mlx_lm.models.pipeline import PipelineMixin
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except Exception as err:  # noqa: BLE001 - an unknown model_type
        why = str(err).splitlines()[0] if str(err) else "unknown model type"
        return {s: why for s in SHARDS}
    module = sys.modules[model_class.__module__]
    piped = any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
                for c in vars(module).values())
    kind = config.get("model_type", "?")
    return {
        "tensor": "" if hasattr(model_class, "shard") else
        f"mlx-lm cannot split {kind} models by heads",
        "pipeline": "" if piped else f"mlx-lm cannot split {kind} models by layers",
    }


def check_shard(config: dict, shard: str, size: int, name: str) -> str:
    """The sharding to use (``auto``: by heads when possible, else by layers); BadInput with
    one line when the model cannot be split that way over ``size`` ranks."""
    support = shard_support(config)
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    layers = int(text.get("num_hidden_layers") or 0)
    if not support["tensor"] and heads and (heads % size or kv_heads % size):
        support["tensor"] = (f"{name} has {heads} attention heads and {kv_heads} KV heads, "
                             f"not divisible by {size} ranks")
    if not support["pipeline"] and layers and layers < size:
        support["pipeline"] = f"{name} has {layers} layers, fewer than {size} ranks"
    order = SHARDS if shard == "auto" else (shard,)
    for s in order:
        if not support[s]:
            return s
    raise BadInput("; ".join(f"--shard {s}: {support[s]}" for s in order))


def split_model(model, config: dict, ring: Ring, name: str,
                tune: Callable[[object, str], list[str]]) -> list[str]:
    """Keep this rank's shard of a lazily loaded model, then load its weights.

    ``tune(model, suffix)`` is ``backend.tune`` with the derived-weights file named by
    ``suffix``: by heads it runs before the split (every rank derives the same file), by
    layers after it (each rank only its own layers).
    """
    import mlx.core as mx

    check_shard(config, ring.shard, ring.size, name)
    if ring.shard == "tensor":
        notices = tune(model, "")
        model.shard(ring.group)
    else:
        model.model.pipeline(ring.group)
        notices = tune(model, f"-pipeline{ring.size}r{ring.rank}")
    mx.eval(model.parameters())
    # Every rank loaded; the first collective also sets the ring up (~0.8 s), not in a turn.
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=ring.group, stream=mx.cpu))
    except RuntimeError as err:  # a follower that could not load its shard went away
        raise ring.lost_error(err) from None
    return notices

