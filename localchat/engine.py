"""A loaded model and tokenizer: render a conversation, prefill a KV cache, decode tokens.

What it is: the only module that runs the model. It knows nothing of conversations, disks or
UIs; ``session.py`` drives it. What it is not: a sampler zoo or a server.

Invariant kept for the session: after ``prefill`` and ``decode`` the KV cache holds exactly
the tokens fed to the model, so ``cache_offset(cache)`` is the length of the cached token list.
``decode`` feeds each yielded token before yielding the next one, and never feeds the token
that ends the reply (EOS or the last allowed token): the next turn prefills it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import backend
from .errors import ModelBroken
from .models import ModelRef, fingerprint, resolve
from .paths import cpu_weights_dir

PREFILL_CHUNK = 512


@dataclass(frozen=True)
class ModelInfo:
    """What the KV cache of a model costs; shown by ``localchat inspect`` and the status bar."""

    name: str
    path: str
    fingerprint: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_bytes_per_token: int
    context_length: int
    trimmable: bool  # plain KVCache on every layer: the cache can be cut at any position


class Engine:
    """A model ready to run. Build one with ``Engine.load``; all calls on one thread."""

    def __init__(self, model, tokenizer, ref: ModelRef, config: dict, kv_bits: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.ref = ref
        self.config = config
        self.kv_bits = kv_bits
        self._fingerprint: str | None = None
        self._info: ModelInfo | None = None
        self._compute_dtype = None
        self.notices: list[str] = []  # one-line notes for the user from loading (slow path…)

    @classmethod
    def load(cls, name: str | None = None, progress: Callable[[str], None] | None = None) -> Engine:
        """Resolve ``name`` (see ``models.resolve``), then load weights and tokenizer.

        Raises:
            ModelNotFound / ModelBroken: with a one-line reason.
        """
        backend.prepare()  # before anything imports mlx.core
        ref = resolve(name, progress=progress)
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.utils import load_model

        try:
            model, config = load_model(ref.path)
            tokenizer = load_tokenizer(ref.path, eos_token_ids=config.get("eos_token_id"))
        except Exception as err:  # noqa: BLE001 - mlx-lm raises many kinds; one line for users
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ModelBroken(f"cannot load model {ref.name}: {reason}") from None
        _quiet_transformers()  # again: loading can reset transformers' logging level
        engine = cls(model, tokenizer, ref, config)
        model_fp = fingerprint(ref.path)
        weights_cache = cpu_weights_dir() / f"{model_fp[:32]}.safetensors"
        slow = backend.slow_path_notice()
        engine.notices = ([slow] if slow else []) + backend.tune(model, weights_cache, model_fp)
        return engine

    # -- facts about the model -------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """Model weights/config/tokenizer digest plus the cache's dtype and kv bits."""
        if self._fingerprint is None:
            base = fingerprint(self.ref.path)
            info = self.info()
            self._fingerprint = f"{base[:32]}-{info.kv_dtype}-kv{self.kv_bits or 0}"
        return self._fingerprint

    def info(self) -> ModelInfo:
        if self._info is None:
            import mlx.core as mx

            cache = self._plain_cache()
            self.model(mx.array([[0]]), cache=cache)  # one token reveals K/V shape and dtype
            trimmable = all(is_plain_kv(c) for c in cache)
            keys = next(c.state[0] for c in cache
                        if isinstance(c.state[0], mx.array) and c.state[0].ndim == 4)
            _, kv_heads, _, head_dim = keys.shape
            self._compute_dtype = keys.dtype
            # Rounding to float16 as K/V enter the cache is done by our KVCache subclass, so
            # only plain caches get it; snapshot caches keep the compute dtype.
            store = mx.float16 if keys.dtype == mx.float32 and trimmable else keys.dtype
            dtype = str(store).replace("mlx.core.", "")
            layers = len(cache)
            heads = int(self.config.get("num_attention_heads", kv_heads))
            ctx = self.config.get("max_position_embeddings") or getattr(
                self.tokenizer, "model_max_length", 4096
            )
            self._info = ModelInfo(
                name=self.ref.name,
                path=str(self.ref.path),
                fingerprint=fingerprint(self.ref.path),
                layers=layers,
                heads=heads,
                kv_heads=int(kv_heads),
                head_dim=int(head_dim),
                kv_dtype=dtype,
                kv_bytes_per_token=2 * layers * int(kv_heads) * int(head_dim) * store.size,
                context_length=int(ctx),
                trimmable=trimmable,
            )
        return self._info

    # -- text ------------------------------------------------------------------------------

    def render(self, messages: list[dict]) -> list[int]:
        """Token ids of the whole conversation, chat template applied, ready for a reply."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        # verbose=False: no "longer than the maximum" warning; we check the context ourselves.
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def detokenizer(self):
        """A fresh streaming detokenizer (holds back partial UTF-8, e.g. half a Hangul)."""
        detok = self.tokenizer.detokenizer
        detok.reset()
        return detok

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids or [])

    # -- compute ---------------------------------------------------------------------------

    def new_cache(self) -> list:
        """An empty cache. float32 K/V (CPU) is rounded to float16 as it enters the cache,
        like llama.cpp's default f16 cache: half the disk, and the disk copy is lossless, so
        a resumed turn computes exactly what a full prefill computes."""
        info = self.info()
        if info.trimmable and self._compute_dtype != info_dtype(info):
            return [_half_stored_cache_class()() for _ in range(info.layers)]
        return self._plain_cache()

    def _plain_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def compute_dtype(self):
        """The dtype the model's K/V come out in (float32 on the CPU path)."""
        self.info()
        return self._compute_dtype

    def prefill(self, tokens: list[int], cache: list, chunk: int = PREFILL_CHUNK):
        """Feed ``tokens`` (at least one) into ``cache``.

        Yields ``(done, total)`` after each chunk and returns the last position's logits
        (``logits = yield from engine.prefill(...)``). Chunks before the last token run through
        the transformer body only: the vocabulary head (~20% of a small model's FLOPs) is
        needed for the last position alone.
        """
        import mlx.core as mx

        assert tokens, "prefill needs at least one token"
        body = getattr(self.model, "model", None)
        done, total = 0, len(tokens)
        while total - done > 1:
            n = min(chunk, total - done - 1)
            x = mx.array(tokens[done : done + n])[None]
            if body is not None:
                body(x, cache=cache)
            else:
                self.model(x, cache=cache)
            mx.eval([c.state for c in cache])
            done += n
            yield done, total
        logits = self.model(mx.array(tokens[-1:])[None], cache=cache)[:, -1, :]
        mx.eval(logits)
        return logits

    def decode(
        self, cache: list, logits, max_tokens: int, temp: float = 0.0, seed: int | None = None
    ) -> Iterator[int]:
        """Yield up to ``max_tokens`` token ids, sampling from ``logits`` onwards.

        Greedy when ``temp`` is 0. The step for token n+1 is queued before token n is
        yielded (MLX async eval), so the model works while the caller prints.
        """
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if max_tokens <= 0:
            return
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp)
        eos = self.eos_ids
        y = sampler(logits)
        mx.async_eval(y)
        for n in range(max_tokens):
            tok = int(y.item())
            if tok in eos or n == max_tokens - 1:
                yield tok
                return
            y = sampler(self.model(y[:, None], cache=cache)[:, -1, :])
            mx.async_eval(y)
            yield tok


def info_dtype(info: ModelInfo):
    import mlx.core as mx

    return getattr(mx, info.kv_dtype)


@functools.cache
def _half_stored_cache_class():
    """Made on first use: importing mlx_lm at module import would load MLX before
    ``backend.prepare()`` could pick the BLAS."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    class HalfStoredKVCache(KVCache):
        """A KVCache whose entries are rounded to float16 (kept in the compute dtype)."""

        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(keys.astype(mx.float16).astype(keys.dtype),
                                            values.astype(mx.float16).astype(values.dtype))

    return HalfStoredKVCache


def is_plain_kv(cache) -> bool:
    """True for mlx-lm's KVCache and our subclass: trimmable at any position."""
    from mlx_lm.models.cache import KVCache

    return type(cache) is KVCache or type(cache) is _half_stored_cache_class()


def _quiet_transformers() -> None:
    """Users cannot act on transformers' warnings (e.g. "sequence length is longer than the
    specified maximum" — we check the context ourselves), so keep them off the screen."""
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
    except ImportError:
        pass


def cache_offset(cache: list) -> int:
    """Number of positions held by a cache (layer 0's view)."""
    return int(cache[0].offset) if cache else 0


def now() -> float:
    return time.perf_counter()
