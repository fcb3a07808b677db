"""Decode and prefill speed: localchat vs plain mlx-lm, and the Linux CPU fast path vs stock.

Side by side in one run, on the default model (or -m MODEL), same prompt:
1. overhead: decode tok/s of a localchat turn vs ``mlx_lm.stream_generate`` on the very same
   loaded model (so only the loop differs);
2. CPU fast path: prefill and decode tok/s of localchat as set up (OpenBLAS + float32 weights
   on a Linux CPU) vs the stock set-up (``LOCALCHAT_BLAS=off LOCALCHAT_DEQUANTIZE=0``: MLX's
   bundled reference BLAS, 4-bit weights), each in its own process.

Usage: python scripts/bench_decode.py [--quick] [-m MODEL]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402

PROMPT_WORDS = 400  # ~500 tokens of prompt


def measure(model: str | None, trials: int, tokens: int) -> dict:
    """In this process: localchat turn figures and plain mlx-lm decode on the same model."""
    from localchat import backend, paths

    backend.prepare()
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from localchat.engine import Engine
    from localchat.session import Session, TurnFinished
    from localchat.store import Store

    engine = Engine.load(model)
    store = Store.open(paths.database_path())
    prompt = " ".join(benchlib.FILLER.split()[:40]) * (PROMPT_WORDS // 40)
    ours, plain, prefill = [], [], []
    for i in range(trials + 1):  # the first round warms up
        conv = store.create(f"d{i}-{time.time()}", engine.ref.name)
        session = Session(store, engine, paths.kv_root(), paths.locks_dir())
        u = next(ev.usage for ev in session.turn(conv, f"{i} {prompt}", max_tokens=tokens)
                 if isinstance(ev, TurnFinished))
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i} {prompt}"}], add_generation_prompt=True,
            tokenize=False)
        responses = list(stream_generate(engine.model, engine.tokenizer, text,
                                         max_tokens=tokens, sampler=make_sampler(0.0)))
        if i:
            ours.append(u.decode_tps)
            prefill.append(u.prefill_tps)
            plain.append(responses[-1].generation_tps)
    return {"localchat_decode_tps": benchlib.median(ours),
            "mlxlm_decode_tps": benchlib.median(plain),
            "localchat_prefill_tps": benchlib.median(prefill),
            "blas": backend.blas_in_use()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    trials, tokens = (1, 32) if args.quick else (3, 64)
    if args.child:
        print(json.dumps(measure(args.model, trials, tokens)))
        return
    home = benchlib.scratch_home()

    def child(extra_env: dict) -> dict:
        cmd = [sys.executable, __file__, "--child"] + (["--quick"] if args.quick else []) + (
            ["-m", args.model] if args.model else [])
        env = {**os.environ, "LOCALCHAT_HOME": str(home), **extra_env}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    fast = child({})
    stock = child({"LOCALCHAT_BLAS": "off", "LOCALCHAT_DEQUANTIZE": "0"})
    rows = [
        ["localchat (as set up)", fast["localchat_prefill_tps"], fast["localchat_decode_tps"],
         fast["mlxlm_decode_tps"], fast["localchat_decode_tps"] / fast["mlxlm_decode_tps"]],
        ["stock mlx[cpu] set-up", stock["localchat_prefill_tps"],
         stock["localchat_decode_tps"], stock["mlxlm_decode_tps"],
         stock["localchat_decode_tps"] / stock["mlxlm_decode_tps"]],
    ]
    print(f"# decode benchmark · {args.model or 'default model'} · {benchlib.machine()} · "
          f"~{PROMPT_WORDS} words prompt, {tokens} tokens, median of {trials}")
    benchlib.print_table(["set-up", "prefill tok/s", "decode tok/s",
                          "plain mlx-lm decode tok/s", "decode vs mlx-lm"], rows)
    pf = fast["localchat_prefill_tps"] / stock["localchat_prefill_tps"]
    dc = fast["localchat_decode_tps"] / stock["localchat_decode_tps"]
    print(f"fast path vs stock: prefill {pf:.1f}x, decode {dc:.1f}x")
    benchlib.print_json({
        "bench": "decode", "machine": benchlib.machine(), "fast": fast, "stock": stock,
        "decode_vs_mlxlm": fast["localchat_decode_tps"] / fast["mlxlm_decode_tps"],
        "prefill_speedup_vs_stock": fast["localchat_prefill_tps"] / stock["localchat_prefill_tps"],
        "decode_speedup_vs_stock": fast["localchat_decode_tps"] / stock["localchat_decode_tps"],
    })


if __name__ == "__main__":
    main()
