"""``localchat batch``: many prompts through one engine, JSONL in, JSONL out, in order.

Input lines (one JSON object each): ``{"id", "prompt"}``, ``{"id", "messages": [...]}`` or
``{"id", "conversation": NAME, "prompt"}``; optional ``"system"`` and ``"max_tokens"``.
Output: exactly one line per input line, in input order — ``{"id", "reply", "usage"}`` or
``{"id", "line", "error"}``. Lines that share a prefix (one long system prompt, one document
with different questions) prefill it once through a ``PrefixPool``; a ``conversation`` line is
a normal turn of that saved conversation (disk cache, stored messages).

Each result is written and flushed whole, so Ctrl-C leaves OUT as valid JSONL, and
``--resume`` skips ids already in OUT. Progress (done/total, tok/s, ETA) goes to stderr when it
is a terminal. Exit status 1 if any line failed.

Decoding is one line at a time by default, so a batch gives exactly the replies ``ask`` gives;
``--parallel N`` decodes up to N consecutive prompt lines together (``parallel.py``), about 2x
faster on the default model, at the price of rare greedy differences (batched rounding).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput, LocalchatError
from .events import Notice, TurnFinished, Usage
from .fmt import StatusLine
from .prefixes import PrefixPool
from .session import Session, TurnOptions


@dataclass(frozen=True)
class Job:
    line: int
    id: object
    messages: list[dict] | None  # an ephemeral prompt
    conversation: str | None  # or a turn of a saved conversation
    prompt: str | None
    max_tokens: int | None


def parse_line(text: str, line: int) -> Job:
    """One input line → a Job. Raises BadInput with the reason."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadInput(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise BadInput("a line must be a JSON object")
    job_id = obj.get("id", line)
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadInput("max_tokens must be a positive integer")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise BadInput("system must be a string")
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in msgs)
        if not ok:
            raise BadInput("messages must be a list of {role, content} objects")
        if msgs[-1]["role"] != "user":
            raise BadInput("the last message must be from the user")
        if system is not None:
            msgs = [{"role": "system", "content": system}] + msgs
        return Job(line, job_id, msgs, None, None, max_tokens)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadInput("needs a non-empty \"prompt\" (or \"messages\")")
    if "conversation" in obj:
        if not isinstance(obj["conversation"], str):
            raise BadInput("conversation must be a name (string)")
        return Job(line, job_id, None, obj["conversation"], prompt, max_tokens)
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return Job(line, job_id, msgs, None, None, max_tokens)


@dataclass(frozen=True)
class BatchOptions:
    max_tokens: int = 256
    temp: float = 0.0
    parallel: int = 1  # decode up to N consecutive prompt lines together
    kv_bits: int | None = None  # KV setting for the conversations of `conversation` lines
    kv_group: int | None = None


@dataclass(frozen=True)
class BatchResult:
    """One output line: a reply with its usage, or an error."""

    id: object
    line: int
    reply: str | None = None
    usage: Usage | None = None
    error: str | None = None

    def to_json(self) -> dict:
        if self.error is not None:
            return {"id": self.id, "line": self.line, "error": self.error}
        return {"id": self.id, "reply": self.reply, "usage": self.usage.public()}


def parse_lines(lines: list[str], skip_ids: set = frozenset()) -> list[Job | BatchResult]:
    """Input lines → jobs to run, or ready error records, in input order."""
    items: list[Job | BatchResult] = []
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            job = parse_line(text, n)
        except BadInput as err:
            items.append(BatchResult(_peek_id(text), n, error=str(err)))
            continue
        if job.id not in skip_ids:
            items.append(job)
    return items


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

    limits = [job.max_tokens or options.max_tokens for job in group]
    outcomes = complete_group(session, [job.messages for job in group], pool, limits,
                              options.temp)
    results = []
    for job, outcome in zip(group, outcomes):
        if isinstance(outcome, LocalchatError):
            results.append(BatchResult(job.id, job.line, error=str(outcome)))
        elif isinstance(outcome, Exception):
            raise outcome
        else:
            reply, usage = outcome
            results.append(BatchResult(job.id, job.line, reply, usage))
    return results


def _run_job(session: Session, pool, job: Job, options: BatchOptions, notice) -> BatchResult:
    turn = TurnOptions(max_tokens=job.max_tokens or options.max_tokens, temp=options.temp)
    try:
        if job.conversation is not None:
            conv = session.store.get(job.conversation)
            if conv.model != session.model_name:
                raise BadInput(f"conversation {conv.name!r} uses model {conv.model}; "
                               f"run the batch with -m {conv.model}")
            if options.kv_bits is not None:
                conv = session.conversation(conv.name, kv_bits=options.kv_bits,
                                            kv_group=options.kv_group)
            events = session.turn(conv, job.prompt, turn)
        else:
            events = session.complete(job.messages, pool, turn)
        for ev in events:
            if isinstance(ev, Notice) and notice is not None:
                notice(job.line, ev.text)
            elif isinstance(ev, TurnFinished):
                return BatchResult(job.id, job.line, ev.reply, ev.usage)
    except LocalchatError as err:
        return BatchResult(job.id, job.line, error=str(err))
    return BatchResult(job.id, job.line, error="no reply")


_ID = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)')


def _peek_id(text: str):
    """The id of a line that failed to parse, if one can still be read from it."""
    try:
        obj = json.loads(text)
        return obj.get("id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        found = _ID.search(text)
        return json.loads(found.group(1)) if found else None


def read_lines(file: str) -> list[str]:
    try:
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as err:
        raise BadInput(f"cannot read {file}: {err.strerror}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise BadInput(f"{file} is not valid UTF-8 (byte {err.start})") from None


def done_ids(path: Path) -> set:
    """Ids with a result line in an earlier, perhaps interrupted, output file.

    A torn last line (a kill mid-write) is cut off so that appending keeps the file JSONL.
    """
    ids = set()
    try:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill; that id runs again
            if isinstance(obj, dict) and "reply" in obj:
                ids.add(obj.get("id"))
    except FileNotFoundError:
        pass
    return ids


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
