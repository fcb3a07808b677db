"""Conversations and their turns, with each conversation's KV cache reused from memory or disk.

What it is: the layer every front end stands on. ``open_session`` is the one factory (store,
model, session); ``Session`` owns the conversation operations (find or create, rename, delete,
regenerate, edit the last message, count a draft's tokens) and the turn itself:
render → match prefix → restore the cache → prefill the rest → decode → persist. ``turn``
is the one generator every front end consumes (CLI ``ask``, ``batch``, the TUI, the
benchmarks); it yields the records of ``events.py``. What it is not: I/O for a person
(``cli.py``, ``tui/``) or the model (``engine.py``).

Order of writes (a crash anywhere leaves a consistent state): the user's message is committed
first, so typed text is never lost; after decoding, the reply; then the KV cache segments,
checkpoints and manifest. A stopped reply (a ``Cancel`` set, Ctrl-C, closing the generator)
is kept, marked partial, and the cache holds exactly the tokens that were fed.

``Session`` is assembled from mixins, one module each: ``turncache.TurnCache`` (where a turn
resumes, what it writes), ``sharing.Sharing`` (forks, prefixes shared between
conversations), ``drafts.DraftPrefill`` (the next message prefilled while it is typed).
Split over ranks (``cluster.py``), every rank runs these same calls on its own shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import cachekinds as ck
from . import kvquality, paths
from .cluster import ClusterLost
from .drafts import DraftPrefill
from .engine import Engine, now
from .errors import BadInput, ContextFull, ConversationNotFound, LocalchatError
from .events import DraftProgress, Event, Notice, PrefillProgress, ReplyChunk, TurnFinished, Usage
from .kvstore import CacheInvalid, KVStore
from .locks import ConversationLock
from .prefixes import PrefixPool
from .sharing import MIN_SHARED, Sharing, delete_conversation, fork_conversation
from .store import Conversation, Store
from .turncache import TurnCache, _Live, _Run, _Start

__all__ = ["Cancel", "DraftProgress", "Event", "Notice", "PrefillProgress", "ReplyChunk",
           "Session", "TurnFinished", "TurnOptions", "Usage", "delete_conversation",
           "fork_conversation", "open_session"]


@dataclass(frozen=True)
class TurnOptions:
    """How to run a turn (``ask``'s flags, a batch line's settings)."""

    max_tokens: int = 1024
    temp: float = 0.0  # 0: greedy
    seed: int | None = None
    no_cache: bool = False  # ignore the stored K/V (full prefill), then store a fresh cache


class Cancel:
    """Stops one turn after the current token; thread-safe. Made by the caller before the
    turn starts, so a stop that comes before the worker runs is not lost."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def open_session(model: str | None = None, *, progress: Callable[[str], None] | None = None,
                 load_engine: Callable[..., Engine] | None = None,
                 lock_timeout: float | None = None, group=None) -> Session:
    """The one wiring of every front end: open the database, load the model, make a session.

    Args:
        model: a model name for ``Engine.load`` (None: the default model).
        progress: one-line progress messages while a model is set up.
        load_engine: ``Engine.load`` unless a test passes another loader.
        lock_timeout: seconds to wait for a conversation another process uses
            (default: ``LOCALCHAT_LOCK_TIMEOUT`` or 60).
        group: a ``cluster.Ring`` (rank 0) to run the model split over several processes.
    Raises:
        StorageError, ModelNotFound, ModelBroken.
    """
    store = Store.open(paths.database_path())
    try:
        if group is None:
            engine = (load_engine or Engine.load)(model, progress)
        else:
            engine = Engine.load(model, progress, group=group)
    except BaseException:
        store.close()
        raise
    if lock_timeout is None:
        lock_timeout = float(os.environ.get("LOCALCHAT_LOCK_TIMEOUT", "60"))
    session = Session(store, engine, engine.group.kv_root(paths.kv_root()), paths.locks_dir(),
                      lock_timeout)
    if group is not None:
        # Before the app's hook: once the app has given the terminal back, it may exit.
        group.on_lost.insert(0, session.save_partial)
    return session


class Session(TurnCache, Sharing, DraftPrefill):
    """Runs turns of conversations stored in ``store`` with ``engine``."""

    def __init__(self, store: Store, engine: Engine, kv_root: Path, locks_dir: Path,
                 lock_timeout: float = 60.0):
        self.store = store
        self.engine = engine
        self.kv_root = kv_root
        self.locks_dir = locks_dir
        self.lock_timeout = lock_timeout
        self._live: _Live | None = None
        self.group = engine.group  # the ranks the model is split over (``cluster.py``)
        # The disk budget's cache root and locks: split, this machine's data folder's (the
        # session's own caches are one rank's folder of it), else the session's own.
        self.budget_home = ((paths.kv_root(), paths.locks_dir()) if self.split
                            else (kv_root, locks_dir))
        self._running: tuple[Conversation, _Run] | None = None  # for ``save_partial``

    @property
    def split(self) -> bool:
        """The model runs over several ranks: no drafts, no sharing between conversations."""
        return self.group.size > 1

    def close(self) -> None:
        self.store.close()

    def save_partial(self, why: str = "") -> None:
        """Store the reply of a turn that cannot finish (a follower was lost while it ran),
        marked partial; from any thread (the cluster watchdog's)."""
        running, self._running = self._running, None
        if running is None or not running[1].reply:
            return
        store = Store.open(paths.database_path())
        try:
            store.add_message(running[0], "assistant", running[1].reply, partial=True)
        finally:
            store.close()

    def kvstore(self, conv: Conversation) -> KVStore:
        return KVStore(self.kv_root / str(conv.id))

    # -- conversations ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.engine.ref.name

    def conversation(self, name: str | None, *, system: str | None = None,
                     kv_bits: int | None = None, kv_group: int | None = None) -> Conversation:
        """The conversation ``name`` (created if new; a fresh name if None), set to this
        session's model and, when given, to ``system`` and to a KV cache setting.

        Args:
            kv_bits: 8 or 4 to store the conversation's K/V quantized, 0 for float16, None to
                keep its setting. ``kv_group``: the group size (default: ``default_group`` of
                the model's head dim). Checked against the model and the quality gate.
        Raises:
            BadInput: a setting this model cannot take, or one that fails the gate.
        """
        changes = {}
        if kv_bits is not None:
            quant = kvquality.setting(self.engine, kv_bits, kv_group)
            changes["kv_bits"] = quant.bits if quant else None
            changes["kv_group"] = quant.group if quant else None
        conv = self.store.find(name) if name else None
        if conv is None:
            conv = self.store.create(name or self.store.unique_name(), self.model_name, system)
        else:
            if conv.model != self.model_name:
                changes["model"] = self.model_name
            if system is not None and system != conv.system:
                changes["system"] = system
        return self.store.update(conv, **changes) if changes else conv

    @staticmethod
    def _quant(conv: Conversation) -> ck.KVQuant | None:
        return ck.KVQuant(conv.kv_bits, conv.kv_group) if conv.kv_bits else None

    def rename(self, conv: Conversation, name: str) -> Conversation:
        return self.store.update(conv, name=name.strip())

    def delete(self, conv: Conversation) -> None:
        """Delete a conversation, its messages and its KV cache (every rank's shard)."""
        if self._live and self._live.conversation_id == conv.id:
            self._live = None
        self.group.command("delete", conversation=conv.id)
        delete_conversation(self.store, conv, self.kv_root, self.locks_dir, self.lock_timeout)
        self.group.finish()

    def delete_shard(self, conversation_id: int) -> None:
        """A follower's part of ``delete``: its own cache folder of the conversation."""
        if self._live and self._live.conversation_id == conversation_id:
            self._live = None
        shutil.rmtree(self.kv_root / str(conversation_id), ignore_errors=True)

    def count_tokens(self, text: str) -> int:
        """A draft's length in tokens; safe from any thread (the app's UI thread)."""
        return self.engine.count_tokens(text)

    # -- turns -----------------------------------------------------------------------------

    def turn(self, conv: Conversation, prompt: str | None,
             options: TurnOptions = TurnOptions(), cancel: Cancel | None = None,
             ) -> Iterator[Event]:
        """Run one turn: add ``prompt`` as the user's message (None: answer as it stands).

        Yields:
            Notice, PrefillProgress and ReplyChunk events, then one TurnFinished.
        Raises:
            BadInput, ContextFull, ConversationBusy, StorageError.
        """
        if prompt is not None and not prompt.strip():
            raise BadInput("empty prompt")
        yield from self._locked(conv, prompt, options, cancel or Cancel(), cut=None)

    def regenerate(self, conv: Conversation, options: TurnOptions = TurnOptions(),
                   cancel: Cancel | None = None) -> Iterator[Event]:
        """Drop the last reply and answer the last user message again (reuses the cache
        up to that message)."""
        yield from self._locked(conv, None, options, cancel or Cancel(), cut="reply")

    def edit_last(self, conv: Conversation, text: str, options: TurnOptions = TurnOptions(),
                  cancel: Cancel | None = None) -> Iterator[Event]:
        """Replace the last user message (and what follows) by ``text`` and answer it."""
        if not text.strip():
            raise BadInput("empty prompt")
        yield from self._locked(conv, text, options, cancel or Cancel(), cut="user")

    def _locked(self, conv, prompt, options, cancel, cut):
        t0 = now()
        lock = ConversationLock(self.locks_dir / f"{conv.id}.lock", conv.name,
                                self.lock_timeout)
        if not lock.try_acquire():
            yield Notice(lock.waiting_message)
            lock.acquire()
        try:
            # Under the lock, as stored now: another process may have renamed, changed or
            # deleted it (``localchat rm`` takes this lock too), and nothing is written into
            # a conversation that is gone.
            fresh = self.store.by_id(conv)
            if fresh is None:
                raise ConversationNotFound(f"conversation {conv.name!r} was deleted by "
                                           "another localchat process")
            conv = fresh
            if self.split and self.group.rank == 0:
                self.group.command(
                    "turn", conversation=dataclasses.asdict(conv), prompt=prompt, cut=cut,
                    options=dataclasses.asdict(options),
                    messages=[(m.seq, m.role, m.content, m.partial)
                              for m in self.store.messages(conv)])
            with self._reported():
                reason = ""
                if cut is not None:
                    reason = self._cut(conv, cut)
                yield from self._turn(conv, prompt, options, cancel, t0, reason)
        finally:
            lock.release()
            self._running = None

    def _cut(self, conv: Conversation, what: str) -> str:
        users = [m for m in self.store.messages(conv) if m.role == "user"]
        if not users:
            raise BadInput("no message to edit yet" if what == "user" else
                           "nothing to regenerate yet")
        seq = users[-1].seq + (1 if what == "reply" else 0)
        self.store.delete_messages_from(conv, seq)
        return "regenerated" if what == "reply" else "edited"

    def _turn(self, conv, prompt, options: TurnOptions, cancel: Cancel, t0: float,
              edit_reason: str):
        history = self._history(conv)
        if prompt is not None:
            history.append({"role": "user", "content": prompt})
        elif not history or history[-1]["role"] != "user":
            raise BadInput("nothing to answer: the conversation does not end with a user message")
        kv = self.kvstore(conv)
        prior, man, note = self._prior(conv, kv, options.no_cache)
        tokens, max_tokens = self.render_checked(history, options.max_tokens, prior)
        if prompt is not None:
            self.store.add_message(conv, "user", prompt)
        if man is None and not options.no_cache and not self.engine.info().unknown \
                and not self.split:
            # Nothing stored for this conversation: start from another one's prefix if any.
            man = self._adopt_shared(conv, kv, tokens)
            if man is not None:
                prior = man.tokens
                note = f"{note}; {len(prior)} tokens shared with another conversation"
        if note.startswith("cache rebuilt"):
            yield Notice(note)
        start = self._start(kv, prior, man, tokens, options.no_cache)
        if start.changed.startswith(("cache rebuilt", "cache partly rebuilt")):
            yield Notice(start.changed)
        parts = [note] if note else [
            edit_reason or start.changed if start.changed else "", start.fallback]
        reason = "; ".join(p for p in parts if p)

        run = _Run()
        self._running = (conv, run)
        new_tokens = tokens[start.pos:]
        try:
            try:
                yield from self._prefill_and_decode(new_tokens, start, max_tokens, options,
                                                    cancel, run)
            except RuntimeError as err:
                if not self.split:
                    raise
                raise self.group.lost_error(err) from None  # a rank went away mid-step
        except GeneratorExit:
            # Closed at a yield point: the cache holds exactly the fed tokens, so keep it.
            self._persist(conv, kv, tokens + run.generated, start, run, True)
            raise
        except (KeyboardInterrupt, ClusterLost):
            # Raised anywhere, perhaps inside a model step: keep the text, not this cache.
            self._live = None
            self._running = None
            if run.reply:
                self.store.add_message(conv, "assistant", run.reply, partial=True)
            raise
        self._running = None
        notes: list[str] = []
        written = self._persist(conv, kv, tokens + run.generated, start, run,
                                run.stopped and run.logits_ready, notes)
        for text in notes:
            yield Notice(text)
        cache_bytes = kv.disk_bytes()
        if self.split:  # the conversation's cache is every rank's shard together
            rows = self.group.gather([cache_bytes, written, int(bool(notes))])
            cache_bytes, written = sum(r[0] for r in rows), sum(r[1] for r in rows)
            for rank, row in enumerate(rows[1:], start=1):
                if row[2]:
                    yield Notice(f"cache not saved on rank {rank}; it will be rebuilt")
        usage = self._usage(tokens, start.pos, run, t0, cache_bytes=cache_bytes,
                            written=written, reason=reason, draft=start.draft)
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated))

    def complete(self, messages: list[dict], pool: PrefixPool,
                 options: TurnOptions = TurnOptions(), cancel: Cancel | None = None,
                 ) -> Iterator[Event]:
        """A turn on messages not stored anywhere (batch lines), reusing pooled prefixes.

        Yields the same events as ``turn``; the finished cache goes back into ``pool``.
        """
        t0 = now()
        if self.split and self.group.rank == 0:
            self.group.command("complete", messages=messages, pool=id(pool),
                               options=dataclasses.asdict(options))
        with self._reported():
            yield from self._complete(messages, pool, options, cancel, t0)

    @contextlib.contextmanager
    def _reported(self):
        """A call every rank makes: when it ends, or fails with the same LocalchatError on
        every rank (they raise it at the same point), the followers' reports are checked
        (``group.finish``); a lost rank has nothing to report."""
        try:
            yield
        except ClusterLost:
            raise
        except LocalchatError:
            self.group.finish()
            raise
        else:
            self.group.finish()

    def _complete(self, messages, pool, options, cancel, t0):
        tokens, max_tokens = self.render_checked(messages, options.max_tokens)
        k, cache, snaps = pool.take(tokens)
        if self.split:  # every rank resumes at the same token (their pools match)
            start = self._agree(_Start(cache, k, snaps))
            k, cache, snaps = start.pos, start.cache, start.checkpoints
        elif k < MIN_SHARED:  # nothing pooled: a stored conversation may share a prefix
            donor = self.find_donor(self.engine.layout(), tokens)
            if donor is not None:
                try:
                    cache, snaps = self._load(donor[0], donor[1], donor[2])
                    k = donor[2]
                except CacheInvalid:
                    pass  # a damaged donor: prefill from zero
        start = _Start(cache, k, snaps)
        run = _Run()
        yield from self._prefill_and_decode(tokens[k:], start, max_tokens, options,
                                            cancel or Cancel(), run)
        pool.put((tokens + run.generated)[: run.fed], cache, {s.pos: s for s in run.checkpoints})
        reason = "" if k else "no shared prefix"
        usage = self._usage(tokens, k, run, t0, reason=reason)
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated))

    def render_checked(self, messages: list[dict], max_tokens: int,
                       prior: list[int] | None = None) -> tuple[list[int], int]:
        """Token ids of ``messages`` ready for a reply, and the reply budget that fits."""
        info = self.engine.info()
        tokens = self.engine.render(messages, prior)
        room = info.context_length - len(tokens)
        if room < 1:
            raise ContextFull(
                f"the conversation is {len(tokens)} tokens; {info.name} holds "
                f"{info.context_length}: start a new conversation or shorten the message"
            )
        return tokens, min(max_tokens, room)

    def _history(self, conv: Conversation) -> list[dict]:
        """The stored messages as the template takes them, the system prompt first."""
        history = [{"role": m.role, "content": m.content} for m in self.store.messages(conv)]
        if conv.system and not any(m["role"] == "system" for m in history):
            history.insert(0, {"role": "system", "content": conv.system})
        return history


    # -- prefill, decode, persist ------------------------------------------------------------

    def _prefill_and_decode(self, new_tokens, start: _Start, max_tokens: int,
                            options: TurnOptions, cancel: Cancel, run: _Run):
        """Prefill ``new_tokens`` then decode, recording into ``run``; checks ``cancel``.

        Models with bounded layers get a checkpoint one token before the reply (the end of
        the prompt) and one at the end of the reply.
        """
        engine, cache = self.engine, start.cache
        bounded = bool(ck.bounded(cache))
        run.fed = start.pos
        t = now()
        prefill = engine.prefill(new_tokens, cache)
        logits = None
        while logits is None:
            if self._stop(cancel):
                run.stopped = True
                run.prefill_s = now() - t
                return
            try:
                done, total = next(prefill)
            except StopIteration as fin:
                logits = fin.value
                break
            run.fed = start.pos + done
            if bounded and done == total - 1:
                run.checkpoints.append(ck.capture(cache, run.fed))
            yield PrefillProgress(done, total)
        run.prefill_s = now() - t
        run.logits_ready = True
        run.fed = start.pos + len(new_tokens)
        detok = engine.detokenizer()
        for tok in engine.decode(cache, logits, max_tokens, options.temp, options.seed):
            if run.t_first is None:
                run.t_first = now()
            run.generated.append(tok)
            # engine.decode has fed every token it yielded, except an EOS and the last
            # allowed one (fed when the loop reads on: see the else below).
            final = tok in engine.eos_ids or len(run.generated) >= max_tokens
            run.fed = start.pos + len(new_tokens) + len(run.generated) - final
            run.t_last = now()
            if tok in engine.eos_ids:
                break
            detok.add_token(tok)
            if piece := detok.last_segment:
                run.reply += piece
                yield ReplyChunk(piece)
            if self._stop(cancel):
                run.stopped = True
                break
        else:
            if run.generated and len(run.generated) >= max_tokens:
                run.fed += 1
        detok.finalize()
        if piece := detok.last_segment:
            run.reply += piece
            yield ReplyChunk(piece)
        # Store what the ids decode to: the streaming detokenizer trims a leading space, and
        # the next turn keeps these ids only if the stored text renders back to them.
        ids = [t for t in run.generated if t not in engine.eos_ids]
        run.reply = engine.decode_text(ids) if ids else run.reply
        if bounded:
            run.checkpoints.append(ck.capture(cache, run.fed))

    def _stop(self, cancel: Cancel) -> bool:
        """Stop here? Split over ranks, rank 0's answer (Ctrl-C reaches rank 0 only)."""
        return self.group.agree_any(cancel.is_set()) if self.split else cancel.is_set()

    def _usage(self, tokens: list[int], k: int, run: _Run, t0: float, *, cache_bytes: int = 0,
               written: int = 0, reason: str = "", draft: int = 0) -> Usage:
        t_end = now()
        t_first = run.t_first or t_end
        return Usage.of(
            prompt_tokens=len(tokens), cached_tokens=k, completion_tokens=len(run.generated),
            t0=t0, t_first=t_first, t_last=run.t_last or t_end, prefill_s=run.prefill_s,
            context_tokens=run.fed,
            context_length=self.engine.info().context_length, cache_bytes=cache_bytes,
            bytes_written=written, miss_reason=reason,
            checkpoints=not self.engine.info().cut_anywhere, draft_tokens=draft)
