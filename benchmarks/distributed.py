"""Dense allreduce vs sparse top-k exchange of ResNet-50-sized gradients, 2 ranks over gloo on loopback.

    python benchmarks/distributed.py            # 25,557,032 fp32 coordinates, k = 0.1% and 1%
    python benchmarks/distributed.py --quick    # a 2.5M-coordinate smoke run

Spawns two processes (one CPU thread each) that rendezvous through a file and
talk over 127.0.0.1. Every repetition starts after a barrier and is timed on
each rank; the step time is the slower rank's, and the table gives medians.
Rows:

* ``dense allreduce``: ``dist.all_reduce`` of the whole gradient and the
  division by P (what DDP does without a hook);
* ``sparse_allreduce``: :func:`functopk.distributed.sparse_allreduce` of ``k``
  precomputed ``(index, value)`` pairs per rank (pack, one all-gather,
  ``index_add_`` into a new zeroed dense buffer, division by P);
* ``sparse exchange in place``: the same into an existing buffer, as
  ``topk_hook`` does with DDP's bucket (no n-sized allocation: a fresh one
  costs page faults, which dominate on a loaded machine);
* ``local top-k selection only``: the exact selection the transform and the
  hook run before exchanging (``functopk.topk_indices``), no communication;
* ``torch.topk selection``: ``torch.topk`` of the magnitudes, for comparison;
* ``distributed_topk step``: the whole transform: add the residual, select the
  local top k of all coordinates, the exchange above, the mean, the new residual.

Bytes are per rank: what it hands to the collective (``4 n`` dense, ``8 k``
sparse: int32 index + fp32 value) and what it gets back (``4 n`` dense, ``8 P k``
sparse). Prints a markdown table and writes a PNG to the path it prints.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
RESNET50_NUMEL = 25_557_032
WORLD = 2


def _timed(fn, reps: int) -> list[float]:
    """Per repetition, the slower rank's seconds (each rep starts after a barrier)."""
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


def _worker(rank: int, store: str, numel: int, densities: list[float], reps: int, out: str) -> None:
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    import functopk as ft
    from functopk.distributed import distributed_topk, sparse_allreduce
    from functopk.distributed.exchange import _exchange, _local_topk, _scatter_add_, _unpack

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    g = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    rows = []

    buf = g.clone()

    def dense():
        dist.all_reduce(buf)
        buf.div_(WORLD)

    times = _timed(dense, reps)
    rows.append(("dense allreduce", None, numel, 4 * numel, 4 * numel, times))

    for density in densities:
        k = ft.sparse.k_from_density(density, numel)
        idx = torch.topk(g.abs(), k, sorted=False).indices
        vals = g[idx]
        times = _timed(lambda: sparse_allreduce(idx, vals, numel, average=True, capacity=k), reps)
        rows.append(("sparse_allreduce", density, k, 8 * k, 8 * k * WORLD, times))

        def in_place():  # topk_hook's path after selection (private helpers of functopk.distributed)
            _, gathered = _exchange(idx, vals, numel, dist.group.WORLD, WORLD, async_op=False)
            _scatter_add_(buf.zero_(), _unpack(gathered, WORLD, k, numel, buf.dtype), 1.0 / WORLD)

        times = _timed(in_place, reps)
        rows.append(("sparse exchange in place", density, k, 8 * k, 8 * k * WORLD, times))

        times = _timed(lambda: _local_topk(g, k), max(3, reps // 2))
        rows.append(("local top-k selection only", density, k, 0, 0, times))
        times = _timed(lambda: torch.topk(g.abs(), k, sorted=False), max(3, reps // 2))
        rows.append(("torch.topk selection", density, k, 0, 0, times))

        tx = distributed_topk(k)
        grads = {"g": g}
        state = [tx.init(grads)]

        def step():
            _, state[0] = tx.update(grads, state[0])

        times = _timed(step, max(3, reps // 2))
        rows.append(("distributed_topk step", density, k, 8 * k, 8 * k * WORLD, times))
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def run(numel: int, densities: list[float], reps: int) -> list[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), numel, densities, reps, out))
                 for r in range(WORLD)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
        for p in procs:
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return torch.load(out, weights_only=False)


def mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def table(rows: list[tuple], numel: int) -> str:
    dense_ms = statistics.median(rows[0][5]) * 1e3
    lines = [
        f"n = {numel:,} fp32 coordinates, P = {WORLD} ranks (gloo, loopback, 1 thread each); "
        f"medians of {len(rows[0][5])} / {len(rows[-1][5])} repetitions",
        "",
        "| method | k | sent per rank (MB) | received per rank (MB) | bytes vs dense | time per step (ms) | vs dense |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, density, k, sent, received, times in rows:
        ms = statistics.median(times) * 1e3
        label = "n" if density is None else f"{density:.1%} ({k:,})"
        if sent == 0:
            lines.append(f"| {name} | {label} | - | - | - | {ms:.1f} | - |")
            continue
        lines.append(
            f"| {name} | {label} | {mb(sent)} | {mb(received)} | {4 * numel / sent:.0f}x less "
            f"| {ms:.1f} | {dense_ms / ms:.2f}x |"
            if density is not None
            else f"| {name} | {label} | {mb(sent)} | {mb(received)} | 1x | {ms:.1f} | 1.00x |"
        )
    return "\n".join(lines)


def plot(rows: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [name if d is None else f"{name}, {d:.1%}" for name, d, *_ in rows]
    ms = [statistics.median(r[5]) * 1e3 for r in rows]
    sent = [r[3] / 1e6 for r in rows]
    y = list(range(len(rows)))[::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    a.barh(y, ms)
    a.set_xlabel("time per step (ms, median)")
    a.set_yticks(y, labels, fontsize=8)
    b.barh([yy for yy, v in zip(y, sent) if v], [v for v in sent if v])
    b.set_xscale("log")
    b.set_xlabel("bytes sent per rank (MB, log)")
    fig.suptitle(f"{WORLD} ranks, gloo on loopback, {rows[0][2]:,} fp32 coordinates")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2.5M coordinates, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (default 10; 3 with --quick)")
    parser.add_argument("--png", type=Path, default=ROOT / "out" / "distributed.png")
    args = parser.parse_args()
    numel = 2_500_000 if args.quick else RESNET50_NUMEL
    reps = args.reps or (3 if args.quick else 10)
    rows = run(numel, [0.001, 0.01], reps)
    print(table(rows, numel))
    plot(rows, args.png)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
