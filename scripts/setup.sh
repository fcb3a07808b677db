#!/usr/bin/env bash
# Set up localchat in ./.venv for this machine's MLX backend, then prepare the default model.
#   scripts/setup.sh          # app only
#   scripts/setup.sh test     # app + test dependencies
# macOS: plain `mlx` (Metal). Linux with an NVIDIA driver: `mlx[cuda]`. Other Linux: `mlx[cpu]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras=""
case "$(uname -s)" in
  Darwin) extras="" ;;
  Linux) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
           extras="cuda"; else extras="cpu"; fi ;;
  *) extras="cpu" ;;
esac
[ "${1:-}" = "test" ] && extras="${extras:+$extras,}test"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
# Which BLAS the CPU path gets, measured; on a Linux CPU without a fast one, the fix to run.
.venv/bin/python -m localchat.cpu.backend
