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
* ``sparse_adamw``: forward, backward through ``StreamingTopK``, and
  ``ft.sparse.sparse_optimizer(ft.adamw(...))`` on the ``k`` selected
  coordinates (AdamW state for those only), applied in place; refreshed every
  step. ``sparse_adamw_m20``: refreshed every 20 steps, so the timed steps
  gather the gradient at the set (``StreamingTopK.gather``);
  ``sparse_adamw_m20_acc``: the same ranking ``|g|`` summed since the last
  refresh (``score="accumulated"``: the stream keeps an ``n``-sized sum);
* ``sparse_adapter``: ``ft.sparse_optimizer_from_torch(torch.optim.AdamW)``,
  refreshed every step: the same through the ``torch.optim`` door;
  ``sparse_adapter_m20``: refreshed every 20 steps, the steps between with
  sampled weight gradients (the supported layers' weight gradient computed at
  the set only); ``sparse_adapter_m20_dense``: the same with ``sampled=False``
  (dense weight gradients gathered at the set);
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
    python benchmarks/sparse_memory.py --cycle 20 --batch 8 --rounds 3   # a whole refresh cycle (below)

``--cycle M`` measures a refresh cycle instead, for ``CYCLE_VARIANTS`` (or
``--variants``): step 0 (a refresh, which also builds what later steps reuse)
untimed, then the peak is reset and steps ``1 .. M-1`` (between refreshes) are
timed and their peak read, then the peak is reset again and step ``M`` (the
next refresh) is timed and its peak read. It writes
``sparse_memory_cycle_b{batch}.{json,md}`` with the targets against
``lora_matched``: the mean step over the cycle, the median step between
refreshes, the peaks between refreshes (whole process, and above the model),
and the refresh step's peak. ``--batch`` sets the batch size (default 1); the
load average is recorded before and after each child.

Flags: ``--density`` (default 0.001), ``--steps`` (default 3, at least 2),
``--variants`` (default all), ``--threads``, ``--rounds`` (default 1: run the
list of variants this many times, interleaved, each run in a fresh process;
step times pooled, peaks the median round). ``peak_bytes_dense`` is the
``dense_adamw`` peak (the reference of the targets), ``peak_bytes_sparse`` the
``sparse_adamw`` peak, ``peak_bytes_stream`` the ``stream`` peak, and
``state_bytes_per_coordinate`` the ``sparse_adamw`` state (indices and AdamW's
per-coordinate buffers and step counts) over ``k``.
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


def build(density: float, batch: int = 1) -> tuple[Any, Any, int, int]:
    """The model (seeded), the batch of ``batch`` x 128 tokens, ``n`` and ``k``."""
    import torch
    import transformers

    import functopk as ft

    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
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


def backward_floor(model: Any, ids: Any, k: int) -> tuple[Step, dict]:
    """Forward and a backward that frees each gradient in a post-accumulate hook: what a stream cannot go below."""
    params = list(model.parameters())
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    def step() -> None:
        model(ids, labels=ids).loss.backward()

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


def state_bytes(tensors: Any) -> int:
    import functopk as ft

    return sum(t.numel() * t.element_size() for t in ft.tree.leaves(tensors))


def sparse_adamw(model: Any, ids: Any, k: int, refresh_every: int = 1, score: str = "gradient") -> tuple[Step, dict]:
    """``ft.sparse.sparse_optimizer(ft.adamw)`` on the stream: AdamW state for the ``k`` coordinates only."""
    import torch

    import functopk as ft

    params = dict(model.named_parameters())
    topk = ft.sparse.StreamingTopK(params, k=k, score=score)
    opt = ft.sparse.sparse_optimizer(ft.adamw(1e-4, weight_decay=0.01), k=k)
    box = {"state": opt.init(params), "step": 0}

    def step() -> Any:
        refresh = box["step"] % refresh_every == 0
        if not refresh:
            topk.gather(box["state"].indices)
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():
            updates, box["state"] = opt.update(topk.result(), box["state"], params, refresh=refresh)
            ft.apply_sparse_updates_(params, updates)
        box["step"] += 1
        return None

    state = box["state"]
    info = {"trainable": k, "refresh_every": refresh_every, "score": score,
            "state_bytes_per_coordinate": state_bytes([state.indices, state.inner]) / k,
            "score_bytes": state_bytes(topk.scores or [])}  # fmt: skip
    return step, info


def sparse_adapter(model: Any, ids: Any, k: int, refresh_every: int = 1, sampled: bool = True) -> tuple[Step, dict]:
    """``ft.sparse_optimizer_from_torch(torch.optim.AdamW)``: the same through the torch.optim door."""
    import torch

    import functopk as ft

    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=k, lr=1e-4, weight_decay=0.01,
                                         refresh_every=refresh_every, sampled=sampled)  # fmt: skip

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    state = opt.state_dict()["state"]
    return step, {"trainable": k, "state_bytes_per_coordinate": state_bytes([state["indices"], state["inner"]]) / k}


VARIANTS: dict[str, Variant] = {
    "dense": dense,
    "stream": stream,
    "dense_adamw": dense_adamw,
    "backward_floor": backward_floor,
    "sparse_adamw": sparse_adamw,
    "sparse_adamw_m20": functools.partial(sparse_adamw, refresh_every=20),
    "sparse_adamw_m20_acc": functools.partial(sparse_adamw, refresh_every=20, score="accumulated"),
    "sparse_adapter": sparse_adapter,
    "sparse_adapter_m20": functools.partial(sparse_adapter, refresh_every=20),
    "sparse_adapter_m20_dense": functools.partial(sparse_adapter, refresh_every=20, sampled=False),
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
    times, cpus = [], []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        sparse = step()
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    peak = status_kib("VmHWM") * 1024
    if sparse is not None:
        torch.save({"indices": sparse.indices, "values": sparse.values}, out)
    return {"variant": variant, "numel": n, "k": k, **info, "rss_model_bytes": rss_model,
            "peak_bytes": peak, "peak_above_model_bytes": peak - rss_model, "hwm_reset": reset, "step_s": times,
            "step_s_median": statistics.median(times[1:]), "cpu_s": cpus, "cpu_s_median": statistics.median(cpus[1:]),
            "torch_threads": torch.get_num_threads()}  # fmt: skip


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
    "backward_floor": "forward + backward freeing each gradient (no selection, no step): the floor",
    "sparse_adamw": "`sparse_optimizer(adamw)` + `StreamingTopK`, refresh every step",
    "sparse_adamw_m20": "the same, refresh every 20 steps (timed steps gather at the set)",
    "sparse_adamw_m20_acc": 'the same, `score="accumulated"` (n-sized sum in the stream)',
    "sparse_adapter": "`ft.sparse_optimizer_from_torch(AdamW)`, refresh every step",
    "sparse_adapter_m20": "`ft.sparse_optimizer_from_torch(AdamW, refresh_every=20)`, sampled weight gradients",
    "sparse_adapter_m20_dense": "the same, `sampled=False` (dense weight gradients gathered at the set)",
    "lora": "LoRA (peft, r={lora_rank}, {trainable:,} trainable) + AdamW",
    "lora_matched": "LoRA (peft, r={lora_rank}, {trainable:,} trainable, nearest k) + AdamW",
}


def markdown(report: dict) -> str:
    ran = [v for v in VARIANTS if v in report]
    first = report[ran[0]]
    lines = [
        f"One training step of GPT-2 small ({first['numel']:,} parameters; k = {first['k']:,}, density "
        f"{report['density']}), CPU, fp32, batch 1 x 128; each variant in a fresh process, step time the median "
        f"of the steps after the first, pooled over {len(first.get('rounds', [1]))} interleaved rounds (peaks: "
        "the median round). `dense` and `stream` stop at the exact top-k (no optimizer); their "
        f"selections bit-identical: {report.get('exact', 'not compared')}. Step time: the process's CPU time (all its "
        "threads; on a loaded machine it leaves out the time other processes held the cores), wall time in brackets.",
        "",
        "| variant | model resident | peak (whole process) | peak above the model | step time | state bytes per "
        "trained coordinate | torch threads |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in ran:
        r = report[v]
        step = f"{r['cpu_s_median']:.2f} s ({r['step_s_median']:.2f})"
        lines.append(
            f"| {LABELS.get(v, v).format(**r)} | {r['rss_model_bytes'] / MIB:,.0f} MiB | "
            f"{r['peak_bytes'] / MIB:,.0f} MiB | {r['peak_above_model_bytes'] / MIB:,.0f} MiB | {step} | "
            f"{r.get('state_bytes_per_coordinate', '')} | {r['torch_threads']} |"
        )
    return "\n".join(lines + targets(report)) + "\n"


def targets(report: dict) -> list[str]:
    """The issue's targets as measured ratios: the sparse-state step (refreshed every step, and every 20 steps)
    against dense AdamW and LoRA at the rank nearest ``k``."""
    names = ["sparse_adamw", "sparse_adamw_m20"]
    if not {*names, "dense_adamw", "lora_matched"} <= set(report):
        return []
    dense, lora = report["dense_adamw"], report["lora_matched"]
    m1, m20 = (report[v] for v in names)

    def ratios(fn: Callable[[dict], float]) -> str:
        return " | ".join(f"{fn(r):.2f}" for r in (m1, m20))

    rows = [
        ("peak above the model / dense AdamW's", ratios(lambda r: r["peak_above_model_bytes"]
                                                         / dense["peak_above_model_bytes"]), "<= 0.5"),
        ("whole-process peak / dense AdamW's", ratios(lambda r: r["peak_bytes"] / dense["peak_bytes"]), "<= 0.7"),
        ("state bytes per selected coordinate", ratios(lambda r: r["state_bytes_per_coordinate"]), "<= 16"),
        ("step time / dense AdamW's (CPU)", ratios(lambda r: r["cpu_s_median"] / dense["cpu_s_median"]), "<= 1"),
        ("whole-process peak / LoRA's (nearest k)", ratios(lambda r: r["peak_bytes"] / lora["peak_bytes"]), "<= 1.25"),
        ("step time / LoRA's (nearest k, CPU)", ratios(lambda r: r["cpu_s_median"] / lora["cpu_s_median"]), "<= 1.6"),
    ]  # fmt: skip
    head = ["", "| sparse-state step | refresh every step | every 20 steps | target |"]
    head.append("| --- | ---: | ---: | ---: |")
    return head + [f"| {name} | {values} | {goal} |" for name, values, goal in rows]


def merged(runs: list[dict]) -> dict:
    """One variant's rounds as one result: every timed step pooled (``step_s`` keeps each round's first
    step first), the median peak; each round's numbers kept under ``rounds``."""
    first = dict(runs[-1])
    for key in ("step_s", "cpu_s"):
        first[key] = [runs[0][key][0]] + [t for r in runs for t in r[key][1:]]
        first[f"{key}_median"] = statistics.median(first[key][1:])
    for key in ("peak_bytes", "peak_above_model_bytes", "rss_model_bytes"):
        first[key] = int(statistics.median(r[key] for r in runs))
    first["rounds"] = [{key: r[key] for key in ("peak_bytes", "peak_above_model_bytes", "step_s")} for r in runs]
    return first


def compare_selections(report: dict, a_name: str, b_name: str) -> bool:
    """Whether two variants saved bit-identical selections (indices and value bits)."""
    import torch

    a, b = (torch.load(report[v]["selection"]) for v in (a_name, b_name))
    same_bits = torch.equal(a["values"].view(torch.int32), b["values"].view(torch.int32))
    return torch.equal(a["indices"], b["indices"]) and same_bits

CYCLE_VARIANTS = ["sparse_adapter_m20", "sparse_adapter_m20_dense", "lora_matched"]


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident size, where the kernel allows it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def timed(step: Step) -> tuple[float, float]:
    """Wall time and this process's CPU time (all its threads) of one step: on a loaded machine the CPU time leaves
    out the time other processes held the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_cycle(variant: str, density: float, batch: int, cycle: int) -> dict:
    """One variant through a refresh cycle in this process: step 0, steps 1 .. M-1, step M (module docstring)."""
    import torch

    model, ids, n, k = build(density, batch)
    rss_model = status_kib("VmRSS") * 1024
    setup = VARIANTS[variant]
    if isinstance(setup, functools.partial) and "refresh_every" in setup.keywords:  # refresh at steps 0 and M
        setup = functools.partial(setup, refresh_every=cycle)
    step, info = setup(model, ids, k)
    first = timed(step)[0]  # a refresh: builds the optimizer state and the allocator's pools
    reset = reset_peak()
    between = [timed(step) for _ in range(cycle - 1)]
    peak_between = status_kib("VmHWM") * 1024
    reset_peak()
    refresh = timed(step)
    peak_refresh = status_kib("VmHWM") * 1024
    walls, cpus = [w for w, _ in between], [c for _, c in between]
    return {"variant": variant, "numel": n, "k": k, "batch": batch, "cycle": cycle, **info,
            "rss_model_bytes": rss_model, "hwm_reset": reset, "first_s": first, "between_s": walls,
            "between_s_median": statistics.median(walls), "refresh_s": refresh[0],
            "cycle_s": statistics.mean([*walls, refresh[0]]), "between_cpu_s": cpus,
            "between_cpu_s_median": statistics.median(cpus), "refresh_cpu_s": refresh[1],
            "cycle_cpu_s": statistics.mean([*cpus, refresh[1]]), "peak_between_bytes": peak_between,
            "peak_between_above_model_bytes": peak_between - rss_model, "peak_refresh_bytes": peak_refresh,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def merged_cycle(runs: list[dict]) -> dict:
    """One variant's rounds: the median over rounds of each number; every round kept under ``rounds``."""
    out = dict(runs[-1])
    keys = ["between_s_median", "refresh_s", "cycle_s", "between_cpu_s_median", "refresh_cpu_s", "cycle_cpu_s",
            "peak_between_bytes", "peak_between_above_model_bytes", "peak_refresh_bytes", "rss_model_bytes"]
    for key in keys:
        out[key] = statistics.median(r[key] for r in runs)
    out["rounds"] = runs
    return out


CYCLE_TARGETS = [  # (what, the sparse variant's number / LoRA's, target)
    ("mean step over the cycle / LoRA's: CPU time", "cycle_cpu_s", "<= 1.1"),
    ("the same, wall time", "cycle_s", "<= 1.1"),
    ("step between refreshes (median) / LoRA's: CPU time", "between_cpu_s_median", "<= 1.0"),
    ("the same, wall time", "between_s_median", "<= 1.0"),
    ("whole-process peak between refreshes / LoRA's", "peak_between_bytes", "<= 1.05"),
    ("peak above the model between refreshes / LoRA's", "peak_between_above_model_bytes", "<= 1.3"),
    ("refresh step's whole-process peak / LoRA's", "peak_refresh_bytes", "(reported)"),
]


def cycle_markdown(report: dict) -> str:
    ran = [v for v in VARIANTS if v in report]
    first = report[ran[0]]
    loads = [load for v in ran for r in report[v]["rounds"] for load in r["loadavg"]]
    lines = [
        f"A refresh cycle of M = {first['cycle']} steps of GPT-2 small ({first['numel']:,} parameters; k = "
        f"{first['k']:,}, density {report['density']}), CPU, fp32, batch {first['batch']} x 128, "
        f"{first['torch_threads']} torch threads; each variant in a fresh process, {len(first['rounds'])} interleaved "
        "rounds, the median round of each number. Step 0 (a refresh) is not timed; steps 1 .. M-1 are between "
        "refreshes, step M refreshes; each peak is the process's `VmHWM` over those steps (reset before them). "
        "Times: the process's CPU time (all its threads: on a loaded machine it leaves out the time other processes "
        f"held the cores), wall time in brackets. Load average (1 min) before and after each child: "
        f"{min(loads):.1f}-{max(loads):.1f}.",
        "",
        "| variant | step between refreshes (median) | refresh step | mean over the cycle | peak between refreshes "
        "| above the model | refresh step's peak |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in ran:
        r = report[v]
        lines.append(
            f"| {LABELS.get(v, v).format(**r)} | {r['between_cpu_s_median']:.3f} s ({r['between_s_median']:.3f}) | "
            f"{r['refresh_cpu_s']:.3f} s ({r['refresh_s']:.3f}) | {r['cycle_cpu_s']:.3f} s ({r['cycle_s']:.3f}) | "
            f"{r['peak_between_bytes'] / MIB:,.0f} MiB | {r['peak_between_above_model_bytes'] / MIB:,.0f} MiB | "
            f"{r['peak_refresh_bytes'] / MIB:,.0f} MiB |"
        )
    if {"sparse_adapter_m20", "lora_matched"} <= set(report):
        lines += ["", "| `sparse_adapter_m20` against LoRA (rank nearest k): median over rounds of the ratio in each "
                  "round | ratio | each round | target |", "| --- | ---: | --- | ---: |"]  # fmt: skip
        for what, key, goal in CYCLE_TARGETS:
            each = paired(report, key)
            lines.append(f"| {what} | {statistics.median(each):.2f} | {', '.join(f'{r:.2f}' for r in each)} | {goal} |")
    return "\n".join(lines) + "\n"


def paired(report: dict, key: str) -> list[float]:
    """``sparse_adapter_m20``'s ``key`` over ``lora_matched``'s, round by round (the same machine state)."""
    rounds = zip(report["sparse_adapter_m20"]["rounds"], report["lora_matched"]["rounds"])
    return [sparse[key] / lora[key] for sparse, lora in rounds]


def main_cycle(args: argparse.Namespace) -> None:
    """``--cycle M``: every variant through a refresh cycle, interleaved rounds, one result file per batch size."""
    variants = args.variants if args.variants != list(VARIANTS) else CYCLE_VARIANTS
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            cmd = [sys.executable, __file__, "--variant", v, "--density", str(args.density), "--cycle",
                   str(args.cycle), "--batch", str(args.batch)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            if args.threads:
                env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
            before = os.getloadavg()[0]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["loadavg"] = [before, os.getloadavg()[0]]
            runs[v].append(result)
            print(f"{v}: between {result['between_cpu_s_median']:.3f} s CPU ({result['between_s_median']:.3f} s wall), "
                  f"cycle {result['cycle_cpu_s']:.3f} s CPU", flush=True)  # fmt: skip
    report = {"density": args.density, **{v: merged_cycle(rs) for v, rs in runs.items()}}
    name = f"sparse_memory_cycle_b{args.batch}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(cycle_markdown(report))
    print(cycle_markdown(report))



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=list(VARIANTS), help="run this one variant here (the child)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads of each child (default: torch's)")
    parser.add_argument("--rounds", type=int, default=1, help="run the variants this many times, interleaved")
    parser.add_argument("--out")
    parser.add_argument("--cycle", type=int, help="measure a refresh cycle of this many steps (module docstring)")
    parser.add_argument("--batch", type=int, default=1, help="sequences of 128 tokens per batch (--cycle only)")
    parser.add_argument("--markdown", action="store_true", help="rewrite the .md from the saved .json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    if args.cycle is not None and args.cycle < 2:
        parser.error("--cycle must be at least 2")
    if args.variant and args.cycle:
        print(json.dumps(run_cycle(args.variant, args.density, args.batch, args.cycle)))
        return
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.density, args.out, args.steps)))
        return
    if args.markdown:
        name = RESULTS / (f"sparse_memory_cycle_b{args.batch}" if args.cycle else "sparse_memory")
        write = cycle_markdown if args.cycle else markdown
        name.with_suffix(".md").write_text(write(json.loads(name.with_suffix(".json").read_text())))
        return
    if args.cycle:
        main_cycle(args)
        return
    path = RESULTS / "sparse_memory.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    report = old if old.get("density") == args.density else {"density": args.density}
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):  # interleaved: each round runs every variant once, in a fresh process
            for v in args.variants:
                runs[v].append(child(v, args, tmp))
        report.update({v: merged(rs) for v, rs in runs.items()})
        if {"dense", "stream"} <= set(args.variants):
            report["exact"] = compare_selections(report, "dense", "stream")
        for v in args.variants:
            report[v].pop("selection")
    report["peak_bytes_dense"] = report.get("dense_adamw", {}).get("peak_bytes")
    report["peak_bytes_sparse"] = report.get("sparse_adamw", {}).get("peak_bytes")
    report["peak_bytes_stream"] = report.get("stream", {}).get("peak_bytes")
    report["state_bytes_per_coordinate"] = report.get("sparse_adamw", {}).get("state_bytes_per_coordinate")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "sparse_memory.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
