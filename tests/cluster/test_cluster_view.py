"""The cache view (F3) of the app as rank 0 of a two-rank loopback cluster (``test_cluster``'s
set-up)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from families import build_family
from test_cluster import _env


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_family("llama", tmp_path_factory.mktemp("cluster-view") / "llama")


def test_the_cache_view_of_a_split_model_opens_and_the_app_goes_on(llama, tmp_path):
    """F3 on two ranks: the view opens (before, its calibration ran the model on rank 0
    alone while rank 1 waited for a turn: the app hung for good, the process could not
    exit), says why there is no estimate, and the next turn is answered on both ranks."""
    home = tmp_path / "home"
    model = llama
    helper = Path(__file__).parents[1] / "cluster_app_helper.py"
    out = subprocess.run([sys.executable, str(helper), str(model), "tensor",
                          "hello there one two", "and now the second turn", "F3", "a third"],
                         env=_env(home), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    [view] = seen["views"]
    assert view is not None and "split over 2 ranks is not calibrated" in view, view
    assert len(seen["shown"]) == 3 and all(seen["shown"])
    assert [r for r, _ in seen["stored"]] == ["user", "assistant"] * 3
