"""One conversation turn, with its KV cache reused from memory or disk.

A turn = render → match prefix → prefill the rest → decode → persist. ``Session.turn`` is the
one generator every front end consumes (CLI ``ask``, ``batch``, the TUI, the benchmarks): it
yields ``Notice``, ``PrefillProgress`` and ``ReplyChunk`` events, then one ``TurnFinished``
carrying the ``Usage`` record the status bar shows.

Order of writes (a crash anywhere leaves a consistent state): the user's message is committed
first, so typed text is never lost; after decoding, the KV cache segments and manifest; then
the reply. A stopped reply (``stop()``, Ctrl-C, closing the generator) is kept, marked
partial, and the cache holds exactly the tokens that were fed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .engine import Engine, cache_offset, now
from .errors import BadInput, ContextFull, StorageError
from .kvstore import CacheInvalid, Geometry, KVStore, common_prefix
from .locks import ConversationLock
from .prefixes import PrefixPool
from .snapshot import load_snapshot, save_snapshot
from .store import Conversation, Store


@dataclass(frozen=True)
class Notice:
    """Something the user should read once (cache rebuilt, waiting for a lock)."""

    text: str


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class ReplyChunk:
    text: str


@dataclass(frozen=True)
class Usage:
    """Figures of one turn. ``prompt_tokens == cached_tokens + prefilled_tokens``."""

    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    context_tokens: int  # positions held by the cache after the turn
    context_length: int
    cache_bytes: int  # size of the conversation's cache on disk
    bytes_written: int  # cache bytes this turn wrote
    miss_reason: str  # why tokens were prefilled: "", "new conversation", "edited", ...
    snapshot: bool = False  # the model's cache is saved whole at turn ends (not appendable)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def public(self) -> dict:
        """The usage object of ``ask --json`` and batch results."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": round(self.ttft_s, 4),
            "prefill_tps": round(self.prefill_tps, 1),
            "decode_tps": round(self.decode_tps, 1),
            "cache_bytes": self.cache_bytes,
            "miss_reason": self.miss_reason,
        }


@dataclass(frozen=True)
class TurnFinished:
    reply: str
    usage: Usage
    stopped: bool  # the reply was cut short by the user; it is saved marked partial
    tokens: tuple[int, ...] = ()  # the generated token ids, EOS included when produced


Event = Notice | PrefillProgress | ReplyChunk | TurnFinished


@dataclass
class _Live:
    """The cache of the last conversation this process ran, kept in memory between turns."""

    conversation_id: int
    fingerprint: str
    tokens: list[int]
    cache: list


@dataclass
class _Run:
    """What a turn's prefill and decode produced so far (read when it is cut short)."""

    generated: list[int] = field(default_factory=list)
    reply: str = ""
    stopped: bool = False
    logits_ready: bool = False
    prefill_s: float = 0.0
    t_first: float | None = None
    t_last: float | None = None  # when the last token came (decode speed ends there)


class Session:
    """Runs turns of conversations stored in ``store`` with ``engine``."""

    def __init__(self, store: Store, engine: Engine, kv_root: Path, locks_dir: Path,
                 lock_timeout: float = 60.0):
        self.store = store
        self.engine = engine
        self.kv_root = kv_root
        self.locks_dir = locks_dir
        self.lock_timeout = lock_timeout
        self._live: _Live | None = None
        self._stop = threading.Event()

    def kvstore(self, conv: Conversation) -> KVStore:
        return KVStore(self.kv_root / str(conv.id))

    def stop(self) -> None:
        """Ask the running turn to stop after the current token (thread-safe)."""
        self._stop.set()

    def geometry(self) -> Geometry:
        info = self.engine.info()
        return Geometry(self.engine.fingerprint, info.layers, info.kv_heads, info.head_dim,
                        info.kv_dtype)

    # -- the turn --------------------------------------------------------------------------

    def turn(self, conv: Conversation, prompt: str | None, *, max_tokens: int = 1024,
             temp: float = 0.0, seed: int | None = None, no_cache: bool = False,
             edited: bool = False) -> Iterator[Event]:
        """Run one turn: add ``prompt`` as the user's message (None: answer as it stands).

        Args:
            conv: the conversation; its messages are read from the store.
            prompt: the new user message, or None to reply to the last stored message.
            max_tokens: reply length limit (also capped by the context window).
            temp: 0 for greedy decoding.
            no_cache: ignore the stored cache (full prefill), then store a fresh one.
            edited: the caller cut the conversation (edit, regenerate); reported as the reason.
        Yields:
            Notice, PrefillProgress and ReplyChunk events, then one TurnFinished.
        Raises:
            BadInput, ContextFull, ConversationBusy, StorageError.
        """
        if prompt is not None and not prompt.strip():
            raise BadInput("empty prompt")
        t0 = now()
        self._stop.clear()
        lock = ConversationLock(self.locks_dir / f"{conv.id}.lock", conv.name,
                                self.lock_timeout)
        if not lock.try_acquire():
            yield Notice(lock.waiting_message)
            lock.acquire()
        try:
            yield from self._locked_turn(conv, prompt, max_tokens, temp, seed, no_cache,
                                         edited, t0)
        finally:
            lock.release()

    def _locked_turn(self, conv, prompt, max_tokens, temp, seed, no_cache, edited, t0):
        history = [{"role": m.role, "content": m.content} for m in self.store.messages(conv)]
        if conv.system and not any(m["role"] == "system" for m in history):
            history.insert(0, {"role": "system", "content": conv.system})
        if prompt is not None:
            history.append({"role": "user", "content": prompt})
        elif not history or history[-1]["role"] != "user":
            raise BadInput("nothing to answer: the conversation does not end with a user message")
        tokens, max_tokens = self.render_checked(history, max_tokens)
        if prompt is not None:
            self.store.add_message(conv, "user", prompt)

        store = self.kvstore(conv)
        geometry = self.geometry()
        cached, cache, reason = self._cache_for(conv, store, geometry, no_cache)
        if reason.startswith("cache rebuilt"):
            yield Notice(reason)
        k = min(common_prefix(cached, tokens), len(tokens) - 1)
        if k < len(cached) and not self.engine.info().trimmable:
            # A snapshot cache cannot be cut: anything but an exact extension starts over.
            cache, k = self.engine.new_cache(), 0
            reason = reason or "edited (this model's cache cannot be cut: full prefill)"
        elif k < cache_offset(cache):
            drop = cache_offset(cache) - k
            for c in cache:
                c.trim(drop)
            if not reason:
                reason = "edited" if edited else f"re-rendered ({len(cached) - k} tokens)"
        if edited and not reason:
            reason = "edited"

        run = _Run()
        try:
            yield from self._prefill_and_decode(tokens[k:], cache, max_tokens, temp, seed, run)
        except GeneratorExit:
            # Closed at a yield point: the cache holds exactly the fed tokens, so keep it.
            self._persist(conv, store, geometry, tokens + run.generated, cache, run.reply, True)
            raise
        except KeyboardInterrupt:
            # Raised anywhere, perhaps inside a model step: keep the text, not this cache.
            self._live = None
            if run.reply:
                self.store.add_message(conv, "assistant", run.reply, partial=True)
            raise
        notes: list[str] = []
        written = self._persist(conv, store, geometry, tokens + run.generated, cache,
                                run.reply, run.stopped and run.logits_ready, notes)
        for text in notes:
            yield Notice(text)
        usage = self._usage(tokens, k, run, cache, t0, store.disk_bytes(), written, reason)
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated))

    def complete(self, messages: list[dict], pool: PrefixPool, *, max_tokens: int = 256,
                 temp: float = 0.0, seed: int | None = None) -> Iterator[Event]:
        """A turn on messages not stored anywhere (batch lines), reusing pooled prefixes.

        Yields the same events as ``turn``; the finished cache goes back into ``pool``.
        """
        t0 = now()
        self._stop.clear()
        tokens, max_tokens = self.render_checked(messages, max_tokens)
        k, cache = pool.take(tokens)
        run = _Run()
        yield from self._prefill_and_decode(tokens[k:], cache, max_tokens, temp, seed, run)
        fed = (tokens + run.generated)[: cache_offset(cache)]
        pool.put(fed, cache)
        reason = "" if k else "no shared prefix"
        usage = self._usage(tokens, k, run, cache, t0, 0, 0, reason)
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated))

    def render_checked(self, messages: list[dict], max_tokens: int) -> tuple[list[int], int]:
        """Token ids of ``messages`` ready for a reply, and the reply budget that fits."""
        info = self.engine.info()
        tokens = self.engine.render(messages)
        room = info.context_length - len(tokens)
        if room < 1:
            raise ContextFull(
                f"the conversation is {len(tokens)} tokens; {info.name} holds "
                f"{info.context_length}: start a new conversation or shorten the message"
            )
        return tokens, min(max_tokens, room)

    def _usage(self, tokens, k, run: _Run, cache, t0, cache_bytes, written, reason) -> Usage:
        t_end = now()
        n_gen = len(run.generated)
        t_first = run.t_first or t_end
        decode_s = (run.t_last or t_end) - t_first
        return Usage(
            prompt_tokens=len(tokens),
            cached_tokens=k,
            prefilled_tokens=len(tokens) - k,
            completion_tokens=n_gen,
            ttft_s=t_first - t0,
            prefill_tps=(len(tokens) - k) / run.prefill_s if run.prefill_s > 0 else 0.0,
            decode_tps=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            context_tokens=cache_offset(cache),
            context_length=self.engine.info().context_length,
            cache_bytes=cache_bytes,
            bytes_written=written,
            miss_reason=reason,
            snapshot=not self.engine.info().trimmable,
        )

    def _prefill_and_decode(self, new_tokens, cache, max_tokens, temp, seed, run: _Run):
        """Prefill ``new_tokens`` then decode, recording into ``run``; checks ``stop()``."""
        engine = self.engine
        t = now()
        prefill = engine.prefill(new_tokens, cache)
        logits = None
        while logits is None:
            if self._stop.is_set():
                run.stopped = True
                run.prefill_s = now() - t
                return
            try:
                done, total = next(prefill)
            except StopIteration as fin:
                logits = fin.value
                break
            yield PrefillProgress(done, total)
        run.prefill_s = now() - t
        run.logits_ready = True
        detok = engine.detokenizer()
        for tok in engine.decode(cache, logits, max_tokens, temp, seed):
            if run.t_first is None:
                run.t_first = now()
            run.generated.append(tok)
            run.t_last = now()
            if tok in engine.eos_ids:
                break
            detok.add_token(tok)
            if piece := detok.last_segment:
                run.reply += piece
                yield ReplyChunk(piece)
            if self._stop.is_set():
                run.stopped = True
                break
        detok.finalize()
        if piece := detok.last_segment:
            run.reply += piece
            yield ReplyChunk(piece)

    def _cache_for(self, conv, store: KVStore, geometry: Geometry, no_cache: bool):
        """(token list, live cache, reason) to start the turn from."""
        engine = self.engine
        live = self._live
        if no_cache:
            self._live = None
            store.clear()
            return [], engine.new_cache(), "cache ignored (--no-cache)"
        if live and live.conversation_id == conv.id and live.fingerprint == geometry.fingerprint:
            # Trust memory only if the disk still agrees (another process may have moved on).
            try:
                man = store.manifest()
            except CacheInvalid:
                man = None
            if man is not None and man.tokens == live.tokens:
                return live.tokens, live.cache, ""
        self._live = None
        try:
            if not engine.info().trimmable:
                loaded = load_snapshot(store, geometry)
                if loaded is not None:
                    return loaded[0], loaded[1], ""
            else:
                loaded = store.load(geometry, engine.compute_dtype(), headroom=256)
        except CacheInvalid as err:
            store.clear()
            return [], engine.new_cache(), f"cache rebuilt: {err}"
        except OSError as err:
            return [], engine.new_cache(), f"cache rebuilt: {err.strerror or err}"
        if loaded is None:
            has_turns = conv.tokens > 0
            reason = "cache rebuilt: no cache on disk" if has_turns else "new conversation"
            return [], engine.new_cache(), reason
        tokens, layers = loaded
        cache = engine.new_cache()
        for c, (keys, values) in zip(cache, layers):
            c.state = (keys, values, len(tokens))
        return tokens, cache, ""

    def _persist(self, conv, store: KVStore, geometry, fed_candidates: list[int], cache,
                 reply: str, partial: bool, notices: list[str] | None = None) -> int:
        """Save the reply, then write the cache (segments, then manifest). Returns bytes written.

        The reply goes first: it is what the user cannot get back, while a cache that is not
        written (full disk, read-only or vanished folder, a kill) only costs a later prefill —
        the previous manifest still describes valid segments.
        """
        if reply:  # an empty reply (stopped before any text) is not worth a message
            self.store.add_message(conv, "assistant", reply, partial=partial)
        n = cache_offset(cache)
        fed = fed_candidates[:n]
        written = 0
        try:
            if self.engine.info().trimmable:
                written = store.commit(geometry, fed, cache)
            else:
                written = save_snapshot(store, geometry, fed, cache)
            self._live = _Live(conv.id, geometry.fingerprint, fed, cache)
        except OSError as err:  # kvstore turns MLX's RuntimeError on a failed write into this
            self._live = None
            if notices is not None:
                notices.append(f"cache not saved ({err.strerror or err}); it will be rebuilt")
        try:
            self.store.update(conv, tokens=n)
        except StorageError:
            pass  # the token count only feeds `localchat list`
        return written
