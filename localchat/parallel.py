"""Batched decoding of ephemeral batch lines with mlx-lm's ``batch_generate``.

Used by ``localchat batch --parallel N``. Measured on the default model (scripts/bench_batch.py,
16 prompts sharing a 500-token system prompt, 32 tokens each, 2-core CPU): 10.9 s batched vs
23.3 s one at a time. It is opt-in because batched (padded) matmuls round differently from
one-at-a-time ones: 15 of those 16 greedy replies were identical, one was not, and ``batch``
promises by default the same replies as ``ask``.

A group shares prefixes the same way as the sequential path: the group's common prefix is
prefilled once into the pool, and each line starts from a sliced copy of the best pooled cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from .engine import now
from .errors import LocalchatError
from .events import Usage
from .generation import opened_in_prompt
from .kvcache.folder import common_prefix
from .kvcache.prefixes import PrefixPool
from .replies import split_reasoning, thinking_markers
from .session import Session


def complete_group(session: Session, chats: list[list[dict]], pool: PrefixPool,
                   max_tokens: list[int], temp: float, thinking: bool | None = None
                   ) -> Iterable[tuple[str, str, Usage] | LocalchatError]:
    """(reply, reasoning, usage) for ``chats`` decoded together; the error in place of a line
    that failed (one that does not fit the context). The chats are checked lines
    (``batch.py``); ``thinking``: the template's switch (``TurnOptions.thinking``)."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    engine = session.engine
    rendered: list[tuple[list[int], int] | LocalchatError] = []
    for chat, limit in zip(chats, max_tokens):
        try:
            rendered.append(session.render_checked(chat, limit, thinking=thinking))
        except LocalchatError as err:  # becomes this line's error record
            rendered.append(err)
    ok = [r for r in rendered if not isinstance(r, LocalchatError)]
    if not ok:
        return rendered
    _seed_pool(engine, pool, [tokens for tokens, _ in ok])
    prompts, caches, ks = [], [], []
    for tokens, _ in ok:
        k, cache, _ = pool.take(tokens)
        prompts.append(tokens[k:])
        caches.append(cache)
        ks.append(k)
    t0 = now()
    out = batch_generate(engine.model, engine.tokenizer, prompts, prompt_caches=caches,
                         max_tokens=[limit for _, limit in ok], return_token_ids=True,
                         sampler=make_sampler(temp),
                         logits_processors=engine.reply_processors(engine.layout().vocab or None))
    stats = out.stats
    info = engine.info()
    markers = thinking_markers(engine)
    results, i = [], 0
    for r in rendered:
        if isinstance(r, LocalchatError):
            results.append(r)
            continue
        tokens, limit = r
        ids = list(out.token_ids[i])
        n_gen = len(ids) + (1 if len(ids) < limit else 0)  # the EOS that ended it
        # The group's clock: its prompt time, then its decode time over this line's tokens.
        t_first = t0 + stats.prompt_time
        usage = Usage.of(
            prompt_tokens=len(tokens), cached_tokens=ks[i], completion_tokens=n_gen, t0=t0,
            t_first=t_first, t_last=t_first + max(n_gen - 1, 0) / max(stats.generation_tps, 1e-9),
            prefill_s=stats.prompt_time * (len(tokens) - ks[i]) / max(stats.prompt_tokens, 1),
            context_tokens=len(tokens) + len(ids), context_length=info.context_length,
            miss_reason="" if ks[i] else "no shared prefix",
            reasoning_tokens=_thought(engine, markers, ids))
        text = engine.decode_text([t for t in ids if t not in engine.hidden_ids])
        opened = opened_in_prompt(engine, markers, tokens)
        reasoning, reply = split_reasoning(markers, (markers[0] + text) if opened else text)
        results.append((reply, reasoning, usage))
        i += 1
    return results


def _thought(engine, markers: tuple[str, str] | None, ids: list[int]) -> int:
    """How many of a reply's ``ids`` are its reasoning (to its end marker, included)."""
    if not markers:
        return 0
    end = engine.encode(markers[1])
    for at in range(len(ids) - len(end) + 1):
        if ids[at:at + len(end)] == end:
            return at + len(end)
    return 0


def _seed_pool(engine, pool: PrefixPool, prompts: list[list[int]]) -> None:
    """Prefill the group's common prefix once, unless the pool already holds it."""
    if len(prompts) < 2:
        return
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
