"""How long ``import functopk`` takes against ``import torch`` alone, each in a fresh interpreter.

Each round starts ``python -c "import torch"`` and ``python -c "import functopk"``
(which imports torch) one after the other, in alternating order, and times the
whole process (wall clock); medians over the rounds. ``-X importtime`` then says
where the difference goes: functopk's own modules, and any heavy torch module
that only functopk pulls in (``torch._dynamo``, ``torch.distributed.tensor``).
Writes ``benchmarks/results/import_time.md``.

Usage:
    python benchmarks/import_time.py              # 15 rounds
    python benchmarks/import_time.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WATCHED = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")


def run(module: str, *flags: str) -> tuple[float, str]:
    """Seconds of a fresh interpreter that imports ``module``, and what it wrote to stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *flags, "-c", f"import {module}"], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    return time.perf_counter() - start, proc.stderr


def cumulative_us(importtime: str) -> dict[str, int]:
    """``-X importtime``'s cumulative microseconds per module (the outermost import of each)."""
    out: dict[str, int] = {}
    for line in importtime.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
            if cumulative.isdigit():
                out[name.strip()] = int(cumulative)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    run("functopk")  # warm the file cache and the bytecode caches
    times: dict[str, list[float]] = {"torch": [], "functopk": []}
    for i in range(args.rounds):
        for module in ("torch", "functopk") if i % 2 == 0 else ("functopk", "torch"):
            times[module].append(run(module)[0])
    med = {m: statistics.median(v) for m, v in times.items()}
    profile = cumulative_us(run("functopk", "-X", "importtime")[1])
    own_us = sum(v for name, v in profile.items() if name == "functopk")
    torch_us = profile.get("torch", 0)
    lines = [
        "# `import functopk` against `import torch`",
        "",
        f"`python benchmarks/import_time.py --rounds {args.rounds}`: torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} cores, load average {load:.2f} before and "
        f"{os.getloadavg()[0]:.2f} after. Wall time of a fresh interpreter, medians of {args.rounds} "
        "alternating rounds.",
        "",
        "| command | median (s) | min (s) | max (s) |",
        "| --- | ---: | ---: | ---: |",
        *(f"| `python -c \"import {m}\"` | {med[m]:.2f} | {min(v):.2f} | {max(v):.2f} |" for m, v in times.items()),
        "",
        f"**functopk / torch: {med['functopk'] / med['torch']:.2f}x** (target: at most 1.3x).",
        "",
        f"`-X importtime` of `import functopk`: {own_us / 1e6:.2f} s in all, of which torch {torch_us / 1e6:.2f} s. "
        f"Of the heavy torch modules {', '.join(f'`{m}`' for m in WATCHED)}, it imports "
        f"{', '.join(f'`{m}`' for m in WATCHED if m in profile) or 'none'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "import_time.md").write_text(text)


if __name__ == "__main__":
    main()
