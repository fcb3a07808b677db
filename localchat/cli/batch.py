"""``localchat batch``: many prompts through one engine, JSONL in, JSONL out, in order.

Input lines (one JSON object each): ``{"id", "prompt"}``, ``{"id", "messages": [...]}`` or
``{"id", "conversation": NAME, "prompt"}``; optional ``"system"``, ``"max_tokens"`` and
``"images"`` (files read when the line runs: a bad one is that line's error).
Output: exactly one line per input line, in input order, whatever the line holds:
``{"id", "reply", "usage"}`` (and ``"reasoning"``: a reasoning model's thinking, apart from
the reply) or ``{"id", "line", "error"}`` (``line``: its number in the
file); a bad line is its own error record and the run goes on. Lines that share a prefix
(one long system prompt) prefill it once through a ``PrefixPool``; a ``conversation`` line is
a normal turn of that saved conversation.

What a line may hold, and how the file and ``--resume``'s OUT are read: ``batchlines.py``.

Each result is written and flushed whole, so Ctrl-C leaves OUT as valid JSONL. ``--resume``
skips the lines whose id has a reply in OUT (error records run again); OUT's damaged lines,
lines that are not JSON and ids of other types count for nothing. Progress (done/total, tok/s,
ETA) goes to stderr when it is a terminal. Exit status 1 if any line failed.

Decoding is one line at a time by default, so a batch gives exactly the replies ``ask`` gives;
``--parallel N`` decodes up to N consecutive prompt lines together (``parallel.py``), about 2x
faster on the default model, at the price of rare greedy differences (batched rounding).
Not here: retries, sampling settings per line, or any order other than the file's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import paths
from ..errors import BadInput, LocalchatError
from ..events import Notice, TurnFinished
from ..fmt import StatusLine
from ..kvcache.prefixes import PrefixPool

if TYPE_CHECKING:
    from ..model.constraint import ConstraintSpec
from ..session.session import Session, TurnOptions
from .batchlines import BatchResult, Job
from .images import line_images


@dataclass(frozen=True)
class BatchOptions:
    max_tokens: int = 256
    temp: float = 0.0
    parallel: int = 1  # decode up to N consecutive prompt lines together
    kv_bits: int | None = None  # KV setting for the conversations of `conversation` lines
    kv_group: int | None = None
    thinking: bool | None = None  # a reasoning model thinks (--thinking; None: as its template)
    context_overflow: str | None = None  # for `conversation` lines (None: the conversation's)
    speculate: str = "lookup"  # prompt-lookup decoding of lone lines (--speculate off|lookup)
    constraint: ConstraintSpec | None = None  # lines without their own (--format/--regex/…)


# -- running ---------------------------------------------------------------------------------

def run_batch(session: Session, items: list[Job | BatchResult], options: BatchOptions,
              notice: Callable[[int, str], None] | None = None) -> Iterator[BatchResult]:
    """One result per item, in order (errors included); ``notice(line, text)`` gets notices.

    Prompt lines share prefixes through one ``PrefixPool``; ``conversation`` lines are real
    turns of saved conversations. With ``options.parallel > 1`` runs of consecutive prompt
    lines are decoded together (models whose every layer grows; others one at a time).
    """
    if options.parallel < 1:
        raise BadInput("--parallel must be at least 1")
    pool = PrefixPool(session.engine.new_cache)
    size = options.parallel if session.engine.info().cut_anywhere else 1
    i = 0
    while i < len(items):
        group = _parallel_group(items, i, size)
        if group:
            results = _run_group(session, pool, group, options)
        else:
            item = items[i]
            results = [item if isinstance(item, BatchResult) else
                       _run_job(session, pool, item, options, notice)]
        yield from results
        i += len(results)


def _parallel_group(items: list, start: int, size: int) -> list[Job]:
    """Up to ``size`` consecutive ephemeral jobs from ``start`` (none if size is 1)."""
    group = []
    for item in items[start:start + size]:
        if size < 2 or not isinstance(item, Job) or item.messages is None:
            break
        group.append(item)
    return group if len(group) > 1 else []


def _run_group(session: Session, pool, group: list[Job], options: BatchOptions
               ) -> list[BatchResult]:
    from .parallel import complete_group

    refused: dict[int, str] = {}
    messages: dict[int, list[dict]] = {}
    for job in group:
        try:
            _check_template(session.engine, job.messages)
            messages[job.line] = _with_images(session, job)
        except BadInput as err:
            refused[job.line] = str(err)
    ok = [job for job in group if job.line not in refused]
    outcomes = iter(complete_group(session, [messages[job.line] for job in ok], pool,
                                   [job.max_tokens or options.max_tokens for job in ok],
                                   options.temp, options.thinking,
                                   [job.constraint or options.constraint for job in ok])
                    if ok else ())
    results = []
    for job in group:
        outcome = refused.get(job.line) or next(outcomes)
        if isinstance(outcome, (str, LocalchatError)):
            results.append(BatchResult(job.id, job.line, error=str(outcome)))
        else:
            reply, reasoning, usage, complete = outcome
            results.append(BatchResult(job.id, job.line, reply, usage, reasoning=reasoning,
                                       complete=complete))
    return results


def _run_job(session: Session, pool, job: Job, options: BatchOptions, notice) -> BatchResult:
    turn = TurnOptions(max_tokens=job.max_tokens or options.max_tokens, temp=options.temp,
                       thinking=options.thinking, speculate=options.speculate,
                       constraint=job.constraint or options.constraint)
    try:
        if job.conversation is not None:
            conv = session.store.get(job.conversation)
            if conv.model != session.model_name:
                raise BadInput(f"conversation {conv.name!r} uses model {conv.model}; "
                               f"run the batch with -m {conv.model}")
            if (options.kv_bits is not None or options.thinking is not None
                    or options.context_overflow is not None):
                conv = session.conversation(conv.name, kv_bits=options.kv_bits,
                                            kv_group=options.kv_group,
                                            thinking=options.thinking,
                                            context_overflow=options.context_overflow)
            events = session.turn(conv, job.prompt, turn,
                                  images=line_images(session, job.images))
        else:
            _check_template(session.engine, job.messages)
            events = session.complete(_with_images(session, job), pool, turn)
        for ev in events:
            if isinstance(ev, Notice) and notice is not None:
                notice(job.line, ev.text)
            elif isinstance(ev, TurnFinished):
                return BatchResult(job.id, job.line, ev.reply, ev.usage,
                                   reasoning=ev.reasoning, complete=ev.complete)
    except LocalchatError as err:
        return BatchResult(job.id, job.line, error=str(err))
    return BatchResult(job.id, job.line, error="no reply")


def _with_images(session: Session, job: Job) -> list[dict]:
    """``job.messages``, its last (the new user message) holding the line's images, checked
    and stored (``images.line_images``: a bad one is this line's BadInput)."""
    if not job.images:
        return job.messages
    last = {**job.messages[-1], "images": list(line_images(session, job.images))}
    return [*job.messages[:-1], last]


def _check_template(engine, messages: list[dict]) -> None:
    """Raise BadInput where the model's chat template refuses ``messages`` (roles out of the
    order it wants, a system message where it takes none): that line's error, not the run's.
    Checked before ``Session.complete`` so that a split model's followers never see it."""
    from jinja2 import TemplateError

    try:
        engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    except TemplateError as err:
        raise BadInput(f"the model's chat template refuses these messages: {err}") from None


def open_output(path, append: bool):
    """A results file the user named: created with the user's own umask (not the data
    folder's owner-only mode); a path that cannot be written is one line."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    try:
        new = not os.path.lexists(path)
        fd = os.open(path, flags, 0o600)
        if new:  # (the process umask is owner-only: ``paths.keep_private``)
            os.fchmod(fd, paths.user_mode())
        return os.fdopen(fd, "w", encoding="utf-8")
    except OSError as err:
        raise BadInput(f"cannot write {path}: {err.strerror or err}") from None


class Progress:
    """done/total, tok/s and ETA of a batch on one status line."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.line = total, StatusLine(enabled)
        self.done = self.tokens = 0
        self.t0 = time.perf_counter()

    def step(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        dt = time.perf_counter() - self.t0
        rate = self.tokens / dt if dt else 0.0
        eta = dt / self.done * (self.total - self.done)
        filled = 24 * self.done // max(self.total, 1)
        self.line.show(f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} · "
                       f"{rate:.1f} tok/s · ETA {eta:.0f}s")

    def clear(self) -> None:
        self.line.clear()
