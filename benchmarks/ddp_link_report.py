"""The tables and the plot of ``benchmarks/ddp_link.py`` (its measuring half is there).

Also the names both halves use: the link rates, the top-k variants' densities
and the variants' labels.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

RATES = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "none": "unthrottled"}
TOPK_DENSITY = {"topk0.1": 0.001, "topk1": 0.01, "topk0.1mc": 0.001, "topk1mc": 0.01,
                "topk-tree0.1": 0.001, "topk-tree1": 0.01, "topk0.1mc-overlap": 0.001, "topk1mc-overlap": 0.01}
HOOK_MOMENTUM = 0.9  # the "mc" variants: momentum correction in the hook, none in the optimizer


def optimizer_momentum(name: str) -> float:
    """SGD's momentum for variant ``name``: 0.9, or 0 where the hook keeps the momentum (``*mc``)."""
    return 0.0 if "mc" in name else 0.9


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


LABELS = {"nocomm": "compute only (no DDP)", "dense": "dense allreduce", "fp16": "fp16 compress hook",
          "powersgd1": "PowerSGD rank 1", "powersgd4": "PowerSGD rank 4",
          "topk0.1": "topk_hook 0.1%", "topk1": "topk_hook 1%",
          "topk0.1mc": "topk_hook 0.1% + momentum corr.", "topk1mc": "topk_hook 1% + momentum corr.",
          "topk-tree0.1": "topk_hook tree 0.1%", "topk-tree1": "topk_hook tree 1%",
          "topk0.1mc-overlap": "topk_hook 0.1% + mom. corr., overlap",
          "topk1mc-overlap": "topk_hook 1% + mom. corr., overlap"}  # fmt: skip


def time_table(arch: str, res: dict, rates: list[str]) -> list[str]:
    dense = res.get("dense", {}).get("times", {})
    head = "| variant | computed MB / rank / step | lo MB / rank / step | " + " | ".join(
        f"{RATES[r]} (ms) | / dense" for r in rates) + " | top-k hook, sync part (ms) |"
    lines = [f"**{arch}** ({res['dense']['numel']:,} parameters)", "", head,
             "| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in rates) + " | ---: |"]  # fmt: skip
    for name, r in res.items():
        lo = [x for x in r["lo"].get("none" if name == "nocomm" else rates[-1], [])]
        cells = [LABELS[name], f"{r['bytes']['2'] / 1e6:.3f}", f"{statistics.median(lo) / 1e6:.3f}" if lo else "-"]
        for rate in rates:
            t = med(r["times"].get("none" if name == "nocomm" else rate, []))
            d = med(dense.get(rate, []))
            cells += [f"{t:.0f}", f"{t / d:.2f}x" if name != "dense" else "1x"]
        hook = r["hook"].get(rates[-1], [])
        cells.append(f"{med(hook):.0f}" if name in TOPK_DENSITY and hook else "-")
        lines.append("| " + " | ".join(cells) + " |")
    n_steps = len(res["dense"]["times"].get(rates[0], []))
    lines += ["", f"Medians of {n_steps} timed steps per cell (the slower rank's); `/ dense`: step time over "
              "dense allreduce's at the same rate (below 1 is faster)."]  # fmt: skip
    return lines


def bytes_table(timing: dict) -> list[str]:
    lines = ["| model | variant | P = 2 (MB) | P = 4 (MB) | P = 8 (MB) | dense / variant at P = 2, 4, 8 |",
             "| --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for arch, res in timing.items():
        for name, r in res.items():
            if name == "nocomm":
                continue
            b = r["bytes"]
            ratio = ", ".join(f"{res['dense']['bytes'][p] / b[p]:.0f}x" for p in ("2", "4", "8"))
            k = f" (k = {r['coords_sent']:,})" if name in TOPK_DENSITY else ""
            lines.append(f"| {arch} | {LABELS[name]}{k} | " + " | ".join(f"{b[p] / 1e6:.3f}" for p in ("2", "4", "8"))
                         + f" | {ratio} |")  # fmt: skip
    return lines


def accuracy_table(acc: dict, spec: dict) -> list[str]:
    lines = ["| task | " + " | ".join(LABELS[v] for v in next(iter(acc.values()))) + " |",
             "| --- |" + " ---: |" * len(next(iter(acc.values())))]  # fmt: skip
    for arch, by_variant in acc.items():
        task = ("examples/ddp_topk.py's CNN, digits 8x8" if arch == "cnn" else f"{arch}, digits upsampled to 32x32")
        task += f", {spec['acc_epochs'][arch]} epochs, lr {spec['acc_lr'][arch]}, {len(by_variant['dense'])} seed(s)"
        lines.append(f"| {task} | " + " | ".join(
            " / ".join(f"{a:.3f}" for a in accs) for accs in by_variant.values()) + " |")  # fmt: skip
    return lines


def plot(timing: dict, rates: list[str], path: Path, ranks: int = 2) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timing), figsize=(6 * len(timing), 4.5), squeeze=False)
    for ax, (arch, res) in zip(axes[0], timing.items()):
        for name, r in res.items():
            if name == "nocomm":
                ax.axhline(med(r["times"]["none"]), color="grey", ls="--", label=LABELS[name])
                continue
            ax.plot(range(len(rates)), [med(r["times"].get(x, [])) for x in rates], marker="o", label=LABELS[name])
        ax.set_xticks(range(len(rates)), [RATES[x] for x in rates])
        ax.set_yscale("log")
        ax.set_xlabel("tbf rate on loopback (both directions share it)")
        ax.set_ylabel("DDP step time (ms, median, log)")
        ax.set_title(f"{arch}, {ranks} ranks, gloo, 1 thread each, batch 8")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(timing: dict, acc: dict | None, spec: dict, meta: dict) -> str:
    rates = spec["rates"]
    lines = ["# DDP step over an emulated link (`benchmarks/ddp_link.py`)", "",
             f"{meta['date']}; torch {meta['torch']}; command `{meta['command']}`; {meta['wall']:.0f} s.",
             f"Load averages (1/5/15 min): {meta['load_before']} before, {meta['load_after']} after "
             f"({os.cpu_count()} cores). {spec['rounds']} rounds x {spec['skip']} untimed + {spec['steps']} timed "
             f"steps per variant and rate, after {spec['warmup']} warm-up steps per variant; batch {spec['batch']} "
             f"per rank; {spec.get('ranks', 2)} ranks, one thread each; top-k mode `{spec['topk_mode']}`.",
             ""]  # fmt: skip
    lines += ["Load averages at the end of each round: " + "; ".join(meta["load_rounds"]) + ".", ""]
    for arch, res in timing.items():
        lines += time_table(arch, res, rates) + [""]
    lines += ["Bytes each rank sends per step in a ring collective, by number of ranks P (analytic; top-k's k is "
              "the hook's measured count over DDP's buckets):", ""] + bytes_table(timing) + [""]  # fmt: skip
    if acc:
        lines += [f"Test accuracy per seed ({spec.get('ranks', 2)} ranks, batch 32 per rank, SGD momentum 0.9 "
                  "(in the hook instead for the momentum-correction variants), "
                  f"hooks dense for the first {spec['acc_warmup']} iterations):", ""] + accuracy_table(acc, spec)
    else:
        lines.append("Accuracy: not measured in this run (`--accuracy cnn,resnet18`).")
    return "\n".join(lines) + "\n"
