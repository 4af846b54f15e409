"""Peak memory of one backward of GPT-2 small with dense gradients vs with ft.sparse.StreamingTopK.

Each variant runs in its own fresh process (``--variant``), and its peak memory
is that process's resident high-water mark (``VmHWM`` in ``/proc/self/status``),
reset once the model is built (``/proc/self/clear_refs``) where the kernel
allows it. A step is: forward, backward and the exact top-k at ``k = density *
n`` (``ft.topk_indices`` on the dense gradients, or the stream's selection made
during backward), on a ``transformers.GPT2LMHeadModel(GPT2Config())`` (124M
parameters, fp32, CPU, dropout off) and one random batch of 1 x 128 tokens.
Both variants save their selection, and the parent checks that they are bit
for bit the same (``exact``).

    python benchmarks/sparse_memory.py            # writes benchmarks/results/sparse_memory.{json,md}

Optimizer state for the selected coordinates only (so ``state_bytes_per_coordinate``)
is not built yet: this measures the gradient side of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_variant(variant: str, density: float, out: str, steps: int) -> dict:
    """One variant in this process: build, reset the peak, run ``steps`` steps; the numbers and the selection."""
    import torch
    import transformers

    import functopk as ft

    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    params = dict(model.named_parameters())
    n = sum(p.numel() for p in params.values())
    k = ft.sparse.k_from_density(density, n)
    ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    stream = ft.sparse.StreamingTopK(params, k=k) if variant == "stream" else None
    rss_model = status_kib("VmRSS") * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        reset = True
    except OSError:
        reset = False
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        if stream is None:
            sparse = ft.topk_indices({name: p.grad for name, p in params.items()}, k)
            model.zero_grad(set_to_none=True)
        else:
            sparse = stream.result()
        times.append(time.perf_counter() - start)
        del loss
    peak = status_kib("VmHWM") * 1024
    torch.save({"indices": sparse.indices, "values": sparse.values}, out)
    return {"variant": variant, "numel": n, "k": k, "rss_model_bytes": rss_model, "peak_bytes": peak,
            "peak_above_model_bytes": peak - rss_model, "hwm_reset": reset, "step_s": times,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def child(variant: str, density: float, steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{variant}.pt")
    cmd = [sys.executable, __file__, "--variant", variant, "--density", str(density), "--steps", str(steps),
           "--out", out]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["selection"] = out
    return result


def markdown(report: dict) -> str:
    d, s = report["dense"], report["stream"]
    lines = [
        f"One step (forward, backward, exact top-k at k = {d['k']:,} of {d['numel']:,}, density "
        f"{report['density']}) of GPT-2 small, CPU, fp32, batch 1 x 128; each variant in a fresh process, "
        f"median of {len(d['step_s'])} steps. Selections bit-identical: {report['exact']}.",
        "",
        "| variant | model resident | peak (whole process) | peak above the model | step time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in (("dense gradients + `topk_indices`", d), ("`StreamingTopK` (gradients freed in backward)", s)):
        step = sorted(r["step_s"])[len(r["step_s"]) // 2]
        lines.append(
            f"| {name} | {r['rss_model_bytes'] / MIB:,.0f} MiB | {r['peak_bytes'] / MIB:,.0f} MiB | "
            f"{r['peak_above_model_bytes'] / MIB:,.0f} MiB | {step:.2f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["dense", "stream"])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.density, args.out, args.steps)))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        report = {"density": args.density, **{v: child(v, args.density, args.steps, tmp) for v in ("dense", "stream")}}
        a, b = (torch.load(report[v].pop("selection")) for v in ("dense", "stream"))
        same_bits = torch.equal(a["values"].view(torch.int32), b["values"].view(torch.int32))
        report["exact"] = torch.equal(a["indices"], b["indices"]) and same_bits
    report["peak_bytes_dense"] = report["dense"]["peak_bytes"]
    report["peak_bytes_sparse"] = report["stream"]["peak_bytes"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sparse_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "sparse_memory.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
