#!/usr/bin/env bash
# Refresh the lock: re-resolve uv.lock (the newest releases pyproject.toml's ranges allow, for
# macOS arm64, Linux x86_64 and aarch64, CPU and CUDA) and the pinned uv, reinstall .venv from
# them and run the whole suite; if anything fails, the previous lock is put back.
#   scripts/lock.sh              # upgrade everything
#   scripts/lock.sh PACKAGE ...  # upgrade only these
# Run it to take new releases (monthly, or for a fix you need); commit uv.lock and
# scripts/uv-requirements.txt only from a green run. A registry release never reaches users
# without it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/uv ] || scripts/setup.sh test
cp uv.lock .uv.lock.before
cp scripts/uv-requirements.txt .uv-requirements.before
restore() {
  mv .uv.lock.before uv.lock
  mv .uv-requirements.before scripts/uv-requirements.txt
  scripts/setup.sh test >/dev/null
  echo "lock.sh: $1; the previous lock is back" >&2
  exit 1
}
if [ $# -gt 0 ]; then
  args=(); for p in "$@"; do args+=(--upgrade-package "$p"); done
else
  args=(--upgrade)
  # uv itself, every platform's wheel hashed (from outside the project: no platform filter).
  out="$PWD/scripts/uv-requirements.txt"
  (cd "${TMPDIR:-/tmp}" && echo uv | "$OLDPWD/.venv/bin/uv" pip compile --universal \
     --generate-hashes --no-header --quiet - -o "$out") || restore "uv could not be re-pinned"
fi
.venv/bin/uv lock "${args[@]}" || restore "no resolution"
scripts/setup.sh test || restore "the new lock did not install"
.venv/bin/python -m pytest -q || restore "the suite failed on the new lock"
rm -f .uv.lock.before .uv-requirements.before
git --no-pager diff --stat uv.lock scripts/uv-requirements.txt
echo "lock.sh: the suite passed on the new lock: commit uv.lock and scripts/uv-requirements.txt"
