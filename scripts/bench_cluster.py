"""Split over 2 loopback ranks vs one process: prefill, decode and time to first token.

Builds a random qwen2 model with the body of SmolLM2-135M (30 layers, 576 wide, MLP 1536;
8 heads / 2 KV heads so that 2 ranks divide them; the tests' small vocabulary) and runs, side
by side in one run, the same two-turn conversation three ways: one process, 2 ranks split by
heads (``--shard tensor``), 2 ranks split by layers (``--shard pipeline``). Each turn is a
fresh ``localchat ask`` (every rank restarts; turn 2 resumes from each rank's cache on disk).
Both ranks share this machine's cores, so this measures the cost of the split (collectives,
the per-token agreement), not a speed-up: that needs a second machine.

Usage: python scripts/bench_cluster.py [--quick]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

BODY = {"model_type": "qwen2", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}


def build(out: Path) -> Path:
    import mlx.core as mx
    from families import write_tokenizer
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos = write_tokenizer(out, context=8192)
    config = {**BODY, "vocab_size": vocab, "eos_token_id": eos,
              "max_position_embeddings": 8192}
    (out / "config.json").write_text(json.dumps(config))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(0)
    params = {k: (mx.random.normal(v.shape) * 0.05 if v.ndim >= 2 else v).astype(mx.float32)
              for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    return out


def ask(home: Path, model: Path, conv: str, prompt: str, max_tokens: int, split: str | None
        ) -> dict:
    cmd = [sys.executable, "-m", "localchat", "ask", "-c", conv, "-m", str(model), "--json",
           "--max-tokens", str(max_tokens), prompt]
    if split:
        cmd += ["--hosts", "127.0.0.1,127.0.0.1", "--shard", split]
    out = subprocess.run(cmd, env={**os.environ, "LOCALCHAT_HOME": str(home)},
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:])}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)["usage"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter history and reply")
    args = ap.parse_args()
    words = 150 if args.quick else 600
    reply = 32 if args.quick else 128
    history = " ".join(f"word{i % 97} and more" for i in range(words))
    from localchat import backend

    backend.prepare()
    print(f"# {backend.describe()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "qwen2-135m-body")
        home = Path(tmp) / "home"
        for split in (None, "tensor", "pipeline"):
            conv = split or "one"
            first = ask(home, model, conv, history, 1, split)
            second = ask(home, model, conv, "and now a short question?", reply, split)
            rows.append({"mode": split or "one process", "prefill_tps": first["prefill_tps"],
                         "history": first["prompt_tokens"], "ttft_s": second["ttft_s"],
                         "cached": second["cached_tokens"],
                         "prefilled": second["prefilled_tokens"],
                         "decode_tps": second["decode_tps"],
                         "generated": second["completion_tokens"]})
    base = rows[0]
    print("| mode | prefill tok/s | turn-2 cached / prefilled | turn-2 TTFT s | decode tok/s "
          "| ms per token | overhead ms/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ms = 1000 / r["decode_tps"]
        r["ms_per_token"] = round(ms, 2)
        r["overhead_ms"] = round(ms - 1000 / base["decode_tps"], 2)
        print(f"| {r['mode']} | {r['prefill_tps']:.0f} | {r['cached']} / {r['prefilled']} | "
              f"{r['ttft_s']:.3f} | {r['decode_tps']:.1f} | {ms:.1f} | {r['overhead_ms']:+.1f} |")
    print(json.dumps({"bench": "cluster", "rows": rows}))


if __name__ == "__main__":
    main()
