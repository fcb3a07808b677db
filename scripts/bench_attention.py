"""CPU attention: MLX's own (``LOCALCHAT_CPU_ATTENTION=mlx``) vs ours (localchat/cpu/attention.py).

Side by side in one process on the default model (or -m MODEL), trials interleaved (the two
paths alternate, order flipped each trial, so machine noise hits both alike):
1. a 15-token message on top of a history of H tokens (``engine.prefill`` of the message into
   a cache that holds the history: the model part of a resumed turn's TTFT), for several H;
2. greedy decode tok/s at the end of that history;
3. full prefill of a long prompt (2k tokens by default) into an empty cache, tok/s;
4. exactness: on a fixed set of prompts, the greedy replies of both paths and the largest
   difference between their logits at every position.
Then the issue's targets: TTFT at 4k ≤ 1.5× at 256, prefill ≥ 1.8× MLX's, decode at 4k ≥
0.9× decode at 256.

Usage: python scripts/bench_attention.py [--quick | --smoke] [-m MODEL]
       [--histories 0,256,...] [--prefill N] [--trials N] [--clock wall|cpu]
``--quick``: histories 256, 1k and 4k, 2 trials, one prefill trial. ``--smoke``: every step
once or twice on lengths a tiny model holds (histories 0 and 256, a 128-token prefill, two
prompts over a 64-token history), in seconds: ``tests/test_scripts.py`` runs it so the
script cannot rot; its figures mean nothing.
``--clock cpu`` times with the process's CPU time instead of the wall clock: steadier on a
machine that other work shares (run it with OPENBLAS_NUM_THREADS=1, or OpenBLAS threads
that spin while waiting count too).
Prints tables, then one JSON line. CPU only (on Metal/CUDA there is nothing to compare).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

MESSAGE_TOKENS = 15
DECODE_TOKENS = 16
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "서울에서 부산까지 기차로 얼마나 걸려요?", "List three uses of a paper clip.",
           "Explain what a KV cache is in two sentences."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "256, 1k, 4k; 2 trials; 1 prefill")
    ap.add_argument("--histories", default=None)
    ap.add_argument("--prefill", type=int, default=None, help="default 2048")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    histories = [int(x) for x in args.histories.split(",")] if args.histories else (
        benchlib.pick(args, [0, 256, 1024, 2048, 4096], [256, 1024, 4096], [0, 256]))
    trials = args.trials or benchlib.pick(args, 3, 2, 2)  # 2: both orders of the pair
    prefill_tokens = args.prefill or benchlib.pick(args, 2048, 2048, 128)
    prefill_trials = benchlib.pick(args, trials, 1, 1)
    # Exactness: the prompts, teacher-forced after this long a history.
    prompts = benchlib.pick(args, PROMPTS, PROMPTS, PROMPTS[:2])
    exact_history = benchlib.pick(args, 1024, 1024, 64)

    benchlib.scratch_home()
    import localchat.cpu.backend as backend

    backend.prepare()
    import mlx.core as mx

    import localchat.cpu.attention as attention
    from localchat.model.engine import Engine

    engine = Engine.load(args.model)
    if not attention.installed():
        sys.exit("our attention is not in use (not a CPU run, or LOCALCHAT_CPU_ATTENTION=mlx)")
    info = engine.info()
    filler = engine.encode(benchlib.FILLER * (1 + max(histories + [prefill_tokens]) // 40))

    def use(path: str) -> None:
        attention.install() if path == "ours" else attention.uninstall()

    def prefill(tokens: list[int], cache) -> mx.array:
        return benchlib.prefill(engine, tokens, cache)

    def decode_time(cache, logits) -> float:
        """Seconds for DECODE_TOKENS greedy steps, EOS or not, queued as engine.decode does."""
        y = mx.argmax(logits, axis=-1)
        mx.async_eval(y)
        t0 = clock()
        for _ in range(DECODE_TOKENS):
            nxt = mx.argmax(engine.model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            int(y.item())
            y = nxt
        int(y.item())
        return clock() - t0

    def orders(i: int) -> list[str]:
        return ["mlx", "ours"] if i % 2 == 0 else ["ours", "mlx"]

    use("ours")
    prefill(filler[:64], engine.new_cache())  # warm-up: page in weights, build kernels
    use("mlx")
    prefill(filler[:64], engine.new_cache())

    # 1-2. A message on top of a history, then decode.
    message = engine.encode("Question: what should I pack for the trip to Busan next week?")
    message = (message * 2)[:MESSAGE_TOKENS]
    rows, per_history = [], []
    for h in histories:
        cache = engine.new_cache()
        use("ours")
        if h:
            prefill(filler[:h], cache)
        base = cache[0].offset if h else 0
        ttft = {"mlx": [], "ours": []}
        tps = {"mlx": [], "ours": []}
        for i in range(trials):
            for path in orders(i):
                use(path)
                t0 = clock()
                logits = prefill(message, cache)
                int(mx.argmax(logits, axis=-1).item())
                ttft[path].append(clock() - t0)
                tps[path].append(DECODE_TOKENS / decode_time(cache, logits))
                for c in cache:  # back to the bare history for the next run
                    c.trim(c.offset - base)
        r = {"history_tokens": h,
             "ttft_mlx_s": benchlib.median(ttft["mlx"]),
             "ttft_ours_s": benchlib.median(ttft["ours"]),
             "decode_mlx_tps": benchlib.median(tps["mlx"]),
             "decode_ours_tps": benchlib.median(tps["ours"])}
        per_history.append(r)
        rows.append([h, r["ttft_mlx_s"] * 1e3, r["ttft_ours_s"] * 1e3,
                     f"{r['ttft_mlx_s'] / r['ttft_ours_s']:.2f}x", r["decode_mlx_tps"],
                     r["decode_ours_tps"], f"{r['decode_ours_tps'] / r['decode_mlx_tps']:.2f}x"])

    # 3. Full prefill of a long prompt.
    long_prompt = filler[:prefill_tokens]
    prefill_s = {"mlx": [], "ours": []}
    for i in range(prefill_trials):
        for path in orders(i):
            use(path)
            t0 = clock()
            logits = prefill(long_prompt, engine.new_cache())
            int(mx.argmax(logits, axis=-1).item())
            prefill_s[path].append(clock() - t0)
    prefill_tps = {p: len(long_prompt) / benchlib.median(s) for p, s in prefill_s.items()}

    # 4. Exactness on fixed prompts: greedy replies and logits at every position.
    agree, worst = 0, 0.0
    for prompt in prompts:
        tokens = engine.render([{"role": "user", "content": prompt}])
        replies, logits = {}, {}
        for path in ("mlx", "ours"):
            use(path)
            cache = engine.new_cache()
            replies[path] = list(engine.decode(cache, prefill(tokens, cache), 24))
            # Teacher-forced on MLX's reply after a long history, so both see the same input
            # and the scores are large enough for our path to run.
            full = filler[:exact_history] + tokens + replies["mlx"]
            logits[path] = engine.model(mx.array(full)[None])
        agree += replies["mlx"] == replies["ours"]
        worst = max(worst, mx.abs(logits["mlx"] - logits["ours"]).max().item())
    use("ours")

    print(f"# CPU attention benchmark · {info.name} · {benchlib.machine()} · "
          f"{MESSAGE_TOKENS}-token message, {DECODE_TOKENS} decoded tokens, median of {trials}"
          f" · {args.clock} clock")
    benchlib.print_table(["history", "TTFT ms (MLX attn)", "TTFT ms (ours)", "speedup",
                          "decode tok/s (MLX attn)", "decode tok/s (ours)", "speedup"], rows)
    by_h = {r["history_tokens"]: r for r in per_history}
    hi = max(by_h)
    lo = 256 if 256 in by_h and hi != 256 else min(by_h)  # the baseline: 256 tokens
    flat = {p: by_h[hi][f"ttft_{p}_s"] / by_h[lo][f"ttft_{p}_s"] for p in ("mlx", "ours")}
    dflat = {p: by_h[hi][f"decode_{p}_tps"] / by_h[lo][f"decode_{p}_tps"] for p in ("mlx", "ours")}
    prefill_gain = prefill_tps["ours"] / prefill_tps["mlx"]
    print()
    benchlib.print_table(["target", "MLX attention", "ours", "goal"], [
        [f"TTFT at {hi} / at {lo}", f"{flat['mlx']:.2f}x", f"{flat['ours']:.2f}x", "<= 1.5x"],
        [f"prefill {len(long_prompt)} tokens, tok/s", prefill_tps["mlx"], prefill_tps["ours"],
         f">= 1.8x MLX (got {prefill_gain:.2f}x)"],
        [f"decode at {hi} / at {lo}", f"{dflat['mlx']:.2f}x", f"{dflat['ours']:.2f}x", ">= 0.9x"],
        ["greedy replies equal", "", f"{agree}/{len(prompts)}", "all"],
        ["max |logit difference|", "", f"{worst:.2e}", "small"],
    ])
    benchlib.print_json({
        "bench": "attention", "mode": benchlib.mode(args), "model": info.name,
        "machine": benchlib.machine(),
        "blas": backend.blas_in_use(), "clock": args.clock, "trials": trials,
        "histories": per_history,
        "ttft_flatness": flat, "decode_flatness": dflat,
        "prefill_tokens": len(long_prompt), "prefill_tps": prefill_tps,
        "prefill_speedup": prefill_gain, "greedy_agree": agree, "prompts": len(prompts),
        "max_logit_diff": worst,
    })


if __name__ == "__main__":
    main()
