"""Conversations and their turns, with each conversation's KV cache reused from memory or disk.

What it is: the layer every front end stands on. ``open_session`` is the one factory (store,
model, session); a ``Session`` runs the turn itself — render → match prefix → restore the
cache → prefill the rest → decode → persist — and is composed of parts with one concern each:

- ``conversations`` (``conversations.py``): find or create, rename, history, fork, delete;
- ``cache`` (``turncache.py``): where a turn resumes, what it writes, the cache in memory;
- ``sharing`` (``kvcache/sharing.py``): prefixes another conversation's cache can lend;
- ``drafts`` (``drafts.py``): the next message prefilled while it is typed;

and the model work of a turn — prefill, decode, checkpoints — is ``generation.generate``.

``turn`` is the one generator every front end consumes (CLI ``ask``, ``batch``, the TUI, the
benchmarks); it yields the records of ``events.py``. What it is not: I/O for a person
(``cli/main.py``, ``tui/``) or the model (``model/engine.py``).

Split over ranks (``cluster/``), every rank runs these same calls on its own shard; what
differs lives in the group (``engine.group``): its agreements, its commands to followers, the
folders of this rank, and the parts only one process can have (``local_only``). Nothing here
asks whether the model is split.

Order of writes (a crash anywhere leaves a consistent state): the user's message is committed
first, so typed text is never lost; after decoding, the reply; then the KV cache segments,
checkpoints and manifest. A stopped reply (a ``Cancel`` set, Ctrl-C, closing the generator)
is kept, marked partial, and the cache holds exactly the tokens that were fed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import crashlog, paths
from ..cluster.group import ClusterLost, reported
from ..errors import BadInput, ContextFull, ConversationNotFound, StorageError
from ..events import DraftProgress, Event, Notice, PrefillProgress, ReplyChunk, TurnFinished, Usage
from ..kvcache import quality as kvquality
from ..kvcache.folder import CacheFolder, CacheInvalid
from ..kvcache.prefixes import PrefixPool
from ..kvcache.sharing import MIN_SHARED, NoSharing, Sharing
from ..model import loading
from ..model.engine import Engine, now
from ..model.replies import split_tool_calls
from ..store.database import Conversation, Store
from ..tools.settings import ToolSettings, digest_of
from . import window
from .conversations import Conversations
from .drafts import Drafts, NoDrafts
from .generation import Cancel, Run, TurnOptions, generate, usage_of
from .images import image_notices, refuse_text_model
from .summary import summarize_cut
from .turncache import Prior, Start, TurnCache

__all__ = ["Cancel", "DraftProgress", "Event", "Notice", "PrefillProgress", "ReplyChunk",
           "Session", "TurnFinished", "TurnOptions", "Usage", "open_session"]


def open_session(model: str | None = None, *, progress: Callable[[str], None] | None = None,
                 load_engine: Callable[..., Engine] | None = None,
                 lock_timeout: float | None = None, group=None) -> Session:
    """The one wiring of every front end: open the database, load the model, make a session.

    Args:
        model: a model name for ``Engine.load`` (None: the default model).
        progress: one-line progress messages while a model is set up.
        load_engine: ``model.loading.load_engine`` (a text or vision model) unless a test
            passes another loader.
        lock_timeout: seconds to wait for a conversation another process uses
            (default: ``LOCALCHAT_LOCK_TIMEOUT`` or 60).
        group: a ``cluster.group.Ring`` (rank 0) to run the model split over several processes.
    Raises:
        StorageError, ModelNotFound, ModelBroken.
    """
    store = Store.open(paths.database_path())
    try:
        if group is None:
            engine = (load_engine or loading.load_engine)(model, progress)
        else:
            engine = loading.load_engine(model, progress, group=group)
    except BaseException:
        store.close()
        raise
    if lock_timeout is None:
        lock_timeout = float(os.environ.get("LOCALCHAT_LOCK_TIMEOUT", "60"))
    session = Session(store, engine, paths.kv_root(), paths.locks_dir(), lock_timeout)
    # Turns an earlier process never finished (killed below Python), said once.
    session.unfinished = crashlog.unfinished_turns(session.locks_dir)
    # Before the app's hook: once the app has given the terminal back, it may exit.
    engine.group.on_lost.insert(0, session.save_partial)
    return session


class Session:
    """Runs turns of conversations stored in ``store`` with ``engine``."""

    def __init__(self, store: Store, engine: Engine, kv_root: Path, locks_dir: Path,
                 lock_timeout: float = 60.0):
        """
        Args:
            kv_root, locks_dir: the data folder's caches and locks (``paths``); this rank's
                own folders are derived from them by the group (``engine.group``).
        """
        self.store = store
        self.engine = engine
        self.group = engine.group  # the ranks the model is split over (``cluster/``)
        self.conversations = Conversations(store, kv_root, self.group.locks_dir(locks_dir),
                                           lock_timeout)
        self.cache = TurnCache(engine, self.group.kv_root(kv_root), (kv_root, locks_dir))
        # What only one process can do: each rank would need the same donor, the same draft.
        self.sharing = self.group.local_only(Sharing(engine, self.cache.kv_root), NoSharing())
        self.drafts = self.group.local_only(Drafts(self.cache, self.conversations), NoDrafts())
        self._running: tuple[Conversation, Run] | None = None  # for ``save_partial``
        self.unfinished: list[str] = []  # turns a killed process left (``open_session``)
        # True while a scheduler drives this session's turns (``scheduler.py``): their decode
        # steps come out as ``Step`` events, run in a batch with other turns'.
        self.stepped = False
        self.prefill_chunk = None  # the scheduler's chunk size, while it runs (``Pace``)
        self.may_draft = None  # whether a greedy turn may draft now, while it runs
        # Prompt lookup for turns whose options leave it open (``--speculate`` of chat/serve).
        self.speculate = "lookup"

    def _speculating(self, options: TurnOptions) -> TurnOptions:
        """``options`` with the session's ``--speculate`` where they leave it open."""
        if options.speculate is not None:
            return options
        return dataclasses.replace(options, speculate=self.speculate)

    @property
    def kv_root(self) -> Path:
        """This rank's folder of conversation caches."""
        return self.cache.kv_root

    @property
    def locks_dir(self) -> Path:
        return self.conversations.locks_dir

    def start_notices(self) -> list[str]:
        """What every front end says once at start: the model's loading notices, then the
        turns an earlier process started and never finished."""
        return [*self.engine.notices, *self.unfinished]

    @property
    def model_name(self) -> str:
        return self.engine.ref.name

    def cache_folder(self, conv: Conversation) -> CacheFolder:
        return self.cache.cache_folder(conv)

    def close(self) -> None:
        self.store.close()

    def save_partial(self, why: str = "") -> None:
        """Store the reply of a turn that cannot finish (a follower was lost while it ran),
        marked partial; from any thread (the cluster watchdog's), on its own connection."""
        running, self._running = self._running, None
        if running is None or not running[1].reply or self.store.path is None:
            return
        store = Store.open(self.store.path)
        try:
            store.add_message(running[0], "assistant", running[1].reply, partial=True)
        finally:
            store.close()

    # -- conversations (on every rank) -----------------------------------------------------

    def conversation(self, name: str | None, *, system: str | None = None,
                     kv_bits: int | None = None, kv_group: int | None = None,
                     thinking: bool | None = None, context_overflow: str | None = None
                     ) -> Conversation:
        """The conversation ``name`` (created if new; a fresh name if None), set to this
        session's model and, when given, to ``system`` and to a KV cache setting.

        Args:
            kv_bits: 8 or 4 to store the conversation's K/V quantized, 0 for float16, None to
                keep its setting. ``kv_group``: the group size (default: ``default_group`` of
                the model's head dim). Checked against the model and the quality gate.
            thinking: whether a reasoning model thinks first (the template's switch; None
                keeps the conversation's setting).
            context_overflow: what a full context does (``window.POLICIES``; None keeps it).
        Raises:
            BadInput: a setting this model cannot take, or one that fails the gate.
        """
        settings = {}
        if kv_bits is not None:
            quant = kvquality.setting(self.engine, kv_bits, kv_group)
            settings = {"kv_bits": quant.bits if quant else None,
                        "kv_group": quant.group if quant else None}
        if thinking is not None:
            settings["thinking"] = thinking
        if context_overflow is not None:
            settings["context_overflow"] = window.policy_of(context_overflow)
        return self.conversations.find_or_create(name, self.model_name, system, **settings)

    def delete(self, conv: Conversation) -> None:
        """Delete a conversation, its messages and its KV cache (every rank's shard)."""
        self.cache.forget(conv.id)
        self.group.command("delete", lambda: {"conversation": conv.id})
        self.conversations.delete(conv)
        self.group.finish()

    def delete_shard(self, conversation_id: int) -> None:
        """A follower's part of ``delete``: its own cache folder of the conversation."""
        self.cache.forget(conversation_id)
        self.cache.cache_folder(conversation_id).remove()

    def fork(self, conv: Conversation, name: str, at: int | None = None
             ) -> tuple[Conversation, int]:
        """A new conversation ``name`` with ``conv``'s first ``at`` messages (all if None),
        sharing ``conv``'s cache files on every rank; (the fork, cache bytes written)."""
        new, written = self.conversations.fork(conv, name, at)
        if at != 0:
            self.group.command("fork", lambda: {"source": conv.id, "fork": new.id})
            self.group.finish()
        return new, written

    def count_tokens(self, text: str) -> int:
        """A draft's length in tokens; safe from any thread (the app's UI thread)."""
        return self.engine.count_tokens(text)

    # -- turns -----------------------------------------------------------------------------

    def turn(self, conv: Conversation, prompt: str | None,
             options: TurnOptions = TurnOptions(), cancel: Cancel | None = None,
             images: tuple[str, ...] = ()) -> Iterator[Event]:
        """Run one turn: add ``prompt`` as the user's message (None: answer as it stands).

        ``images``: content hashes of images stored in the data folder
        (``store.images.ImageStore``) that the message holds, before its text.

        Yields:
            Notice, PrefillProgress and ReplyChunk events, then one TurnFinished.
        Raises:
            BadInput, ContextFull, ConversationBusy, ConversationNotFound, StorageError.
        """
        if prompt is not None and not prompt.strip() and not images:
            raise BadInput("empty prompt")
        if images:
            refuse_text_model(self.engine)
        new = [] if prompt is None else [{"role": "user", "content": prompt,
                                          **({"images": list(images)} if images else {})}]
        yield from self.follow(conv, new, options, cancel or Cancel(), cut=None)

    def answer(self, conv: Conversation, new: list[dict], options: TurnOptions = TurnOptions(),
               cancel: Cancel | None = None) -> Iterator[Event]:
        """Add ``new`` messages (``{role, content}``, the last from the user) and answer: the
        turn of a request that re-sends a conversation (``stateless.py``). Nothing is stored
        when the conversation would not fit the context."""
        yield from self.follow(conv, new, options, cancel or Cancel(), cut=None)

    def regenerate(self, conv: Conversation, options: TurnOptions = TurnOptions(),
                   cancel: Cancel | None = None) -> Iterator[Event]:
        """Drop the last reply and answer the last user message again (reuses the cache
        up to that message)."""
        yield from self.follow(conv, [], options, cancel or Cancel(), cut="reply")

    def edit_last(self, conv: Conversation, text: str, options: TurnOptions = TurnOptions(),
                  cancel: Cancel | None = None) -> Iterator[Event]:
        """Replace the last user message (and what follows) by ``text`` and answer it."""
        if not text.strip():
            raise BadInput("empty prompt")
        yield from self.follow(conv, [{"role": "user", "content": text}], options,
                               cancel or Cancel(), cut="user")

    def follow(self, conv: Conversation, new: list[dict], options: TurnOptions,
               cancel: Cancel, cut: str | None) -> Iterator[Event]:
        """A turn as ``turn``, ``answer``, ``regenerate`` (``cut="reply"``) or ``edit_last``
        (``cut="user"``) run it — and as a follower rank runs rank 0's: ``new`` messages are
        added (after the cut) and the conversation is answered."""
        t0 = now()
        lock = self.conversations.lock(conv)
        if not lock.try_acquire():
            yield Notice(lock.waiting_message, waiting=True)
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
            self.group.command("turn", lambda: {
                "conversation": dataclasses.asdict(conv), "new": new, "cut": cut,
                "options": dataclasses.asdict(options),
                "messages": [(m.seq, m.role, m.content, m.partial, m.extra)
                             for m in self.store.messages(conv)]})
            marker = crashlog.turn_started(self.locks_dir, conv.id, conv.name)
            try:
                with reported(self.group):
                    reason = self.conversations.cut(conv, cut) if cut else ""
                    yield from self._turn(conv, new, options, cancel, t0, reason)
            finally:
                crashlog.turn_ended(marker)
        finally:
            lock.release()
            self._running = None

    def _turn(self, conv, new: list[dict], options: TurnOptions, cancel: Cancel, t0: float,
              edit_reason: str):
        history = self.conversations.history(conv) + list(new)
        if not history or history[-1]["role"] not in ("user", "tool"):
            raise BadInput("nothing to answer: the conversation does not end with a user message")
        prior = self.cache.prior(conv, options.no_cache)
        thinking = options.thinking if options.thinking is not None else conv.thinking
        tools = list(options.tools) or None
        policy = window.policy_of(options.context_overflow or conv.context_overflow)
        summary = window.summary_in_force(conv, policy)

        def fit(at: int, summary: str | None, how: str) -> window.Fitted:
            return window.fit(
                lambda msgs: self.engine.render(msgs, prior.tokens, tools=tools,
                                                thinking=thinking),
                self.engine.info().context_length, window.with_summary(history, summary), at,
                how, options.max_tokens, self.engine.info().name)

        fitted = fit(conv.window_from, summary, policy)
        # A cut writes the summary; so does the first turn of a window none was written for
        # (the policy switched to summarize after a cut, or the user stopped the last one).
        summarized = policy == "summarize" and (fitted.moved or (
            fitted.window_from > 0 and conv.summary_upto != fitted.window_from))
        if summarized:
            yield Notice(f"context full: summarizing {fitted.window_from} earlier messages "
                         "for the model's window (all stay stored)")
            summary, fitted = yield from summarize_cut(self.engine, history, conv, summary,
                                                       fitted, fit, cancel.is_set)
            summarized = summary is not None  # (none written: the cut stands as a truncate)
            if summarized or not cancel.is_set():  # (stopped: the next turn writes it)
                conv = self.store.update(conv, summary=summary,
                                         summary_upto=fitted.window_from)
        tokens, max_tokens = fitted.tokens, fitted.max_tokens
        if fitted.window_from != conv.window_from:
            conv = self.store.update(conv, window_from=fitted.window_from)
        if fitted.moved:
            yield Notice(f"{fitted.notice(summarized)} of the model's window (all stay stored)")
        for m in new:
            self.store.add_message(conv, m["role"], m["content"],
                                   extra={k: v for k, v in m.items()
                                          if k not in ("role", "content")} or None)
        yield from image_notices(self.engine, new)  # (its processor saw them in the render)
        note = prior.note
        if prior.manifest is None and not options.no_cache and not self.engine.info().unknown:
            # Nothing stored for this conversation: start from another one's prefix if any.
            man = self.sharing.adopt(self.cache_folder(conv), self.cache.layout(conv), tokens)
            if man is not None:
                prior = Prior(man.tokens, man)
                note = f"{note}; {len(man.tokens)} tokens shared with another conversation"
        if note.startswith("cache rebuilt"):
            yield Notice(note)
        start = self.cache.start(conv, prior, tokens, options.no_cache)
        if start.changed.startswith("re-rendered") and any(
                m.get("reasoning_content") for m in history):
            start.changed = start.changed.replace(
                "the conversation differs", "earlier reasoning dropped by the template,")
        known_tools, tools_digest = ToolSettings.of(conv), digest_of(options.tools)
        if start.changed.startswith("re-rendered") and tools_digest != known_tools.digest:
            start.changed = "tools changed"  # (tool definitions render near the start)
        if start.damaged:
            yield Notice(start.changed)
        parts = [note] if note else [
            edit_reason or start.changed if start.changed else "", start.fallback]
        if fitted.moved:  # what the cut left out, not the re-render it caused
            parts = [fitted.notice(summarized), start.fallback]
        reason = "; ".join(p for p in parts if p)

        run = Run()
        self._running = (conv, run)
        new_tokens = tokens[start.pos:]
        try:
            try:
                yield from generate(self.engine, new_tokens, start, max_tokens,
                                    self._speculating(options), cancel, run, tokens[:start.pos],
                                    self.stepped, self.prefill_chunk, self.may_draft)
            except RuntimeError as err:  # split: a rank went away mid-step
                raise self.group.lost_error(err) from None
        except GeneratorExit:
            # Closed at a yield point: the cache holds exactly the fed tokens, so keep it.
            self._persist(conv, tokens + run.generated, start, run, True)
            raise
        except (KeyboardInterrupt, ClusterLost):
            # Raised anywhere, perhaps inside a model step: keep the text, not this cache.
            self.cache.forget()
            self._running = None
            if run.reply:
                self.store.add_message(conv, "assistant", run.reply, partial=True)
            raise
        self._running = None
        if options.tools and not run.stopped:
            run.reply, run.tool_calls = split_tool_calls(self.engine, run.reply, options.tools,
                                                         options.call_ids)
            if run.tool_calls:
                run.finish = "tool_calls"
        written, note = self._persist(conv, tokens + run.generated, start, run,
                                      run.stopped and run.logits_ready)
        if tools_digest != known_tools.digest:
            with contextlib.suppress(StorageError):  # (only the miss reason depends on it)
                self.store.update(conv, tools=dataclasses.replace(
                    known_tools, digest=tools_digest).to_json())
        if note:
            yield Notice(note)
        # The conversation's cache is every rank's shard together.
        rows = self.group.gather([self.cache_folder(conv).disk_bytes(), written, int(bool(note))])
        for rank, row in enumerate(rows[1:], start=1):
            if row[2]:
                yield Notice(f"cache not saved on rank {rank}; it will be rebuilt")
        usage = usage_of(self.engine, tokens, start.pos, run, t0,
                         cache_bytes=sum(r[0] for r in rows), written=sum(r[1] for r in rows),
                         reason=reason, draft=start.draft)
        try:
            self.store.add_turn(conv, usage)
        except StorageError:
            pass  # the record only feeds the cache view
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated), run.finish,
                           run.stop_sequence, tuple(run.tool_calls), run.reasoning,
                           run.thinking_seconds, run.complete)

    def _persist(self, conv: Conversation, fed_candidates: list[int], start: Start, run: Run,
                 partial: bool) -> tuple[int, str]:
        """Save the reply, then the cache of the tokens fed; (bytes written, a notice).

        The reply goes first: it is what the user cannot get back, while a cache that is not
        written (full disk, read-only or vanished folder, a kill) only costs a later prefill —
        the previous manifest still describes valid files.
        """
        if run.reply or run.tool_calls or run.reasoning:  # (a reply stopped before any text
            extra = {**({"tool_calls": run.tool_calls} if run.tool_calls else {}),  # is not one)
                     **({"reasoning_content": run.reasoning,  # (and what it took, shown by
                         "reasoning_tokens": run.reasoning_tokens,  # the app's fold)
                         "thinking_seconds": run.thinking_seconds} if run.reasoning else {})}
            self.store.add_message(conv, "assistant", run.reply, partial=partial,
                                   extra=extra or None)
        fed = fed_candidates[:run.fed]
        written, note = self.cache.persist(conv, fed, start, run.checkpoints,
                                           self.sharing.shareable_ends(conv, fed))
        try:
            self.store.update(conv, tokens=run.fed)
        except StorageError:
            pass  # the token count only feeds `localchat list`
        return written, note

    def complete(self, messages: list[dict], pool: PrefixPool,
                 options: TurnOptions = TurnOptions(), cancel: Cancel | None = None,
                 ) -> Iterator[Event]:
        """A turn on messages not stored anywhere (batch lines), reusing pooled prefixes.

        Yields the same events as ``turn``; the finished cache goes back into ``pool``.
        """
        t0 = now()
        self.group.command("complete", lambda: {
            "messages": messages, "pool": id(pool), "options": dataclasses.asdict(options)})
        with reported(self.group):
            yield from self._complete(messages, pool, options, cancel, t0)

    def _complete(self, messages, pool, options, cancel, t0):
        tokens, max_tokens = self.render_checked(messages, options.max_tokens,
                                                 thinking=options.thinking)
        yield from image_notices(self.engine, messages[-1:])  # (a batch line's new message)
        k, cache, snaps = pool.take(tokens)
        if k < MIN_SHARED:  # nothing pooled: a stored conversation may share a prefix
            donor = self.sharing.find_donor(self.engine.layout(), tokens)
            if donor is not None:
                try:
                    cache, snaps = self.cache.load(*donor)
                    k = donor[2]
                except CacheInvalid:
                    pass  # a damaged donor: prefill from zero
        start = self.cache.agree(Start(cache, k, snaps))  # every rank at the same token
        run = Run()
        yield from generate(self.engine, tokens[start.pos:], start, max_tokens,
                            self._speculating(options), cancel or Cancel(), run,
                            tokens[:start.pos], self.stepped, self.prefill_chunk,
                            self.may_draft)
        pool.put((tokens + run.generated)[: run.fed], start.cache,
                 {s.pos: s for s in run.checkpoints})
        reason = "" if start.pos else "no shared prefix"
        usage = usage_of(self.engine, tokens, start.pos, run, t0, reason=reason)
        yield TurnFinished(run.reply, usage, run.stopped, tuple(run.generated), run.finish,
                           run.stop_sequence, reasoning=run.reasoning, complete=run.complete)

    def render_checked(self, messages: list[dict], max_tokens: int,
                       prior: list[int] | None = None, tools: list[dict] | None = None,
                       thinking: bool | None = None) -> tuple[list[int], int]:
        """Token ids of ``messages`` ready for a reply, and the reply budget that fits."""
        info = self.engine.info()
        tokens = self.engine.render(messages, prior, tools=tools, thinking=thinking)
        room = info.context_length - len(tokens)
        if room < 1:
            raise ContextFull(
                f"the conversation is {len(tokens)} tokens; {info.name} holds "
                f"{info.context_length}: start a new conversation or shorten the message"
            )
        return tokens, min(max_tokens, room)
