"""Where a turn's cache starts and what it leaves on disk: a mixin of ``Session``.

What it is: reading a conversation's cache back (``_prior``: the manifest and its token list;
``_start``: the cache object at the position the turn resumes from, from memory or disk) and
writing it after the turn (``_persist``). Split over ranks (``cluster.py``), each rank reads its
own shard and the ranks agree before using it (``_prior``, ``_agree``). What it is not: the
turn itself (``session.py``) or the file format (``kvstore.py``).

Resuming (see ``cachekinds.py``): the cached token list ``C`` and the new rendering ``T``
share a prefix of length k. Growing layers are cut to any position; bounded layers only come
back at a checkpoint, so a turn resumes from p = the latest checkpoint ≤ k (p = k when every
layer grows). Checkpoints are taken at the end of each prompt's prefill (one token before the
reply: regenerate resumes there) and at the end of each reply (the next turn resumes there).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from . import budget
from . import cachekinds as ck
from .errors import StorageError
from .kvstore import KEEP_CHECKPOINTS, CacheInvalid, KVStore, Manifest, common_prefix
from .store import Conversation

HEADROOM = 256  # positions allocated past a loaded cache, so the turn appends in place


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
class _Start:
    """Where a turn starts: the conversation's token list, the cache holding its first
    ``pos`` tokens, and why anything before the new message is prefilled again."""

    cache: list
    pos: int
    checkpoints: dict[int, ck.Captured]
    changed: str = ""  # the rendering differs from the cached tokens before their end
    fallback: str = ""  # bounded layers resumed from a checkpoint before that point
    draft: int = 0  # of ``pos``: tokens past the disk's, prefilled as a draft before Enter


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


class TurnCache:
    """``Session``'s cache side; expects ``engine``, ``group``, ``store``, ``kv_root``,
    ``locks_dir``, ``split``, ``_live``, ``_quant`` and ``_shareable_ends``."""

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

    def _persist(self, conv, kv: KVStore, fed_candidates: list[int], start: _Start, run,
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
                budget.enforce(*self.budget_home, budget.cache_limit(self.budget_home[0]),
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
