"""One turn's model work: prefill the new tokens, then decode, recording what happened.

What it is: ``generate`` — the loop every turn runs (``Session.turn`` and ``complete``): it
prefills ``new_tokens`` into a cache in chunks (``PrefillProgress``), decodes (``ReplyChunk``),
captures the bounded layers' checkpoints one token before the reply and at its end (and, for
a reasoning model, where the reply starts: see ``reply_start``), and keeps
in a ``Run`` exactly how many tokens the cache holds, so a stopped turn's cache matches its
partial reply. Also the options and the stop signal a caller passes in, and the usage record.
What it is not: where the cache comes from or goes (``turncache.py``) or the conversation
(``session.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..cpu import threads
from ..events import Event, Notice, PrefillProgress, ReasoningChunk, ReplyChunk, Step, Usage
from ..kvcache import kinds as ck
from ..model.engine import Engine, now
from ..model.loops import loop_span, looping
from ..model.replies import ReasoningStream, split_reasoning, thinking_markers
from . import speculative
from .turncache import Start

if TYPE_CHECKING:  # (llguidance is imported by a constrained turn only)
    from ..model.constraint import ConstraintSpec, Matcher


@dataclass(frozen=True)
class TurnOptions:
    """How to run a turn (``ask``'s flags, a batch line's settings)."""

    max_tokens: int = 1024
    temp: float = 0.0  # 0: greedy
    seed: int | None = None
    no_cache: bool = False  # ignore the stored K/V (full prefill), then store a fresh cache
    top_p: float = 1.0  # nucleus sampling when temp > 0 (1: off)
    top_k: int = 0  # only the k likeliest tokens when temp > 0 (0: off)
    min_p: float = 0.0  # drop tokens below min_p × the likeliest's probability (0: off)
    repetition_penalty: float = 1.0  # mlx-lm's, over the last 20 tokens (1: off)
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings
    tools: tuple[dict, ...] = ()  # function tools the model may call (OpenAI's shape)
    thinking: bool | None = None  # a reasoning model thinks (None: the conversation's setting)
    context_overflow: str | None = None  # stop/truncate (None: the conversation's; ``window``)

    def sampling_extras(self) -> dict:
        """The sampling settings beyond temp/top_p that differ from off (``Engine.decode``'s
        keywords; an engine that takes none still runs a turn that sets none)."""
        extras = {"top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty}
        off = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        return {k: v for k, v in extras.items() if v != off[k]}
    speculate: str | None = None  # "lookup" (where it can run: ``speculative``) or "off";
    #                               None: the session's setting (lookup unless told)
    call_ids: str = ""  # the reply's tool calls get ids PREFIX0, PREFIX1, … ("": none;
    #                     ``tools/turns.py``, whose result messages answer them by id)
    constraint: ConstraintSpec | None = None  # the reply's shape (``model/constraint.py``):
    #                     checked before the turn, a grammar beside the sampler during it


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
    t_ready: float | None = None  # when the prompt's logits were ready (decode speed starts)
    fed: int = 0  # tokens the cache holds (ArraysCache keeps no count of its own)
    checkpoints: list[ck.Captured] = field(default_factory=list)
    finish: str = "stop"  # why it ended: stop (end of text), length, stop_sequence, cancelled,
    #                       tool_calls
    tool_calls: list[dict] = field(default_factory=list)  # parsed from the reply (``replies``)
    reasoning: str = ""  # what the model thought before answering (``replies``)
    reasoning_tokens: int = 0  # of ``generated``: those that were reasoning
    thinking_s: float = 0.0  # from the first token to the end of the reasoning
    stop_sequence: str | None = None  # the one of ``TurnOptions.stop`` that ended it
    lookup: speculative.LookupStats = field(default_factory=speculative.LookupStats)
    grammar: Matcher | None = None  # a constrained turn's grammar state (``complete``)

    @property
    def complete(self) -> bool | None:
        """A constrained reply: whether its grammar was satisfied (False: cut before, e.g. by
        the token cap); None for a free reply."""
        g = self.grammar
        return None if g is None else g.finished or g.accepting or g.stopped

    @property
    def thinking_seconds(self) -> float:
        """What the reasoning took, as stored with the reply and shown by the app."""
        return round(self.thinking_s, 1)


def generate(engine: Engine, new_tokens: list[int], start: Start, max_tokens: int,
             options: TurnOptions, cancel: Cancel, run: Run,
             prior: Sequence[int] = (), stepped: bool = False,
             chunk: Callable[[], int] | None = None,
             may_draft: Callable[[], bool] | None = None) -> Iterator[Event]:
    """Prefill ``new_tokens`` then decode, recording into ``run``; checks ``cancel``.

    ``prior``: the tokens before ``new_tokens`` that the cache holds (the conversation so far),
    where prompt lookup (``speculative.py``) looks for drafts besides the new ones.

    Models with bounded layers get a checkpoint one token before the reply (the end of
    the prompt) and one at the end of the reply. Split over ranks, every rank stops at
    the same token: rank 0's answer (Ctrl-C reaches rank 0 only; ``engine.group``).
    ``stepped``: model calls (decode steps, prompt chunks) are yielded as ``Step`` events for a
    scheduler to run together with other turns';
    ``chunk``: the scheduler's prefill chunk size, asked before each chunk; ``may_draft``:
    whether a greedy turn may verify prompt-lookup drafts under it now.
    """
    cache = start.cache

    def stop() -> bool:
        return engine.group.agree_any(cancel.is_set())

    bounded = bool(ck.bounded(cache))
    markers = thinking_markers(engine)
    # A reasoning model's template usually drops a reply's thinking when it renders the
    # history again, so the next turn resumes where this reply (with the template's thinking
    # prefix, when the prompt opens one) starts: bounded layers need a checkpoint there.
    cut = reply_start(engine, markers, new_tokens) if bounded and markers else None
    run.fed = start.pos
    t = now()
    total = len(new_tokens)
    logits = None
    # The BLAS thread count, chosen step by step (``cpu/threads.py``; under a scheduler it
    # times its rounds itself).
    meter = None if stepped else threads.meter()
    for lo, hi in ((0, cut), (cut, total)) if cut and cut < total else ((0, total),):
        prefill = engine.prefill(new_tokens[lo:hi], cache,
                                 **({"chunk": chunk} if chunk else {}),
                                 **({"before": [*prior, *new_tokens[:lo]]}
                                    if engine.takes_images() else {}),
                                 **({"stepped": True} if stepped else {}))
        if meter is not None:
            prefill = meter.timed("prefill", prefill, chunk_tokens(hi - lo))
        while True:
            if stop():
                run.stopped = True
                run.prefill_s = now() - t
                return
            try:
                ev = next(prefill)
            except StopIteration as fin:
                logits = fin.value
                break
            if isinstance(ev, Step):  # the scheduler runs it beside other turns' steps
                yield ev
                continue
            done, _ = ev
            run.fed = start.pos + lo + done
            if bounded and lo + done == total - 1:
                run.checkpoints.append(ck.capture(cache, run.fed))
            yield PrefillProgress(lo + done, total)
        run.fed = start.pos + hi
        if hi == cut:
            run.checkpoints.append(ck.capture(cache, run.fed))
            if hi < total:
                yield PrefillProgress(hi, total)
    run.t_ready = now()
    run.prefill_s = run.t_ready - t
    run.logits_ready = True
    run.fed = start.pos + len(new_tokens)
    detok = engine.detokenizer()
    text = Streamed(options.stop)  # the answer, cut at a stop string
    opened = opened_in_prompt(engine, markers, new_tokens)
    thought = ReasoningStream(markers, inside=opened)
    # Prompt lookup (``speculative.py``) or plain; under a scheduler, verify passes and plain
    # steps run in one model call with other turns' steps. Closed in ``finally`` so that a
    # reply cut short leaves the cache holding exactly the tokens taken, no drafts past them.
    if options.constraint is not None:  # (llguidance's view of the vocabulary: built once)
        from ..model.constraint import Matcher, tokenizer_for

        run.grammar = Matcher(options.constraint, tokenizer_for(engine.tokenizer, engine.eos_ids))
    # A reasoning model's thinking stays free, the grammar starting after its end marker:
    # opened by the prompt, or by the model's first token (a start marker of one token).
    gate = {}
    if markers and run.grammar is not None:
        opening, closing = engine.encode(markers[0]), tuple(engine.encode(markers[1]))
        if opened:
            gate = {"free_until": closing}
        elif len(opening) == 1:
            gate = {"free_until": closing, "opens": opening[0]}
    steps = speculative.decode(engine, cache, logits, max_tokens, options,
                               [*prior, *new_tokens], run.lookup, stepped, may_draft,
                               grammar=run.grammar, **gate)
    if meter is not None:
        steps = meter.timed("decode", steps, decode_tokens())
    closing_said = False
    try:
        for tok in steps:
            if not isinstance(tok, int):  # a Step: the scheduler runs it, then this goes on
                yield tok
                continue
            if run.t_first is None:
                run.t_first = now()
            run.generated.append(tok)
            # engine.decode has fed every token it yielded, except an EOS and the last
            # allowed one (fed only if the loop reads on: see below).
            final = tok in engine.eos_ids or len(run.generated) >= max_tokens
            run.fed = start.pos + len(new_tokens) + len(run.generated) - final
            run.t_last = now()
            if tok in engine.eos_ids:
                break
            was_inside = thought.inside
            if tok not in engine.hidden_ids:  # a control token (<|im_start|>…) is fed, not text
                detok.add_token(tok)
            reasoning, said = thought.add(detok.last_segment)
            run.reasoning_tokens += was_inside or thought.inside  # (its markers count)
            if was_inside or thought.inside:
                run.thinking_s = now() - run.t_first
            piece = text.add(said)
            run.reasoning += reasoning
            run.reply = text.text  # (what a turn cut short by an error or Ctrl-C keeps)
            so_far = (len(run.generated), run.reasoning_tokens)  # (the live status bar's)
            if reasoning:
                yield ReasoningChunk(reasoning, *so_far)
            if piece:
                yield ReplyChunk(piece, *so_far)
            if text.stop is not None:
                run.finish, run.stop_sequence = "stop_sequence", text.stop
                break
            if run.grammar is not None and run.grammar.closing and not closing_said:
                closing_said = True
                yield Notice("the reply repeated itself: from there it only closes its shape")
            if options.temp > 0 and run.grammar is None and (period := looping(run.generated)):
                run.finish = "length"
                yield Notice(f"reply cut: it repeated the same {period} tokens over its last "
                             f"{loop_span(period)}")
                break
            if stop():
                run.stopped, run.finish = True, "cancelled"
                break
            if len(run.generated) >= max_tokens:
                run.finish = "length"
                # The last allowed token is fed only where the reply would otherwise end the
                # cache inside a character: feeding it costs a decode step now, where the
                # next turn prefills it in its first chunk almost free.
                if not ends_mid_character(engine, run.generated):
                    break
        else:
            if run.generated and len(run.generated) >= max_tokens:
                run.fed += 1  # (read on: the decoder fed it)
    finally:
        steps.close()
    detok.finalize()
    reasoning, said = thought.add(detok.last_segment)
    held_reasoning, held_said = thought.end()
    piece = text.end(said + held_said)
    run.reply = text.text
    if reasoning + held_reasoning:
        yield ReasoningChunk(reasoning + held_reasoning, len(run.generated),
                             run.reasoning_tokens)
    if piece:
        yield ReplyChunk(piece, len(run.generated), run.reasoning_tokens)
    # Store what the ids decode to: the streaming detokenizer trims a leading space, and
    # the next turn keeps these ids only if the stored text renders back to them. A reply
    # cut at a stop string is stored cut (the next turn's prefix match drops the rest). The
    # reasoning is kept apart from the answer (``replies.split_reasoning``).
    ids = [t for t in run.generated if t not in engine.hidden_ids]
    if ids and text.stop is None:
        whole = engine.decode_text(ids)
        run.reasoning, run.reply = split_reasoning(
            markers, (markers[0] + whole) if opened else whole)
    else:
        run.reasoning = run.reasoning.strip()
    if bounded:
        run.checkpoints.append(ck.capture(cache, run.fed))


def ends_mid_character(engine: Engine, generated: list[int]) -> bool:
    """Whether a capped reply's tokens but its last end inside a character (a byte-level
    tokenizer splits one over several). The cache must then hold the last token too: the next
    turn's render keeps the reply's ids only as far as they decode to its text
    (``Engine.render``), and bounded layers resume at a checkpoint no later than that."""
    ids = [t for t in generated[:-1] if t not in engine.hidden_ids]
    return engine.decode_text(ids).endswith("\ufffd")


def chunk_tokens(total: int) -> Callable[[object], int]:
    """For ``Meter.timed``: the tokens each prefill progress event (``(done, total)``) adds,
    and those of the pass that ends it (``None``)."""
    done = 0

    def tokens(item) -> int:
        nonlocal done
        now_done = total if item is None else item[0] if isinstance(item, tuple) else done
        added, done = now_done - done, now_done
        return added

    return tokens


def decode_tokens() -> Callable[[object], int]:
    """For ``Meter.timed``: one token per id, except the first (drawn from the prompt's
    logits, with no model call), and none for the end."""
    seen = 0

    def tokens(item) -> int:
        nonlocal seen
        if not isinstance(item, int):
            return 0
        seen += 1
        return int(seen > 1)

    return tokens


def opened_in_prompt(engine: Engine, markers: tuple[str, str] | None,
                     tokens: list[int]) -> bool:
    """Whether the template opened the reasoning at the end of the prompt (``<think>\n``)."""
    return bool(markers) and engine.decode_text(tokens[-8:]).rstrip().endswith(markers[0])


def reply_start(engine: Engine, markers: tuple[str, str], new_tokens: list[int]) -> int:
    """Where in ``new_tokens`` the next turn's rendering of this reply may start to differ:
    at the thinking marker the template put at the end of the prompt (``<think>`` opened,
    or an empty ``<think></think>`` when thinking is off), else after the whole prompt."""
    mark = engine.encode(markers[0])
    for at in range(len(new_tokens) - len(mark), max(0, len(new_tokens) - 16) - 1, -1):
        if at > 0 and new_tokens[at:at + len(mark)] == mark:
            return at
    return len(new_tokens)


class Streamed:
    """A reply's text as it is streamed, ending before the first of ``stops``: text that may
    be the start of a stop string is held back until the next piece says it is not."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # all of the reply so far (cut at a stop string once one is found)
        self.sent = 0  # characters of ``text`` streamed
        self.stop: str | None = None

    def add(self, piece: str) -> str:
        """What of ``piece`` (and of earlier held text) can be streamed now."""
        if not piece or self.stop is not None:
            return ""
        self.text += piece
        if self.stops:
            hits = [(self.text.find(s, max(0, self.sent - len(s))), s) for s in self.stops]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, self.stop = min(hits)
                self.text = self.text[:at]
                return self._send(len(self.text))
        return self._send(len(self.text) - self.hold)

    def end(self, piece: str) -> str:
        """The rest, once the reply ended."""
        out = self.add(piece)
        return out + (self._send(len(self.text)) if self.stop is None else "")

    def _send(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out


def usage_of(engine: Engine, tokens: list[int], k: int, run: Run, t0: float, *,
             cache_bytes: int = 0, written: int = 0, reason: str = "", draft: int = 0) -> Usage:
    """The usage record of a turn: ``tokens`` rendered, the first ``k`` from the cache."""
    t_end = now()
    t_first = run.t_first or t_end
    return Usage.of(
        prompt_tokens=len(tokens), cached_tokens=k, completion_tokens=len(run.generated),
        t0=t0, t_first=t_first, t_last=run.t_last or t_end, prefill_s=run.prefill_s,
        decode_from=min(run.t_ready or t_first, t_first),
        context_tokens=run.fed,
        context_length=engine.info().context_length, cache_bytes=cache_bytes,
        bytes_written=written, miss_reason=reason,
        checkpoints=not engine.info().cut_anywhere, draft_tokens=draft,
        reasoning_tokens=run.reasoning_tokens, lookup_drafted=run.lookup.drafted,
        lookup_accepted=run.lookup.accepted, blas_threads=threads.note(),
        **({"constrained": run.grammar.spec.name, "forced_tokens": run.lookup.forced}
           if run.grammar is not None else {}))
