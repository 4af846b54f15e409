"""Optimizer step time on a ResNet-50 parameter tree: functopk against torch.optim (and TorchOpt).

For each optimizer it times one optimizer step (the update plus adding it to
the parameters; gradients are given, fixed random tensors) in these variants:

* ``torch.optim``: ``opt.step()`` with ``foreach=True`` (in place), the baseline;
  for ``Muon``, which has no foreach implementation in torch 2.14 (``foreach=True``
  raises), its default per-parameter loop;
* ``functopk eager pure``: ``tx.update`` then ``ft.apply_updates`` (new tensors);
* ``functopk eager in-place``: ``tx.update`` then ``ft.apply_updates_`` (into the parameters);
* ``functopk eager update_``: ``ft.update_(tx, grads, state, params)``, the in-place twin
  (state and parameters donated; the same numbers as the pure step, bit for bit);
* ``functopk compiled pure``: the pure step under ``torch.compile(fullgraph=True)``
  (inductor); should that fail (a graph break), the error is recorded and the step
  is compiled and timed again without ``fullgraph``, with its graph breaks counted;
* ``TorchOpt``: its functional optimizer with ``inplace=True`` updates and apply,
  when installed (SGD, Adam and AdamW only).

The optimizers (``--opts``, default all): the 13 ``torch.optim`` classes functopk
covers, each as ``ft.from_torch(torch.optim.X, **kw)`` with the same keywords as
the torch optimizer it is timed against (``OPTIMIZERS`` below), and two with no
torch class, Lion and LAMB (optax's semantics), which are timed against torch's
AdamW foreach as a reference point only. Muon takes 2-D parameters only: it runs on
the tree's leaves with ``dim() == 2`` (for ResNet-50 that is the one ``fc.weight``,
1000 x 2048), nothing else.

All variants of one optimizer live side by side and are timed round-robin, one
step each per round, so machine load affects them alike; the table shows medians
and ratios to torch.optim. Every variant runs the same steps from the same start,
and at the end their parameters are compared with torch.optim's (see ``parity``):
relative 1e-4 (float32 rounding over the steps), for Muon 2e-2 of the distance the
parameters moved (its Newton-Schulz iteration runs in bfloat16, and inductor rounds
fused bfloat16 expressions once where eager rounds every operation).

Usage:
    python benchmarks/optim.py                          # ResNet-50, every optimizer, 20 rounds
    python benchmarks/optim.py --opts adam,muon,lion    # some of them
    python benchmarks/optim.py --quick                  # ResNet-18, 3 rounds: a smoke run
    python benchmarks/optim.py --malloc tuned           # keep freed memory in the process (see below)
    python benchmarks/optim.py --results benchmarks/results/optim.md --out benchmarks/results/optim.png

The tables go to stdout and to ``--results`` (markdown, with the machine, the load
average before and after, and the command line); the plot to ``--out``.

Memory: a pure step allocates new state tensors (torch.optim overwrites its
own). glibc returns large freed blocks to the system, so on CPU each step's new
tensors arrive as fresh pages, i.e. page faults. ``--malloc tuned`` re-runs the
script with glibc told to keep freed memory (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``), which is what jemalloc or
tcmalloc (the PyTorch CPU tuning guide's advice) do by default.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import functopk as ft  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_report import plot, summary, table  # noqa: E402

try:
    import torchopt
except ImportError:  # optional
    torchopt = None

TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 29),
}
TOL = 1e-4  # relative (floor 1e-3): float32 rounding, accumulated over the steps
MUON_TOL = 2e-2  # of the distance moved: bfloat16 Newton-Schulz (about 2**-8 relative per element)


class Opt(NamedTuple):
    """One benchmarked optimizer.

    Attributes:
        torch_class: The ``torch.optim`` class with its semantics, or ``None`` (functopk only).
        kwargs: Keywords of ``torch_class`` (also given to ``ft.from_torch``).
        alias: The functopk call with the same maths, for the tables.
        foreach: Whether torch has a foreach implementation of ``torch_class``.
        matrices: Run on the tree's 2-D leaves only (Muon).
        make: For an optimizer without a torch class: its transformation.
    """

    torch_class: str | None
    kwargs: dict[str, Any]
    alias: str
    foreach: bool = True
    matrices: bool = False
    make: Callable[[], ft.GradientTransformation] | None = None


REFERENCE = ("AdamW", {"lr": 1e-3, "weight_decay": 1e-2})  # the reference point of Lion and LAMB
OPTIMIZERS: dict[str, Opt] = {
    "sgd-momentum": Opt("SGD", {"lr": 0.1, "momentum": 0.9}, "ft.sgd(0.1, momentum=0.9)"),
    "adam": Opt("Adam", {"lr": 1e-3}, "ft.adam(1e-3)"),
    "adamw": Opt("AdamW", {"lr": 1e-3, "weight_decay": 1e-2}, "ft.adamw(1e-3, weight_decay=1e-2)"),
    "rmsprop": Opt("RMSprop", {"lr": 1e-2}, "ft.rmsprop(1e-2)"),
    "adagrad": Opt("Adagrad", {"lr": 1e-2}, "ft.adagrad(1e-2)"),
    "nadam": Opt("NAdam", {"lr": 2e-3}, "ft.nadam(2e-3)"),
    "radam": Opt("RAdam", {"lr": 1e-3}, "ft.radam(1e-3)"),
    "adamax": Opt("Adamax", {"lr": 2e-3}, "ft.adamax(2e-3)"),
    "adadelta": Opt("Adadelta", {"lr": 1.0}, "ft.adadelta(1.0)"),
    "rprop": Opt("Rprop", {"lr": 1e-2}, "ft.rprop(1e-2)"),
    "asgd": Opt("ASGD", {"lr": 1e-2}, "ft.asgd(1e-2)"),
    "adafactor": Opt("Adafactor", {"lr": 1e-2}, "ft.adafactor(1e-2)"),
    "muon": Opt("Muon", {"lr": 1e-3}, "ft.muon(1e-3)", foreach=False, matrices=True),
    "lion": Opt(None, {}, "ft.lion(1e-4)", make=lambda: ft.lion(1e-4)),
    "lamb": Opt(None, {}, "ft.lamb(1e-3, weight_decay=1e-2)", make=lambda: ft.lamb(1e-3, weight_decay=1e-2)),
}


def model_params(name: str) -> dict[str, torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(tree):
    return {k: v.clone() for k, v in tree.items()}


def ft_optimizer(opt: Opt) -> ft.GradientTransformation:
    if opt.make is not None:
        return opt.make()
    return ft.from_torch(getattr(torch.optim, opt.torch_class), **opt.kwargs)


class TorchOptim:
    def __init__(self, opt: Opt, params, grads):
        self.tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
        for k, t in self.tensors.items():
            t.grad = grads[k]
        cls, kwargs = (opt.torch_class, opt.kwargs) if opt.torch_class else REFERENCE
        foreach = opt.foreach or opt.torch_class is None
        if opt.torch_class is None:
            self.name = f"torch.optim {cls} foreach (reference)"
        else:
            self.name = "torch.optim foreach" if foreach else f"torch.optim {cls} (no foreach: for-loop)"
        extra = {"foreach": True} if foreach else {}
        self.opt = getattr(torch.optim, cls)(list(self.tensors.values()), **kwargs, **extra)

    def step(self) -> None:
        self.opt.step()

    def params(self):
        return {k: v.detach() for k, v in self.tensors.items()}


class FunctopkPure:
    name = "functopk eager pure"

    def __init__(self, opt: Opt, params, grads):
        self.tx = ft_optimizer(opt)
        self.p = clone(params)
        self.grads = grads
        self.state = self.tx.init(self.p)

    def step(self) -> None:
        updates, self.state = self.tx.update(self.grads, self.state, self.p)
        self.p = ft.apply_updates(self.p, updates)

    def params(self):
        return self.p


class FunctopkInplace(FunctopkPure):
    name = "functopk eager in-place"

    def step(self) -> None:
        updates, self.state = self.tx.update(self.grads, self.state, self.p)
        ft.apply_updates_(self.p, updates)


class FunctopkTwin(FunctopkPure):
    name = "functopk eager update_ (donated)"

    def step(self) -> None:
        ft.update_(self.tx, self.grads, self.state, self.p)


class FunctopkCompiled(FunctopkPure):
    name = "functopk compiled pure"

    def __init__(self, opt: Opt, params, grads):
        super().__init__(opt, params, grads)
        tx = self.tx

        def step(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return ft.apply_updates(params, updates), state

        self.fn = step
        self.compiled = torch.compile(step, fullgraph=True)
        self.notes: list[str] = []

    def step(self) -> None:
        self.p, self.state = self.compiled(self.p, self.grads, self.state)

    def first_call(self) -> None:
        """Compile (fullgraph; on failure record it and compile again allowing graph breaks) and run one step."""
        breaks = sum(counters["graph_break"].values())
        t0 = time.perf_counter()
        try:
            self.step()
        except Exception as e:  # a graph break under fullgraph=True, or an inductor error
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.notes.append(f"fullgraph compile FAILED ({type(e).__name__}: {msg[:100]})")
            print(f"    compile failed: {type(e).__name__}: {msg[:300]}", flush=True)
            self.compiled = torch.compile(self.fn)
            t0 = time.perf_counter()
            self.step()  # a failure here is not caught: nothing to time
            self.name = "functopk compiled pure (graph breaks)"
            self.notes.append(f"{sum(counters['graph_break'].values()) - breaks} graph breaks")
        self.notes.append(f"first call {time.perf_counter() - t0:.0f} s")


class TorchOpt:
    name = "TorchOpt"

    def __init__(self, opt: Opt, params, grads):
        if opt.torch_class == "SGD":
            self.tx = torchopt.sgd(opt.kwargs["lr"], momentum=0.9)
        elif opt.torch_class == "Adam":
            self.tx = torchopt.adam(opt.kwargs["lr"])
        else:
            self.tx = torchopt.adamw(opt.kwargs["lr"], weight_decay=1e-2)
        self.p = clone(params)
        self.source = grads
        self.grads = clone(grads)
        self.state = self.tx.init(self.p)

    def prepare(self) -> None:
        # inplace=True turns the gradient tensors into the updates: refill them (untimed).
        for k, v in self.source.items():
            self.grads[k].copy_(v)

    def step(self) -> None:
        # TorchOpt's fastest functional path: updates computed and applied in place.
        updates, self.state = self.tx.update(self.grads, self.state, params=self.p, inplace=True)
        torchopt.apply_updates(self.p, updates, inplace=True)

    def params(self):
        return self.p


def time_variants(variants, rounds: int, sync=lambda: None) -> dict[str, list[float]]:
    times = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            getattr(v, "prepare", lambda: None)()
            gc.collect()
            t0 = time.perf_counter()
            v.step()
            sync()
            times[v.name].append(time.perf_counter() - t0)
    return times


def parity(opt: Opt, v, ref, start) -> tuple[float, float]:
    """How far ``v``'s parameters are from the reference's, and the bound they must meet.

    Relative with a floor (1e-3), worst coordinate, against ``TOL``. Muon: the error's
    norm over the norm of the reference's move from ``start``, against ``MUON_TOL``
    (its direction is a bfloat16 Newton-Schulz result, correct to a few bfloat16 ulps).
    """
    p = v.params()
    if opt.matrices:
        err = sum(float((p[k] - ref[k]).double().square().sum()) for k in ref) ** 0.5
        moved = sum(float((ref[k] - start[k]).double().square().sum()) for k in ref) ** 0.5
        return err / moved, MUON_TOL
    worst = max(float(((p[k] - ref[k]).abs() / (ref[k].abs() + 1e-3)).max()) for k in ref)
    # TorchOpt's Adam orders its float32 operations differently, and with the same gradient every step the
    # difference grows by about 1e-5 per step (1.7e-4 after 22 steps), so it only gets a sanity bound
    return worst, (1e-3 if isinstance(v, TorchOpt) else TOL)


def warm_up(name: str, variants, warmup: int) -> None:
    for v in variants:
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        if isinstance(v, FunctopkCompiled):
            v.first_call()
            for _ in range(warmup - 1):
                v.step()
            v.graphs = counters["stats"]["unique_graphs"] - graphs
            print(f"  {name}: compile + {warmup} warm-up steps took {time.perf_counter() - t0:.1f} s "
                  f"({v.graphs} graph(s))", flush=True)
            continue
        for _ in range(warmup):
            getattr(v, "prepare", lambda: None)()
            v.step()


def compiled_notes(v, graphs_before: int) -> list[str]:
    notes = list(v.notes)
    if v.graphs != 1:
        notes.append(f"{v.graphs} graphs")
    recompiled = counters["stats"]["unique_graphs"] - graphs_before
    if recompiled:
        notes.append(f"RECOMPILED {recompiled}x while timed")
    return notes


def run_one(name: str, opt: Opt, params, grads, rounds: int, warmup: int, compile_: bool, sync) -> list[dict]:
    classes: list[Callable] = [TorchOptim, FunctopkPure, FunctopkInplace, FunctopkTwin]
    if compile_:
        classes.append(FunctopkCompiled)
    if torchopt is not None and opt.torch_class in ("SGD", "Adam", "AdamW"):
        classes.append(TorchOpt)
    variants = [cls(opt, params, grads) for cls in classes]
    warm_up(name, variants, warmup)
    graphs = counters["stats"]["unique_graphs"]
    times = time_variants(variants, rounds, sync)
    base = statistics.median(times[variants[0].name])
    # the parameters every variant must reproduce: torch's, or (no torch class) functopk's eager pure step's
    ref_v = variants[0] if opt.torch_class else variants[1]
    ref = ref_v.params()
    rows = []
    for v in variants:
        notes: list[str] = []
        if v is variants[0]:
            err, tol = None, None
            if opt.torch_class is None:
                notes.append(f"not {name}: AdamW(lr=1e-3, weight_decay=1e-2), for scale only")
        elif v is ref_v and v is not variants[0]:
            err, tol = None, None
            notes.append("the reference of the parameter check (no torch class)")
        else:
            err, tol = parity(opt, v, ref, params)
        if isinstance(v, FunctopkCompiled):
            notes += compiled_notes(v, graphs)
        if err is not None and err > tol:
            notes.append(f"PARITY FAILED: {err:.1e} > {tol:.0e}")
        med = statistics.median(times[v.name])
        q = statistics.quantiles(times[v.name], n=4)
        rows.append({
            "optimizer": name, "variant": v.name, "ms": med * 1e3, "ratio": med / base, "iqr": (q[2] - q[0]) * 1e3,
            "err": err, "tol": tol, "notes": "; ".join(notes), "failed": err is not None and err > tol,
        })
    return rows


def run(model: str, rounds: int, warmup: int, opts: list[str], compile_: bool, device: str = "cpu") -> list[dict]:
    params = {k: v.to(device) for k, v in model_params(model).items()}
    g = torch.Generator().manual_seed(1)
    grads = {k: (torch.randn(v.shape, generator=g) * 1e-2).to(device) for k, v in params.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    numel = sum(v.numel() for v in params.values())
    malloc = "tuned" if all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()) else "default"
    print(f"# {model}: {len(params)} tensors, {numel / 1e6:.1f}M parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, glibc malloc {malloc}, "
          f"TorchOpt {torchopt.__version__ if torchopt else 'not installed'}",
          flush=True)
    rows = []
    for name in opts:
        opt = OPTIMIZERS[name]
        p, gr = params, grads
        if opt.matrices:
            p = {k: v for k, v in params.items() if v.dim() == 2}
            gr = {k: grads[k] for k in p}
            shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in p.items())
            print(f"  {name}: the {len(p)} 2-D leaves only ({shapes})", flush=True)
        t0 = time.perf_counter()
        rows += run_one(name, opt, p, gr, rounds, warmup, compile_, sync)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        torch._dynamo.reset()  # frees the compiled step; also keeps the graph counts per optimizer
        gc.collect()
    return rows


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def report(rows: list[dict], model: str, rounds: int, warmup: int, load_before: str, seconds: float) -> str:
    malloc = "tuned" if all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()) else "default"
    command = "python " + shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    return "\n".join([
        f"# Optimizer steps ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; {seconds / 60:.1f} min.",
        "",
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
        f"glibc malloc {malloc}, TorchOpt {torchopt.__version__ if torchopt else 'not installed'}; "
        f"load average before the run {load_before}, after it {loadavg()}.",
        "",
        f"{model} parameter tree, fixed random gradients; {rounds} round-robin rounds after {warmup} warm-up "
        f"steps, medians; ratios to the torch.optim row of the same optimizer (foreach, except Muon: torch has "
        f"no foreach Muon). Muon runs on the tree's 2-D leaves only. Lion and LAMB have no torch.optim class: "
        f"their baseline is torch's AdamW foreach, a reference point, not the same maths. Parameter check after "
        f"the {warmup + rounds} steps: worst relative difference to torch.optim's parameters (floor 1e-3; bound "
        f"{TOL:.0e}); Muon: difference norm over the norm of the parameters' move (bound {MUON_TOL:.0e}, bfloat16 "
        f"Newton-Schulz); Lion and LAMB: against functopk's eager pure step. Compile: inductor with its "
        f"on-disk caches as configured (a rerun compiles faster).",
        "",
        summary(rows, OPTIMIZERS),
        "",
        table(rows),
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-18, 3 rounds: a smoke run")
    parser.add_argument("--model", default=None, help="a torchvision model name (default resnet50)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--opts", "--optimizers", dest="opts", default="all",
                        help=f"comma-separated, from {','.join(OPTIMIZERS)} (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (parameters, gradients and states live there)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--out", default="out/bench/optim.png", help="where to write the plot")
    parser.add_argument("--results", default="out/bench/optim.md", help="where to write the tables (markdown)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--malloc", choices=["default", "tuned"], default="default",
                        help="glibc malloc settings for the run (tuned: keep freed memory in the process)")
    args = parser.parse_args()
    if args.malloc == "tuned" and any(os.environ.get(k) != v for k, v in TUNED_MALLOC.items()):
        # glibc reads these when the process starts: run again with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})
    opts = list(OPTIMIZERS) if args.opts == "all" else args.opts.split(",")
    unknown = [o for o in opts if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or ("resnet18" if args.quick else "resnet50")
    rounds = args.rounds or (3 if args.quick else 20)
    load_before, t0 = loadavg(), time.perf_counter()
    rows = run(model, rounds, warmup=2, opts=opts, compile_=not args.no_compile, device=args.device)
    text = report(rows, model, rounds, 2, load_before, time.perf_counter() - t0)
    print()
    print(text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    malloc = "tuned malloc" if all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()) else "default malloc"
    title = f"Optimizer step, {model} ({platform.machine()}, {torch.get_num_threads()} threads, {malloc})"
    plot(rows, args.out, title, OPTIMIZERS)
    print(f"\ntables: {args.results}\nplot: {args.out}")
    failed = [f"{r['optimizer']}/{r['variant']}" for r in rows if r["failed"]]
    if failed:
        raise SystemExit(f"parameters differ from the reference beyond the bound: {', '.join(failed)}")


if __name__ == "__main__":
    main()
