"""FSDP2 training steps over an emulated link: dense reduce-scatter against ``compress_fsdp``'s top-k pairs.

    python benchmarks/fsdp_link.py                       # resnet50, 1gbit and unthrottled, 4 rounds
    python benchmarks/fsdp_link.py --quick               # a smoke run (resnet18, 1 round)

As ``benchmarks/ddp_link.py`` (whose network helpers it reuses), it re-launches
itself in a private network namespace (``unshare -rn``), brings the loopback up
and shapes it with ``tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency
10ms``; two ranks started by ``torchrun`` (gloo on 127.0.0.1, one thread each)
train torchvision's model (10 classes, batches of 8 random 3x32x32 images per
rank) sharded with ``fully_shard`` (one unit per residual block, and the root),
``reshard_after_forward=False`` (so a step's collectives are one parameter
all-gather and the gradient reduction), SGD with momentum 0.9. Variants
(``VARIANTS``: a name and what it installs on the sharded model):

* ``dense``: FSDP2's own reduce-scatter;
* ``topk1`` / ``topk0.1``: ``functopk.distributed.compress_fsdp`` at density 1% / 0.1%.

Each variant keeps its model for the whole run and is warmed up before timing;
then ``--rounds`` rounds visit every rate (rotated) and every variant (rotated)
for ``--skip`` untimed and ``--steps`` timed steps. A step's time is the slower
rank's; the table gives medians, ``lo`` the loopback bytes per rank and step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_link import at_each_rate, lo_tx_bytes, rotated, set_rate  # noqa: E402
from ddp_link_report import loadavg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NETNS_FLAG = "FUNCTOPK_FSDP_LINK_NETNS"


def _compressed(density: float):
    def install(model):
        from functopk.distributed import compress_fsdp

        return compress_fsdp(model, density=density)

    return install


# Name -> install(sharded model) -> state or None; a state may report residual_numel() and sent_bytes.
VARIANTS = {"dense": lambda model: None, "topk1": _compressed(0.01), "topk0.1": _compressed(0.001)}


def reexec_in_netns(argv: list[str]) -> int:
    """This script again, inside a new user + network namespace (as ``ddp_link.py``)."""
    env = dict(os.environ, **{NETNS_FLAG: "1"})
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    for flags in (["-rn"], ["-n"]):
        if subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
            return subprocess.call(["unshare", *flags, *cmd], env=env)
    raise SystemExit("unshare -rn / -n failed here")


def build(arch: str, install):
    """``(model, opt, state)``: the model sharded per residual block, then ``install(model)`` (a variant)."""
    import torch
    import torchvision

    from functopk.distributed.fsdp_torch import fully_shard

    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=10)
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    state = install(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), state


def step(model, opt, x, y) -> None:
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def chunk(run, batches, skip: int, steps: int, rank: int) -> tuple[list[float], float]:
    """``skip + steps`` steps after a barrier: the slower rank's timed step seconds, lo bytes per rank-step."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    tx0 = lo_tx_bytes()
    times = []
    for i in range(skip + steps):
        t0 = time.perf_counter()
        step(*run[:2], *batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    tx = (lo_tx_bytes() - tx0) / (dist.get_world_size() * (skip + steps))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[skip:].tolist(), tx


def worker(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    runs = {name: build(spec["model"], VARIANTS[name]) for name in spec["variants"]}
    for run in runs.values():
        for i in range(spec["warmup"]):
            step(*run[:2], *batches[i % len(batches)])
    res: dict = {name: {"times": {}, "lo": {}} for name in runs}
    loads = []
    for rnd in range(spec["rounds"]):
        for rate in at_each_rate(spec["rates"], rnd, rank):
            for name in rotated(list(runs), rnd):
                times, lo = chunk(runs[name], batches, spec["skip"], spec["steps"], rank)
                res[name]["times"].setdefault(rate, []).extend(times)
                res[name]["lo"].setdefault(rate, []).append(lo)
        loads.append(loadavg())
        if rank == 0:
            print(f"round {rnd + 1}: load {loads[-1]}", flush=True)
    if rank == 0:
        set_rate("none")
    for name, (model, _, state) in runs.items():
        res[name]["shard_numel"] = sum(p.to_local().numel() for p in model.parameters())
        res[name]["residual_numel"] = state.residual_numel() if hasattr(state, "residual_numel") else 0
        res[name]["sent_bytes_per_step"] = getattr(state, "sent_bytes", 0) / state_steps(spec)
    return {"res": res, "load": loads}


def state_steps(spec: dict) -> int:
    return spec["warmup"] + spec["rounds"] * len(spec["rates"]) * (spec["skip"] + spec["steps"])


def report(out: dict, spec: dict, meta: dict) -> str:
    res = out["res"]
    lines = [f"`{meta['command']}` ({meta['date']} UTC, torch {meta['torch']}, {spec['model']}, 2 ranks; "
             f"load before {meta['load_before']}, per round {', '.join(out['load'])}, after {meta['load_after']})",
             "", "| variant | " + " | ".join(f"{r} step (ms) | {r} lo MB" for r in spec["rates"]) + " |",
             "| --- |" + " --- | --- |" * len(spec["rates"])]  # fmt: skip
    for name, r in res.items():
        cells = [f"{statistics.median(r['times'][rate]) * 1e3:.0f} | {statistics.median(r['lo'][rate]) / 1e6:.1f}"
                 for rate in spec["rates"]]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, r in res.items():
        lines.append(f"- {name}: parameter shard {r['shard_numel']:,} coordinates per rank, residual "
                     f"{r['residual_numel']:,}, sparse bytes sent {r['sent_bytes_per_step'] / 1e6:.2f} MB per step")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--variants", default="dense,topk1", help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--rates", default="1gbit,none")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="resnet18, 1 round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import torch
        import torch.distributed as dist

        spec = json.loads(Path(args.worker).read_text())
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        out = worker(spec)
        if dist.get_rank() == 0:
            Path(spec["out"]).write_text(json.dumps(out))
        dist.barrier()
        dist.destroy_process_group()
        return
    if os.environ.get(NETNS_FLAG) != "1":
        raise SystemExit(reexec_in_netns(argv))
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    set_rate("none")
    import torch

    if args.quick:
        args.model, args.rounds, args.steps = "resnet18", 1, 2
    spec = {"model": args.model, "variants": args.variants.split(","), "rates": args.rates.split(","),
            "rounds": args.rounds, "steps": args.steps, "skip": args.skip, "warmup": args.warmup}  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "torch": torch.__version__,
            "load_before": loadavg(), "command": "python benchmarks/fsdp_link.py " + " ".join(argv)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, spec["out"] = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        Path(spec_path).write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).resolve()), "--worker", spec_path], check=True, env=env)  # fmt: skip
        out = json.loads(Path(spec["out"]).read_text())
    meta["load_after"] = loadavg()
    print(report(out, spec, meta))


if __name__ == "__main__":
    main(sys.argv[1:])
