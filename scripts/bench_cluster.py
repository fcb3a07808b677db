"""Split over 2 loopback ranks vs one process: prefill, decode and time to first token.

Builds a random qwen2 model with the body of SmolLM2-135M (30 layers, 576 wide, MLP 1536;
8 heads / 2 KV heads so that 2 ranks divide them; the tests' small vocabulary), or takes
-m MODEL, and runs, side by side in one run, the same two-turn conversation three ways: one
process, 2 ranks split by heads (``--shard tensor``), 2 ranks split by layers (``--shard
pipeline``); a way the model cannot be split is shown as skipped, with the reason. Each turn
is a fresh ``localchat ask`` (every rank restarts; turn 2 resumes from each rank's cache on
disk), in a scratch data folder. Both ranks share this machine's cores, so this measures the
cost of the split (collectives, the per-token agreement), not a speed-up: that needs a second
machine.

Usage: python scripts/bench_cluster.py [--quick | --smoke] [-m MODEL]
``--quick``: a shorter history and reply. ``--smoke``: a 10-word history and a 4-token
reply on a tiny qwen2 (2 layers, 4 heads / 2 KV heads) unless -m is given: every step in
seconds (``tests/test_scripts.py`` runs it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import benchlib  # noqa: E402

BODY = {"model_type": "qwen2", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}
# --smoke without -m: the same family, tiny (qwen2 splits both by heads and by layers).
TINY_BODY = {**BODY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4}
SPLITS = (None, "tensor", "pipeline")  # None: one process
HOSTS = "127.0.0.1,127.0.0.1"


def build(out: Path, body: dict) -> Path:
    import mlx.core as mx
    from families import write_tokenizer
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos = write_tokenizer(out, context=8192)
    config = {**body, "vocab_size": vocab, "eos_token_id": eos,
              "max_position_embeddings": 8192}
    (out / "config.json").write_text(json.dumps(config))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    params = {k: (mx.random.normal(v.shape) * 0.05 if v.ndim >= 2 else v).astype(mx.float32)
              for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


def unsplittable(model: Path, name: str, split: str) -> str:
    """Why ``model`` cannot be split ``split``-wise over 2 ranks ("" if it can)."""
    from localchat.cluster.split import check_shard
    from localchat.errors import BadInput

    try:
        check_shard(json.loads((model / "config.json").read_text()), split, 2, name)
    except BadInput as err:
        return str(err)
    return ""


def ask(model: Path, conv: str, prompt: str, max_tokens: int, split: str | None) -> dict:
    cmd = benchlib.localchat("ask", "-c", conv, "-m", str(model), "--json", "--max-tokens",
                             str(max_tokens), prompt)
    if split:
        cmd += ["--hosts", HOSTS, "--shard", split]
    return json.loads(benchlib.run(cmd, timeout=600).stdout)["usage"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "shorter history and reply")
    args = ap.parse_args()
    words = benchlib.pick(args, 600, 150, 10)
    reply = benchlib.pick(args, 128, 32, 4)
    history = " ".join(f"word{i % 97} and more" for i in range(words))
    home = benchlib.scratch_home()  # every `localchat ask` below inherits it
    import localchat.cpu.backend as backend

    backend.prepare()
    if args.model:
        from localchat.model.resolve import resolve

        ref = resolve(args.model)
        model, name = Path(ref.path), ref.name
    elif args.smoke:
        model, name = build(home / "qwen2-tiny", TINY_BODY), "random tiny qwen2"
    else:
        model = build(home / "qwen2-135m-body", BODY)
        name = "random qwen2 with SmolLM2-135M's body"
    rows, skipped = [], {}
    for split in SPLITS:
        if split and (why := unsplittable(model, name, split)):
            skipped[split] = why
            continue
        conv = split or "one"
        # Imports, the CPU copy of the weights written (first load), the ring set up.
        ask(model, f"{conv}-warm-up", "warm up", 1, split)
        first = ask(model, conv, history, 1, split)
        second = ask(model, conv, "and now a short question?", reply, split)
        rows.append({"mode": split or "one process", "prefill_tps": first["prefill_tps"],
                     "history": first["prompt_tokens"], "ttft_s": second["ttft_s"],
                     "cached": second["cached_tokens"],
                     "prefilled": second["prefilled_tokens"],
                     "decode_tps": second["decode_tps"],
                     "generated": second["completion_tokens"]})
    base = rows[0]
    for r in rows:
        r["ms_per_token"] = round(benchlib.ratio(1000, r["decode_tps"]), 2)
        r["overhead_ms"] = round(r["ms_per_token"] - base["ms_per_token"], 2)
    print(f"# 2 loopback ranks vs one process · {name} · {base['history']}-token history, "
          f"{reply}-token reply · {benchlib.machine()}")
    benchlib.print_table(
        ["mode", "prefill tok/s", "turn-2 cached / prefilled", "turn-2 TTFT s", "decode tok/s",
         "ms per token", "overhead ms/token", "TTFT vs one process"],
        [[r["mode"], r["prefill_tps"], f"{r['cached']} / {r['prefilled']}", r["ttft_s"],
          r["decode_tps"], r["ms_per_token"], f"{r['overhead_ms']:+.1f}",
          f"{benchlib.ratio(r['ttft_s'], base['ttft_s']):.2f}x"] for r in rows]
        + [[f"--shard {s}", "skipped", why, "", "", "", "", ""] for s, why in skipped.items()])
    benchlib.print_json({"bench": "cluster", "mode": benchlib.mode(args), "model": name,
                         "machine": benchlib.machine(), "rows": rows, "skipped": skipped})


if __name__ == "__main__":
    main()
