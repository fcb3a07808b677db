"""Batch benchmark: 16 prompts sharing a ~500-token system prompt.

Side by side in one run, on the default model (or -m MODEL):
1. ``localchat batch`` over a 16-line JSONL file (one process; the shared prefix is prefilled
   once and reused from the prefix pool);
2. the same with ``--parallel 16`` (the lines decoded together on localchat's scheduler,
   ``localchat/session/scheduler.py``; replies compared with 1.);
3. 16 sequential ``localchat ask --system … PROMPT`` processes (each a new conversation);
4. in one process, the decode strategies on the same 16 prompts, each starting from the
   shared prefix in a ``PrefixPool``: localchat's one-at-a-time decode (``Session.complete``)
   vs mlx-lm's ``batch_generate`` (what ``--parallel`` ran before the scheduler) and how
   often their greedy replies agree.

Usage: python scripts/bench_batch.py [--quick | --smoke] [-m MODEL]
``--quick``: 4 prompts, 16 tokens each. ``--smoke``: 2 prompts sharing a ~128-token system
prompt, 4 tokens each — every step in seconds on a tiny model (``tests/test_scripts.py``);
its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

QUESTIONS = [
    "What time does the museum open?", "Who books the train tickets?",
    "부산에는 언제 가나요?", "What is the weather in Seoul?", "Summarise the plan.",
    "What is the budget for?", "When does the tour start?", "다음 주 계획은 뭐예요?",
    "Name one thing to pack.", "Is the museum open at ten?", "Who discussed the budget?",
    "서울 날씨는 어때요?", "What do we see in Busan?", "Give the schedule in one line.",
    "How many cities are in the plan?", "What should we not forget?",
]


def system_prompt(engine, n_tokens: int) -> str:
    text = "You are a travel assistant. Use these notes when you answer.\n"
    while engine.count_tokens(text) < n_tokens:
        text += benchlib.FILLER
    return text


def in_process(model: str | None, questions: list[str], system_tokens: int,
               max_tokens: int) -> dict:
    """One-at-a-time decode vs mlx-lm's batch_generate, in this process, both from the
    shared prefix in a PrefixPool."""
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from mlx_lm.generate import batch_generate

    from localchat.kvcache.folder import common_prefix
    from localchat.kvcache.prefixes import PrefixPool
    from localchat.model.engine import Engine
    from localchat.session.session import Session, TurnFinished, TurnOptions
    from localchat.store.database import Store

    engine = Engine.load(model)
    system = system_prompt(engine, system_tokens)
    session = Session(Store.open(paths.database_path()), engine, paths.kv_root(),
                      paths.locks_dir())
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in questions]
    options = TurnOptions(max_tokens=max_tokens)
    # Warm-up.
    list(session.complete(chats[0], PrefixPool(engine.new_cache), TurnOptions(max_tokens=4)))

    t0 = time.perf_counter()
    pool = PrefixPool(engine.new_cache)
    ours = [next(ev for ev in session.complete(c, pool, options)
                 if isinstance(ev, TurnFinished)) for c in chats]
    t_ours = time.perf_counter() - t0

    t0 = time.perf_counter()
    pool = PrefixPool(engine.new_cache)
    prompts = [engine.render(c) for c in chats]
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    _, cache, _ = pool.take(prompts[0][:shared])
    benchlib.prefill(engine, prompts[0][:shared], cache)
    pool.put(prompts[0][:shared], cache)
    caches, suffixes = [], []
    for p in prompts:  # each a sliced copy of the prefix; batch_generate feeds the rest
        k, c, _ = pool.take(p)
        caches.append(c)
        suffixes.append(p[k:])
    out = batch_generate(engine.model, engine.tokenizer, suffixes, prompt_caches=caches,
                         max_tokens=max_tokens, return_token_ids=True)
    t_batch = time.perf_counter() - t0
    eos = engine.eos_ids
    agree = sum([t for t in o.tokens if t not in eos] == list(ids)
                for o, ids in zip(ours, out.token_ids))
    return {"ours_s": t_ours, "batch_generate_s": t_batch,
            "ours_tokens": sum(o.usage.completion_tokens for o in ours),
            "replies_equal": agree, "lines": len(ours)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "4 prompts, 16 tokens")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    max_tokens = benchlib.pick(args, 32, 16, 4)
    questions = benchlib.pick(args, QUESTIONS, QUESTIONS[:4], QUESTIONS[:2])
    system_tokens = benchlib.pick(args, 500, 500, 128)
    if args.child:
        print(json.dumps(in_process(args.model, questions, system_tokens, max_tokens)))
        return
    home = benchlib.scratch_home()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    model_args = ["-m", args.model] if args.model else []

    from localchat.model.engine import Engine

    engine = Engine.load(args.model)
    system = system_prompt(engine, system_tokens)
    work = home / "bench-batch"
    work.mkdir()
    infile = work / "in.jsonl"
    infile.write_text("".join(json.dumps({"id": i, "system": system, "prompt": q},
                                         ensure_ascii=False) + "\n"
                              for i, q in enumerate(questions)), encoding="utf-8")
    benchlib.run(benchlib.localchat("ask", *model_args, "--max-tokens", "2", "warm up"), env)

    def batch(out: Path, *extra: str) -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        benchlib.run(benchlib.localchat("batch", str(infile), "-o", str(out), "--quiet",
                                        "--max-tokens", str(max_tokens), *extra, *model_args),
                     env)
        elapsed = time.perf_counter() - t0
        return elapsed, [json.loads(x) for x in out.read_text().splitlines()]

    t_batch, results = batch(work / "out.jsonl")
    cached = [r["usage"]["cached_tokens"] for r in results]
    parallel = len(questions)
    t_par, par = batch(work / "par.jsonl", "--parallel", str(parallel))
    same_par = sum(a.get("reply") == b.get("reply") for a, b in zip(results, par))

    t0 = time.perf_counter()
    for q in questions:
        benchlib.run(benchlib.localchat("ask", *model_args, "--system", system, "--max-tokens",
                                        str(max_tokens), q), env)
    t_asks = time.perf_counter() - t0

    child = benchlib.run([sys.executable, __file__, "--child", *model_args,
                          *benchlib.size_flags(args)], env)
    decode = json.loads(child.stdout.strip().splitlines()[-1])

    shared_tokens = min(cached[1:]) if len(cached) > 1 else 0
    print(f"# batch benchmark · {engine.ref.name} · {len(questions)} prompts, "
          f"~{system_tokens}-token shared system prompt, {max_tokens} tokens each · "
          f"{benchlib.machine()}")
    benchlib.print_table(["run", "wall s", "vs localchat batch"], [
        ["localchat batch (1 process)", t_batch, "1.00x"],
        [f"localchat batch --parallel {parallel} ({same_par}/{len(par)} replies equal)", t_par,
         f"{t_par / t_batch:.2f}x"],
        [f"{len(questions)} x localchat ask", t_asks, f"{t_asks / t_batch:.2f}x"],
        ["in-process: one-at-a-time + prefix pool", decode["ours_s"], ""],
        [f"in-process: mlx-lm batch_generate ({decode['replies_equal']}/{decode['lines']} "
         "replies equal)", decode["batch_generate_s"],
         f"{decode['batch_generate_s'] / decode['ours_s']:.2f}x of one-at-a-time"],
    ])
    print(f"cached_tokens per line: {cached} (line 1 prefills the prefix; the rest reuse "
          f">= {shared_tokens} tokens)")
    benchlib.print_json({
        "bench": "batch", "mode": benchlib.mode(args), "model": engine.ref.name,
        "machine": benchlib.machine(), "lines": len(questions), "max_tokens": max_tokens,
        "batch_wall_s": t_batch, "asks_wall_s": t_asks, "asks_vs_batch": t_asks / t_batch,
        "parallel": parallel, "parallel_wall_s": t_par, "parallel_replies_equal": same_par,
        "cached_tokens": cached, "decode_strategies": decode,
    })


if __name__ == "__main__":
    main()
