"""Where a turn's cache starts and what it leaves on disk: one part of a ``Session``.

What it is: ``TurnCache`` reads a conversation's cache back (``prior``: the manifest and its
token list; ``start``: the cache object at the position the turn resumes from, from memory
or disk), writes it after the turn (``persist``), and keeps the last conversation's cache in
memory between turns (``live``). Split over ranks (``cluster/``), each rank reads its own
shard and the ranks agree through the group before using it; with one process the group's
agreements are the local values. What it is not: the turn itself (``session.py``), the file
format (``kvcache/``), or which other conversation can lend a prefix (``kvcache/sharing``).

Resuming (see ``kvcache/kinds.py``): the cached token list ``C`` and the new rendering ``T``
share a prefix of length k. Growing layers are cut to any position; bounded layers only come
back at a checkpoint, so a turn resumes from p = the latest checkpoint ≤ k (p = k when every
layer grows). Checkpoints are taken at the end of each prompt's prefill (one token before the
reply: regenerate resumes there) and at the end of each reply (the next turn resumes there).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..kvcache import budget
from ..kvcache import kinds as ck
from ..kvcache.folder import (
     KEEP_CHECKPOINTS,
     CacheFolder,
     CacheInvalid,
     Layout,
     Manifest,
     common_prefix,
 )
from ..store.database import Conversation

HEADROOM = 256  # positions allocated past a loaded cache, so the turn appends in place


@dataclass
class Live:
    """The cache of the last conversation this process ran, kept in memory between turns.

    ``cache`` holds exactly ``tokens``. Its first ``on_disk`` tokens are the manifest's; a
    draft prefilled before Enter (``Drafts.prefill``) adds more, in memory only.
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


@dataclass(frozen=True)
class Prior:
    """What a conversation's folder holds before a turn: its cached token list (also read
    with ``--no-cache``: it aligns the rendering), its manifest if usable, and a note."""

    tokens: list[int] | None
    manifest: Manifest | None
    note: str = ""  # "", "new conversation", "cache rebuilt: …", …


@dataclass
class Start:
    """Where a turn starts: the cache holding the first ``pos`` tokens of the rendering, and
    why anything before the new message is prefilled again."""

    cache: list
    pos: int
    checkpoints: dict[int, ck.Captured]
    changed: str = ""  # the rendering differs from the cached tokens before their end
    fallback: str = ""  # bounded layers resumed from a checkpoint before that point
    draft: int = 0  # of ``pos``: tokens past the disk's, prefilled as a draft before Enter

    @property
    def damaged(self) -> bool:
        return self.changed.startswith(("cache rebuilt", "cache partly rebuilt"))


def quant_of(conv: Conversation) -> ck.KVQuant | None:
    """The conversation's KV cache quantization setting (None: stored as computed)."""
    return ck.KVQuant(conv.kv_bits, conv.kv_group) if conv.kv_bits else None


class TurnCache:
    """The caches of one engine's conversations under ``kv_root`` (this rank's folder)."""

    def __init__(self, engine, kv_root: Path, budget_home: tuple[Path, Path]):
        """
        Args:
            engine: the loaded model; ``engine.group`` is the ranks it is split over.
            kv_root: this rank's folder of conversation caches.
            budget_home: the data folder's cache root and locks, over which the disk budget
                is enforced after each write (every rank's folder counts together).
        """
        self.engine = engine
        self.group = engine.group
        self.kv_root = kv_root
        self.budget_home = budget_home
        self.live: Live | None = None

    def cache_folder(self, conv: Conversation | int) -> CacheFolder:
        return CacheFolder(self.kv_root / str(conv.id if isinstance(conv, Conversation) else conv))

    def layout(self, conv: Conversation) -> Layout:
        return self.engine.layout(quant_of(conv))

    def forget(self, conversation_id: int | None = None) -> None:
        """Drop the cache held in memory (of ``conversation_id`` only, when given)."""
        if conversation_id is None or (self.live and self.live.conversation_id ==
                                       conversation_id):
            self.live = None

    # -- reading ---------------------------------------------------------------------------

    def prior(self, conv: Conversation, no_cache: bool, *, draft: bool = False) -> Prior:
        """The conversation's cached token list and valid manifest, on every rank.

        Each rank reads its own folder; the result is used only if every rank holds a valid
        one for the same tokens (else all rebuild together), so every rank renders the same
        token ids. ``draft``: for a draft prefill, which writes nothing: an invalid cache is
        left for the turn to clear (and to say why).
        """
        kv = self.cache_folder(conv)
        prior = self._prior_here(conv, kv, no_cache, draft)
        digest = hashlib.sha256(f"{prior.manifest is not None}:{prior.tokens}".encode())
        rows = self.group.gather([int.from_bytes(digest.digest()[:7], "little")])
        odd = [str(i) for i, r in enumerate(rows) if r != rows[0]]
        if not odd:
            return prior
        self.live = None
        kv.clear()
        return Prior(None, None, f"cache rebuilt: the shard of rank {', '.join(odd)} does not "
                     "match rank 0's (damaged, missing or behind)")

    def _prior_here(self, conv: Conversation, kv: CacheFolder, no_cache: bool,
                    draft: bool) -> Prior:
        """``prior`` of this process's own folder."""
        live = self.live
        try:
            man = kv.checked_manifest(self.layout(conv))
        except CacheInvalid as err:
            if not draft:
                kv.clear()
            self.live = None
            return Prior(None, None, f"cache rebuilt: {err}")
        except OSError as err:
            return Prior(None, None, f"cache rebuilt: {err.strerror or err}")
        if no_cache:
            self.live = None
            kv.clear()  # a fresh cache is written at the end of the turn
            return Prior(man.tokens if man else None, None, "cache ignored (--no-cache)")
        fingerprint = self.engine.cache_fingerprint
        if man is None:
            # Memory may hold a draft of this new conversation (nothing of it on disk).
            if not (live and live.conversation_id == conv.id and live.on_disk == 0
                    and live.fingerprint == fingerprint):
                self.live = None
            if self.engine.info().unknown:
                return Prior(None, None, "this model's cache is not kept")
            return Prior(None, None, "cache rebuilt: no cache on disk" if conv.tokens > 0
                         else "new conversation")
        # Trust memory only if the disk still agrees (another process may have moved on);
        # memory may hold more: a draft prefilled before Enter.
        if not (live and live.conversation_id == conv.id and live.on_disk == len(man.tokens)
                and live.tokens[:live.on_disk] == man.tokens
                and live.fingerprint == fingerprint):
            self.live = None
        return Prior(man.tokens, man)

    def start(self, conv: Conversation, prior: Prior, tokens: list[int], no_cache: bool, *,
              draft: bool = False) -> Start:
        """The cache to prefill ``tokens`` from, at a token every rank resumes at."""
        return self.agree(self._start_here(conv, prior, tokens, no_cache, draft))

    def agree(self, start: Start) -> Start:
        """Every rank resumes at the same token, the lowest any rank can (a rank whose cache
        was cut short, or whose layers resume only at checkpoints); a rank that cannot go
        back there makes every rank start from zero. One process: ``start`` as it is."""
        rows = self.group.gather([start.pos, 2 if start.damaged else 1 if start.fallback
                                  else 0])
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
        self.live = None
        return Start(self.engine.new_cache(), 0, {},
                     "cache rebuilt: the ranks' shards cannot resume at the same token")

    def _start_here(self, conv: Conversation, prior: Prior, tokens: list[int],
                    no_cache: bool, draft: bool) -> Start:
        """The cache to prefill from: memory when it holds this conversation, else disk.

        Memory may hold more than the disk (``prior``): a draft prefilled before Enter. Its
        tokens count where they match ``tokens``; the rest of it is cut like any other.
        """
        engine, live, man, kv = self.engine, self.live, prior.manifest, self.cache_folder(conv)
        cached = live.tokens if live is not None else prior.tokens
        if not cached or no_cache or (man is None and live is None):
            return Start(engine.new_cache(), 0, {})
        base = len(prior.tokens or ())  # what the disk holds
        k = engine.resume_at(tokens, min(common_prefix(cached, tokens), len(tokens) - 1))
        changed = "" if k >= base else \
            f"re-rendered: the conversation differs {base - k} tokens back"
        fallback = ""
        bounded = engine.layout().has_bounded
        if not bounded:
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
            return Start(engine.new_cache(), 0, {}, changed, fallback)
        try:
            if live is not None:
                cache = live.cache
                if p < len(live.tokens):
                    ck.trim_growing(cache, p)
                    if snap is None and bounded:
                        snap = kv.load_checkpoint(man.checkpoint_at_most(p))
                    if snap is not None:
                        ck.restore(cache, snap)
                # (a draft's own checkpoints are of no use once it is sent, except at p)
                checkpoints = {q: c for q, c in live.checkpoints.items()
                               if q <= p and (q <= base or q == p or draft)}
            else:
                try:
                    cache, checkpoints = self.load(kv, man, p)
                except CacheInvalid as err:
                    # A damaged segment spoils only what it covers: resume before it.
                    ckpt = man.checkpoint_at_most(err.usable)
                    q = err.usable if not bounded else (ckpt.pos if ckpt else 0)
                    if q <= 0:
                        raise
                    cache, checkpoints = self.load(kv, man, q)
                    changed = f"cache partly rebuilt: {err}; {q} tokens reused"
                    p, fallback = q, ""
        except CacheInvalid as err:
            if not draft:  # a draft writes nothing: the turn clears it
                kv.clear()
            self.live = None
            return Start(engine.new_cache(), 0, {}, f"cache rebuilt: {err}")
        return Start(cache, p, checkpoints, changed, fallback, max(0, p - base))

    def load(self, kv: CacheFolder, man: Manifest, p: int) -> tuple[list, dict]:
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

    # -- writing ---------------------------------------------------------------------------

    def persist(self, conv: Conversation, fed: list[int], start: Start,
                checkpoints: list[ck.Captured], ends: tuple[int, ...] = ()) -> tuple[int, str]:
        """Write the cache of ``fed`` (the tokens the cache now holds) and keep it in memory.

        Positions from ``start.pos`` on were computed this turn; memory holds those
        (quantized as they are stored), so the disk copy is rewritten to match. ``ends``:
        where a new segment should end so that another conversation can link it whole.

        Returns:
            (bytes written, "" or a one-line notice when the cache could not be written:
            full disk, read-only or vanished folder; the next turn rebuilds it).
        """
        if self.engine.info().unknown:
            return 0, ""
        cache, kv = start.cache, self.cache_folder(conv)
        quant = quant_of(conv)
        layout = self.engine.layout(quant)
        encode = None
        if quant is not None:
            def encode(a: int, b: int) -> dict:
                return ck.quantize_growing(cache, layout.growing, a, b, quant)
        try:
            written = kv.commit(layout, fed, cache, checkpoints, start.pos, encode, ends)
            root, locks = self.budget_home
            budget.enforce(root, locks, budget.cache_limit(root), keep={str(conv.id)})
        except OSError as err:  # files.write_tensors turns MLX's RuntimeError into this
            self.live = None
            return 0, f"cache not saved ({err.strerror or err}); it will be rebuilt"
        held = {**start.checkpoints, **{c.pos: c for c in checkpoints}}
        # Memory keeps what the disk keeps: the newest few (a long chat must not grow).
        held = dict(sorted(held.items())[-KEEP_CHECKPOINTS:])
        self.live = Live(conv.id, layout.fingerprint, fed, cache, held)
        return written, ""
