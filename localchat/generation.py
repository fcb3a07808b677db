"""One turn's model work: prefill the new tokens, then decode, recording what happened.

What it is: ``generate`` — the loop every turn runs (``Session.turn`` and ``complete``): it
prefills ``new_tokens`` into a cache in chunks (``PrefillProgress``), decodes (``ReplyChunk``),
captures the bounded layers' checkpoints one token before the reply and at its end, and keeps
in a ``Run`` exactly how many tokens the cache holds, so a stopped turn's cache matches its
partial reply. Also the options and the stop signal a caller passes in, and the usage record.
What it is not: where the cache comes from or goes (``turncache.py``) or the conversation
(``session.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from .engine import Engine, now
from .events import Event, PrefillProgress, ReplyChunk, Usage
from .kvcache import kinds as ck
from .turncache import Start


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


@dataclass
class Run:
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


def generate(engine: Engine, new_tokens: list[int], start: Start, max_tokens: int,
             options: TurnOptions, cancel: Cancel, run: Run) -> Iterator[Event]:
    """Prefill ``new_tokens`` then decode, recording into ``run``; checks ``cancel``.

    Models with bounded layers get a checkpoint one token before the reply (the end of
    the prompt) and one at the end of the reply. Split over ranks, every rank stops at
    the same token: rank 0's answer (Ctrl-C reaches rank 0 only; ``engine.group``).
    """
    cache = start.cache

    def stop() -> bool:
        return engine.group.agree_any(cancel.is_set())

    bounded = bool(ck.bounded(cache))
    run.fed = start.pos
    t = now()
    prefill = engine.prefill(new_tokens, cache)
    logits = None
    while logits is None:
        if stop():
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
        if stop():
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


def usage_of(engine: Engine, tokens: list[int], k: int, run: Run, t0: float, *,
             cache_bytes: int = 0, written: int = 0, reason: str = "", draft: int = 0) -> Usage:
    """The usage record of a turn: ``tokens`` rendered, the first ``k`` from the cache."""
    t_end = now()
    t_first = run.t_first or t_end
    return Usage.of(
        prompt_tokens=len(tokens), cached_tokens=k, completion_tokens=len(run.generated),
        t0=t0, t_first=t_first, t_last=run.t_last or t_end, prefill_s=run.prefill_s,
        context_tokens=run.fed,
        context_length=engine.info().context_length, cache_bytes=cache_bytes,
        bytes_written=written, miss_reason=reason,
        checkpoints=not engine.info().cut_anywhere, draft_tokens=draft)
