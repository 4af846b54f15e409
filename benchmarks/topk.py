"""Global top-k selection on parameter-shaped trees: functopk's methods against the usual ways.

Trees have the parameter shapes of torchvision's resnet18 (11.7M coordinates)
and resnet50 (25.6M), filled with standard normal "gradients" (fixed seed).
For k in {1e3, 1e4, 1e5, 1% n, 10% n}, measured side by side in one process,
in interleaved rounds (medians reported):

  (a) cat + torch.topk + scatter + split   the usual dense top-k (a new dense tree)
  (b) (a)'s selection + a Python loop mapping each flat index to its parameter
  (c) jax.lax.top_k on |g| (if jax is installed): the concatenated magnitudes
      are converted to a jax array once, outside the timing, and the jitted
      top_k is timed with block_until_ready. This is generous to jax: it pays
      no concatenation, no abs and builds no output tree.
  (d) floor: one read pass over every leaf, torch._foreach_norm
  exact-sparse  ft.topk_indices(g, k)              (default method, SparseUpdates out)
  exact-dense   ft.topk_sparsify(g, k)             (default method, dense tree out)
  torch-dense   ft.topk_sparsify(g, k, method="torch")
  approx-dense  ft.topk_sparsify(g, k, method="approx")
  sgd-sparse    ft.apply_sparse_updates(p, ft.topk_indices(g, k), -lr)  (a whole plain SGD step)
  sgd-dense     chain(topk(k), sgd(lr)).update + apply_updates          (the same step, dense)

With --selection, only ft.topk_indices against the read pass (d), at k = 1e3, 1e4,
1e5 and 1% n: each round times the read pass and then the selection, back to
back, for every k; the table gives the medians and the median of the rounds'
ratios (robust to load that drifts between rounds); --aten adds the same
selection with the ATen scan (KernelConfig(native=False)) to every round.

With --dense, only the dense outputs against their parts, interleaved (medians):
topk_indices (the selection), topk_sparsify and topk_mask (the selection plus
the dense tree), and zeros_like of every leaf (what a dense tree costs at
least), and both in one call (the selection, then zeros_like: the same
allocations in the same order as a dense output, so the same luck with the
C library's heap); the target is sparsify (and mask) <= indices + 1.5 x
zeros_like. Also
the minor page faults per call (median of 5 calls, each result freed when the
next returns): whether the C library handed the freed output's pages back to
the system, which moves a 100 MB dense output by tens of ms.

Peak memory: the most CPU memory held at once during one call beyond what
existed before it (output included), from the allocator records of
torch.profiler (profile_memory=True); jax's is not visible to torch.

Usage:
    python benchmarks/topk.py                 # both trees, all k (tens of minutes on 2 cores)
    python benchmarks/topk.py --quick         # resnet18, two k, two rounds
    python benchmarks/topk.py --quick --no-memory --trees squeezenet1_0 --threads 1 --out /tmp/t.png   # smoke run
    python benchmarks/topk.py --out some.png --rounds 7 --threads 2 --trees resnet50 --no-memory
    python benchmarks/topk.py --dense --trees resnet50 --threads 1 --rounds 15   # the dense outputs, k = 1e3 and 1% n
    python benchmarks/topk.py --selection --aten --trees resnet50 --threads 1 --rounds 41   # against the read pass
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import functopk as ft  # noqa: E402

try:  # optional
    import jax
    import jax.numpy as jnp
    import numpy as np
except ImportError:  # pragma: no cover
    jax = None


def model_shapes(name: str) -> dict[str, tuple[int, ...]]:
    import torchvision

    model = getattr(torchvision.models, name)()
    return {k: tuple(v.shape) for k, v in model.named_parameters()}


def random_tree(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


# --------------------------------------------------------------------------- baselines


def cat_topk_scatter_split(tree, k):
    """(a): what one writes by hand: a dense tree with the top-k kept."""
    leaves, treedef = optree.tree_flatten(tree)
    flat = torch.cat([x.reshape(-1) for x in leaves])
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    out = torch.zeros_like(flat).index_copy_(0, idx, flat.index_select(0, idx))
    pieces = torch.split(out, [x.numel() for x in leaves])
    return optree.tree_unflatten(treedef, [p.view(x.shape) for p, x in zip(pieces, leaves)])


def naive_python_mapping(tree, k):
    """(b): select as (a), then map every flat index back to its parameter in a Python loop."""
    leaves, treedef = optree.tree_flatten(tree)
    flat = torch.cat([x.reshape(-1) for x in leaves])
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    offsets = [0]
    for x in leaves:
        offsets.append(offsets[-1] + x.numel())
    out = [torch.zeros_like(x) for x in leaves]
    views = [o.view(-1) for o in out]
    values = flat.index_select(0, idx).tolist()
    for i, v in zip(idx.tolist(), values):
        leaf = bisect.bisect_right(offsets, i) - 1
        views[leaf][i - offsets[leaf]] = v
    return optree.tree_unflatten(treedef, out)


def make_jax_topk(tree):
    if jax is None:
        return None
    flat = torch.cat([x.reshape(-1) for x in optree.tree_leaves(tree)]).abs().numpy()
    x = jnp.asarray(np.ascontiguousarray(flat))
    fns = {}

    def run(k):
        if k not in fns:
            fns[k] = jax.jit(lambda v: jax.lax.top_k(v, k))
        values, indices = fns[k](x)
        values.block_until_ready()
        indices.block_until_ready()

    return run


# --------------------------------------------------------------------------- measurement


def peak_memory(fn) -> int:
    """Most CPU bytes held at once during ``fn()`` beyond the start (profiler allocation records)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []

    def walk(node):
        if node.typed[0] == _EventType.Allocation:
            records.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not records:
        return 0
    records.sort()
    base = records[0][2] - records[0][1]
    return max(total for _, _, total in records) - base


def measure(fns: dict, rounds: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call, interleaving the candidates round by round (one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    skipped = set()
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        if time.perf_counter() - t > budget_s:
            skipped.add(name)  # too slow to repeat: keep the single (warm-up) measurement
            times[name].append(time.perf_counter() - t)
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in skipped:
                continue
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def page_faults(fn, calls: int = 5) -> float:
    """Median minor page faults per call of ``fn`` (``ru_minflt``), each call's result kept until the next returns."""
    counts, out = [], None
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = fn()  # noqa: F841 (the previous result is freed only now, as in a training loop)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(counts)


def bench_tree(name: str, ks: list, rounds: int, naive_max_k: int, with_memory: bool) -> list[dict]:
    tree = random_tree(model_shapes(name))
    leaves = optree.tree_leaves(tree)
    n = sum(x.numel() for x in leaves)
    params = {k: torch.zeros_like(v) for k, v in tree.items()}
    jax_topk = make_jax_topk(tree)
    rows = []
    for k in ks:
        k = int(k if k >= 1 else round(k * n))
        dense_tx = ft.chain(ft.topk(k), ft.sgd(0.1))
        dense_state = dense_tx.init(params)
        fns = {
            "(a) cat+topk+scatter+split": lambda k=k: cat_topk_scatter_split(tree, k),
            "(d) floor: _foreach_norm": lambda: torch._foreach_norm(leaves),
            "exact-sparse": lambda k=k: ft.topk_indices(tree, k),
            "exact-dense": lambda k=k: ft.topk_sparsify(tree, k),
            "torch-dense": lambda k=k: ft.topk_sparsify(tree, k, method="torch"),
            "approx-dense": lambda k=k: ft.topk_sparsify(tree, k, method="approx"),
            "sgd-sparse": lambda k=k: ft.apply_sparse_updates(params, ft.topk_indices(tree, k), -0.1),
            "sgd-dense": lambda: ft.apply_updates(params, dense_tx.update(tree, dense_state, params)[0]),
        }
        if k <= naive_max_k:
            fns["(b) naive python mapping"] = lambda k=k: naive_python_mapping(tree, k)
        if jax_topk is not None:
            fns["(c) jax.lax.top_k"] = lambda k=k: jax_topk(k)
        t = measure(fns, rounds, budget_s=20.0)
        mem = {}
        if with_memory:
            for key in ("(a) cat+topk+scatter+split", "exact-sparse", "exact-dense", "torch-dense", "approx-dense"):
                mem[key] = peak_memory(fns[key])
        approx_count = sum(int(m.sum()) for m in optree.tree_leaves(ft.topk_mask(tree, k, method="approx")))
        rows.append({"tree": name, "n": n, "k": k, "times": t, "memory": mem, "approx_count": approx_count})
        print(f"  {name} k={k}: exact-sparse {t['exact-sparse'] * 1e3:.1f} ms, (a) "
              f"{t['(a) cat+topk+scatter+split'] * 1e3:.1f} ms, floor {t['(d) floor: _foreach_norm'] * 1e3:.1f} ms",
              file=sys.stderr, flush=True)
    return rows


def bench_dense(name: str, ks: list, rounds: int) -> str:
    """--dense: the selection, the two dense outputs and zeros_like of the tree, interleaved; a markdown table."""
    tree = random_tree(model_shapes(name))
    leaves = optree.tree_leaves(tree)
    n = sum(x.numel() for x in leaves)
    lines = ["| tree | k | topk_indices | topk_sparsify | topk_mask | zeros_like | indices, then zeros_like "
             "| (sparsify - indices) / zeros | (mask - indices) / zeros | (sparsify - both) / zeros "
             "| page faults per call: indices / sparsify / mask / zeros / both |", "|" + "---|" * 11]
    for k in ks:
        k = int(k if k >= 1 else round(k * n))
        fns = {
            "indices": lambda k=k: ft.topk_indices(tree, k),
            "sparsify": lambda k=k: ft.topk_sparsify(tree, k),
            "mask": lambda k=k: ft.topk_mask(tree, k),
            "zeros": lambda: [torch.zeros_like(x) for x in leaves],
            "both": lambda k=k: (ft.topk_indices(tree, k), [torch.zeros_like(x) for x in leaves]),
        }
        t = measure(fns, rounds, budget_s=20.0)
        faults = {key: page_faults(fn) for key, fn in fns.items()}
        ms = {key: f"{v * 1e3:.1f}" for key, v in t.items()}
        extra = [f"{(t[key] - t['indices']) / t['zeros']:.2f}x" for key in ("sparsify", "mask")]
        extra.append(f"{(t['sparsify'] - t['both']) / t['zeros']:.2f}x")
        lines.append(f"| {name} | {k:,} | {ms['indices']} | {ms['sparsify']} | {ms['mask']} | {ms['zeros']} | "
                     f"{ms['both']} | " + " | ".join(extra) + " | " + " / ".join(f"{faults[key]:.0f}" for key in fns)
                     + " |")
        print(f"  {lines[-1]}", file=sys.stderr, flush=True)
    return "\n".join(lines)


def bench_selection(name: str, rounds: int, aten: bool) -> str:
    """--selection: topk_indices (and with --aten the ATen scan) against the read pass; a markdown table."""
    tree = random_tree(model_shapes(name))
    leaves = optree.tree_leaves(tree)
    n = sum(x.numel() for x in leaves)
    ks = [1000, 10_000, 100_000, round(0.01 * n)]
    variants = {"compiled": None} | ({"aten": ft.sparse.KernelConfig(native=False)} if aten else {})
    times: dict = {("floor", k): [] for k in ks} | {(v, k): [] for v in variants for k in ks}
    ratios: dict = {(v, k): [] for v in variants for k in ks}

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for k in ks:  # warm-up
        for config in variants.values():
            ft.topk_indices(tree, k, config=config)
    for _ in range(rounds):
        for k in ks:
            floor = timed(lambda: torch._foreach_norm(leaves))
            times["floor", k].append(floor)
            for v, config in variants.items():
                t = timed(lambda config=config: ft.topk_indices(tree, k, config=config))
                times[v, k].append(t)
                ratios[v, k].append(t / floor)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    head = ["threads", "k", "(d) read pass ms"] + [f"{v} ms" for v in variants] + [f"{v} / (d)" for v in variants]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for k in ks:
        cells = [str(torch.get_num_threads()), f"{k:,}", f"{med['floor', k]:.1f}"]
        cells += [f"{med[v, k]:.1f}" for v in variants]
        cells += [f"{statistics.median(ratios[v, k]):.1f}x" for v in variants]
        lines.append("| " + " | ".join(cells) + " |")
        print(f"  {lines[-1]}", file=sys.stderr, flush=True)
    return "\n".join(lines)


COLUMNS = [
    "(a) cat+topk+scatter+split",
    "(b) naive python mapping",
    "(c) jax.lax.top_k",
    "(d) floor: _foreach_norm",
    "exact-sparse",
    "exact-dense",
    "torch-dense",
    "approx-dense",
    "sgd-sparse",
    "sgd-dense",
]


def markdown(rows: list[dict]) -> str:
    present = [c for c in COLUMNS if any(c in r["times"] for r in rows)]
    head = ["tree", "k"] + [c for c in present] + [
        "(a) / exact-dense", "(c) / exact-sparse", "exact-sparse / (d)", "approx count / k"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = r["times"]
        cells = [r["tree"], f"{r['k']:,}"] + [f"{t[c] * 1e3:.1f}" if c in t else "-" for c in present]
        cells.append(f"{t['(a) cat+topk+scatter+split'] / t['exact-dense']:.1f}x")
        cells.append(f"{t['(c) jax.lax.top_k'] / t['exact-sparse']:.1f}x" if "(c) jax.lax.top_k" in t else "-")
        cells.append(f"{t['exact-sparse'] / t['(d) floor: _foreach_norm']:.1f}x")
        cells.append(f"{r['approx_count'] / r['k']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if any(r["memory"] for r in rows):
        mem_cols = [c for c in COLUMNS if any(c in r["memory"] for r in rows)]
        out += "\n\nPeak extra CPU memory per call, MB (output included; an n-sized float32 copy is n*4 bytes):\n\n"
        out += "| tree | k | n*4 | " + " | ".join(mem_cols) + " |\n|" + "---|" * (3 + len(mem_cols)) + "\n"
        for r in rows:
            out += (f"| {r['tree']} | {r['k']:,} | {r['n'] * 4 / 2**20:.0f} | "
                    + " | ".join(f"{r['memory'][c] / 2**20:.1f}" for c in mem_cols) + " |\n")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(dict.fromkeys(r["tree"] for r in rows))
    fig, axes = plt.subplots(1, len(trees), figsize=(6.5 * len(trees), 4.8), squeeze=False)
    for ax, tree in zip(axes[0], trees):
        sub = [r for r in rows if r["tree"] == tree]
        for c in COLUMNS:
            pts = [(r["k"], r["times"][c] * 1e3) for r in sub if c in r["times"]]
            if pts:
                style = "-o" if not c.startswith("(") else "--s"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=c, markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("k")
        ax.set_ylabel("median ms per call")
        ax.set_title(f"{tree} ({sub[0]['n'] / 1e6:.1f}M coordinates)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"global top-k, {torch.get_num_threads()} threads, torch {torch.__version__}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="resnet18, k in {1e3, 1%% n}, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dense", action="store_true", help="only the dense outputs (k = 1e3, 1%% n)")
    parser.add_argument("--selection", action="store_true", help="only topk_indices against the read pass")
    parser.add_argument("--aten", action="store_true", help="with --selection: also the ATen scan")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--trees", nargs="+", default=None, help="torchvision model names (default: resnet18 resnet50)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "topk.png")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trees = args.trees or (["resnet18"] if args.quick else ["resnet18", "resnet50"])
    ks = [1000, 0.01] if args.quick else [1000, 10_000, 100_000, 0.01, 0.1]
    rounds = 2 if args.quick else args.rounds
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, jax {jax.__version__ if jax else 'not installed'}", file=sys.stderr)
    if args.dense:
        print("\n\n".join(bench_dense(tree, [1000, 0.01], rounds) for tree in trees))
        return
    if args.selection:
        print("\n\n".join(bench_selection(tree, rounds, args.aten) for tree in trees))
        return
    rows = []
    for tree in trees:
        rows += bench_tree(tree, ks, rounds, naive_max_k=100_000, with_memory=not args.no_memory)
    print(markdown(rows))
    plot(rows, args.out)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
