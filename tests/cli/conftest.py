"""Fixtures of the CLI's image tests (``ask --image``, a batch line's ``"images"``)."""

from pathlib import Path

import pytest
from tinyvlm import build_tiny_vlm


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen", "qwen2_vl")
