"""Global top-k on one device (CUDA first): functopk's kernels against torch.topk, and the bandwidth reached.

Trees, filled with standard normal values on the device: the resnet50 parameter shapes (161
leaves, 25.6M fp32 coordinates; flat, as in one gradient buffer), the same with its 4-d leaves in
channels_last (the gradients of a model trained in that format: strided leaves, read in place), the
same with 99.9% of the coordinates exactly 0 (at k = 1% the k-th largest magnitude is 0: the kernel's
ties at the threshold), and a 100M-coordinate tree (40 leaves of 2.5M). For k = 1000 and
1% of n, in interleaved rounds (medians), each case timed over a batch of calls between two CUDA
events (no synchronisation inside the batch: host and device work overlap as in a training loop):

  topk on concatenated   torch.topk(|v|, k) on an already concatenated vector (the floor of the usual way)
  cat+topk+scatter       the usual dense top-k: cat, abs, topk, scatter into zeros, split
  indices (aten)         ft.topk_indices with KernelConfig(backend="aten") (the static kernel)
  indices (triton)       ft.topk_indices with KernelConfig(backend="triton")
  sparsify               ft.topk_sparsify (the default backend: Triton on CUDA where it imports)

Bandwidth: the tree's bytes read once over the time of ``indices (triton)`` (without Triton: of
``indices (aten)``; so is the speed-up over cat+topk+scatter), against the copy
bandwidth measured here (``dst.copy_(src)`` of 1 GiB: bytes read plus bytes written, over its time).
Targets (H200): indices (triton) at most 0.10 ms (k = 1000) and 0.15 ms (1%) on resnet50, at least 8x
faster than cat+topk+scatter, at most 0.3 ms on the 100M tree; sparsify at most indices plus one
write pass. Runs on the CPU too (a smoke run; the Triton rows need a GPU there).

A second table times ``ft.apply_sparse_updates_`` of that selection into the tree, in place: the ATen path
(the indices split by leaf with a host read, one ``index_add_`` per leaf that receives any) against the
Triton kernel (one launch for the whole tree).

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
from benchmarks.timing import medians  # noqa: E402
from functopk.sparse.kernels import triton_select  # noqa: E402

ATEN = ft.sparse.KernelConfig(backend="aten")
TRITON = ft.sparse.KernelConfig(backend="triton")


def trees(device: str, small: bool) -> dict[str, list[torch.Tensor]]:
    import torchvision

    g = torch.Generator(device=device).manual_seed(0)
    scale = 100 if small else 1
    shapes = [p.shape for p in torchvision.models.resnet50().parameters()]
    if small:  # fewer output channels
        shapes = [torch.Size((max(1, s[0] // scale), *s[1:])) for s in shapes]
    r50 = [torch.randn(s.numel(), generator=g, device=device) for s in shapes]
    cl = [torch.randn(s, generator=g, device=device) for s in shapes]
    cl = [x.to(memory_format=torch.channels_last) if x.dim() == 4 else x for x in cl]
    zeros = [torch.where(torch.rand(x.shape, generator=g, device=device) < 0.999, 0.0, x) for x in r50]
    big = [torch.randn(2_500_000 // scale, generator=g, device=device) for _ in range(40)]
    return {"resnet50": r50, "resnet50 channels_last": cl, "resnet50 99.9% zeros": zeros, "100M": big}


def usual_dense_topk(leaves: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    flat = torch.cat([x.reshape(-1) for x in leaves])
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    out = torch.zeros_like(flat).scatter_(0, idx, flat[idx])
    return list(torch.split(out, [x.numel() for x in leaves]))


def copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by ``dst.copy_(src)`` of 1 GiB (median of 10 rounds; 3 on the CPU)."""
    src = torch.empty(1 << 28, device=device)
    dst = torch.empty_like(src)
    rounds = 10 if device.startswith("cuda") else 3
    seconds = medians({"copy": lambda: dst.copy_(src)}, rounds, 5, device)["copy"]
    return 2 * src.numel() * src.element_size() / seconds


def cases(leaves: list[torch.Tensor], flat_mags: torch.Tensor, k: int, triton: bool) -> dict:
    out = {
        "floor": lambda: torch.topk(flat_mags, k, sorted=False),
        "usual": lambda: usual_dense_topk(leaves, k),
        "aten": lambda: ft.topk_indices(leaves, k, config=ATEN),
    }
    if triton:
        out["triton"] = lambda: ft.topk_indices(leaves, k, config=TRITON)
    out["sparsify"] = lambda: ft.topk_sparsify(leaves, k)
    return out


def check(leaves: list[torch.Tensor], flat_mags: torch.Tensor, k: int, triton: bool) -> None:
    """Every variant selects the same coordinates (ties are unlikely on normal data; torch.topk breaks the
    ties at 0 of the mostly-zero tree its own way, so only functopk's kernels are compared there)."""
    expected = ft.topk_indices(leaves, k, config=ATEN)
    if torch.topk(flat_mags, k).values[-1].item() > 0:
        got = torch.topk(flat_mags, k).indices.sort().values
        assert torch.equal(expected.indices, got), "the ATen kernel differs from torch.topk"
    if triton:
        fast = ft.topk_indices(leaves, k, config=TRITON)
        assert torch.equal(fast.indices, expected.indices) and torch.equal(fast.values, expected.values)


def apply_times(leaves: list[torch.Tensor], k: int, triton: bool, rounds: int, calls: int, device: str) -> list:
    """Seconds per ``apply_sparse_updates_`` of the top ``k`` of ``leaves`` into them: ATen, Triton (NaN without)."""
    sparse = ft.topk_indices(leaves, k, config=ATEN)
    fns = {"aten": lambda: ft.apply_sparse_updates_(leaves, sparse, -1e-3, config=ATEN)}
    if triton:
        fns["triton"] = lambda: ft.apply_sparse_updates_(leaves, sparse, -1e-3, config=TRITON)
    med = medians(fns, rounds, calls, device)
    return [med["aten"], med.get("triton", float("nan"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed batch (CUDA)")
    parser.add_argument("--small", action="store_true", help="trees 100x smaller (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    triton = cuda and triton_select.available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    bandwidth = copy_bandwidth(args.device)
    timing = f"medians of {args.rounds} interleaved rounds, " + (
        f"each {args.calls} calls between CUDA events" if cuda else "each call synchronised")
    lines = [
        f"torch {torch.__version__}, device {args.device} ({name}), {timing}; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s (bytes read + written by a 1 GiB copy, over its time)",
        "",
        "| tree | k | topk on concatenated (ms) | cat+topk+scatter (ms) | indices, aten (ms) | indices, triton (ms) "
        "| sparsify (ms) | cat+topk+scatter / triton | bandwidth reached (TB/s) | of copy bandwidth |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    applies = ["", "| tree | k | apply_sparse_updates_, aten (ms) | apply_sparse_updates_, triton (ms) |",
               "| --- | --- | ---: | ---: |"]
    for tree_name, leaves in trees(args.device, args.small).items():
        n = sum(x.numel() for x in leaves)
        nbytes = sum(x.numel() * x.element_size() for x in leaves)
        flat_mags = torch.cat([x.reshape(-1) for x in leaves]).abs()
        for label, k in (("1000", 1000), ("1% n", n // 100)):
            check(leaves, flat_mags, k, triton)
            fns = cases(leaves, flat_mags, k, triton)
            med = medians(fns, args.rounds, args.calls, args.device)
            ms = {key: 1e3 * v for key, v in med.items()}
            fast = med.get("triton", med["aten"])
            lines.append(
                f"| {tree_name} ({n / 1e6:.1f}M) | {label} | {ms['floor']:.3f} | {ms['usual']:.3f} | "
                f"{ms['aten']:.3f} | {ms.get('triton', float('nan')):.3f} | {ms['sparsify']:.3f} | "
                f"{med['usual'] / fast:.1f}x | {nbytes / fast / 1e12:.2f} | {nbytes / fast / bandwidth:.0%} |"
            )
            print(lines[-1], flush=True)
            applies.append(f"| {tree_name} | {label} | " + " | ".join(
                f"{1e3 * t:.3f}" for t in apply_times(leaves, k, triton, args.rounds, args.calls, args.device)) + " |")
    text = "\n".join(lines + applies) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
