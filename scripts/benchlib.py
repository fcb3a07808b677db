"""Shared bits of the benchmark scripts: a scratch data folder, filler text, a table printer.

Not a library for the app; imported by ``scripts/bench_*.py`` only.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

# English and Korean sentences, so histories look like what our users write.
FILLER = (
    "The museum opens at nine and the guided tour starts at ten. "
    "서울의 날씨는 오늘 맑고 따뜻합니다. "
    "We discussed the budget, the schedule and who will book the train tickets. "
    "다음 주에는 부산에 가서 바다를 볼 계획입니다. "
)


def scratch_home(keep_models_from: str | None = None) -> Path:
    """A fresh LOCALCHAT_HOME that shares the converted models (and CPU weights) of the
    user's own data folder, so benchmarks do not convert the default model again."""
    home = Path(tempfile.mkdtemp(prefix="localchat-bench-"))
    src = Path(keep_models_from or os.environ.get("LOCALCHAT_HOME") or _default_home())
    for name in ("models", "cpu-weights", "fingerprints.json"):
        if (src / name).exists():
            (home / name).symlink_to((src / name).resolve())
    os.environ["LOCALCHAT_HOME"] = str(home)
    return home


def _default_home() -> str:
    import platformdirs

    return platformdirs.user_data_dir("localchat", appauthor=False)


def filler_messages(engine, n_tokens: int) -> list[dict]:
    """A user message of about ``n_tokens`` tokens (rendered) and a short reply."""
    text = ""
    while engine.count_tokens(text) < n_tokens - 40:
        text += FILLER
    return [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                     if line.startswith("Model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    from localchat import backend

    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {cpu}, "
            f"matmuls: {backend.describe()}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def print_json(obj: dict) -> None:
    print(json.dumps(obj))
