"""Convergence of sparsified training: dense SGD vs top-k with and without error feedback vs DGC.

The documented experiment of docs/algorithms.md. It runs the demo's code
(``examples/train_resnet.py``: torchvision ResNet-18 with a small-image stem on
scikit-learn's handwritten digits, fixed seeds, the same initial weights and
mini-batches for every method) with the experiment's settings: density 0.1%,
more epochs than the demo, and the table and curves written to
``benchmarks/results/convergence/``.
Every option of the demo is accepted and overrides these defaults.

    python benchmarks/convergence.py                 # the documented run (under 10 minutes on 2 cores)
    python benchmarks/convergence.py --epochs 1 --train-size 256 --out /tmp/conv   # smoke run
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train_resnet  # noqa: E402  (examples/ is not a package)

DEFAULTS = {
    "epochs": 8,
    "density": 0.001,
    "out": os.path.join(ROOT, "benchmarks", "results", "convergence"),
    "no_progress": True,
}

if __name__ == "__main__":
    train_resnet.main(defaults=DEFAULTS, description=__doc__.split("\n")[0], png_name="convergence.png")
