"""What the README's commands install is the lock: every package the lock names for this
platform and these extras is installed at exactly the locked version (``uv.lock``, installed by
``scripts/setup.sh`` with ``uv sync --locked``)."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker

ROOT = Path(__file__).resolve().parent.parent


def _uv() -> str:
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.is_file() else shutil.which("uv")
    if not found:
        pytest.skip("uv is not installed here (scripts/setup.sh installs it)")
    return found


def _installed_extras() -> list[str]:
    names = {d.metadata["Name"].lower() for d in md.distributions()}
    extras = ["test"]
    if "mlx-cpu" in names:
        extras.append("cpu")
    elif any(n.startswith("mlx-cuda") for n in names):
        extras.append("cuda")
    if "mlx-vlm" in names:
        extras.append("vision")
    return extras


def locked(extras: list[str]) -> dict[str, str]:
    """Name -> version of every package the lock installs here with ``extras``."""
    cmd = [_uv(), "export", "--frozen", "--no-hashes", "--no-emit-project", "--no-header",
           "--project", str(ROOT)] + [f"--extra={e}" for e in extras]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pins = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)(?:\s*;\s*(.*))?$", line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def mismatches(pins: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    """Name -> (locked, installed) for every package not installed at its locked version."""
    wrong = {}
    for name, version in pins.items():
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            got = None
        if got != version:
            wrong[name] = (version, got)
    return wrong


def test_the_installed_packages_are_the_locked_versions():
    pins = locked(_installed_extras())
    assert "mlx" in pins and "mlx-lm" in pins and len(pins) > 30
    assert not mismatches(pins), "locked vs installed"
    if sys.platform.startswith("linux") and "cpu" in _installed_extras():
        # The wheel built for a baseline x86-64 CPU, not one built for AVX-512 (issue 30).
        assert pins.get("cmeel-openblas") == "0.3.29"


def test_the_comparison_can_fail():
    """Negative control: another version, or a package that is not there, is caught."""
    pins = locked(_installed_extras())
    changed = {**pins, "textual": "0.0.1", "no-such-package": "1.0"}
    assert mismatches(changed) == {"textual": ("0.0.1", md.version("textual")),
                                   "no-such-package": ("1.0", None)}
