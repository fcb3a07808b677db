"""Resume benchmark: time to first token of a new turn after a restart, and the disk it costs.

For each history length, on the default model (or -m MODEL), side by side in one run:
- localchat resumed: a new Session (nothing in memory) answers a new message; the cache comes
  from the conversation's segments on disk, only the new message is prefilled;
- the same with MLX's own CPU attention (what ``LOCALCHAT_CPU_ATTENTION=mlx`` runs; trials
  interleaved with the row above), to show what localchat/cpu/attention.py changes;
- full prefill: the same conversation state answered with no cache at all;
- mlx-lm route: ``load_prompt_cache`` of a ``save_prompt_cache`` file of the same cache, then
  the new message prefilled (what an mlx-lm user would do by hand).
Disk: bytes per token of our segments vs theory (2 x layers x kv_heads x head_dim x bytes) and
vs mlx-lm's file; bytes one turn writes vs the K/V of its new positions.

Usage: python scripts/bench_resume.py [--quick | --smoke] [-m MODEL] [--lengths 256,1024,...]
       [--trials N]
``--quick``: 256 and 1k, 1 trial (~1 min). ``--smoke``: 128 and 256, 1 trial: every step in
seconds on a tiny model (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import benchlib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "256 and 1k only, 1 trial (~1 min)")
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--trials", type=int, default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        benchlib.pick(args, [256, 1024, 2048, 4096], [256, 1024], [128, 256]))
    trials = args.trials or benchlib.pick(args, 3, 1, 1)

    benchlib.scratch_home()
    import localchat.cpu.backend as backend
    import localchat.paths as paths

    backend.prepare()
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    import localchat.cpu.attention as attention
    from localchat.events import TurnFinished
    from localchat.kvcache.folder import common_prefix
    from localchat.model.engine import Engine, make_prompt_cache
    from localchat.session.session import Session, TurnOptions
    from localchat.store.database import Store

    engine = Engine.load(args.model)
    info = engine.info()
    store = Store.open(paths.database_path())

    def session() -> Session:  # a fresh one per run: nothing of the cache left in memory
        return Session(store, engine, paths.kv_root(), paths.locks_dir())

    def turn(sess, conv, prompt, **kw):
        for ev in sess.turn(conv, prompt, TurnOptions(max_tokens=1, **kw)):
            if isinstance(ev, TurnFinished):
                return ev.usage
        raise RuntimeError("no reply")

    def reset(conv, n_messages):
        store.delete_messages_from(conv, n_messages + 1)

    # Warm-up: compile paths, page in weights.
    warm = store.create("warm", engine.ref.name)
    turn(session(), warm, "Hello")
    turn(session(), warm, "Hello again")

    rows, results = [], []
    for length in lengths:
        msgs = benchlib.filler_messages(engine, length)
        conv = store.create(f"h{length}", engine.ref.name)
        ref = store.create(f"h{length}-full", engine.ref.name)
        for c in (conv, ref):
            for m in msgs:
                store.add_message(c, m["role"], m["content"])
        turn(session(), conv, "Thanks.")  # builds the cache of the history on disk
        base = len(store.messages(conv))
        resumed, resumed_mlx_attn, full, mlxlm = [], [], [], []
        ours_attn = attention.installed()  # False off the CPU: both columns then run MLX's
        written = new_positions = 0
        for i in range(trials):
            for mlx_attn in (False, True) if i % 2 == 0 else (True, False):
                # A different question each run, so the cache left by the last run (history +
                # that question) is only a hit up to the history.
                new = f"Question {2 * i + mlx_attn}: what should I pack for the trip?"
                if mlx_attn:
                    attention.uninstall()
                u = turn(session(), conv, new)
                if ours_attn:
                    attention.install()
                (resumed_mlx_attn if mlx_attn else resumed).append(u.ttft_s)
                if not mlx_attn and i == 0:
                    written = u.bytes_written
                    new_positions = u.context_tokens - u.cached_tokens
                reset(conv, base)
            full.append(turn(session(), ref, new, no_cache=True).ttft_s)
            reset(ref, len(msgs))
        new = "Question: what should I pack for the trip?"
        # mlx-lm's own route on the same history cache.
        sess = session()
        man = sess.cache_folder(conv).manifest()
        rendered = engine.render([{"role": m.role, "content": m.content}
                                  for m in store.messages(conv)] +
                                 [{"role": "user", "content": new}])
        k = min(common_prefix(man.tokens, rendered), len(rendered) - 1)
        layers = sess.cache_folder(conv).load_growing(man, k, engine.compute_dtype())
        cache = make_prompt_cache(engine.model)  # mlx-lm's own KVCache, as an mlx-lm user has it
        for c, (keys, values) in zip(cache, layers):
            c.state = (keys[..., :k, :], values[..., :k, :], k)
        mlx_file = Path(paths.data_home()) / f"mlxlm-{length}.safetensors"
        save_prompt_cache(str(mlx_file), cache)
        suffix = rendered[k:]
        for _ in range(trials):
            t0 = time.perf_counter()
            loaded = load_prompt_cache(str(mlx_file))
            logits = benchlib.prefill(engine, suffix, loaded)
            int(mx.argmax(logits, axis=-1).item())
            mlxlm.append(time.perf_counter() - t0)
        ours = sess.cache_folder(conv).disk_bytes()
        theory = info.kv_bytes_per_token * len(man.tokens)
        mlx_per_token = mlx_file.stat().st_size / k
        r = {
            "history_tokens": len(man.tokens),
            "resumed_ttft_s": benchlib.median(resumed),
            "resumed_mlx_attention_ttft_s": benchlib.median(resumed_mlx_attn),
            "full_prefill_ttft_s": benchlib.median(full),
            "mlxlm_load_ttft_s": benchlib.median(mlxlm),
            "speedup_vs_full": benchlib.ratio(benchlib.median(full), benchlib.median(resumed)),
            "disk_bytes_per_token": ours / len(man.tokens),
            "disk_vs_theory": ours / theory,
            "mlxlm_file_vs_ours": mlx_per_token / (ours / len(man.tokens)),
            "turn_bytes_written": written,
            "turn_written_vs_new_kv": written / max(1, new_positions * info.kv_bytes_per_token),
        }
        results.append(r)
        rows.append([r["history_tokens"], r["resumed_ttft_s"], r["resumed_mlx_attention_ttft_s"],
                     r["full_prefill_ttft_s"],
                     r["mlxlm_load_ttft_s"], f"{r['speedup_vs_full']:.1f}x",
                     f"{r['disk_bytes_per_token']:,.0f}", f"{r['disk_vs_theory']:.3f}",
                     f"{r['mlxlm_file_vs_ours']:.2f}", f"{r['turn_written_vs_new_kv']:.3f}"])
    print(f"# resume benchmark · {info.name} · kv {info.kv_dtype} "
          f"{info.kv_bytes_per_token:,} B/token (theory) · {benchlib.machine()} · "
          f"trials {trials} (median)")
    benchlib.print_table(
        ["history", "resumed TTFT s", "same, MLX attention", "full prefill TTFT s",
         "mlx-lm load TTFT s",
         "resumed vs full", "disk B/token", "disk/theory", "mlx-lm file/ours",
         "turn written/new KV"], rows)
    first, last = results[0], results[-1]
    flat = last["resumed_ttft_s"] / first["resumed_ttft_s"]
    flat_mlx = last["resumed_mlx_attention_ttft_s"] / first["resumed_mlx_attention_ttft_s"]
    print(f"resumed TTFT at {last['history_tokens']} / at {first['history_tokens']} tokens: "
          f"{flat:.2f}x (MLX attention: {flat_mlx:.2f}x)")
    benchlib.print_json({
        "bench": "resume", "mode": benchlib.mode(args), "model": info.name,
        "machine": benchlib.machine(),
        "results": results,
        "flatness_last_vs_first": flat,
        "flatness_mlx_attention": flat_mlx,
    })


if __name__ == "__main__":
    main()
