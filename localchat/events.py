"""What a turn yields: small frozen records that every front end consumes.

``Session.turn`` (and ``Session.complete`` for batch lines) yield ``Notice``,
``PrefillProgress`` and ``ReplyChunk`` events, then one ``TurnFinished`` carrying the ``Usage``
record the status bar, ``ask --json`` and batch results show; ``Drafts.prefill`` yields
``DraftProgress``. ``Usage.of`` is the one place that computes its figures. Nothing here
imports MLX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Notice:
    """Something the user should read once (cache rebuilt, waiting for a lock)."""

    text: str
    waiting: bool = False  # the turn waits for a conversation's lock when resumed


@dataclass
class Step:
    """A model step a turn asks the scheduler for (``session/scheduler.py``), only while one drives
    the session (``Session.stepped``): feed ``token`` (an (n,) MLX array: one token to decode,
    or a prompt chunk) into ``cache``; the scheduler runs it in one model call with other
    turns' steps and puts the last position's ``logits`` here before the turn goes on
    (``head`` False: a chunk whose logits no one reads; ``rows``: the logits of every position,
    (n, vocab) — a prompt-lookup verify pass). Never reaches a front end."""

    token: object
    cache: list
    logits: object = None
    head: bool = True
    rows: bool = False


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class ReplyChunk:
    text: str
    generated: int = 0  # tokens generated so far, this piece's included (what a bar shows)
    thinking: int = 0  # of ``generated``: the model's reasoning


@dataclass(frozen=True)
class ReasoningChunk:
    """A piece of what a reasoning model thinks before its answer (kept apart from it)."""

    text: str
    generated: int = 0  # as ``ReplyChunk``'s
    thinking: int = 0


@dataclass(frozen=True)
class DraftProgress:
    """How much of an unsent message is prefilled (``Drafts.prefill``).

    ``total``: tokens the message adds to the conversation (its text and the template's
    framing); ``target``: the stable ones a draft prefills (the last word, the end of the
    message and the generation prompt are held back); ``done``: those prefilled so far.
    """

    done: int
    target: int
    total: int

    @property
    def ready(self) -> bool:
        return self.done >= self.target


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
    miss_reason: str  # why more than the new message was prefilled: "", "edited", ...
    checkpoints: bool = False  # the model has bounded layers: resumes from checkpoints
    draft_tokens: int = 0  # of cached_tokens: the message's, prefilled before it was sent
    reasoning_tokens: int = 0  # of completion_tokens: the model's reasoning
    lookup_drafted: int = 0  # prompt-lookup draft tokens verified (``session/speculative.py``)
    lookup_accepted: int = 0  # of those, the ones the model agreed with (in the reply)
    constrained: str = ""  # the reply's constraint ("json_schema", "regex", …; "": free)
    forced_tokens: int = 0  # of completion_tokens: those the grammar allowed alone
    blas_threads: str = ""  # the BLAS runs fewer threads than cores, and why (``cpu/threads``)

    @classmethod
    def of(cls, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
           t0: float, t_first: float, t_last: float, prefill_s: float, context_tokens: int,
           context_length: int, cache_bytes: int = 0, bytes_written: int = 0,
           miss_reason: str = "", checkpoints: bool = False, draft_tokens: int = 0,
           reasoning_tokens: int = 0, lookup_drafted: int = 0,
           lookup_accepted: int = 0, decode_from: float | None = None,
           constrained: str = "", forced_tokens: int = 0, blas_threads: str = "") -> Usage:
        """Build the record from counts and clock readings (``time.perf_counter``).

        Args:
            t0: the turn's start; t_first / t_last: the first and last generated token.
            prefill_s: seconds spent prefilling ``prompt_tokens - cached_tokens`` tokens.
            decode_from: when the prompt's logits were ready (default ``t_first``): the
                decode speed is the tokens after the first over the time from there to
                ``t_last`` (tokens that come in bursts, a verify pass's, count over the
                time that made them).
        """
        prefilled = prompt_tokens - cached_tokens
        decode_s = t_last - (t_first if decode_from is None else decode_from)
        return cls(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            prefilled_tokens=prefilled,
            completion_tokens=completion_tokens,
            ttft_s=t_first - t0,
            prefill_tps=prefilled / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=((completion_tokens - 1) / decode_s
                        if completion_tokens > 1 and decode_s > 0 else 0.0),
            context_tokens=context_tokens,
            context_length=context_length,
            cache_bytes=cache_bytes,
            bytes_written=bytes_written,
            miss_reason=miss_reason,
            checkpoints=checkpoints,
            draft_tokens=draft_tokens,
            reasoning_tokens=reasoning_tokens,
            lookup_drafted=lookup_drafted,
            lookup_accepted=lookup_accepted,
            constrained=constrained,
            forced_tokens=forced_tokens,
            blas_threads=blas_threads,
        )

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
            "bytes_written": self.bytes_written,
            "miss_reason": self.miss_reason,
            **({"reasoning_tokens": self.reasoning_tokens} if self.reasoning_tokens else {}),
            **({"lookup_drafted": self.lookup_drafted, "lookup_accepted": self.lookup_accepted}
               if self.lookup_drafted else {}),
            **({"constrained": self.constrained, "forced_tokens": self.forced_tokens}
               if self.constrained else {}),
        }


@dataclass(frozen=True)
class TurnFinished:
    reply: str
    usage: Usage
    stopped: bool  # the reply was cut short by the user; it is saved marked partial
    tokens: tuple[int, ...] = ()  # the generated token ids, EOS included when produced
    finish: str = "stop"  # stop (the model ended it), length, stop_sequence, cancelled,
    #                       tool_calls
    stop_sequence: str | None = None  # the stop string that ended it
    tool_calls: tuple[dict, ...] = ()  # {"type": "function", "function": {name, arguments}}
    reasoning: str = ""  # the model's reasoning before ``reply`` (a reasoning model's)
    thinking_s: float = 0.0  # what the reasoning took, as stored with the reply (0.1 s steps)
    complete: bool | None = None  # a constrained reply: its grammar satisfied (None: free)


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call the model made, about to be approved and run (``tools/turns.py``)."""

    call_id: str
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallFinished:
    """A tool call's outcome: ``ran`` (``result`` is what the model got, ``full_chars`` the
    whole result's length), ``denied``, ``failed`` (``error`` says why, one line) or
    ``stopped`` (the user stopped it)."""

    call_id: str
    name: str
    arguments: dict
    outcome: str
    result: str = ""
    full_chars: int = 0
    error: str = ""
    seconds: float = 0.0
    full: str = ""  # the whole result when it was cut for the model (not stored)

    def public(self) -> dict:
        """The call as ``ask --json`` lists it."""
        return {"name": self.name, "arguments": self.arguments, "outcome": self.outcome,
                "result": self.result, **({"error": self.error} if self.error else {}),
                **({"full_chars": self.full_chars}
                   if self.full_chars > len(self.result) else {})}


Event = (Notice | PrefillProgress | ReasoningChunk | ReplyChunk | TurnFinished | ToolCallStarted
         | ToolCallFinished)
