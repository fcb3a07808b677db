"""A loaded model and tokenizer: render a conversation, prefill a KV cache, decode tokens.

What it is: the only module that runs the model. It knows nothing of conversations, disks or
UIs; ``session/session.py`` drives it. What it is not: a sampler zoo or a server.

Invariant kept for the session: after ``prefill`` and ``decode`` the KV cache holds exactly
the tokens fed to the model, so ``kvcache.kinds.position(cache)`` is the length of the cached
token list.
``decode`` feeds each yielded token before yielding the next one; it never feeds an EOS (the
next turn prefills it, as the template renders it), and feeds the last allowed token only
when the caller reads on after it (a turn does not: ``session/generation.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from ..cpu import activations, attention, backend
from ..errors import BadInput, ModelBroken
from ..events import Step
from ..kvcache import kinds as ck
from ..kvcache.folder import Layout, common_prefix
from .info import ModelInfo, measure
from .preload import before_the_first_turn, cpu_weights_path, quiet_transformers
from .resolve import ModelRef, model_digest, resolve

PREFILL_CHUNK = 512
ONE_PASS = 32  # prefills up to this long run the whole model once (see ``Engine.prefill``)
SHORT_PROMPT = 128  # a scheduler's small chunks are for longer prompts: a short one is one
#                     chunk (splitting it costs a weight read per piece, and it delays the
#                     others once, not for long)


class Engine:
    """A model ready to run. Build one with ``Engine.load``; all model calls on one thread."""

    def __init__(self, model, tokenizer, ref: ModelRef, config: dict):
        self.model = model
        self.tokenizer = tokenizer
        self.ref = ref
        self.config = config
        self._cache_fingerprint: str | None = None
        self._info: ModelInfo | None = None
        self._layout = None
        self._compute_dtype = None
        self._end_tokens = None  # ``end_tokens``, once asked
        self._sampling = None  # ``sampling``, once asked
        self._tokenizer_lock = threading.Lock()  # the app counts draft tokens on its UI thread
        self.notices: list[str] = []  # one-line notes for the user from loading (slow path…)
        self.tokenizer_plan = ""  # which path the tokenizer took and why (``tokenizer.plan``)
        from ..cluster.group import Solo

        self.group = Solo()  # the ranks this model is split over (``cluster/``)

    @classmethod
    def load(cls, name: str | None = None, progress: Callable[[str], None] | None = None,
             *, group=None) -> Engine:
        """Resolve ``name`` (see ``models.resolve``), then load weights and tokenizer.

        ``group``: a ``cluster.group.Ring`` to load this rank's shard of the model (every rank
        calls this at the same time; ``cluster.split.check_shard`` says which models split how).

        Raises:
            ModelNotFound / ModelBroken: with a one-line reason. BadInput: a model that
            cannot be split that way.
        """
        backend.prepare()  # before anything imports mlx.core
        ref = resolve(name, progress=progress)
        digest = model_digest(ref.path)
        weights_cache = cpu_weights_path(digest)
        split = group is not None and group.size > 1
        # The CPU weights are read on a thread (made from this digest; ``preload`` may have
        # started it already) while the tokenizer and the model's modules are built.
        fetched = None if split else backend.prefetch(weights_cache, digest)
        # Neither imports transformers unless the tokenizer needs it (``tokenizer/``).
        from .mlxlm import Unquantized, load_config, load_model
        from .tokenizer import load_tokenizer

        left = fetched  # what ``tune`` is to take, unless the built model took it all
        taken = False
        try:
            tokenizer, plan = load_tokenizer(
                ref.path, eos_token_ids=load_config(ref.path).get("eos_token_id"))
            # Where float32 weights are coming, the modules are built plain (nothing
            # quantized to be replaced), beside the reading thread (MLX >= 0.32 is safe
            # across threads); the quantized tensors are mapped lazily, never read.
            built = Unquantized.build(ref.path) if fetched is not None else None
            if fetched is not None:
                before_the_first_turn(tokenizer)  # (the thread is still reading)
                fetched.join()
            if built is not None:
                left = backend.tune_built(built, fetched)
                taken = left is None
            if taken:
                model, config = built.model, built.config
            else:
                model, config = load_model(ref.path, lazy=True)
        except Exception as err:  # noqa: BLE001 - mlx-lm raises many kinds; one line for users
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ModelBroken(f"cannot load model {ref.name}: {reason}") from None
        quiet_transformers()  # again: loading can reset transformers' logging level
        engine = cls(model, tokenizer, ref, config)
        engine.tokenizer_plan = plan.describe()
        slow = backend.blas_notice()
        if split:
            from ..cluster import split

            engine.group = group
            tuned = split.split_model(model, config, group, ref.name, lambda m, suffix:
                                        backend.tune(m, weights_cache.with_name(
                                            f"{digest[:32]}{suffix}.safetensors"), digest))
        else:
            import mlx.core as mx

            try:
                tuned = [] if taken else backend.tune(model, weights_cache, digest, left)
                mx.eval(model.parameters())  # what tune did not replace (all, off the CPU)
            except (RuntimeError, ValueError) as err:  # the model's own files, read lazily
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise ModelBroken(f"cannot load model {ref.name}: {reason}") from None
        engine.notices = ([slow] if slow else []) + tuned
        engine.end_tokens()  # before any loop reads the tokenizer's EOS set
        engine.notices.extend(engine.sampling().notices)
        attention.install()  # CPU only: softmax without MLX's slow CPU exp (attention.py)
        activations.install()  # likewise the SwiGLU's sigmoid (activations.py)
        if unknown := engine.info().unknown:
            engine.notices.append(
                f"this model's cache ({', '.join(unknown)}) is not one localchat can keep: "
                "every turn prefills the whole conversation")
        return engine

    # -- facts about the model -------------------------------------------------------------

    @property
    def cache_fingerprint(self) -> str:
        """What a stored cache must have been made with: the model digest plus cache settings."""
        if self._cache_fingerprint is None:
            info = self.info()
            g = self.group
            shard = f"-{g.shard}{g.size}r{g.rank}" if g.size > 1 else ""
            self._cache_fingerprint = f"{info.model_digest[:32]}-{info.kv_dtype}{shard}"
        return self._cache_fingerprint

    def info(self) -> ModelInfo:
        if self._info is None:
            self._info, self._compute_dtype, self._layout = measure(
                self, make_prompt_cache(self.model))
        return self._info

    def layout(self, quant: ck.KVQuant | None = None) -> Layout:
        """What this model's caches on disk are validated against (see ``kvcache.folder.Layout``),
        for a conversation storing its K/V as ``quant`` (None: float16/bfloat16)."""
        info = self.info()
        # Token ids at or past the vocabulary would read an embedding that does not exist.
        text = self.config.get("text_config") or {}
        vocab = int(self.config.get("vocab_size") or text.get("vocab_size") or 0)
        return Layout(self.cache_fingerprint, info.kv_dtype, self._layout,
                      quant.bits if quant else 0, quant.group if quant else 0, vocab)

    # -- text ------------------------------------------------------------------------------

    def render(self, messages: list[dict], prior: list[int] | None = None,
               generation_prompt: bool = True, tools: list[dict] | None = None,
               thinking: bool | None = None) -> list[int]:
        """Token ids of the whole conversation, chat template applied, ready for a reply.

        ``prior``: the token ids this conversation was last fed (the cache's token list).
        Where the rendered text starts with what a prefix of ``prior`` decodes to, that
        prefix is kept as it is and only the rest is tokenized: a reply whose text would
        re-tokenize differently from the ids that were generated (non-canonical pieces,
        byte-level Korean) keeps its ids, so the next turn does not prefill it again. The
        ids are the conversation's; ``--no-cache`` uses the same ones. ``tools``: function
        tools the template lists for the model (OpenAI's shape). ``thinking``: the template's
        switch for a reasoning model (``enable_thinking``; None: its default).
        """
        from jinja2 import TemplateError

        with self._tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=generation_prompt, tokenize=False,
                    **({"tools": tools} if tools else {}),
                    **({"enable_thinking": thinking} if thinking is not None else {}))
            except TemplateError as err:  # roles in an order it refuses, say
                raise BadInput(f"the model's chat template refuses these messages: {err}"
                               ) from None
            canonical = self._encode(text)
            if not prior or common_prefix(prior, canonical) == len(prior):
                return canonical
            j, prefix_text = self._aligned_prefix(prior, text)
            if j <= common_prefix(prior, canonical):
                return canonical
            return list(prior[:j]) + self._encode(text[len(prefix_text):])

    def _aligned_prefix(self, prior: list[int], text: str) -> tuple[int, str]:
        """The longest j whose decoded ``prior[:j]`` is a prefix of ``text`` (binary search;
        a prefix that decodes into a prefix of the text stays one when shortened, except
        mid-character, which only makes the search stop a little short)."""
        def decoded(j: int) -> str:
            return self.tokenizer.decode(prior[:j], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)


        whole = decoded(len(prior))
        if text.startswith(whole):
            return len(prior), whole
        lo, hi, best = 0, len(prior), ""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            piece = decoded(mid)
            if text.startswith(piece):
                lo, best = mid, piece
            else:
                hi = mid - 1
        return lo, best if lo else ""

    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        # verbose=False: no "longer than the maximum" warning; we check the context ourselves.
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    @property
    def thinking_switch(self) -> bool:
        """Whether the chat template turns a reasoning model's thinking on and off."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "enable_thinking" in template

    def decode_text(self, ids: list[int]) -> str:
        """The exact text of ``ids`` (special tokens included, no space clean-up)."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` (a draft); safe from any thread."""
        return len(self.encode(text)) if text else 0

    def detokenizer(self):
        """A fresh streaming detokenizer (holds back partial UTF-8, e.g. half a Hangul)."""
        detok = self.tokenizer.detokenizer
        detok.reset()
        return detok

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every token that ends a reply (``endtokens.end_tokens``)."""
        return self.end_tokens().ends

    @property
    def hidden_ids(self) -> frozenset[int]:
        """Control tokens never shown or stored as reply text (the ends included)."""
        return self.end_tokens().hidden

    def sampler(self, temp: float = 0.0, top_p: float = 1.0, **settings):
        """A turn's ``Sampler`` (``sampler.py``) with this model's banned control tokens and,
        split over ranks, rank 0's choice for every rank. ``settings``: top_k, min_p,
        repetition_penalty, seed, grammar, free_until, opens."""
        from .sampler import Sampler

        return Sampler(temp, top_p, banned=sorted(self.hidden_ids - self.eos_ids),
                       root=self.group.from_root, **settings)

    def sampling(self):
        """The sampling defaults in force for the app and ``serve`` (``defaults.py``)."""
        if self._sampling is None:
            from .defaults import model_defaults

            self._sampling = model_defaults(self.ref.path)
        return self._sampling

    def end_tokens(self):
        if self._end_tokens is None:
            from .endtokens import end_tokens, parser_markers

            self._end_tokens = end_tokens(self.tokenizer, self.ref.path,
                                          parser_markers(self.tokenizer))
            # mlx-lm's own loops (``batch_generate`` in ``cli/parallel.py``) stop on the same set.
            for tok in sorted(self._end_tokens.ends - set(self.tokenizer.eos_token_ids)):
                self.tokenizer.add_eos_token(str(tok))
        return self._end_tokens

    # -- compute ---------------------------------------------------------------------------

    def new_cache(self) -> list:
        """An empty cache. float32 K/V (CPU) is rounded to float16 as it enters the cache,
        like llama.cpp's default f16 cache: half the disk, and the disk copy is lossless, so
        a resumed turn computes exactly what a full prefill computes."""
        import mlx.core as mx

        cache = make_prompt_cache(self.model)
        if self.compute_dtype() == mx.float32 and self.info().kv_dtype == "float16":
            ck.half_stored(cache)
        return cache

    def compute_dtype(self):
        """The dtype the model's K/V come out in (float32 on the CPU path)."""
        self.info()
        return self._compute_dtype

    def prefill(self, tokens: list[int], cache: list,
                chunk: int | Callable[[], int] = PREFILL_CHUNK, stepped: bool = False,
                before: list[int] | None = None):
        """Feed ``tokens`` (at least one) into ``cache``.

        Yields ``(done, total)`` after each chunk and returns the last position's logits
        (``logits = yield from engine.prefill(...)``). Chunks before the last token run through
        the transformer body only: the vocabulary head (~20% of a small model's FLOPs) is
        needed for the last position alone. ``chunk``: tokens per chunk, or a function asked
        before each chunk (a scheduler shrinks chunks while other turns wait to decode).
        ``stepped``: each model call is yielded as a ``Step`` instead of being run here, for a
        scheduler to run in the same call as other turns' decode steps (``session/scheduler.py``).
        ``before``: the tokens the cache holds (a text model needs only the cache; a vision
        model's positions depend on the images before: ``vision.py``).
        """
        import mlx.core as mx

        assert tokens, "prefill needs at least one token"
        body = getattr(self.model, "model", None)
        done, total = 0, len(tokens)
        size = chunk if callable(chunk) and len(tokens) > SHORT_PROMPT else \
            (lambda: chunk if not callable(chunk) else PREFILL_CHUNK)
        if total <= min(ONE_PASS, size()) and not ck.bounded(cache) and self.group.size == 1:
            # A short message (a chat turn) goes through once, head included: feeding its last
            # token apart would attend the whole history a second time (~12 ms at 4k on the
            # default model), more than the head costs for a few more rows (~5 ms at 15).
            # Not with bounded layers: they need the state one token before the end (the
            # checkpoint a regenerate resumes from); not split over ranks, whose layers differ.
            if stepped:
                step = Step(mx.array(tokens), cache)
                yield step
                logits = step.logits
            else:
                logits = self.model(mx.array(tokens)[None], cache=cache)[:, -1, :]
            mx.eval(logits)
            return logits
        while total - done > 1:
            n = max(1, min(size(), total - done - 1))
            if stepped:
                yield Step(mx.array(tokens[done : done + n]), cache, head=False)
            else:
                x = mx.array(tokens[done : done + n])[None]
                if body is not None:
                    body(x, cache=cache)
                else:
                    self.model(x, cache=cache)
            mx.eval(ck.state_arrays(cache))
            done += n
            yield done, total
        if stepped:
            step = Step(mx.array(tokens[-1:]), cache)
            yield step
            logits = step.logits
        else:
            logits = self.model(mx.array(tokens[-1:])[None], cache=cache)[:, -1, :]
        mx.eval(logits)
        return logits

    def resume_at(self, tokens: list[int], k: int) -> int:
        """Where a turn may resume given a common prefix of ``k`` tokens with ``tokens``:
        ``k`` for text (a vision model moves it back to the start of an image it would cut)."""
        return k

    def takes_images(self) -> bool:
        """Whether a message may hold images (a vision model: ``vision.py``)."""
        return False

    def see(self, digest: str, picture) -> None:
        """Take the decoded image ``digest`` (a Pillow image) in hand for the next render, so
        it need not be read from the data folder (a request's image before it is stored).

        Raises:
            BadInput: a text model; the model's processor refuses the image.
        """
        raise BadInput(f"{self.info().name} is a text model: it cannot take images")

    def image_note(self, digest: str) -> str:
        """One line for the user about how the model sees image ``digest`` ("": nothing to
        say; a text model has no images)."""
        return ""

    def image_spans(self, tokens: list[int], digests: list[str]) -> list[tuple[int, int, str]]:
        """Where the images ``digests`` are in ``tokens`` (a cache's keys): ``(start, end,
        digest)`` each (a text model has none)."""
        return []

    def unstepped(self) -> str:
        """Why a scheduler must let this model's turns make their own model calls, one turn
        at a time ("": its calls can be ``Step``s that a scheduler batches with other turns'
        — ``session/scheduler.py``)."""
        return ""

    def can_verify(self) -> bool:
        """Whether speculative decoding (``session/speculative.py``) may stand in for
        ``decode``: this class's own ``decode`` (an engine that scripts its tokens overrides it
        and opts out), one rank (a split model's ranks would have to agree on every draft: it
        decodes plain), and only cache classes localchat knows how to cut back."""
        return (type(self).decode is Engine.decode and self.group.size == 1
                and not self.info().unknown)

    def feed(self, cache: list, tok: int) -> None:
        """Put one token into ``cache`` now (a reply's last, or one a caller stopped after)."""
        import mlx.core as mx

        mx.eval(ck.state_arrays(cache), self.model(mx.array([[tok]]), cache=cache))

    def hand_out(self, tok: int, cache: list):
        """Yield ``tok`` before it is fed (``eager``); a caller that stops there gets it fed."""
        try:
            yield tok
        except GeneratorExit:
            self.feed(cache, tok)
            raise

    @property
    def eager(self) -> bool:
        """Whether a model call computes before it returns (the CPU attention evaluates each
        layer): queuing the next step first would make a token wait for it, so the decoders
        hand the token out first and feed it after (``hand_out``)."""
        return attention.installed()

    def decode(
        self, cache: list, logits, max_tokens: int, temp: float = 0.0, seed: int | None = None,
        top_p: float = 1.0, *, top_k: int = 0, min_p: float = 0.0,
        repetition_penalty: float = 1.0, stepped: bool = False, grammar=None, **gate,
    ) -> Iterator[int | Step]:
        """Yield up to ``max_tokens`` token ids, sampling from ``logits`` onwards.

        The tokens are chosen by ``self.sampler`` (``sampler.py``: greedy when ``temp`` is 0,
        no control token that is not an end; a seeded turn samples as it would alone). The
        step for token n+1 is queued before token n is yielded (MLX async eval), so the model
        works while the caller prints; where model calls compute as they are made
        (``eager``), token n is yielded first and fed after (when the caller stops there,
        as it closes this generator) — also ``stepped``: each model step is yielded as a
        ``Step`` for a scheduler to run together with other turns' (``session/scheduler.py``)
        instead of being run here, and the token goes out before its step (the scheduler runs
        a step before it reads on). ``grammar``: the turn's constraint
        (``constraint.Matcher``), which masks each step; ``gate``: where a reasoning model's
        thinking frees it (``Sampler``).
        """
        import mlx.core as mx

        if max_tokens <= 0:
            return
        sampler = self.sampler(temp, top_p, top_k=top_k, min_p=min_p,
                               repetition_penalty=repetition_penalty, seed=seed,
                               grammar=grammar, **gate)
        eos = self.eos_ids
        eager = self.eager
        y = sampler.draw(logits)
        mx.async_eval(y)
        for n in range(max_tokens):
            tok = int(y.item())
            sampler.note(tok)
            if tok in eos:
                yield tok
                return
            if n == max_tokens - 1:
                yield tok
                # Fed too, once the caller asks for more: the cache then ends where the
                # reply's text ends (not inside a character split over two tokens).
                if stepped:
                    yield Step(y, cache)
                else:
                    self.feed(cache, tok)
                return
            if eager:
                yield from self.hand_out(tok, cache)
            if stepped:
                step = Step(y, cache)
                yield step
                logits = step.logits
            else:
                logits = self.model(y[:, None], cache=cache)[:, -1, :]
            y = sampler.draw(logits)
            mx.async_eval(y)
            if not eager:
                yield tok


def make_prompt_cache(model) -> list:
    from mlx_lm.models.cache import make_prompt_cache as make

    return make(model)


def now() -> float:
    return time.perf_counter()
