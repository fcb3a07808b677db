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

Resuming (see ``cachekinds.py``): the cached token list ``C`` and the new rendering ``T``
share a prefix of length k. Growing layers are cut to any position; bounded layers only come
back at a checkpoint, so a turn resumes from p = the latest checkpoint ≤ k (p = k when every
layer grows). Checkpoints are taken at the end of each prompt's prefill (one token before the
reply: regenerate resumes there) and at the end of each reply (the next turn resumes there).

Drafts (``prefill_draft``): while the user is still typing, the app prefills the message's
stable tokens into the cache in memory; the turn that sends it starts from the part that
matches its own rendering, so only the rest is prefilled after Enter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import budget, drafts, paths
from . import cachekinds as ck
from .cluster import ClusterLost, Solo
from .engine import Engine, now
from .errors import BadInput, ContextFull, LocalchatError, StorageError
from .events import DraftProgress, Event, Notice, PrefillProgress, ReplyChunk, TurnFinished, Usage
from .kvstore import KEEP_CHECKPOINTS, CacheInvalid, KVStore, Layout, Manifest, common_prefix
from .locks import ConversationLock
from .prefixes import PrefixPool
from .store import Conversation, Store

__all__ = ["Cancel", "DraftProgress", "Event", "Notice", "PrefillProgress", "ReplyChunk",
           "Session", "TurnFinished", "TurnOptions", "Usage", "open_session"]

HEADROOM = 256  # positions allocated past a loaded cache, so the turn appends in place
MIN_SHARED = 32  # shorter prefixes shared with another conversation are not worth linking
# A draft prefills this many tokens at a time, checking between chunks whether the user typed
# again (or sent it): ~0.25 s of the default model on a 2-core CPU.
DRAFT_CHUNK = 64
DRAFT_CHECKPOINTS = 3  # bounded states kept past the history's end while a draft grows


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
    kv_root = group.kv_root(paths.kv_root()) if group is not None else paths.kv_root()
    session = Session(store, engine, kv_root, paths.locks_dir(), lock_timeout, group=group)
    if group is not None:
        group.on_lost.append(session.save_partial)
    return session


def fork_conversation(store: Store, conv: Conversation, name: str, at: int | None = None,
                      kv_root: Path | None = None, locks_dir: Path | None = None,
                      lock_timeout: float = 60.0) -> tuple[Conversation, int]:
    """A new conversation ``name`` holding ``conv``'s first ``at`` messages (all if None),
    its system prompt and settings, and its cache files as hard links (no model needed).

    The fork's cache holds all of the parent's tokens; its next turn keeps the prefix its own
    rendering shares and drops the rest. Deleting either conversation leaves the other's
    files intact. Returns (the fork, cache bytes written: the manifest, plus copies where the
    filesystem has no hard links).
    """
    kv_root = kv_root or paths.kv_root()
    messages = store.messages(conv)
    if at is not None and not 0 <= at <= len(messages):
        raise BadInput(f"--at must be between 0 and {len(messages)} (messages in {conv.name})")
    lock = ConversationLock((locks_dir or paths.locks_dir()) / f"{conv.id}.lock", conv.name,
                            lock_timeout)
    with lock:
        new = store.create(name, conv.model, conv.system)
        if conv.kv_bits:
            new = store.update(new, kv_bits=conv.kv_bits, kv_group=conv.kv_group)
        for m in messages[:at]:
            store.add_message(new, m.role, m.content, m.partial)
        src = KVStore(kv_root / str(conv.id))
        try:
            man = src.manifest()
        except CacheInvalid:
            man = None
        written = 0
        if man is not None and at != 0:
            try:
                written = KVStore(kv_root / str(new.id)).adopt(src, man, len(man.tokens))
            except (CacheInvalid, OSError):
                shutil.rmtree(kv_root / str(new.id), ignore_errors=True)  # only speed lost
    return store.get(name), written


def delete_conversation(store: Store, conv: Conversation, kv_root: Path | None = None) -> None:
    """Delete a conversation's messages, then its KV cache folder (no model needed)."""
    store.delete(conv)
    shutil.rmtree((kv_root or paths.kv_root()) / str(conv.id), ignore_errors=True)


@dataclass
class _Live:
    """The cache of the last conversation this process ran, kept in memory between turns.

    ``cache`` holds exactly ``tokens``. Its first ``on_disk`` tokens are the manifest's; a
    draft prefilled before Enter (``Session.prefill_draft``) adds more, in memory only.
    """

    conversation_id: int
    fingerprint: str
    tokens: list[int]
    cache: list
    checkpoints: dict[int, ck.Captured]
    on_disk: int = -1  # -1: all of ``tokens``

    def __post_init__(self) -> None:
        if self.on_disk < 0:
            self.on_disk = len(self.tokens)


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
    fed: int = 0  # tokens the cache holds (ArraysCache keeps no count of its own)
    checkpoints: list[ck.Captured] = field(default_factory=list)


@dataclass
class _Start:
    """Where a turn starts: the conversation's token list, the cache holding its first
    ``pos`` tokens, and why anything before the new message is prefilled again."""

    cache: list
    pos: int
    checkpoints: dict[int, ck.Captured]
    changed: str = ""  # the rendering differs from the cached tokens before their end
    fallback: str = ""  # bounded layers resumed from a checkpoint before that point
    draft: int = 0  # of ``pos``: tokens past the disk's, prefilled as a draft before Enter


class Session:
    """Runs turns of conversations stored in ``store`` with ``engine``."""

    def __init__(self, store: Store, engine: Engine, kv_root: Path, locks_dir: Path,
                 lock_timeout: float = 60.0, group=None):
        self.store = store
        self.engine = engine
        self.kv_root = kv_root
        self.locks_dir = locks_dir
        self.lock_timeout = lock_timeout
        self._live: _Live | None = None
        self.group = group or Solo()  # the ranks the model is split over (``cluster.py``)
        self._running: tuple[Conversation, _Run] | None = None  # for ``save_partial``

    @property
    def split(self) -> bool:
        """The model runs over several ranks: no drafts, no sharing between conversations."""
        return self.group.size > 1

    def close(self) -> None:
        self.store.close()
        if self.split and self.group.rank == 0:
            self.group.close()

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
            quant = self._check_quant(kv_bits, kv_group)
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

    def _check_quant(self, bits: int, group: int | None) -> ck.KVQuant | None:
        from . import kvquality

        if bits == 0:
            return None
        if bits not in (4, 8):
            raise BadInput("--kv-bits must be 8 or 4 (or 0 for float16)")
        growing = self.engine.layout().growing
        if not growing:
            raise BadInput(f"{self.model_name} keeps no growing K/V to quantize")
        width = growing[0].k_shape[1]
        group = group or ck.default_group(width)
        if group not in (32, 64, 128) or not any(ck.KVQuant(bits, group).fits(s)
                                                 for s in growing):
            raise BadInput(f"--kv-group-size must be 32, 64 or 128 and divide the head "
                           f"dimension ({width} for {self.model_name})")
        quant = ck.KVQuant(bits, group)
        kvquality.check(self.engine, quant)
        return quant

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
        delete_conversation(self.store, conv, self.kv_root)
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
            if self.split and self.group.rank == 0:
                self.group.command(
                    "turn", conversation=dataclasses.asdict(conv), prompt=prompt, cut=cut,
                    options=dataclasses.asdict(options),
                    messages=[(m.seq, m.role, m.content, m.partial)
                              for m in self.store.messages(conv)])
            reason = ""
            if cut is not None:
                reason = self._cut(conv, cut)
            yield from self._turn(conv, prompt, options, cancel, t0, reason)
        except ClusterLost:
            raise
        except LocalchatError:
            self.group.finish()  # the followers raised it too, at the same point
            raise
        else:
            self.group.finish()
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
        usage = self._usage(tokens, start.pos, run, t0, cache_bytes=kv.disk_bytes(),
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
        try:
            yield from self._complete(messages, pool, options, cancel, t0)
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

    # -- drafts: the next message, prefilled before it is sent -------------------------------

    def prefill_draft(self, conv: Conversation, text: str, cancel: Cancel
                      ) -> Iterator[DraftProgress]:
        """Prefill the stable part of an unsent message into the conversation's cache in
        memory, so that the turn that sends it starts from there.

        Renders the conversation with ``text`` as a new user message, holds back what may
        still change (``drafts.stable_tokens``: the last word, the end of the message, the
        generation prompt) and prefills the rest after the cached history, ``DRAFT_CHUNK``
        tokens at a time, checking ``cancel`` between chunks. Nothing goes to the database or
        the disk. The next turn of ``conv`` keeps what matches its own rendering (``_start``):
        an edit keeps the prefilled tokens before it, and the reply is the one it would be
        without a draft. A turn of another conversation or of another process drops it, and
        so does quitting. Nothing is done for a damaged or missing cache (the turn rebuilds
        it), a model whose cache is not kept, a template that rewrites the end of the
        history, or a message over the context.

        Not concurrently with a turn of this session: the app runs both on its one MLX
        thread (``tui/mlxthread.py``).

        Yields:
            DraftProgress: first what is prefilled already, then after each chunk.
        """
        engine = self.engine
        if cancel.is_set() or not text.strip() or engine.info().unknown or self.split:
            return
        kv = self.kvstore(conv)
        prior, man, note = self._prior(conv, kv, False, draft=True)
        if note not in ("", "new conversation"):
            return
        messages = self._history(conv) + [{"role": "user", "content": text}]
        tokens = engine.render(messages, prior)
        on_disk = len(prior or ())
        if common_prefix(prior or [], tokens) < on_disk or \
                len(tokens) >= engine.info().context_length:
            return
        target = drafts.stable_tokens(engine, messages, tokens, on_disk)
        live = self._live  # this conversation's (``_prior`` dropped any other) or None

        def progress(fed: int) -> DraftProgress:
            return DraftProgress(max(0, min(fed, target) - on_disk), target - on_disk,
                                 len(tokens) - on_disk)

        if target == on_disk or (live and common_prefix(live.tokens, tokens) >= target):
            yield progress(target)
            return
        start = self._start(kv, prior, man, tokens[:target], False, draft=True)
        if start.changed.startswith(("cache rebuilt", "cache partly rebuilt")):
            return
        self._live = live = _Live(conv.id, engine.cache_fingerprint, tokens[: start.pos],
                                  start.cache, dict(start.checkpoints), on_disk)
        yield progress(start.pos)
        bounded = bool(ck.bounded(live.cache))
        # Bounded caches get checkpoints as the draft grows (an edit goes back to one), and
        # one at the history's end when resumed before it.
        ends = [on_disk] if bounded and start.pos < on_disk else []
        for end in ends + [target]:
            first = len(live.tokens)
            steps = engine.prefill(tokens[first:end], live.cache, DRAFT_CHUNK)
            while not cancel.is_set():
                try:
                    done, _ = next(steps)
                except StopIteration:
                    done = end - first
                except BaseException:
                    self._live = None  # stopped inside a model step: the cache is unknown
                    raise
                live.tokens = tokens[: first + done]
                if bounded and (len(live.tokens) > on_disk or len(live.tokens) == end):
                    self._keep_draft_checkpoint(live)
                if len(live.tokens) == end:
                    break
                yield progress(len(live.tokens))
            steps.close()
            if cancel.is_set():
                break
        yield progress(len(live.tokens))

    @staticmethod
    def _keep_draft_checkpoint(live: _Live) -> None:
        """Capture the bounded state where the draft now ends. Kept: the history's
        checkpoints, and past them the newest ``DRAFT_CHECKPOINTS`` at least 8 tokens apart
        (not all at the last few words typed), so that an edit restores a state near it."""
        pos = len(live.tokens)
        live.checkpoints[pos] = ck.capture(live.cache, pos)
        kept: list[int] = []
        for q in sorted((q for q in live.checkpoints if q > live.on_disk), reverse=True):
            if len(kept) < DRAFT_CHECKPOINTS and (not kept or kept[-1] - q >= 8):
                kept.append(q)
            else:
                del live.checkpoints[q]

    # -- where a turn starts -----------------------------------------------------------------

    def _shareable_ends(self, conv: Conversation, fed: list[int]) -> tuple[int, ...]:
        """Where a new segment should end so that another conversation can link it whole:
        after the system prompt (a persona or a document many conversations start with)."""
        if not conv.system or self.engine.info().unknown:
            return ()
        head = self.engine.render([{"role": "system", "content": conv.system}],
                                  generation_prompt=False)
        n = common_prefix(head, fed)
        return (n,) if n == len(head) else ()

    def _load(self, kv: KVStore, man: Manifest, p: int) -> tuple[list, dict]:
        """A fresh cache holding the first ``p`` tokens of a stored one (growing layers from
        segments, bounded ones from the checkpoint at ``p``), and that checkpoint."""
        engine = self.engine
        cache = engine.new_cache()
        growing = [o for _, o in ck.leaves(cache) if ck.kind_of(o) == ck.GROWING]
        loaded = kv.load_growing(man, p, engine.compute_dtype(), HEADROOM)
        for obj, (keys, values) in zip(growing, loaded):
            ck.set_growing(obj, keys, values, p)
        checkpoints = {}
        if engine.layout().has_bounded:
            snap = kv.load_checkpoint(man.checkpoint_at_most(p))
            ck.restore(cache, snap)
            checkpoints[p] = snap
        return cache, checkpoints

    # -- sharing -------------------------------------------------------------------------

    def find_donor(self, layout: Layout, tokens: list[int], exclude: str | None = None
                   ) -> tuple[KVStore, Manifest, int] | None:
        """The stored cache (of any conversation, same model and settings) that gives the
        longest prefix of ``tokens``: (its store, manifest, usable length), or None.

        Growing layers can give any prefix; bounded ones only up to a checkpoint.
        """
        best = None
        if not self.kv_root.is_dir():
            return None
        for folder in self.kv_root.iterdir():
            if folder.name == exclude or not folder.is_dir():
                continue
            kv = KVStore(folder)
            try:
                man = kv.checked_manifest(layout)
            except (CacheInvalid, OSError):
                continue
            if man is None:
                continue
            k = min(common_prefix(man.tokens, tokens), len(tokens) - 1)
            if layout.has_bounded:
                ckpt = man.checkpoint_at_most(k)
                k = ckpt.pos if ckpt else 0
            if k >= MIN_SHARED and (best is None or k > best[2]):
                best = (kv, man, k)
        return best

    def _adopt_shared(self, conv: Conversation, kv: KVStore, tokens: list[int]
                      ) -> Manifest | None:
        """Link the best donor's prefix into ``conv``'s empty cache folder; its manifest."""
        layout = self.engine.layout(self._quant(conv))
        donor = self.find_donor(layout, tokens, exclude=str(conv.id))
        if donor is None:
            return None
        src, man, k = donor
        try:
            kv.clear()
            kv.adopt(src, man, k)
            return kv.checked_manifest(layout)
        except (CacheInvalid, OSError):
            kv.clear()  # a donor changing under us only costs the sharing
            return None

    def fork(self, conv: Conversation, name: str, at: int | None = None
             ) -> tuple[Conversation, int]:
        """A new conversation ``name`` with ``conv``'s first ``at`` messages (all if None),
        sharing ``conv``'s cache files; (the fork, cache bytes written)."""
        return fork_conversation(self.store, conv, name, at, self.kv_root, self.locks_dir,
                                 self.lock_timeout)

    def _prior(self, conv: Conversation, kv: KVStore, no_cache: bool, *, draft: bool = False
               ) -> tuple[list[int] | None, Manifest | None, str]:
        """(the conversation's cached token list, its valid manifest, a note).

        Split over ranks, each rank reads its own shard; they are used only if every rank
        holds a valid one for the same tokens (else all rebuild together), so every rank
        renders the same token ids.
        """
        prior, man, note = self._prior_local(conv, kv, no_cache, draft=draft)
        if not self.split:
            return prior, man, note
        digest = hashlib.sha256(f"{man is not None}:{prior}".encode()).digest()
        rows = self.group.gather([int.from_bytes(digest[:7], "little")])
        if all(r == rows[0] for r in rows):
            return prior, man, note
        self._live = None
        kv.clear()
        odd = [str(i) for i, r in enumerate(rows) if r != rows[0]]
        return None, None, (f"cache rebuilt: the shard of rank {', '.join(odd)} does not match "
                            "rank 0's (damaged, missing or behind)")

    def _prior_local(self, conv: Conversation, kv: KVStore, no_cache: bool, *,
                     draft: bool = False) -> tuple[list[int] | None, Manifest | None, str]:
        """``_prior`` of this process's own cache folder.

        The token list also aligns the rendering (``Engine.render``), so ``--no-cache`` reads
        it too and only ignores the K/V. ``draft``: for ``prefill_draft``, which writes
        nothing: an invalid cache is left for the turn to clear (and to say why).
        """
        live = self._live
        try:
            man = kv.checked_manifest(self.engine.layout(self._quant(conv)))
        except CacheInvalid as err:
            if not draft:
                kv.clear()
            self._live = None
            return None, None, f"cache rebuilt: {err}"
        except OSError as err:
            return None, None, f"cache rebuilt: {err.strerror or err}"
        if no_cache:
            self._live = None
            kv.clear()  # a fresh cache is written at the end of the turn
            return (man.tokens if man else None), None, "cache ignored (--no-cache)"
        if man is None:
            # Memory may hold a draft of this new conversation (nothing of it on disk).
            if not (live and live.conversation_id == conv.id and live.on_disk == 0
                    and live.fingerprint == self.engine.cache_fingerprint):
                self._live = None
            if self.engine.info().unknown:
                return None, None, "this model's cache is not kept"
            return None, None, ("cache rebuilt: no cache on disk" if conv.tokens > 0
                                else "new conversation")
        # Trust memory only if the disk still agrees (another process may have moved on);
        # memory may hold more: a draft prefilled before Enter.
        if not (live and live.conversation_id == conv.id and live.on_disk == len(man.tokens)
                and live.tokens[:live.on_disk] == man.tokens
                and live.fingerprint == self.engine.cache_fingerprint):
            self._live = None
        return man.tokens, man, ""

    def _start(self, kv: KVStore, prior, man: Manifest | None, tokens: list[int],
               no_cache: bool, *, draft: bool = False) -> _Start:
        """The cache to prefill from (``_start_local``), at a token every rank resumes at."""
        start = self._start_local(kv, prior, man, tokens, no_cache, draft=draft)
        return self._agree(start) if self.split else start

    def _agree(self, start: _Start) -> _Start:
        """Split over ranks: every rank resumes at the same token, the lowest any rank can
        (a rank whose cache was cut short, or whose layers resume only at checkpoints);
        a rank that cannot go back there makes every rank start from zero."""
        damaged = start.changed.startswith(("cache rebuilt", "cache partly rebuilt"))
        rows = self.group.gather([start.pos, 2 if damaged else 1 if start.fallback else 0])
        p, was = min(r[0] for r in rows), start.pos
        why = max(r[1] for r in rows if r[0] == p)
        ok = True
        if p < start.pos:
            cache = start.cache
            if p == 0:
                cache = self.engine.new_cache()
            elif ck.bounded(cache):
                ok = p in start.checkpoints
                if ok:
                    ck.trim_growing(cache, p)
                    ck.restore(cache, start.checkpoints[p])
            else:
                ck.trim_growing(cache, p)
            if ok:
                odd = ", ".join(str(i) for i, r in enumerate(rows) if r[0] == p)
                start = dataclasses.replace(
                    start, cache=cache, pos=p,
                    checkpoints={q: c for q, c in start.checkpoints.items() if q <= p})
                if why == 2:
                    start.changed = (f"cache partly rebuilt: the shard of rank {odd} is "
                                     f"damaged; {p} tokens reused" if p else
                                     f"cache rebuilt: the shard of rank {odd} is damaged")
                elif why == 1 and not start.fallback:
                    start.fallback = (f"resumed from the checkpoint {was - p} tokens "
                                      f"back (rank {odd}'s layers cannot be cut there)")
        if self.group.agree_all(ok):
            return start
        self._live = None
        return _Start(self.engine.new_cache(), 0, {},
                      "cache rebuilt: the ranks' shards cannot resume at the same token")

    def _start_local(self, kv: KVStore, prior, man: Manifest | None, tokens: list[int],
                     no_cache: bool, *, draft: bool = False) -> _Start:
        """The cache to prefill from: memory when it holds this conversation, else disk.

        Memory may hold more than the disk (``prior``): a draft prefilled before Enter. Its
        tokens count where they match ``tokens``; the rest of it is cut like any other.
        """
        engine, live = self.engine, self._live
        cached = live.tokens if live is not None else prior
        if not cached or no_cache or (man is None and live is None):
            return _Start(engine.new_cache(), 0, {})
        base = len(prior or ())  # what the disk holds
        k = min(common_prefix(cached, tokens), len(tokens) - 1)
        changed = "" if k >= base else \
            f"re-rendered: the conversation differs {base - k} tokens back"
        fallback = ""
        if not engine.layout().has_bounded:
            p, snap = k, None
        else:
            held = dict(live.checkpoints) if live else {}
            on_disk = man.checkpoint_at_most(k) if man else None
            p = max([q for q in held if q <= k] + [on_disk.pos if on_disk else 0])
            if live and k == len(live.tokens):
                p = k  # an exact extension: the bounded state in memory is already there
            snap = held.get(p)
            if p < min(k, base):  # (a draft's own tail recomputed is no miss)
                fallback = (f"resumed from the checkpoint {min(k, base) - p} tokens back "
                            "(this model's cache cannot be cut there)")
        if p == 0:
            return _Start(engine.new_cache(), 0, {}, changed, fallback)
        try:
            if live is not None:
                cache = live.cache
                if p < len(live.tokens):
                    ck.trim_growing(cache, p)
                    if snap is None and engine.layout().has_bounded:
                        snap = kv.load_checkpoint(man.checkpoint_at_most(p))
                    if snap is not None:
                        ck.restore(cache, snap)
                # (a draft's own checkpoints are of no use once it is sent, except at p)
                checkpoints = {q: c for q, c in live.checkpoints.items()
                               if q <= p and (q <= base or q == p or draft)}
            else:
                try:
                    cache, checkpoints = self._load(kv, man, p)
                except CacheInvalid as err:
                    # A damaged segment spoils only what it covers: resume before it.
                    ckpt = man.checkpoint_at_most(err.usable)
                    q = err.usable if not engine.layout().has_bounded else (
                        ckpt.pos if ckpt else 0)
                    if q <= 0:
                        raise
                    cache, checkpoints = self._load(kv, man, q)
                    changed = f"cache partly rebuilt: {err}; {q} tokens reused"
                    p, fallback = q, ""
        except CacheInvalid as err:
            if not draft:  # a draft writes nothing: the turn clears it
                kv.clear()
            self._live = None
            return _Start(engine.new_cache(), 0, {}, f"cache rebuilt: {err}")
        return _Start(cache, p, checkpoints, changed, fallback, max(0, p - base))

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

    def _persist(self, conv, kv: KVStore, fed_candidates: list[int], start: _Start, run: _Run,
                 partial: bool, notices: list[str] | None = None) -> int:
        """Save the reply, then write the cache (segments, checkpoints, manifest). Returns
        bytes written.

        The reply goes first: it is what the user cannot get back, while a cache that is not
        written (full disk, read-only or vanished folder, a kill) only costs a later prefill —
        the previous manifest still describes valid files.
        """
        if run.reply:  # an empty reply (stopped before any text) is not worth a message
            self.store.add_message(conv, "assistant", run.reply, partial=partial)
        cache = start.cache
        n = run.fed
        fed = fed_candidates[:n]
        written = 0
        if not self.engine.info().unknown:
            quant = self._quant(conv)
            layout = self.engine.layout(quant)
            encode = None
            if quant is not None:
                def encode(a: int, b: int) -> dict:
                    return ck.quantize_growing(cache, layout.growing, a, b, quant)
            try:
                # Positions from the resume point on were computed this turn; memory holds
                # those (quantized as they are stored), so the disk copy is rewritten to match.
                written = kv.commit(layout, fed, cache, run.checkpoints, start.pos, encode,
                                    self._shareable_ends(conv, fed))
                budget.enforce(self.kv_root, self.locks_dir, budget.cache_limit(self.kv_root),
                               keep={str(conv.id)})
                held = {**start.checkpoints, **{c.pos: c for c in run.checkpoints}}
                # Memory keeps what the disk keeps: the newest few (a long chat must not grow).
                held = dict(sorted(held.items())[-KEEP_CHECKPOINTS:])
                self._live = _Live(conv.id, layout.fingerprint, fed, cache, held)
            except OSError as err:  # files.write_tensors turns MLX's RuntimeError into this
                self._live = None
                if notices is not None:
                    notices.append(f"cache not saved ({err.strerror or err}); "
                                   "it will be rebuilt")
        try:
            self.store.update(conv, tokens=n)
        except StorageError:
            pass  # the token count only feeds `localchat list`
        return written

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
