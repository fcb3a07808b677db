"""Every benchmark script runs, in its quickest form, on a tiny model: none can rot.

Each test runs ``scripts/bench_X.py --smoke`` as a user would (a subprocess, ``-m`` a tiny
model folder) and checks what every script promises: exit status 0, no traceback on stderr,
the last line of stdout one JSON object with the script's keys, every step taken (each trial
kind, each row of the table), and the data folder it was given left untouched (the script
works in its own scratch folder, ``benchlib.scratch_home``, removed when it ends). Figures are
not checked: a smoke run's mean nothing.

What it is not: a benchmark (``--quick`` and full runs need the real default model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny import build_tiny_model

SCRIPTS = Path(__file__).parent.parent / "scripts"
TIMEOUT = 180  # seconds per script; each takes 1-25 s on a 2-core machine
COMMON = {"bench", "mode", "model", "machine"}


@dataclass(frozen=True)
class Case:
    """How to run one script and what its JSON line must hold."""

    keys: set[str]
    check: Callable[[dict], None] = lambda record: None  # every step taken
    model: bool = True  # pass -m (bench_families builds its own tiny models)


def _attention(r: dict) -> None:
    assert [h["history_tokens"] for h in r["histories"]] == [0, 256]
    assert r["prompts"] == 2 and r["trials"] == 2


def _batch(r: dict) -> None:
    assert r["lines"] == 2 and len(r["cached_tokens"]) == 2
    assert r["cached_tokens"][0] == 0 and r["cached_tokens"][1] > 0  # the prefix was reused
    assert r["decode_strategies"]["lines"] == 2


def _blas(r: dict) -> None:
    timed = [x for x in r["results"] if "refused" not in x]
    assert [x["setting"] for x in timed][:2] == ["1 thread", "all cores, spin"]
    assert all(x["quiet"]["decode_tps"] > 0 and x["loaded"]["decode_tps"] > 0 for x in timed)


def _threads(r: dict) -> None:
    assert set(r["states"]) == {"quiet", "loaded"} and set(r["ratios"]) == {"quiet", "loaded"}
    for state in r["states"].values():
        assert state["settings"][0] == "1 thread" and state["settings"][2] == "auto"
        assert all(state["figures"][s]["decode_tps"] > 0 for s in state["settings"])


def _cluster(r: dict) -> None:
    # The tiny llama splits by heads (4 heads, 2 KV heads over 2 ranks), not by layers.
    assert [row["mode"] for row in r["rows"]] == ["one process", "tensor"]
    assert set(r["skipped"]) == {"pipeline"} and "layers" in r["skipped"]["pipeline"]
    assert all(row["cached"] > 0 for row in r["rows"])  # turn 2 resumed on every rank


def _coldstart(r: dict) -> None:
    assert set(r["versions"]) == {"this tree", "HEAD"}  # side by side with the commit
    steps = r["steps_s"]["this tree"]
    assert {"database", "model digest", "model + tokenizer (with imports)", "turn",
            "exit"} <= set(steps) and steps["turn"] > 0
    assert r["transformers_imported"]["this tree"] is False


def _constraint(r: dict) -> None:
    decoded = [x for x in r["schemas"] if "tokens" in x]
    assert len(r["schemas"]) == 7 and len(decoded) == 6
    assert all(x["compile_ms"] > 0 and x["tokens"] > 0 for x in decoded)
    assert set(r["per_token_us"]) >= {"mask", "consume", "forward", "verify masks (4)"}
    assert r["apply_us"]["1 row float32"] > 0 and r["vocab"] == r["logits_width"]


def _structured(r: dict) -> None:
    assert r["replies"] == 5 and set(r["validity"]) == {"person", "review", "event", "shopping",
                                                        "contact"}
    assert set(r["decode_tps"]) == {"free", "long_string", "ten_plain", "ten_forced"}
    assert all(v > 0 for v in r["decode_tps"].values()) and r["forced_tokens"][0] > 0


def _decode(r: dict) -> None:
    assert r["stock"] is not None and r["fast"]["model"] == r["model"]
    look = r["lookup"]  # prompt lookup on and off, both tasks: the same replies
    assert set(look) == {"copy", "free"} and all(t["same_text"] for t in look.values())
    assert r["stock"]["lookup"] is None


def _reasoning(r: dict) -> None:
    assert [f["family"] for f in r["families"]] == ["llama", "qwen3_next"]
    for f in r["families"]:  # each later turn resumes where the previous reply starts
        assert all(t["cached"] > 0 and t["reasoning_tokens"] == r["think_tokens"] + 2
                   for t in f["thinking_on"][1:])
        assert all(t["reasoning_tokens"] == 0 for t in f["thinking_off"])


def _edges(r: dict) -> None:
    # The whole `ask` check of issue 35 on a 1,024-token context: the cut, its notice, every
    # message shown, the append after it and the equality with --no-cache.
    assert r["checks"] and all(r["checks"].values()), r["checks"]
    assert r["messages_shown"] == 6 and "left out" in r["notice"]


def _families(r: dict) -> None:
    assert [f["family"] for f in r["families"]] == ["llama", "qwen3_next"]
    assert all(len(f["turns"]) == 4 and f["turns"][-1]["cached"] > 0 for f in r["families"])


def _windows(r: dict) -> None:
    # The tiny Gemma 3's 16-token windows on 2 of 3 layers; both fits read every prefill.
    assert r["windows"] == [[0, 1 / 3], [16, 2 / 3]]
    assert set(r["measured_s"]) == {"64@0", "256@0", "256@512"}
    assert set(r["ratios"]) == {"windows", "as if global"}
    assert all(set(v) == set(r["measured_s"]) for v in r["ratios"].values())


def _kvquant(r: dict) -> None:
    assert [(s["bits"], s["group"]) for s in r["settings"]] == [(8, 32), (4, 32)]
    assert not r["settings"][0]["refused"]  # 8-bit passes the gate: the quantized turns ran


def _load(r: dict) -> None:
    assert r["history_tokens"] >= 200 and r["segments"] >= 1
    assert set(r["steps_ms"]) == {"read", "check", "parse", "allocate", "convert"}
    assert all(v > 0 for v in r["steps_ms"].values()), r["steps_ms"]


def _figures(r: dict) -> None:
    assert len(r["turns"]) == 3 and r["prefill_model"]["source"] == "calibration"
    assert len(r["saved_ratios"]) == 2 and r["long_prompt_tokens"] > 0


def _longuse(r: dict) -> None:
    assert r["conversations"] == 200 and r["messages"] == 2000
    assert r["app_first_frame_s"] > 0 and r["app_next_page_s"] > 0


def _resume(r: dict) -> None:
    assert len(r["results"]) == 2


def _serve(r: dict) -> None:
    assert r["turns"] == 3 and r["stored"] == 50
    assert r["cached_live"] > 0 and r["cached_restart"] > 0  # turn N hit, restart or not
    assert r["mlx_lm_turn_live_s"] > 0 and r["serve_stored_s"] > 0
    assert r["clients"]["2"]["replies_equal"] in (True, False) and r["gaps"]["median_gap_s"] > 0


def _sampling(r: dict) -> None:
    # A greedy control row per prompt, then every seed at each temperature.
    assert [(x["temp"], x["runs"]) for x in r["results"]] == [
        (0.0, 1), (0.0, 1), (0.2, 2), (0.2, 2), (0.7, 2), (0.7, 2)]
    assert set(r["totals"]) == {"0.2", "0.7"} and r["totals"]["0.2"]["runs"] == 4
    assert all(x["ended"] + x["loop_cut"] + x["at_cap"] == x["runs"] for x in r["results"])


def _resident(r: dict) -> None:
    assert set(r["exit_s"]) == {"in-process", "first ask", "resident"}
    assert r["turns_served"] >= 1 and r["crowd"] == 2 and r["crowd_models"] == 1
    assert 0 <= r["keep_alive_overshoot_s"] < 30


def _share(r: dict) -> None:
    assert r["shared_cached_tokens"] > 0 and r["fork_next_turn"]["cached_tokens"] > 0


CASES = {
    "attention": Case({"histories", "ttft_flatness", "decode_flatness", "prefill_tokens",
                       "prefill_tps", "prefill_speedup", "greedy_agree", "prompts",
                       "max_logit_diff"}, _attention),
    "batch": Case({"lines", "batch_wall_s", "asks_wall_s", "asks_vs_batch", "parallel_wall_s",
                   "parallel_replies_equal", "cached_tokens", "decode_strategies"}, _batch),
    "blas": Case({"bench", "mode", "results"}, _blas),
    "cluster": Case({"rows", "skipped"}, _cluster),
    "coldstart": Case({"history", "trials", "resumed_s", "full_prefill_s", "ratio",
                       "resumed_exit_s", "chat_first_frame_s", "chat_model_ready_s",
                       "imports_s", "steps_s", "transformers_imported", "versions"},
                      _coldstart),
    "constraint": Case({"vocab", "logits_width", "tokenizer_build_s", "schemas",
                        "per_token_us", "apply_us", "forward_ms", "overhead_us"}, _constraint),
    "decode": Case({"fast", "stock", "decode_vs_mlxlm", "prefill_speedup_vs_stock",
                    "decode_speedup_vs_stock", "attention_prefill_speedup",
                    "attention_decode_speedup", "lookup"}, _decode),
    "draft": Case({"note_tokens", "ttft_one_word_s", "ttft_paste_wait_s", "ttft_paste_at_once_s",
                   "enter_to_screen_one_word_s", "draft_tokens", "paste_to_prefilled_s",
                   "key_ms_median_draft_on", "key_ms_median_draft_off"}),
    "edges": Case({"message_tokens", "turns", "no_cache_turn3", "turn3_needed_cached", "notice",
                   "messages_shown", "checks"}, _edges),
    "families": Case({"families", "history_tokens"}, _families, model=False),
    "figures": Case({"trials", "prefill_model", "turns", "saved_ratios", "within_25pct",
                     "long_prompt_tokens", "long_ratio"}, _figures),
    "kvquant": Case({"f16_bytes_per_token", "settings"}, _kvquant),
    "load": Case({"history_tokens", "segments", "load_s", "steps_ms", "ttft_long_s",
                  "ttft_short_s", "ttft_ratio"}, _load),
    "longuse": Case({"conversations", "messages", "search_korean_s", "search_english_s",
                     "cli_search_s", "cli_list_s", "app_first_frame_s", "app_next_page_s"},
                    _longuse, model=False),
    "reasoning": Case({"families", "think_tokens", "answer_tokens"}, _reasoning, model=False),
    "resident": Case({"history_tokens", "trials", "first_token_s", "exit_s",
                      "resident_vs_in_process", "first_ask_minus_in_process_s", "turns_served",
                      "crowd", "crowd_in_process_s", "crowd_resident_s", "crowd_speedup",
                      "crowd_models", "keep_alive_overshoot_s"}, _resident),
    "resume": Case({"results", "flatness_last_vs_first", "flatness_mlx_attention"}, _resume),
    "sampling": Case({"cap", "seeds", "top_p", "results", "totals"}, _sampling),
    "serve": Case({"turns", "history_tokens", "turn_live_s", "mlx_lm_turn_live_s",
                   "turn_restart_s", "mlx_lm_turn_restart_s", "turn1_full_prefill_s",
                   "cached_live", "cached_restart", "stored", "ask_empty_s", "ask_stored_s",
                   "serve_empty_s", "serve_stored_s", "clients", "gaps"}, _serve),
    "share": Case({"prompt_tokens", "shared_cached_tokens", "shared_ttft_s", "alone_ttft_s",
                   "fork_bytes_written", "fork_next_turn"}, _share),
    "structured": Case({"cap", "prompts_per_schema", "validity", "valid_total", "replies",
                        "decode_tps", "trials", "forced_tokens", "mask_ratio", "forced_ratio"},
                       _structured),
    "threads": Case({"states", "ratios"}, _threads),
    "windows": Case({"layer_mix", "windows", "calibration_s", "measured_s", "ratios",
                     "worst_error"}, _windows, model=False),
}


def test_every_script_has_a_case():
    found = {p.stem.removeprefix("bench_") for p in SCRIPTS.glob("bench_*.py")}
    assert found == set(CASES)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> Path:
    # 128 wide, 4 heads: head dimension 32, so bench_kvquant's group of 32 fits (the suite's
    # tiny_model has 16); 2 KV heads, so 2 ranks split it by heads (bench_cluster).
    return build_tiny_model(tmp_path_factory.mktemp("bench") / "tiny-llama", hidden=128)


def _attention_unavailable() -> str:
    import localchat.cpu.backend as backend

    if not backend.cpu_path() or os.environ.get("LOCALCHAT_CPU_ATTENTION") == "mlx":
        return "bench_attention compares two CPU attention paths; MLX does not run on the CPU here"
    return ""


@pytest.mark.parametrize("name", sorted(CASES))
def test_smoke_run(name: str, bench_model: Path, tmp_path: Path):
    case = CASES[name]
    if name == "attention" and (why := _attention_unavailable()):
        pytest.skip(why)
    script = SCRIPTS / f"bench_{name}.py"
    cmd = [sys.executable, str(script), "--smoke"]
    if case.model:
        cmd += ["-m", str(bench_model)]
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "LOCALCHAT_HOME": str(home), "TMPDIR": str(scratch),
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                         cwd=SCRIPTS.parent)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    record = json.loads(lines[-1])
    assert isinstance(record, dict)
    assert record["bench"] == name and record["mode"] == "smoke"
    assert COMMON | case.keys <= record.keys(), sorted(COMMON | case.keys - record.keys())
    case.check(record)
    assert any(line.startswith("|") for line in lines[:-1]), "no table before the JSON line"
    assert not home.exists(), "the script wrote into the data folder it was given"
    assert not list(scratch.glob("localchat-bench-*")), "the scratch data folder was left"



def test_cluster_script_model_splits_both_ways(home: Path, tmp_path: Path):
    """bench_cluster's own model (its run without -m; tiny under --smoke) splits by heads and
    by layers over 2 ranks, and loads. The smoke run above passes -m instead: the tiny llama
    takes the skipped-split row, and one split fewer keeps the file under two minutes."""
    import importlib.util

    from localchat.cluster.split import check_shard
    from localchat.model.engine import Engine

    spec = importlib.util.spec_from_file_location("bench_cluster", SCRIPTS / "bench_cluster.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    folder = bench.build(tmp_path / "qwen2", bench.TINY_BODY)
    config = json.loads((folder / "config.json").read_text())
    assert [check_shard(config, s, 2, "qwen2") for s in ("tensor", "pipeline")] == [
        "tensor", "pipeline"]
    engine = Engine.load(str(folder))
    cache = engine.new_cache()
    logits = bench.benchlib.prefill(engine, engine.encode("Hello there"), cache)
    assert len(list(engine.decode(cache, logits, 3))) >= 1


def test_sampling_uncut_says_where_the_loop_check_would_cut(bench_model: Path, tmp_path: Path):
    """``bench_sampling --uncut``: replies run past the loop check, which is then asked token
    by token (``would_cut_at``): a loop is placed where the check fires, a repeat under its
    size is not."""
    import importlib.util

    from localchat.model.loops import LOOP_LEAST, looping

    spec = importlib.util.spec_from_file_location("bench_sampling",
                                                  SCRIPTS / "bench_sampling.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.would_cut_at([1, 2] + [7, 8] * 40, looping) == 2 + LOOP_LEAST
    assert bench.would_cut_at([7, 8] * (LOOP_LEAST // 2 - 1), looping) is None
    env = {**os.environ, "LOCALCHAT_HOME": str(tmp_path / "home"),
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_sampling.py"), "--smoke",
                          "--uncut", "-m", str(bench_model)], env=env, capture_output=True,
                         text=True, timeout=TIMEOUT, cwd=SCRIPTS.parent)
    assert out.returncode == 0, out.stderr[-4000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    for temp in ("0.2", "0.7"):
        t = record["totals"][temp]
        assert isinstance(t["would_cut_at"], list) and t["would_cut_ended"] >= 0
        assert t["loop_cut"] == 0  # (the check was off while they ran)
    assert "loop check off: it would cut" in out.stdout
