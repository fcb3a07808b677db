"""Batch benchmark: 16 prompts sharing a ~500-token system prompt.

Side by side in one run, on the default model (or -m MODEL):
1. ``localchat batch`` over a 16-line JSONL file (one process; the shared prefix is prefilled
   once and reused from the prefix pool);
2. 16 sequential ``localchat ask --system … PROMPT`` processes (each a new conversation);
3. in one process, the decode strategies on the same 16 prompts and the same prefix cache:
   localchat's one-at-a-time decode vs mlx-lm's ``batch_generate`` (BatchGenerator) — the
   reason ``localchat batch`` decodes one line at a time, or would not.

Usage: python scripts/bench_batch.py [--quick] [-m MODEL]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def system_prompt(engine) -> str:
    text = "You are a travel assistant. Use these notes when you answer.\n"
    while engine.count_tokens(text) < 500:
        text += benchlib.FILLER
    return text


def in_process(model: str | None, max_tokens: int) -> dict:
    from localchat import backend, paths

    backend.prepare()
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    from localchat.engine import Engine
    from localchat.kvstore import common_prefix
    from localchat.prefixes import PrefixPool
    from localchat.session import Session, TurnFinished
    from localchat.store import Store

    engine = Engine.load(model)
    system = system_prompt(engine)
    session = Session(Store.open(paths.database_path()), engine, paths.kv_root(),
                      paths.locks_dir())
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in QUESTIONS]
    # Warm-up.
    list(session.complete(chats[0], PrefixPool(engine.new_cache), max_tokens=4))

    t0 = time.perf_counter()
    pool = PrefixPool(engine.new_cache)
    ours = [next(ev for ev in session.complete(c, pool, max_tokens=max_tokens)
                 if isinstance(ev, TurnFinished)) for c in chats]
    t_ours = time.perf_counter() - t0

    t0 = time.perf_counter()
    prompts = [engine.render(c) for c in chats]
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    prefix_cache = engine._plain_cache()
    gen = engine.prefill(prompts[0][:shared], prefix_cache)
    for _ in gen:
        pass
    mx.eval([c.state for c in prefix_cache])
    caches = []
    for _ in prompts:
        copy = engine._plain_cache()
        for dst, src in zip(copy, prefix_cache):
            k, v, off = src.state
            dst.state = (k[..., :off, :], v[..., :off, :], off)
        caches.append(copy)
    # The last prefix token is fed again with each suffix (batch_generate wants >= 1 token).
    suffixes = [p[shared - 1:] for p in prompts]
    for c in caches:
        for layer in c:
            layer.trim(1)
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
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    max_tokens = 16 if args.quick else 32
    if args.quick:
        del QUESTIONS[4:]
    if args.child:
        print(json.dumps(in_process(args.model, max_tokens)))
        return
    home = benchlib.scratch_home()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    exe = [sys.executable, "-m", "localchat"]
    model_args = ["-m", args.model] if args.model else []

    from localchat.engine import Engine
    system = system_prompt(Engine.load(args.model))
    work = Path(tempfile.mkdtemp(prefix="localchat-batch-"))
    infile = work / "in.jsonl"
    infile.write_text("".join(json.dumps({"id": i, "system": system, "prompt": q},
                                         ensure_ascii=False) + "\n"
                              for i, q in enumerate(QUESTIONS)), encoding="utf-8")
    subprocess.run(exe + ["ask", *model_args, "--max-tokens", "2", "warm up"], env=env,
                   capture_output=True, check=True)

    t0 = time.perf_counter()
    subprocess.run(exe + ["batch", str(infile), "-o", str(work / "out.jsonl"), "--quiet",
                          "--max-tokens", str(max_tokens), *model_args],
                   env=env, capture_output=True, check=True)
    t_batch = time.perf_counter() - t0
    results = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
    cached = [r["usage"]["cached_tokens"] for r in results]

    t0 = time.perf_counter()
    subprocess.run(exe + ["batch", str(infile), "-o", str(work / "par.jsonl"), "--quiet",
                          "--parallel", "16", "--max-tokens", str(max_tokens), *model_args],
                   env=env, capture_output=True)
    t_par = time.perf_counter() - t0
    par = [json.loads(x) for x in (work / "par.jsonl").read_text().splitlines()]
    same_par = sum(a.get("reply") == b.get("reply") for a, b in zip(results, par))

    t0 = time.perf_counter()
    for q in QUESTIONS:
        subprocess.run(exe + ["ask", *model_args, "--system", system, "--max-tokens",
                              str(max_tokens), q], env=env, capture_output=True, check=True)
    t_asks = time.perf_counter() - t0

    child = subprocess.run([sys.executable, __file__, "--child", *model_args] +
                           (["--quick"] if args.quick else []), env=env, capture_output=True,
                           text=True, check=True)
    decode = json.loads(child.stdout.strip().splitlines()[-1])

    shared_tokens = min(cached[1:]) if len(cached) > 1 else 0
    print(f"# batch benchmark · {len(QUESTIONS)} prompts, ~500-token shared system prompt, "
          f"{max_tokens} tokens each · {benchlib.machine()}")
    benchlib.print_table(["run", "wall s", "vs localchat batch"], [
        ["localchat batch (1 process)", t_batch, "1.00x"],
        [f"localchat batch --parallel 16 ({same_par}/{len(par)} replies equal)", t_par,
         f"{t_par / t_batch:.2f}x"],
        [f"{len(QUESTIONS)} x localchat ask", t_asks, f"{t_asks / t_batch:.2f}x"],
        ["in-process: one-at-a-time + prefix pool", decode["ours_s"], ""],
        ["in-process: mlx-lm batch_generate", decode["batch_generate_s"],
         f"{decode['batch_generate_s'] / decode['ours_s']:.2f}x of one-at-a-time"],
    ])
    print(f"cached_tokens per line: {cached} (line 1 prefills the prefix; the rest reuse "
          f">= {shared_tokens} tokens)")
    benchlib.print_json({
        "bench": "batch", "machine": benchlib.machine(), "lines": len(QUESTIONS),
        "batch_wall_s": t_batch, "asks_wall_s": t_asks, "asks_vs_batch": t_asks / t_batch,
        "parallel16_wall_s": t_par, "parallel16_replies_equal": same_par,
        "cached_tokens": cached, "decode_strategies": decode,
    })


if __name__ == "__main__":
    main()
