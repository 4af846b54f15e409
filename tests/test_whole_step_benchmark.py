"""benchmarks/whole_step.py as a smoke run on the CPU: a small torchvision model, one round; both pairs in its table."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchvision")
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "whole_step.py"


def test_the_smoke_run_writes_both_pairs(tmp_path, monkeypatch):
    out = tmp_path / "whole_step.md"
    argv = ["whole_step.py", "--device", "cpu", "--model", "mobilenet_v3_small", "--batch", "2", "--size", "32",
            "--rounds", "1", "--steps", "1", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    text = out.read_text()
    assert "mobilenet_v3_small, batch 2 of 3x32x32" in text and "k = 1000" in text
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert [row[:4] for row in rows] == ["| (a", "| (b"]
    for row in rows:
        dense, topk, ratio = (float(v) for v in re.findall(r"\| ([\d.]+)x? ", row)[:3])
        assert dense > 0 and topk > 0 and ratio == pytest.approx(topk / dense, rel=0.01, abs=0.002)
