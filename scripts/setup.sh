#!/usr/bin/env bash
# Set up localchat in ./.venv from the lock (uv.lock: exact versions and hashes for macOS arm64,
# Linux x86_64 and aarch64), with this machine's MLX backend; then test and report the BLAS.
#   scripts/setup.sh          # app only
#   scripts/setup.sh test     # app + test dependencies
# macOS: plain `mlx` (Metal). Linux with an NVIDIA driver: `mlx[cuda]`. Other Linux: `mlx[cpu]`.
# uv itself comes pinned by hash (scripts/uv-requirements.txt); `scripts/lock.sh` refreshes both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "localchat: error: needs Python 3.11 or newer ($PY is $("$PY" -V 2>&1 || echo missing));" \
       "set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
  -r scripts/uv-requirements.txt
extras=()
case "$(uname -s)" in
  Darwin) ;;
  Linux) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
           extras+=(--extra cuda); else extras+=(--extra cpu); fi ;;
  *) extras+=(--extra cpu) ;;
esac
# Images (docs/images.md): mlx-vlm and Pillow, 39 MB; imported only when a vision model loads.
extras+=(--extra vision)
[ "${1:-}" = "test" ] && extras+=(--extra test)
# --locked: fail rather than install anything the lock does not say; --inexact: keep pip and
# uv in the environment; never download a Python (the venv's is the one).
UV_PROJECT_ENVIRONMENT=.venv UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=copy \
  .venv/bin/uv sync --locked --inexact --quiet --python .venv/bin/python "${extras[@]}"
# Which BLAS the CPU path gets: each candidate run in a child process first, the chosen one's
# kernels and measured rate; on a Linux CPU without a fast one, the fix to run.
.venv/bin/python -m localchat.cpu.backend
