"""``ModelInfo``: what the KV cache of a loaded model costs (``Engine.info``); a record, no MLX."""

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
