"""Many turns at once on the one model thread: continuous batching over the session's turns.

What it is: ``Scheduler`` drives several turn generators (``Session.answer``, ``turn``,
``complete``) of one session on the model thread. Each turn runs exactly the code a lone turn
runs — place, render, resume from its own conversation's cache (memory, disk, a shared
prefix), prefill, decode, persist — except that its decode steps come out as ``Step`` events
(``Session.stepped``). Between steps the scheduler

- admits waiting jobs into the running set (continuous batching) while ``max_batch`` and the
  memory budget allow (a job that does not fit waits in the queue: it is never crashed);
- advances one turn that is not decoding to its next model call: its resume, then one prompt
  chunk, sized by ``Pace`` to a share of one decode round while others decode, so a long
  prompt does not freeze the others;
- runs every waiting ``Step`` — the decode steps and that chunk — as one model call
  (``run_steps``): the chunk's tokens are rows beside the decode rows, so a round reads the
  weights once (a model that cannot, ``fusion_refusal``, runs the chunk as a pass of its own);
  each turn gets its last row's logits.

A turn retires when it ends, is stopped (``Cancel``, the client went away) or fails; it
persists as a lone turn does, so its conversation is resumable.

How a batch step stays per sequence (``batchstep.py``): each turn keeps its own cache objects
and attention runs per turn over exactly its own keys, so the cache persisted afterwards is
the lone turn's object; the dense layers run batched, reading the weights once for all rows
(decode is memory-bound: 91 ms at batch 1, 131 ms at 8 on the default model, issue 32).
Batched matmuls round differently from one-row ones (~1e-5 here), so greedy replies can,
rarely, differ from the lone reply. A model whose batched step fails or does not match its
lone steps (``batch_refusal`` tries one at start: MLA, which works on its keys before
attention; llama4's chunked cache; deepseek_v32's indexer) runs its turns one at a time, said
once in the log. A model whose turns cannot be stepped at all (``Engine.unstepped``: a
vision model) runs each turn whole, one at a time, making its own model calls. What it is
not: the HTTP side (``server/``), the turn itself (``session.py``).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..cpu import threads
from ..events import Notice, PrefillProgress, Step
from .batchstep import batch_refusal, fusion_refusal, run_steps

BATCH_MEMORY_ENV = "LOCALCHAT_BATCH_MEMORY"  # bytes of K/V the running turns may hold


# -- the scheduler ----------------------------------------------------------------------------


def batch_memory() -> int:
    """The K/V bytes running turns may hold together: ``LOCALCHAT_BATCH_MEMORY`` (``4G``), else
    a quarter of the machine's memory (the model's weights and the OS need the rest)."""
    from ..kvcache.budget import parse_size

    text = os.environ.get(BATCH_MEMORY_ENV, "").strip()
    if text:
        return parse_size(text)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError):  # (no sysconf names: a platform without them)
        return 8 * 2**30


@dataclass
class Work:
    """A job the scheduler runs: ``start(session)`` returns a turn's event generator (driven
    here; each event goes to ``emit``) or None when it did its work at once (a quick call).
    ``cost``: an upper bound of the K/V bytes its turn holds, for the memory budget."""

    start: Callable
    emit: Callable
    cancelled: Callable[[], bool] = lambda: False
    cost: int = 0
    done: Callable = lambda: None  # told once the job's events have ended


MIN_CHUNK = 8  # fewest prompt tokens a chunk takes (below this a chunk is mostly overhead)


@dataclass
class Pace:
    """How many prompt tokens one prefill chunk takes: while other turns wait to decode, what
    adds about ``share`` of one decode round's time to the round it runs in (measured: moving
    averages of a round without a chunk and of what each chunk token adds), so a long prompt
    arriving raises the running streams' inter-token gap by about 1 + ``share`` (issue 32: at
    most 2x) instead of by a whole 512-token chunk (6.8x measured); with no one waiting,
    ``Engine.prefill``'s own chunk."""

    share: float = 0.7
    step_s: float = 0.0  # a decode round with no chunk: the step and each turn's work after
    token_s: float = 0.0  # what one prompt token of a chunk adds to a round
    busy: bool = False  # turns are waiting to decode

    def chunk(self) -> int:
        from ..model.engine import PREFILL_CHUNK

        if not self.busy:
            return PREFILL_CHUNK
        if not (self.step_s and self.token_s):
            return 4 * MIN_CHUNK  # not measured yet: small, to measure
        return max(MIN_CHUNK, min(PREFILL_CHUNK, round(self.share * self.step_s / self.token_s)))

    def stepped(self, seconds: float, chunk_tokens: int = 0, decoding: bool = True) -> None:
        """A round took ``seconds``; ``chunk_tokens`` prompt tokens ran in it, beside decode
        steps if ``decoding``."""
        if not chunk_tokens:
            if decoding:
                self.step_s = ema(self.step_s, seconds)
            return
        extra = seconds - (self.step_s if decoding else 0.0)
        if extra > 0:
            self.token_s = ema(self.token_s, extra / chunk_tokens)


def ema(old: float, new: float) -> float:
    return new if not old else 0.7 * old + 0.3 * new


def is_chunk(step: Step) -> bool:
    """A prompt chunk or a verify pass (more than one token, or one whose logits no one
    reads): rows beyond one decode row each, what ``Pace`` counts."""
    return step.token.shape[0] > 1 or not step.head


@dataclass
class _Turn:
    work: Work
    events: Iterator
    step: Step | None = None  # the decode step it waits for
    locked: bool = False  # waits for a conversation's lock (held by another turn here?)


@dataclass
class Scheduler:
    """Runs ``Work`` on the calling thread (the model thread), ``max_batch`` turns at once."""

    session: object
    max_batch: int = 4
    memory: int = 0  # K/V bytes the running turns may hold together (0: no bound)
    log: Callable[[str], None] = lambda line: None
    queued: collections.deque = field(default_factory=collections.deque)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    running: list = field(default_factory=list)
    refusal: str | None = None  # why turns run alone ("" once checked and batchable)
    unfused: str | None = None  # why prompt chunks run as passes of their own ("" if not)
    steps: int = 0  # decode steps run, and the rows they held (rows / steps: mean batch)
    rows: int = 0
    widest: int = 0
    pace: Pace = field(default_factory=Pace)
    _next: int = 0

    def __post_init__(self) -> None:
        if not self.memory:
            self.memory = batch_memory()

    @property
    def width(self) -> int:
        """How many turns may run at once: ``max_batch``, or 1 for a model that cannot batch."""
        if self.max_batch < 2:
            return 1
        if self.refusal is None:
            engine = self.session.engine
            self.refusal = engine.unstepped() or batch_refusal(engine)
            if self.refusal:
                self.log(f"localchat: turns of this model run one at a time ({self.refusal})")
        return 1 if self.refusal else self.max_batch

    def serve_forever(self) -> None:
        """Run queued jobs, for ever (the server's daemon thread)."""
        self._drive(True)
        while True:
            self.admit(block=not self.running)
            try:
                self.round()
            except Exception as err:  # noqa: BLE001 - a bug: its turns answer it, serving goes on
                for t in list(self.running):
                    self._retire(t, err)

    def run_all(self, works: list[Work]) -> None:
        """Run ``works`` to their end (``batch --parallel``), in order of admission."""
        for w in works:
            self.put(w)
        self._drive(True)
        try:
            while self.running or self.queued:
                self.admit(block=False)
                self.round()
        finally:
            self._drive(False)

    def _drive(self, on: bool) -> None:
        """Take the session's turns over (their decode steps come here) or give them back."""
        s = self.session
        # (a model whose turns make their own calls runs each turn whole, one at a time: the
        # scheduler then only queues them, its rounds each advancing the one turn)
        s.stepped = on and not s.engine.unstepped()
        s.prefill_chunk = self.pace.chunk if on else None
        s.may_draft = self.may_draft if on else None

    def may_draft(self) -> bool:
        """Whether a greedy turn may verify a prompt-lookup draft now: its verify pass is then
        rows of the round's one model call (``fused``), or, for a model that cannot fuse,
        a pass of its own — only while it runs alone and none waits."""
        return self.fused() or (len(self.running) == 1 and not self.queued)

    # -- admission

    def put(self, work: Work) -> None:
        """Queue ``work`` (from any thread)."""
        with self.arrived:
            self.queued.append(work)
            self.arrived.notify()

    def admit(self, block: bool) -> None:
        """Start waiting jobs, oldest first, while there is room: ``width`` turns, and K/V
        within ``memory`` (a job that would pass it waits; alone, a job runs whatever it
        costs, as it always could). ``block``: wait for one when none runs."""
        while len(self.running) < self.width:
            with self.arrived:
                while not self.queued and block and not self.running:
                    # No timeout: a daemon thread woken while the interpreter exits aborts it.
                    self.arrived.wait()
                if not self.queued:
                    return
                work = self.queued[0]
                held = sum(t.work.cost for t in self.running)
                if self.running and self.memory and held + work.cost > self.memory:
                    return
                self.queued.popleft()
            self._start(work)

    def _start(self, work: Work) -> None:
        if work.cancelled():
            work.done()
            return
        try:
            events = work.start(self.session)
        except BaseException as err:  # noqa: BLE001 - the job's owner answers it
            work.emit(err)
            work.done()
            return
        if events is None:
            work.done()
            return
        self.running.append(_Turn(work, events))

    # -- one round: one turn advanced to its next model call (a resume, a prompt chunk), then
    #    one model call for every turn's step

    def fused(self) -> bool:
        """Whether prompt chunks run in the same call as decode steps (checked once)."""
        if self.unfused is None:
            self.unfused = fusion_refusal(self.session.engine)
            if self.unfused:
                self.log("localchat: this model's prompt chunks run as passes of their own "
                         f"({self.unfused})")
        return not self.unfused

    def round(self) -> None:
        if not self.running:
            return
        others = [t for t in self.running if t.step is None and not t.locked]
        t0 = time.perf_counter()
        if others:
            self.pace.busy = any(t.step is not None for t in self.running)
            if not self.pace.busy and len(others) > 1 and self.fused():
                # No one decodes (turns admitted together): every prompt's first chunk goes
                # into this round's one call, the weights read once for all of them.
                for turn in others:
                    self._advance(turn)
            else:
                # Round robin over the turns that are not decoding: one yield point a round.
                self._next %= len(others)
                turn = others[self._next]
                self._next += 1
                self._advance(turn)
            t0 = time.perf_counter()  # (a resume read from disk is no model time)
        elif all(t.locked for t in self.running):
            # Each waits for a conversation's lock and no other turn here holds one now.
            self._advance(self.running[0], unlock=True)
        stepping = [t for t in self.running if t.step is not None]
        if not stepping:
            return
        chunks = [t for t in stepping if is_chunk(t.step)]
        decoding = len(chunks) < len(stepping)
        chunk_tokens = sum(t.step.token.shape[0] for t in chunks)
        if not chunks or len(stepping) == 1 or self.fused():
            calls = [stepping]
        else:  # each chunk as a pass of its own, then the decode steps batched
            calls = [[t] for t in chunks] + [[t for t in stepping if t not in chunks]]
        # The BLAS thread count for this round (``cpu/threads.py``): a round with a prompt
        # chunk counts as prefill (its tokens), one of decode steps as one decode step.
        meter = threads.meter()
        if meter is not None:
            meter.begin("prefill" if chunk_tokens else "decode")
        for call in calls:
            self._call(call, stepping)
        self.steps, self.rows = self.steps + 1, self.rows + len(stepping)
        self.widest = max(self.widest, len(stepping))
        for t in stepping:
            t.step = None
            self._advance(t)
        if meter is not None:
            meter.end(chunk_tokens or 1)
        self.pace.stepped(time.perf_counter() - t0, chunk_tokens, decoding)

    def _call(self, call: list, stepping: list) -> None:
        """Run the steps of ``call`` in one model call; if it fails, each alone (only a failing
        turn fails: it retires, and leaves ``stepping``)."""
        model = self.session.engine.model
        try:
            run_steps(model, [t.step for t in call])
        except Exception:  # noqa: BLE001 - tried again one by one: only a failing turn fails
            for t in list(call):
                try:
                    run_steps(model, [t.step])
                except Exception as err:  # noqa: BLE001 - its owner answers it
                    stepping.remove(t)
                    self._retire(t, err)

    def _retire(self, turn: _Turn, err: BaseException) -> None:
        """End ``turn`` with ``err`` (closed: it keeps its partial reply and the cache of what
        was fed, as a lone turn stopped there)."""
        try:
            turn.events.close()
        except Exception:  # noqa: BLE001 - already failing: the first error is the answer
            pass
        turn.work.emit(err)
        if turn in self.running:
            self.running.remove(turn)
        turn.work.done()

    def _advance(self, turn: _Turn, unlock: bool = False) -> None:
        """Run ``turn`` to its next yield point: a Step (it then waits for the batch), a
        prefill chunk, a lock to wait for, or its end. Its other events go to its owner."""
        if unlock:
            turn.locked = False
        try:
            while True:
                ev = next(turn.events)
                if isinstance(ev, Step):
                    turn.step = ev
                    return
                if isinstance(ev, Notice) and ev.waiting:
                    turn.work.emit(ev)
                    # The lock may be another turn's here: go on once this is the only one.
                    turn.locked = len(self.running) > 1
                    if turn.locked:
                        return
                    continue
                turn.work.emit(ev)
                if isinstance(ev, PrefillProgress):
                    return
        except StopIteration:
            pass
        except BaseException as err:  # noqa: BLE001 - the job's owner answers it
            turn.work.emit(err)
        self.running.remove(turn)
        turn.work.done()
