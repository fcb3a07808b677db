"""``localchat batch --parallel N``: a group of batch lines decoded together on the scheduler.

Each line is the turn ``Session.complete`` runs for it alone (its prefix from the pool,
prefill, decode), driven by the same ``Scheduler`` as ``serve`` (``session/scheduler.py``): up to N
lines decode together, one model call per step for all of them. The replies are the lone
replies except for rare greedy differences (batched matmuls round differently), which is why
``--parallel`` stays opt-in: ``batch`` promises by default the replies ``ask`` gives.

A group shares prefixes the same way as the sequential path: the group's common prefix is
prefilled once into the pool, and each line starts from a sliced copy of the best pooled cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import LocalchatError
from ..events import TurnFinished, Usage
from ..kvcache.folder import common_prefix
from ..kvcache.prefixes import PrefixPool
from ..session.generation import TurnOptions
from ..session.scheduler import Scheduler, Work
from ..session.session import Session


def complete_group(session: Session, chats: list[list[dict]], pool: PrefixPool,
                   max_tokens: list[int], temp: float, thinking: bool | None = None,
                   constraints: list | None = None
                   ) -> Iterable[tuple[str, str, Usage, bool | None] | LocalchatError]:
    """(reply, reasoning, usage, complete) for ``chats`` decoded together; the error in place
    of a line that failed (one that does not fit the context). The chats are checked lines
    (``batch.py``); ``thinking``: the template's switch (``TurnOptions.thinking``);
    ``constraints``: each chat's ``ConstraintSpec`` or None (each row masked by its own)."""
    engine = session.engine
    rendered = []
    for chat, limit in zip(chats, max_tokens):
        try:
            rendered.append(session.render_checked(chat, limit, thinking=thinking)[0])
        except LocalchatError:  # the line's own turn raises it again, as its error record
            pass
    if len(rendered) > 1:
        _seed_pool(engine, pool, rendered)
    results: list = [None] * len(chats)

    def work(i: int) -> Work:
        options = TurnOptions(max_tokens=max_tokens[i], temp=temp, thinking=thinking,
                              constraint=constraints[i] if constraints else None)

        def emit(ev) -> None:
            if isinstance(ev, TurnFinished):
                results[i] = (ev.reply, ev.reasoning, ev.usage, ev.complete)
            elif isinstance(ev, LocalchatError):
                results[i] = ev
            elif isinstance(ev, BaseException):
                raise ev  # a bug: not a line's error record

        return Work(lambda s: s.complete(chats[i], pool, options), emit)

    Scheduler(session, max_batch=len(chats)).run_all([work(i) for i in range(len(chats))])
    return [r if r is not None else LocalchatError("no reply") for r in results]


def _seed_pool(engine, pool: PrefixPool, prompts: list[list[int]]) -> None:
    """Prefill the group's common prefix once, unless the pool already holds it."""
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    shared = min(shared, min(len(p) for p in prompts) - 1)
    held, _ = pool.peek(prompts[0])
    if shared <= held + 16:  # nothing worth prefilling separately
        return
    k, cache, _ = pool.take(prompts[0][:shared + 1])
    steps = engine.prefill(prompts[0][k:shared + 1], cache)
    for _ in steps:
        pass
    pool.put(prompts[0][:shared + 1], cache)
