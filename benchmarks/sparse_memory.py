"""Peak memory and step time of one training step of GPT-2 small, one variant per fresh process.

Each variant runs in its own fresh process (``--variant``), and its peak memory
is that process's resident high-water mark (``VmHWM`` in ``/proc/self/status``),
reset once the model is built (``/proc/self/clear_refs``) where the kernel
allows it; so the peak counts everything a variant builds on top of the model
(optimizer state, LoRA adapters, gradients). The model is a
``transformers.GPT2LMHeadModel(GPT2Config())`` (124M parameters, fp32, CPU,
dropout off) fed one random batch of 1 x 128 tokens; ``k = density * n``.

The variants (``VARIANTS``, name -> setup function returning the step):

* ``dense``: forward, backward, ``ft.topk_indices`` on the dense gradients;
* ``stream``: forward, backward through ``ft.sparse.StreamingTopK`` (each
  gradient folded into the running top-k and freed during backward);
* ``dense_adamw``: forward, backward, ``torch.optim.AdamW(foreach=True)`` step,
  ``zero_grad(set_to_none=True)``: the dense fine-tuning baseline;
* ``lora``: peft LoRA at rank 8 on ``c_attn``/``c_proj``/``c_fc`` (the base
  frozen), torch AdamW on the adapters;
* ``lora_matched``: the same at the rank whose trainable count is nearest ``k``
  (at least 1).

Every variant runs ``--steps`` steps; the first builds what later steps reuse
(optimizer state, allocator pools) and is not timed, the step time is the
median of the others, and the peak is over the whole run. ``dense`` and
``stream`` save their selection, and the parent checks that they are bit for
bit the same (``exact``).

    python benchmarks/sparse_memory.py                      # all variants -> benchmarks/results/sparse_memory.{json,md}
    python benchmarks/sparse_memory.py --variants lora dense_adamw   # only these; the others' results are kept
    python benchmarks/sparse_memory.py --threads 1          # torch threads in each child (default: torch's)

Flags: ``--density`` (default 0.001), ``--steps`` (default 3, at least 2),
``--variants`` (default all), ``--threads``. ``peak_bytes_dense`` is the
``dense_adamw`` peak (the reference of the targets), ``peak_bytes_sparse`` the
``stream`` peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def build(density: float) -> tuple[Any, Any, int, int]:
    """The model (seeded), the batch, ``n`` and ``k``."""
    import torch
    import transformers

    import functopk as ft

    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, ids, n, ft.sparse.k_from_density(density, n)


# A variant: setup(model, ids, k) -> (step, info); step() runs one training step and returns
# its selection (a SparseUpdates, compared across variants for `exact`) or None.
Step = Callable[[], Any]
Variant = Callable[[Any, Any, int], tuple[Step, dict]]


def dense(model: Any, ids: Any, k: int) -> tuple[Step, dict]:
    import functopk as ft

    params = dict(model.named_parameters())

    def step() -> Any:
        model(ids, labels=ids).loss.backward()
        sparse = ft.topk_indices({name: p.grad for name, p in params.items()}, k)
        model.zero_grad(set_to_none=True)
        return sparse

    return step, {}


def stream(model: Any, ids: Any, k: int) -> tuple[Step, dict]:
    import functopk as ft

    topk = ft.sparse.StreamingTopK(dict(model.named_parameters()), k=k)

    def step() -> Any:
        model(ids, labels=ids).loss.backward()
        return topk.result()

    return step, {}


def adamw_step(model: Any, ids: Any, params: list) -> Step:
    """Forward, backward, a foreach AdamW step on ``params``, gradients set to None."""
    import torch

    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def dense_adamw(model: Any, ids: Any, k: int) -> tuple[Step, dict]:
    params = list(model.parameters())
    return adamw_step(model, ids, params), {"trainable": sum(p.numel() for p in params)}


LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]


def lora_per_rank(model: Any) -> int:
    """Trainable LoRA parameters per unit of rank: ``in + out`` summed over the targeted layers."""
    return sum(sum(m.weight.shape) for name, m in model.named_modules() if name.split(".")[-1] in LORA_TARGETS)


def lora(model: Any, ids: Any, k: int, rank: int | None = 8) -> tuple[Step, dict]:
    """peft LoRA on the attention and MLP projections (base frozen); ``rank=None``: the rank nearest ``k``."""
    import peft

    rank = rank or max(1, round(k / lora_per_rank(model)))
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             fan_in_fan_out=True)  # fmt: skip  # GPT-2's Conv1D stores weights as (in, out)
    wrapped = peft.get_peft_model(model, config)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    return adamw_step(wrapped, ids, params), {"lora_rank": rank, "trainable": sum(p.numel() for p in params)}


VARIANTS: dict[str, Variant] = {
    "dense": dense,
    "stream": stream,
    "dense_adamw": dense_adamw,
    "lora": lora,
    "lora_matched": functools.partial(lora, rank=None),
}


def run_variant(variant: str, density: float, out: str, steps: int) -> dict:
    """One variant in this process: build, reset the peak, set up, run ``steps`` steps; numbers and selection."""
    import torch

    model, ids, n, k = build(density)
    rss_model = status_kib("VmRSS") * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        reset = True
    except OSError:
        reset = False
    step, info = VARIANTS[variant](model, ids, k)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sparse = step()
        times.append(time.perf_counter() - start)
    peak = status_kib("VmHWM") * 1024
    if sparse is not None:
        torch.save({"indices": sparse.indices, "values": sparse.values}, out)
    return {"variant": variant, "numel": n, "k": k, **info, "rss_model_bytes": rss_model,
            "peak_bytes": peak, "peak_above_model_bytes": peak - rss_model, "hwm_reset": reset, "step_s": times,
            "step_s_median": statistics.median(times[1:]), "torch_threads": torch.get_num_threads()}  # fmt: skip


def child(variant: str, args: argparse.Namespace, tmp: str) -> dict:
    out = os.path.join(tmp, f"{variant}.pt")
    cmd = [sys.executable, __file__, "--variant", variant, "--density", str(args.density), "--steps", str(args.steps),
           "--out", out]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["selection"] = out
    return result


LABELS = {
    "dense": "dense gradients + `topk_indices`",
    "stream": "`StreamingTopK` (gradients freed in backward)",
    "dense_adamw": "dense AdamW (foreach)",
    "lora": "LoRA (peft, r={lora_rank}, {trainable:,} trainable) + AdamW",
    "lora_matched": "LoRA (peft, r={lora_rank}, {trainable:,} trainable, nearest k) + AdamW",
}


def markdown(report: dict) -> str:
    ran = [v for v in VARIANTS if v in report]
    first = report[ran[0]]
    lines = [
        f"One training step of GPT-2 small ({first['numel']:,} parameters; k = {first['k']:,}, density "
        f"{report['density']}), CPU, fp32, batch 1 x 128; each variant in a fresh process, step time the median "
        f"of steps 2..{len(first['step_s'])}. `dense` and `stream` stop at the exact top-k (no optimizer); their "
        f"selections bit-identical: {report.get('exact', 'not compared')}.",
        "",
        "| variant | model resident | peak (whole process) | peak above the model | step time | torch threads |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in ran:
        r = report[v]
        step = statistics.median(r["step_s"][1:] or r["step_s"])
        lines.append(
            f"| {LABELS.get(v, v).format(**r)} | {r['rss_model_bytes'] / MIB:,.0f} MiB | "
            f"{r['peak_bytes'] / MIB:,.0f} MiB | {r['peak_above_model_bytes'] / MIB:,.0f} MiB | {step:.2f} s | "
            f"{r['torch_threads']} |"
        )
    return "\n".join(lines) + "\n"


def compare_selections(report: dict, a_name: str, b_name: str) -> bool:
    """Whether two variants saved bit-identical selections (indices and value bits)."""
    import torch

    a, b = (torch.load(report[v]["selection"]) for v in (a_name, b_name))
    same_bits = torch.equal(a["values"].view(torch.int32), b["values"].view(torch.int32))
    return torch.equal(a["indices"], b["indices"]) and same_bits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(VARIANTS), help="run this one variant here (the child)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads of each child (default: torch's)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.density, args.out, args.steps)))
        return
    path = RESULTS / "sparse_memory.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    report = old if old.get("density") == args.density else {"density": args.density}
    with tempfile.TemporaryDirectory() as tmp:
        report.update({v: child(v, args, tmp) for v in args.variants})
        if {"dense", "stream"} <= set(args.variants):
            report["exact"] = compare_selections(report, "dense", "stream")
        for v in args.variants:
            report[v].pop("selection")
    report["peak_bytes_dense"] = report.get("dense_adamw", {}).get("peak_bytes")
    report["peak_bytes_sparse"] = report.get("stream", {}).get("peak_bytes")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "sparse_memory.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
