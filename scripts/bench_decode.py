"""Decode and prefill speed: localchat vs plain mlx-lm, and the Linux CPU fast path vs stock.

Side by side in one run, on the default model (or -m MODEL), same prompt:
1. overhead: decode tok/s of a localchat turn vs ``mlx_lm.stream_generate`` on the very same
   loaded model (so only the loop differs);
2. CPU fast path: prefill and decode tok/s of localchat as set up (OpenBLAS + float32 weights
   on a Linux CPU) vs the stock set-up (``LOCALCHAT_BLAS=off LOCALCHAT_DEQUANTIZE=0``: MLX's
   bundled reference BLAS, 4-bit weights), each in its own process;
3. CPU attention: the same turn with MLX's own attention (``LOCALCHAT_CPU_ATTENTION=mlx``)
   in the same process, rounds interleaved with ours (localchat/cpu/attention.py). ``--history N``
   puts an N-token conversation before the prompt, where attention weighs more.
4. prompt lookup (localchat/session/speculative.py): decode tok/s of ``--speculate off`` and
   ``lookup`` turns, rounds interleaved, on a copy-heavy task (``COPY_TASK``: a 60-line
   function given back with one name changed) and a free-form one (``FREE_TASK``), with
   whether the two replies are the same text and the draft tokens accepted / verified.
   ``--lookup-only`` runs just this part (in this process).

Usage: python scripts/bench_decode.py [--quick | --smoke] [-m MODEL] [--history N]
       [--lookup-only] [--lookup-tokens N]
``--quick``: 1 trial, 32 tokens. ``--smoke``: 1 trial of 8 tokens after a ~40-word prompt,
every step (both processes, both attentions, plain mlx-lm) in seconds on a tiny model
(``tests/test_scripts.py`` runs it); its figures mean nothing.
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

# Prompt lookup (localchat/session/speculative.py): a copy-heavy task, a 60-line function to give
# back with one name changed, and a free-form one.
FUNCTION = """def summarize_orders(orders, customers, tax_rate=0.2, currency="EUR"):
    \"\"\"Group orders by customer and return one summary row per customer.\"\"\"
    by_customer = {}
    for order in orders:
        customer_id = order["customer_id"]
        if customer_id not in customers:
            continue
        rows = by_customer.setdefault(customer_id, [])
        rows.append(order)
    summaries = []
    for customer_id, rows in sorted(by_customer.items()):
        customer = customers[customer_id]
        subtotal = 0.0
        items = 0
        largest = None
        for order in rows:
            amount = order["quantity"] * order["unit_price"]
            subtotal += amount
            items += order["quantity"]
            if largest is None or amount > largest["amount"]:
                largest = {"order_id": order["id"], "amount": amount}
        discount = 0.0
        if items >= 100:
            discount = subtotal * 0.1
        elif items >= 50:
            discount = subtotal * 0.05
        taxed = (subtotal - discount) * (1 + tax_rate)
        first = min(order["date"] for order in rows)
        last = max(order["date"] for order in rows)
        days = (last - first).days + 1
        per_day = taxed / days if days else taxed
        status = "active"
        if days > 365:
            status = "loyal"
        if taxed > 10000:
            status = "premium"
        summary = {
            "customer_id": customer_id,
            "name": customer["name"],
            "country": customer.get("country", "unknown"),
            "orders": len(rows),
            "items": items,
            "subtotal": round(subtotal, 2),
            "discount": round(discount, 2),
            "total": round(taxed, 2),
            "currency": currency,
            "per_day": round(per_day, 2),
            "largest_order": largest,
            "first_order": first.isoformat(),
            "last_order": last.isoformat(),
            "status": status,
        }
        summaries.append(summary)
    summaries.sort(key=lambda row: row["total"], reverse=True)
    for rank, summary in enumerate(summaries, start=1):
        summary["rank"] = rank
    total = sum(row["total"] for row in summaries)
    for summary in summaries:
        summary["share"] = round(summary["total"] / total, 4) if total else 0.0
    return summaries
"""


def copy_task(lines: int = 60) -> str:
    """Give back the first ``lines`` lines of ``FUNCTION`` with one name changed."""
    code = "".join(FUNCTION.splitlines(keepends=True)[:lines])
    return ("Rename the function summarize_orders to summarize_purchases. Reply with the "
            "whole function, unchanged otherwise.\n\n```python\n" + code + "```")


COPY_TASK = copy_task()
FREE_TASK = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(model: str | None, trials: int, tokens: int, words: int, history: int = 0,
            look_tokens: int = 0) -> dict:
    """In this process: localchat turn figures (with our CPU attention and with MLX's), plain
    mlx-lm decode on the same model, and (``look_tokens``) prompt lookup on and off."""
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    import localchat.cpu.attention as attention
    from localchat.events import TurnFinished, Usage
    from localchat.model.engine import Engine
    from localchat.session.session import Session, TurnOptions
    from localchat.store.database import Store

    engine = Engine.load(model)
    ours_attn = attention.installed()  # False off the CPU: both rows then run MLX's
    store = Store.open(paths.database_path())
    prompt = " ".join(benchlib.FILLER.split()[:40]) * max(1, words // 40)
    before = benchlib.filler_messages(engine, history) if history else []
    ours, plain, prefill, mlx_attn_decode, mlx_attn_prefill = [], [], [], [], []

    def turn(run: int) -> Usage:
        # A prompt of its own per run: conversations share cached prefixes (the history, after
        # the warm-up round), so the same prompt would be a cache hit for the second path.
        conv = store.create(f"d{run}-{time.time()}", engine.ref.name)
        for m in before:
            store.add_message(conv, m["role"], m["content"])
        session = Session(store, engine, paths.kv_root(), paths.locks_dir())
        return next(ev.usage for ev in session.turn(conv, f"{run} {prompt}",
                                                    TurnOptions(max_tokens=tokens))
                    if isinstance(ev, TurnFinished))

    for i in range(trials + 1):  # the first round warms up
        rounds = (False, True) if i % 2 == 0 else (True, False)
        for mlx_attn in rounds if ours_attn else (False,):
            if mlx_attn:
                attention.uninstall()
            u = turn(2 * i + mlx_attn)
            if ours_attn:
                attention.install()
            if i and mlx_attn:
                mlx_attn_decode.append(u.decode_tps)
                mlx_attn_prefill.append(u.prefill_tps)
            elif i:
                ours.append(u.decode_tps)
                prefill.append(u.prefill_tps)
        text = engine.tokenizer.apply_chat_template(
            before + [{"role": "user", "content": f"{i} {prompt}"}], add_generation_prompt=True,
            tokenize=False)
        responses = list(stream_generate(engine.model, engine.tokenizer, text,
                                         max_tokens=tokens, sampler=make_sampler(0.0)))
        if i:
            plain.append(responses[-1].generation_tps)
    if not ours_attn:  # MLX's attention all along
        mlx_attn_decode, mlx_attn_prefill = ours, prefill
    return {"model": engine.ref.name, "localchat_decode_tps": benchlib.median(ours),
            "mlxlm_decode_tps": benchlib.median(plain),
            "localchat_prefill_tps": benchlib.median(prefill),
            "mlx_attention_decode_tps": benchlib.median(mlx_attn_decode),
            "mlx_attention_prefill_tps": benchlib.median(mlx_attn_prefill),
            "blas": backend.blas_in_use(),
            # (a smoke run's tiny model has a 1k context: a few lines of the function)
            "lookup": measure_lookup(engine, store, trials, look_tokens,
                                     60 if tokens > 8 else 6) if look_tokens else None}


def measure_lookup(engine, store, trials: int, tokens: int, lines: int = 60) -> dict:
    """Decode tok/s with and without prompt lookup, per task: medians over ``trials`` rounds
    (after one warm-up round), the two orders alternating. Every turn prefills its whole prompt
    (``no_cache``) in a conversation of its own, so the two paths see the same work."""
    import localchat.paths as paths
    from localchat.events import TurnFinished
    from localchat.session.session import Session, TurnOptions

    out = {}
    for task, prompt in (("copy", copy_task(lines)), ("free", FREE_TASK)):
        tps = {"off": [], "lookup": []}
        same, accepted, drafted, completion = True, 0, 0, 0
        for i in range(trials + 1):
            replies = {}
            for how in ("off", "lookup") if i % 2 else ("lookup", "off"):
                conv = store.create(f"l{task}{i}{how}-{time.time()}", engine.ref.name)
                session = Session(store, engine, paths.kv_root(), paths.locks_dir())
                done = next(ev for ev in session.turn(
                    conv, prompt, TurnOptions(max_tokens=tokens, no_cache=True, speculate=how))
                    if isinstance(ev, TurnFinished))
                replies[how] = done.tokens
                if i:
                    tps[how].append(done.usage.decode_tps)
                if how == "lookup":
                    accepted += done.usage.lookup_accepted
                    drafted += done.usage.lookup_drafted
                    completion = len(done.tokens)
            same = same and replies["off"] == replies["lookup"]
        off, on = benchlib.median(tps["off"]), benchlib.median(tps["lookup"])
        out[task] = {"plain_tps": off, "lookup_tps": on, "speedup": benchlib.ratio(on, off),
                     "same_text": same, "accepted": accepted, "drafted": drafted,
                     "completion_tokens": completion}
    return out


def lookup_table(look: dict) -> None:
    benchlib.print_table(
        ["task", "plain decode tok/s", "lookup decode tok/s", "speed-up", "same text",
         "draft tokens accepted / verified", "reply tokens"],
        [[task, r["plain_tps"], r["lookup_tps"], f"{r['speedup']:.2f}x",
          "yes" if r["same_text"] else "NO", f"{r['accepted']} / {r['drafted']}",
          r["completion_tokens"]] for task, r in look.items()])


def lookup_only(args, trials: int, tokens: int) -> None:
    """Part 4 alone, in this process, in a scratch data folder."""
    os.environ["LOCALCHAT_HOME"] = str(benchlib.scratch_home())
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    from localchat.model.engine import Engine
    from localchat.store.database import Store

    engine = Engine.load(args.model)
    store = Store.open(paths.database_path())
    look = measure_lookup(engine, store, trials, tokens)
    print(f"# prompt lookup · {engine.ref.name} · {benchlib.machine()} · up to {tokens} "
          f"tokens, median of {trials}")
    lookup_table(look)
    benchlib.print_json({"bench": "decode", "mode": benchlib.mode(args),
                         "model": engine.ref.name, "machine": benchlib.machine(),
                         "lookup": look})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "1 trial, 32 tokens")
    ap.add_argument("--history", type=int, default=0,
                    help="tokens of conversation before the prompt (e.g. 4096)")
    ap.add_argument("--lookup-only", action="store_true",
                    help="only the prompt-lookup comparison (copy-heavy and free-form tasks)")
    ap.add_argument("--lookup-tokens", type=int, default=None, metavar="N",
                    help="reply cap of the prompt-lookup tasks (default 700; --quick 200)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    trials, tokens = benchlib.pick(args, (3, 64), (1, 32), (1, 8))
    words = benchlib.pick(args, 400, 400, 40)  # 400: ~500 tokens of prompt
    look_tokens = (args.lookup_tokens if args.lookup_tokens is not None
                   else benchlib.pick(args, 700, 200, 12))  # 0: not measured
    if args.lookup_only:
        lookup_only(args, trials, look_tokens)
        return
    if args.child:
        print(json.dumps(measure(args.model, trials, tokens, words, args.history,
                                 look_tokens)))
        return
    home = benchlib.scratch_home()

    def child(extra_env: dict, lookup: int) -> dict:
        cmd = [sys.executable, __file__, "--child", "--history", str(args.history),
               "--lookup-tokens", str(lookup),
               *benchlib.size_flags(args)] + (["-m", args.model] if args.model else [])
        env = {**os.environ, "LOCALCHAT_HOME": str(home), **extra_env}
        return json.loads(benchlib.run(cmd, env).stdout.strip().splitlines()[-1])

    fast = child({}, look_tokens)
    # Stock is MLX's attention too. Not run with a history: its 4-bit reference-BLAS prefill
    # of thousands of tokens takes minutes per trial.
    stock = None if args.history else child({
        "LOCALCHAT_BLAS": "off", "LOCALCHAT_DEQUANTIZE": "0", "LOCALCHAT_CPU_ATTENTION": "mlx"},
        0)  # prompt lookup: measured on the fast path only
    rows = [
        ["localchat (as set up)", fast["localchat_prefill_tps"], fast["localchat_decode_tps"],
         fast["mlxlm_decode_tps"],
         benchlib.ratio(fast["localchat_decode_tps"], fast["mlxlm_decode_tps"])],
        ["  same, MLX's CPU attention", fast["mlx_attention_prefill_tps"],
         fast["mlx_attention_decode_tps"], "", ""],
    ]
    if stock:
        rows.append(["stock mlx[cpu] set-up", stock["localchat_prefill_tps"],
                     stock["localchat_decode_tps"], stock["mlxlm_decode_tps"],
                     benchlib.ratio(stock["localchat_decode_tps"],
                                    stock["mlxlm_decode_tps"])])
    print(f"# decode benchmark · {fast['model']} · {benchlib.machine()} · "
          f"{args.history} tokens of history + ~{words} words prompt, {tokens} tokens, "
          f"median of {trials}")
    benchlib.print_table(["set-up", "prefill tok/s", "decode tok/s",
                          "plain mlx-lm decode tok/s", "decode vs mlx-lm"], rows)
    pf = benchlib.ratio(fast["localchat_prefill_tps"], stock["localchat_prefill_tps"]
                        ) if stock else None
    dc = benchlib.ratio(fast["localchat_decode_tps"], stock["localchat_decode_tps"]
                        ) if stock else None
    if stock:
        print(f"fast path vs stock: prefill {pf:.1f}x, decode {dc:.1f}x")
    if fast["lookup"]:
        lookup_table(fast["lookup"])
    apf = benchlib.ratio(fast["localchat_prefill_tps"], fast["mlx_attention_prefill_tps"])
    adc = benchlib.ratio(fast["localchat_decode_tps"], fast["mlx_attention_decode_tps"])
    print(f"our CPU attention vs MLX's: prefill {apf:.2f}x, decode {adc:.2f}x")
    benchlib.print_json({
        "bench": "decode", "mode": benchlib.mode(args), "model": fast["model"],
        "machine": benchlib.machine(), "fast": fast, "stock": stock,
        "decode_vs_mlxlm": benchlib.ratio(fast["localchat_decode_tps"],
                                          fast["mlxlm_decode_tps"]),
        "prefill_speedup_vs_stock": pf, "decode_speedup_vs_stock": dc,
        "history_tokens": args.history,
        "attention_prefill_speedup": apf, "attention_decode_speedup": adc,
        "lookup": fast["lookup"],
    })


if __name__ == "__main__":
    main()
