"""DDP training steps over an emulated link: dense allreduce, fp16, PowerSGD and top-k.

    python benchmarks/ddp_link.py --rounds 6 --accuracy cnn --accuracy-seeds cnn=10 \
        --variants dense,fp16,powersgd1,powersgd4,topk0.1,topk1,topk0.1mc,topk1mc,topk1mc-overlap
                                                        # the recorded run: 12 min on 2 cores
    python benchmarks/ddp_link.py                       # timing only, 6 rounds (about 10 min)
    python benchmarks/ddp_link.py --ranks 1 --no-netns --rates none \
        --variants dense,topk1mc,topk1mc-overlap       # the hook's own cost, a core free (2 min)
    python benchmarks/ddp_link.py --rates none          # unthrottled loopback only (about 3 min)
    python benchmarks/ddp_link.py --quick               # a smoke run (ResNet-18, 1 round: 30 s)

It re-launches itself in a private network namespace (``unshare -rn``, no
privileges needed), brings its loopback up and shapes it with a token bucket
(``tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 10ms``; ``tbf``
works on these machines, ``netem`` does not): only that namespace's loopback.
Two ranks are started with ``torchrun`` (gloo over TCP on 127.0.0.1, one thread
each: ``OMP_NUM_THREADS=1``, ``OMP_WAIT_POLICY=PASSIVE``) and train real DDP
steps (forward, backward with the communication, SGD with momentum) of
torchvision's ResNet-18 and ResNet-50 (10 classes, batches of 8 random 3x32x32
images per rank) with each variant:

* ``dense``: DDP's default allreduce (no hook), default 25 MB buckets;
* ``fp16``: ``default_hooks.fp16_compress_hook``;
* ``powersgd1`` / ``powersgd4``: torch's ``powerSGD_hook`` at rank 1 / 4 (error
  feedback, warm start), one bucket (``bucket_cap_mb=10000``: its nested
  ``wait()`` needs a single bucket on gloo);
* ``topk0.1`` / ``topk1``: ``functopk.distributed.topk_hook`` at density 0.1% / 1%
  (exact selection; ``--topk-mode threshold-reuse``: ``selection="threshold"``,
  which reuses each bucket's previous k-th magnitude and selects the same
  coordinates);
* ``topk0.1mc`` / ``topk1mc``: the same with DGC's momentum correction in the
  hook (``TopKHookState(momentum=0.9)``) and SGD without momentum;
* ``topk-tree0.1`` / ``topk-tree1`` (not run unless named in ``--variants``): the
  same with ``TopKHookState(exchange="tree")``, gTop-k's tree per bucket
  (``log2(P) k`` pairs per rank, rounds run synchronously in the hook);
* ``nocomm``: the same step on the bare module, no DDP: the compute floor.

Each variant keeps its own model for the whole run; every one is warmed up
(``--warmup`` steps, past the hooks' dense iterations) before timing. Then
``--rounds`` rounds: each round visits every rate (order rotated per round),
and at each rate every variant (order rotated) for ``--skip`` untimed plus
``--steps`` timed steps. A step's time is the slower rank's; tables give
medians. The tbf on loopback shapes the traffic of both ranks together, so a
rate R here is R shared by the two directions (about a full-duplex link of R/2
per direction when both ranks send at once, as in a ring of 2).

Bytes per rank and step: ``computed`` is what each rank sends in a ring
collective (allreduce ``2(P-1)/P`` times its buffer, all-gather ``P-1`` times
its part; PowerSGD's P and Q factors and uncompressed tensors, top-k from the
hook's ``HookStats``); ``lo`` is measured, the namespace's loopback ``tx_bytes``
over the timed chunk divided by ranks and steps (TCP/IP headers included).
``--accuracy`` also trains every variant on scikit-learn's digits (the CNN of
``examples/ddp_topk.py``, or a ResNet on digits upsampled to 32x32) and reports
test accuracy. Prints and writes ``benchmarks/results/ddp_link.md`` and, with
several rates, ``ddp_link.png`` (step time against bandwidth); ``--json`` keeps
every step time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_link_report import HOOK_MOMENTUM, TOPK_DENSITY, loadavg, optimizer_momentum, plot, report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NETNS_FLAG = "FUNCTOPK_DDP_LINK_NETNS"
WORLD = 2  # ranks (--ranks)
VARIANTS = ["dense", "fp16", "powersgd1", "powersgd4", "topk0.1", "topk1", "topk0.1mc", "topk1mc"]
EXTRA_VARIANTS = ["topk-tree0.1", "topk-tree1", "topk0.1mc-overlap", "topk1mc-overlap"]  # when named in --variants
HOOK_WARMUP = 2  # dense iterations of the hooks (DDP rebuilds its buckets after the first)


# ----------------------------------------------------------------------------- the network namespace


def reexec_in_netns(argv: list[str]) -> int:
    """Run this script again inside a new user + network namespace; return its exit status."""
    env = dict(os.environ, **{NETNS_FLAG: "1"})
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    for flags in (["-rn"], ["-n"]):  # -r maps us to root in the namespace; plain -n needs real root
        if subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
            return subprocess.call(["unshare", *flags, *cmd], env=env)
    raise SystemExit("unshare -rn / -n failed here: run with --no-netns (unthrottled loopback only)")


def rotated(items: list, r: int) -> list:
    """``items`` started at position ``r`` (mod its length): round ``r``'s order, so no variant always goes first."""
    return items[r % len(items):] + items[: r % len(items)]


def at_each_rate(rates: list, r: int, rank: int):
    """Round ``r``'s rates in :func:`rotated` order, each set on the link by rank 0 between two barriers."""
    import torch.distributed as dist

    for rate in rotated(rates, r):
        dist.barrier()
        if rank == 0:
            set_rate(rate)
        dist.barrier()
        yield rate


def set_rate(rate: str) -> None:
    """Shape this namespace's loopback (``none``: remove the shaping)."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # absent at first: ignored
    if rate != "none":
        cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "10ms"]
        subprocess.run(cmd, check=True, capture_output=True)


def lo_tx_bytes() -> int:
    """Bytes sent on this network namespace's loopback (``/proc/self/net/dev``; ``/sys`` shows the host's)."""
    for line in Path("/proc/self/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    return 0


# ----------------------------------------------------------------------------- variants


class TimedHook:
    """A hook state that times the synchronous part of the inner hook (on the backward thread)."""

    def __init__(self, state, hook) -> None:
        self.state, self.hook, self.seconds = state, hook, 0.0


def timed_hook(state: TimedHook, bucket):
    t0 = time.perf_counter()
    fut = state.hook(state.state, bucket)
    state.seconds += time.perf_counter() - t0
    return fut


def make_topk_state(mode: str, density: float, warmup: int, momentum: float = 0.0, exchange: str = "allgather",
                    overlap: bool = False):  # fmt: skip
    """``(state, hook)`` of the top-k variant for ``--topk-mode``, ``momentum``, ``exchange`` and ``overlap``."""
    from functopk.distributed import TopKHookState, topk_hook

    selection = {"exact": "exact", "threshold-reuse": "threshold"}[mode]
    state = TopKHookState(density=density, warmup_iters=warmup, selection=selection, momentum=momentum,
                          exchange=exchange, overlap=overlap)  # fmt: skip
    return state, topk_hook


def build_variant(name: str, module, topk_mode: str, hook_warmup: int):
    """``(model, hook state or None)``: ``module`` wrapped in DDP with ``name``'s communication."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name == "nocomm":
        return module, None
    if name.startswith("powersgd"):
        model = DDP(module, bucket_cap_mb=10_000)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[8:]),
                                            start_powerSGD_iter=hook_warmup)  # fmt: skip
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return model, state
    model = DDP(module)
    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name in TOPK_DENSITY:
        momentum = HOOK_MOMENTUM if "mc" in name else 0.0
        exchange = "tree" if name.startswith("topk-tree") else "allgather"
        state = TimedHook(*make_topk_state(topk_mode, TOPK_DENSITY[name], hook_warmup, momentum, exchange,
                                           name.endswith("-overlap")))  # fmt: skip
        model.register_comm_hook(state, timed_hook)
        return model, state
    elif name != "dense":
        raise ValueError(f"unknown variant {name}")
    return model, None


def powersgd_numel(module, rank: int, min_rate: float = 2.0) -> int:
    """Values one PowerSGD step allreduces: uncompressed tensors plus the P and Q factors (torch's rule)."""
    total = 0
    for p in module.parameters():
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else p.numel()
    return total


def ring_bytes(kind: str, size_bytes: float, world: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``size_bytes`` or all-gather of ``size_bytes`` per rank."""
    return 2 * (world - 1) / world * size_bytes if kind == "allreduce" else (world - 1) * size_bytes


def computed_bytes(name: str, module, coords_sent: int, world: int) -> float:
    n = sum(p.numel() for p in module.parameters())
    if name == "dense":
        return ring_bytes("allreduce", 4 * n, world)
    if name == "fp16":
        return ring_bytes("allreduce", 2 * n, world)
    if name.startswith("powersgd"):
        return ring_bytes("allreduce", 4 * powersgd_numel(module, int(name[8:])), world)
    if name.startswith("topk-tree"):  # log2(P) swaps of k pairs (P a power of two)
        return (world.bit_length() - 1) * 8 * coords_sent
    if name in TOPK_DENSITY:
        return ring_bytes("allgather", 8 * coords_sent, world)
    return 0.0


# ----------------------------------------------------------------------------- timing worker (one per rank)


def train_step(model, opt, x, y) -> None:
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def time_chunk(model, opt, state, batches, skip: int, steps: int, rank: int):
    """``skip + steps`` steps after a barrier: the slower rank's step times, hook seconds, lo bytes per step."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    tx0 = lo_tx_bytes() if rank == 0 else 0
    times, hook = [], []
    for i in range(skip + steps):
        if isinstance(state, TimedHook):
            state.seconds = 0.0
        t0 = time.perf_counter()
        train_step(model, opt, *batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
        hook.append(state.seconds if isinstance(state, TimedHook) else 0.0)
    tx = (lo_tx_bytes() - tx0) / (dist.get_world_size() * (skip + steps)) if rank == 0 else 0.0
    t = torch.tensor([times, hook], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0, skip:].tolist(), t[1, skip:].tolist(), tx


def timing_worker(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torchvision

    rank = dist.get_rank()
    out: dict = {}
    loads: list[str] = []
    for arch in spec["models"]:
        g = torch.Generator().manual_seed(1000 + rank)
        batches = [(torch.randn(spec["batch"], 3, 32, 32, generator=g), torch.randint(0, 10, (spec["batch"],),
                    generator=g)) for _ in range(4)]  # fmt: skip
        torch.manual_seed(0)
        base = getattr(torchvision.models, arch)(num_classes=10)
        runs = {}
        for name in ["nocomm", *spec["variants"]]:
            model, state = build_variant(name, copy.deepcopy(base), spec["topk_mode"], HOOK_WARMUP)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=optimizer_momentum(name))
            for i in range(spec["warmup"]):
                train_step(model, opt, *batches[i % len(batches)])
            runs[name] = (model, opt, state)
        res = out[arch] = {name: {"times": {}, "hook": {}, "lo": {}} for name in runs}
        for rnd in range(spec["rounds"]):
            first = rotated(spec["rates"], rnd)[0]
            for rate in at_each_rate(spec["rates"], rnd, rank):
                for name in rotated(list(runs), rnd):
                    if name == "nocomm" and rate != first:
                        continue  # no communication: once per round is enough
                    times, hook, lo = time_chunk(*runs[name], batches, spec["skip"], spec["steps"], rank)
                    key = "none" if name == "nocomm" else rate
                    res[name]["times"].setdefault(key, []).extend(times)
                    res[name]["hook"].setdefault(key, []).extend(hook)
                    res[name]["lo"].setdefault(key, []).append(lo)
            if rank == 0:
                loads.append(f"{arch} round {rnd + 1}: {loadavg()}")
                print(f"{loads[-1]} (load averages)", flush=True)
        if rank == 0:
            set_rate("none")
        for name, (model, _, state) in runs.items():
            stats = state.state.last_step if isinstance(state, TimedHook) else None
            res[name]["coords_sent"] = stats.coords_sent if stats else 0
            res[name]["numel"] = sum(p.numel() for p in model.parameters())
            res[name]["bytes"] = {str(p): computed_bytes(name, base, res[name]["coords_sent"], p) for p in (2, 4, 8)}
            if state is not None:  # buckets holding error-feedback memory (PowerSGD: one, by construction)
                res[name]["buckets"] = len(state.state.residuals if isinstance(state, TimedHook) else state.error_dict)
        del runs
    return {"models": out, "load": loads}


# ----------------------------------------------------------------------------- accuracy worker (one per rank)


def digits_task(arch: str, seed: int):
    """``(make_model, x_train, x_test, y_train, y_test)``: the example's task, or digits upsampled to 32x32."""
    import torch.nn.functional as F
    import torchvision

    sys.path.insert(0, str(ROOT / "examples"))
    from quickstart import digits, make_model  # the data and CNN of examples/ddp_topk.py

    x_train, x_test, y_train, y_test = digits(seed)
    if arch == "cnn":
        return make_model, x_train, x_test, y_train, y_test

    def up(x):  # 1x8x8 in [0, 1] -> 3x32x32, standardised
        return (F.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1) - 0.3) / 0.4

    return (lambda: getattr(torchvision.models, arch)(num_classes=10)), up(x_train), up(x_test), y_train, y_test


def train_accuracy(arch: str, name: str, seed: int, spec: dict) -> float:
    """Train ``arch`` with variant ``name`` as examples/ddp_topk.py does (SGD, momentum 0.9); test accuracy."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    make_model, x_train, x_test, y_train, y_test = digits_task(arch, seed)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True,
                                 seed=seed)  # fmt: skip
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, drop_last=True)
    torch.manual_seed(seed)
    model, _ = build_variant(name, make_model(), "exact", spec["acc_warmup"])
    opt = torch.optim.SGD(model.parameters(), lr=spec["acc_lr"][arch], momentum=optimizer_momentum(name))
    for epoch in range(spec["acc_epochs"][arch]):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            train_step(model, opt, x, y)
    model.eval()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def accuracy_worker(spec: dict) -> dict:
    import torch.distributed as dist

    out: dict = {}
    for arch in spec["accuracy"]:
        for seed in range(spec["acc_seeds"][arch]):
            for name in ["dense", *[v for v in spec["variants"] if v != "dense"]]:
                t0 = time.perf_counter()
                acc = train_accuracy(arch, name, seed, spec)
                out.setdefault(arch, {}).setdefault(name, []).append(acc)
                if dist.get_rank() == 0:
                    secs = time.perf_counter() - t0
                    print(f"accuracy {arch} {name} seed {seed}: {acc:.4f} ({secs:.0f} s)", flush=True)
    return out


def worker(spec_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    result = timing_worker(spec) if spec["mode"] == "timing" else accuracy_worker(spec)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def torchrun(spec: dict, tmp: str) -> dict:
    spec_path = os.path.join(tmp, f"spec_{spec['mode']}.json")
    spec["out"] = os.path.join(tmp, f"out_{spec['mode']}.json")
    Path(spec_path).write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['ranks']}",
           str(Path(__file__).resolve()), "--worker", spec_path]  # fmt: skip
    subprocess.run(cmd, check=True, env=env)
    return json.loads(Path(spec["out"]).read_text())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50", help="torchvision models, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {VARIANTS + EXTRA_VARIANTS}")  # fmt: skip
    p.add_argument("--rates", default="1gbit,10gbit,none", help="tc tbf rates; 'none' is unthrottled loopback")
    p.add_argument("--topk-mode", choices=["exact", "threshold-reuse"], default="exact",
                   help="top-k selection: exact, or threshold-reuse (TopKHookState(selection='threshold'))")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant, rate and round")
    p.add_argument("--skip", type=int, default=1, help="untimed steps before them (after switching variant)")
    p.add_argument("--warmup", type=int, default=4, help=f"steps per variant before timing (> {HOOK_WARMUP})")
    p.add_argument("--batch", type=int, default=8, help="images per rank and step")
    p.add_argument("--ranks", type=int, default=WORLD, help="processes (one thread each; 1: the hook's own cost, "
                                                            "with the machine's other core free)")
    p.add_argument("--accuracy", default="", help="also train on digits: 'cnn' (the example's task), 'resnet18'")
    p.add_argument("--accuracy-seeds", default="cnn=5,resnet18=1", help="seeds per task")
    p.add_argument("--accuracy-epochs", default="cnn=8,resnet18=6", help="epochs per task")
    p.add_argument("--no-netns", action="store_true", help="no namespace, no shaping: unthrottled loopback only")
    p.add_argument("--quick", action="store_true", help="resnet18, 1 round of 2 steps")
    p.add_argument("--out", type=Path, default=RESULTS / "ddp_link.md", help="the report; the plot goes beside it")
    p.add_argument("--json", type=Path, help="also write every step time and hook time there")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models, args.variants, args.rates = (s.split(",") for s in (args.models, args.variants, args.rates))
    args.accuracy = [a for a in args.accuracy.split(",") if a]
    if bad := [v for v in args.variants if v not in VARIANTS + EXTRA_VARIANTS]:
        p.error(f"unknown variants {bad}; choose from {VARIANTS + EXTRA_VARIANTS}")
    args.variants = ["dense", *[v for v in args.variants if v != "dense"]]  # the reference of every ratio
    if bad := [r for r in args.rates if r != "none" and not r.endswith("bit")]:
        p.error(f"rates look like 1gbit, 500mbit or none, got {bad}")
    if bad := [a for a in args.accuracy if a not in ("cnn", "resnet18", "resnet50")]:
        p.error(f"--accuracy tasks are cnn, resnet18, resnet50; got {bad}")
    if args.no_netns and args.rates != ["none"]:
        p.error("--no-netns measures unthrottled loopback only: pass --rates none")
    if args.ranks < 1:
        p.error("--ranks must be >= 1")
    if args.warmup <= HOOK_WARMUP:
        p.error(f"--warmup must exceed the hooks' {HOOK_WARMUP} dense iterations")
    if args.quick:
        args.models, args.rounds, args.steps = ["resnet18"], 1, 2
    return args


def per_task(text: str) -> dict[str, int]:
    """``"cnn=8,resnet18=6"`` as a dict."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.no_netns and os.environ.get(NETNS_FLAG) != "1":
        raise SystemExit(reexec_in_netns(argv))
    if not args.no_netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        set_rate("none")
    import torch

    epochs = {"cnn": 8, "resnet18": 6, "resnet50": 4, **per_task(args.accuracy_epochs)}
    seeds = {"cnn": 5, "resnet18": 1, "resnet50": 1, **per_task(args.accuracy_seeds)}
    spec = {"models": args.models, "variants": args.variants, "rates": args.rates, "topk_mode": args.topk_mode,
            "rounds": args.rounds, "steps": args.steps, "skip": args.skip, "warmup": args.warmup,
            "batch": args.batch, "ranks": args.ranks, "accuracy": args.accuracy, "acc_seeds": seeds,
            "acc_epochs": epochs,
            "acc_lr": {"cnn": 0.05, "resnet18": 0.01, "resnet50": 0.01},
            "acc_warmup": 10}  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "load_before": loadavg(),
            "command": "python benchmarks/ddp_link.py " + " ".join(argv)}  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        timed = torchrun(dict(spec, mode="timing"), tmp)
        timing, meta["load_rounds"] = timed["models"], timed["load"]
        acc = torchrun(dict(spec, mode="accuracy"), tmp) if args.accuracy else None
    meta.update(wall=time.perf_counter() - start, load_after=loadavg())
    text = report(timing, acc, spec, meta)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    written = [args.out]
    if args.json:
        args.json.write_text(json.dumps({"timing": timing, "accuracy": acc, "meta": meta}))
        written.append(args.json)
    if len(args.rates) > 1:
        plot(timing, args.rates, args.out.with_suffix(".png"), args.ranks)
        written.append(args.out.with_suffix(".png"))
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main(sys.argv[1:])
