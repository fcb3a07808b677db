"""The cache view's full-prefill estimate on a model with sliding windows, against measured
prefills: the attention term counted per layer window (``prefillfit.attended``) and, side by
side from the same calibration, as if every layer kept every position (before).

The model: a random-weight Gemma 3 text model built here (``tests/families.py``'s builder;
no real Gemma 3 offline), 18 layers of which 15 have 512-token sliding windows (Gemma 3's
five to one), head width 256, context 16k. In a scratch data folder: the calibration
(``prefillmodel.calibration``, with its run at depth), then full prefills of several lengths
(the faster of two) and 256 tokens fed after 3,000 and 8,000 prefilled ones; each estimate ÷
what was measured.

Usage: python scripts/bench_windows.py [--quick | --smoke]
``--quick``: full prefills up to 4,096 tokens, the turn after 3,000. ``--smoke``: a tiny
model (3 layers, 16-token windows), every step in seconds (``tests/test_scripts.py`` runs
it); its figures mean nothing.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import benchlib  # noqa: E402

GEMMA3_SHAPED = {  # Gemma 3's mix and head width, at the default model's hidden size
    "model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_scaling": None}


def build(folder: Path, smoke: bool) -> Path:
    import families

    if not smoke:
        families.FAMILIES["gemma3_text"] = GEMMA3_SHAPED
    families.build_family("gemma3_text", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings":
                                                    4096 if smoke else 16384}))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_flags(ap, "up to 4,096 tokens", model=False)  # the model is built here
    args = ap.parse_args()
    home = benchlib.scratch_home()
    from localchat.cpu import backend

    backend.prepare()
    import mlx.core as mx

    from localchat.cacheview import prefillfit, prefillmodel
    from localchat.model.engine import Engine

    engine = Engine.load(str(build(home / "gemma3-shaped", args.smoke)))
    windows = engine.info().attention
    t = time.perf_counter()
    if prefillmodel.calibration(engine, deep=True) is None:
        raise SystemExit("the calibration gave no model")
    calibration_s = time.perf_counter() - t
    key = prefillmodel.machine_key(engine)
    samples = prefillmodel.read_samples(prefillmodel.calibration_path(key), key)
    fulls = benchlib.pick(args, (640, 1280, 2560, 4096, 8000), (640, 1280, 2560, 4096),
                          (64, 256))
    depths = benchlib.pick(args, (3000, 8000), (3000,), (512,))
    ids = [5 + (i * 7) % 200 for i in range(max(*fulls, *depths) + 256)]

    def timed(tokens: list[int], cache: list) -> float:
        t = time.perf_counter()
        logits = benchlib.prefill(engine, tokens, cache)
        mx.eval(mx.argmax(logits, axis=-1))
        return time.perf_counter() - t

    timed(ids[:40], engine.new_cache())  # warm-up
    measured: dict[tuple[int, int], float] = {}
    for n in fulls:
        measured[n, 0] = min(timed(ids[:n], engine.new_cache()) for _ in range(2))
    for k in depths:
        best = float("inf")
        for _ in range(1 if k > 4096 else 2):
            cache = engine.new_cache()
            timed(ids[:k], cache)
            best = min(best, timed(ids[k:k + 256], cache))
        measured[256, k] = best
    models = {"windows": prefillfit.fit(samples, "calibration", windows),
              "as if global": prefillfit.fit(samples, "calibration")}
    rows, ratios = [], {name: {} for name in models}
    for (n, k), seconds in measured.items():
        what = f"{n} tokens" + (f" after {k}" if k else " (full)")
        row = [what, seconds]
        for name, model in models.items():
            ratios[name][f"{n}@{k}"] = r = model.cost(n, k) / seconds
            row.append(f"{r:.2f}")
        rows.append(row)
    print(f"# sliding-window prefill estimates · {engine.info().layer_mix} · "
          f"{benchlib.machine()} · calibration {calibration_s:.1f} s")
    benchlib.print_table(["prefill", "measured s"] + [f"estimate ÷ measured, {name}"
                                                      for name in models], rows)
    worst = {name: max(abs(r - 1) for r in ratios[name].values()) for name in models}
    benchlib.print_json({"bench": "windows", "mode": benchlib.mode(args), "model": "gemma3-shaped",
                         "machine": benchlib.machine(), "layer_mix": engine.info().layer_mix,
                         "windows": [list(w) for w in windows],
                         "calibration_s": calibration_s,
                         "measured_s": {f"{n}@{k}": s for (n, k), s in measured.items()},
                         "ratios": ratios, "worst_error": worst})


if __name__ == "__main__":
    main()
