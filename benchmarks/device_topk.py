"""Global top-k on one device (CUDA first): functopk against torch.topk and cat + topk + scatter.

Trees, filled with standard normal values on the device: the resnet50
parameter shapes (25.6M coordinates) and a 100M-coordinate tree (40 leaves of
2.5M). For k = 1000 and 1% of n, in interleaved rounds (medians, the device
synchronised after each call):

  topk on concatenated   torch.topk(|v|, k) on an already concatenated vector (the floor)
  cat+topk+scatter       the usual dense top-k: cat, abs, topk, scatter into zeros, split
  ft.topk_indices        functopk, SparseUpdates out
  ft.topk_sparsify       functopk, dense tree out

Targets: ft.topk_indices within 2x of the floor and faster than
cat+topk+scatter. Runs on the CPU too (a smoke run).

Usage:
    python benchmarks/device_topk.py --device cuda --out benchmarks/results/gpu/topk.md
    python benchmarks/device_topk.py --device cpu --small --rounds 2     # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import functopk as ft  # noqa: E402
from benchmarks.timing import device_sync, interleaved  # noqa: E402


def trees(device: str, small: bool) -> dict[str, list[torch.Tensor]]:
    import torchvision

    g = torch.Generator(device=device).manual_seed(0)
    scale = 100 if small else 1
    r50 = [torch.randn(max(1, p.numel() // scale), generator=g, device=device)
           for p in torchvision.models.resnet50().parameters()]
    big = [torch.randn(2_500_000 // scale, generator=g, device=device) for _ in range(40)]
    return {"resnet50": r50, "100M": big}


def usual_dense_topk(leaves: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    flat = torch.cat([x.reshape(-1) for x in leaves])
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    out = torch.zeros_like(flat).scatter_(0, idx, flat[idx])
    return list(torch.split(out, [x.numel() for x in leaves]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="trees 100x smaller (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args()
    sync = device_sync(args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    lines = [
        f"torch {torch.__version__}, device {args.device} ({name}), {args.rounds} interleaved rounds, medians",
        "",
        "| tree | k | topk on concatenated (ms) | cat+topk+scatter (ms) | ft.topk_indices (ms) | "
        "ft.topk_sparsify (ms) | indices / floor | indices / cat+topk+scatter |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tree_name, leaves in trees(args.device, args.small).items():
        n = sum(x.numel() for x in leaves)
        flat_mags = torch.cat([x.reshape(-1) for x in leaves]).abs()
        for label, k in (("1000", 1000), ("1% n", n // 100)):
            expected = ft.topk_indices(leaves, k).indices.cpu()
            got = torch.topk(flat_mags, k).indices.sort().values.cpu()
            assert torch.equal(expected, got), "selection differs from torch.topk (ties are unlikely on normal data)"
            med = interleaved(
                {
                    "floor": lambda k=k: torch.topk(flat_mags, k, sorted=False),
                    "usual": lambda k=k: usual_dense_topk(leaves, k),
                    "indices": lambda k=k: ft.topk_indices(leaves, k),
                    "sparsify": lambda k=k: ft.topk_sparsify(leaves, k),
                },
                args.rounds,
                sync,
            )
            ms = {key: 1e3 * v for key, v in med.items()}
            lines.append(
                f"| {tree_name} ({n / 1e6:.1f}M) | {label} | {ms['floor']:.2f} | {ms['usual']:.2f} | "
                f"{ms['indices']:.2f} | {ms['sparsify']:.2f} | {med['indices'] / med['floor']:.2f}x | "
                f"{med['indices'] / med['usual']:.2f}x |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
