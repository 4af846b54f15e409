"""A layer's weight gradient at fixed coordinates on CPU: box products, gathers, ``torch.sparse.sampled_addmm``.

``v_j = sum_t dy[t, r_j] * x[t, c_j]`` for ``k`` coordinates ``(r_j, c_j)`` of a
``rows x cols`` weight (``nn.Linear``'s gradient is ``dy^T x``), five ways:

* ``functopk``: what ``functopk.sparse.sampled`` does: ``torch.sparse.sampled_addmm``
  on the rows and columns the coordinates use, copied coordinate-major;
* ``sampled_addmm``: the same function on the whole ``dy`` and ``x`` (a CSR
  pattern over the whole weight);
* ``gather``: each coordinate's two columns gathered, multiplied and summed
  (``index_select``, ``mul_``, ``sum``; chunks of a million elements);
* ``box``: the dense product of the rows and columns the coordinates use,
  read at the coordinates (cheap when they fill a few rows and columns);
* ``dense``: the whole ``dy^T x`` (what a dense backward computes).

The coordinate sets: ``topk``, the exact top-k of a real gradient's layers
(GPT-2 small built from a config, one batch: top-k coordinates cluster in a
few large rows and columns; the three layers with the most, and the token
embedding as the output layer, with its 50,257 rows), and ``random`` ones of
the same sizes. Each case
is timed interleaved (``--repeats`` rounds, the median), on ``--threads``
torch threads. It prints a table and writes ``benchmarks/results/sampled_grad_t{tokens}.md``.

    python benchmarks/sampled_grad.py [--tokens 128] [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from functopk.sparse import sampled

RESULTS = Path(__file__).resolve().parent / "results"


def gpt2_topk_sets(tokens: int) -> list[tuple[str, int, int, torch.Tensor]]:
    """(layer, rows, cols, flat positions) of GPT-2 small's largest per-layer shares of a 0.1% global top-k."""
    import transformers

    import functopk as ft

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    n = sum(g.numel() for g in grads.values())
    sel = ft.topk_indices(grads, n // 1000)
    out, offset = [], 0
    for name, g in zip(sorted(grads), ft.tree.leaves(grads)):
        inside = sel.indices[(sel.indices >= offset) & (sel.indices < offset + g.numel())] - offset
        if g.dim() == 2 and inside.numel() >= 1000:
            out.append((name, g.shape[0], g.shape[1], inside))
        offset += g.numel()
    largest = sorted(out, key=lambda t: -t[3].numel())[:3]
    tied = [t for t in out if t[0] == "transformer.wte.weight"]  # as the output layer's (50,257 rows)
    return largest + [(f"{name} (lm_head)", rows, cols, pos) for name, rows, cols, pos in tied]


def gather(dy: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    step = max(1, (1 << 20) // dy.shape[0])
    parts = []
    for lo in range(0, rows.numel(), step):
        a = dy.index_select(1, rows[lo : lo + step])
        parts.append(a.mul_(x.index_select(1, cols[lo : lo + step])).sum(0))
    return torch.cat(parts)


def box(dy: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    used_rows, row_at = torch.unique(rows, return_inverse=True)
    used_cols, col_at = torch.unique(cols, return_inverse=True)
    product = dy.index_select(1, used_rows).t() @ x.index_select(1, used_cols)
    return product.reshape(-1)[row_at * used_cols.numel() + col_at]


def methods(dy: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, cols: int) -> dict[str, Callable[[], object]]:
    rows_of, cols_of = pos // cols, pos % cols
    plan = sampled.plan_product(rows_of, cols_of)
    crow = torch.zeros(dy.shape[1] + 1, dtype=torch.int64)
    crow[1:] = torch.bincount(rows_of, minlength=dy.shape[1]).cumsum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mask = torch.sparse_csr_tensor(crow, cols_of, torch.zeros(pos.numel()), (dy.shape[1], cols))
    return {
        "functopk": lambda: sampled.sampled_product(dy, x, plan),
        "sampled_addmm": lambda: torch.sparse.sampled_addmm(mask, dy.t(), x, beta=0.0),
        "gather": lambda: gather(dy, x, rows_of, cols_of),
        "box": lambda: box(dy, x, rows_of, cols_of),
        "dense": lambda: dy.t() @ x,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = []
    for name, rows, cols, pos in gpt2_topk_sets(args.tokens):
        gen = torch.Generator().manual_seed(1)
        random = torch.randperm(rows * cols, generator=gen)[: pos.numel()].sort().values
        cases += [(f"{name} top-k", rows, cols, pos), (f"{name} random", rows, cols, random)]
    lines = [
        f"Sampled weight gradient of a `rows x cols` weight at `k` coordinates, {args.tokens} tokens, "
        f"{args.threads} torch threads, median of {args.repeats} interleaved rounds (load average "
        f"{os.getloadavg()[0]:.1f} at the start).",
        "",
        "| coordinates | rows x cols | k | functopk | `sampled_addmm` (whole) | gather | box | dense `dy^T x` |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, rows, cols, pos in cases:
        gen = torch.Generator().manual_seed(2)
        dy, x = torch.randn(args.tokens, rows, generator=gen), torch.randn(args.tokens, cols, generator=gen)
        fns = methods(dy, x, pos, cols)
        times: dict[str, list[float]] = {m: [] for m in fns}
        for _ in range(args.repeats):
            for m, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - start)
        ms = {m: 1000 * statistics.median(t) for m, t in times.items()}
        lines.append(f"| {label} | {rows} x {cols} | {pos.numel():,} | " + " | ".join(f"{ms[m]:.2f} ms" for m in fns)
                     + " |")  # fmt: skip
        print(lines[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"sampled_grad_t{args.tokens}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
