"""The tables and the plot of ``benchmarks/optim.py`` (its measuring half is there)."""

from __future__ import annotations

import os


def fmt_err(r: dict) -> str:
    return "-" if r["err"] is None else f"{r['err']:.1e}"


def table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | variant | median ms / step | IQR ms | vs torch.optim | max diff vs torch.optim | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {r['variant']} | {r['ms']:.1f} | {r['iqr']:.1f} | {r['ratio']:.2f}x | "
                     f"{fmt_err(r)} | {r['notes']} |")
    return "\n".join(lines)


VARIANTS = (
    "functopk eager pure", "functopk eager in-place", "functopk eager update_", "functopk compiled pure", "TorchOpt"
)
"""The variants' name prefixes, in the order of the summary's columns and the plot's bars."""


def summary(rows: list[dict], optimizers: dict) -> str:
    """One line per optimizer: the torch baseline and functopk's four ratios to it."""
    lines = [
        "| optimizer | functopk | torch.optim baseline | baseline ms | eager pure | eager in-place | eager update_ "
        "| compiled pure |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == name]
        opt = optimizers[name]
        torch_name = f"`{opt.torch_class}`" if opt.torch_class else "none"
        base = mine[0]
        cells = []
        for prefix in VARIANTS[:4]:
            hit = [r for r in mine if r["variant"].startswith(prefix)]
            if not hit:
                cells.append("-")
                continue
            r = hit[0]
            mark = " (graph breaks)" if "graph breaks" in r["variant"] else ""
            mark += " FAILED PARITY" if r["failed"] else ""
            cells.append(f"{r['ratio']:.2f}x{mark}")
        lines.append(f"| {name} | `{opt.alias}` | {torch_name}: {base['variant']} | {base['ms']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str, optimizers: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    names = list(VARIANTS)
    names = [n for n in names if any(r["variant"].startswith(n) for r in rows)]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(9, 0.9 * len(opts) + 3), 4.5))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, opt in enumerate(opts):
            for r in rows:
                if r["optimizer"] == opt and r["variant"].startswith(name):
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(r["ratio"])
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    labels = [o if optimizers[o].torch_class else f"{o} (vs AdamW)" for o in opts]
    ax.set_xticks(range(len(opts)), labels, rotation=30, ha="right")
    ax.set_ylabel("median step time / torch.optim's (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
