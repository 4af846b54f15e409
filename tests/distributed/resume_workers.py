"""The ranks of ``test_resume.py``: DDP with several buckets, trained through, or resumed in fresh processes.

``through``: trains ``STEPS`` steps and, after ``SAVE_AT`` of them, writes each
rank's checkpoint (model, optimizer, hook state) as ``examples/ddp_topk.py``
does. ``resume``: fresh processes build a fresh model (another initialisation),
DDP, optimizer and hook state, load the checkpoint and train the remaining
steps; then, as the control, once more without the saved bucket layout. Both
with DDP's default ``find_unused_parameters=False`` and with ``True`` (which
never rebuilds its buckets). ``mixed``: the first checkpoint resumed by a DDP
with ``find_unused_parameters=True``, whose several buckets all differ from
the saved ones (the hook defers several real DDP buckets). The workers only
record; the assertions live in ``test_resume.py``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from functopk.distributed import TopKHookState, topk_hook
from tests.distributed.common import record_and_exit, start_gloo
from tests.helpers import batch, small_cnn

WORLD = 2
STEPS, SAVE_AT, WARMUP, DENSITY = 8, 4, 2, 0.1
BUCKET_CAP_MB = 0.0002  # 209 bytes: small_cnn's 315 parameters fall into 3 buckets once DDP has rebuilt them
RESUME_WATCHDOG_S = 60.0


def _train(rank: int, unused: bool, steps: range, checkpoint: dict | None, out_dir: str, keep_layout: bool = True):
    """Train ``steps`` on a fresh DDP model; load ``checkpoint`` first if given. What was seen, per step."""
    torch.manual_seed(0 if checkpoint is None else 1)  # a resumed model starts from other values, then loads
    module = small_cnn()
    model = DDP(module, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TopKHookState(density=DENSITY, warmup_iters=WARMUP, model=model)
    if checkpoint is not None:
        module.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        hook_state = dict(checkpoint["hook"])
        if not keep_layout:
            hook_state["layout"] = None
        state.load_state_dict(hook_state)
    names = {id(p): n for n, p in module.named_parameters()}
    layouts: list[list[list[str]]] = []

    def recording_hook(state, bucket):  # DDP checks the parameter names (and annotations, if any)
        layouts[-1].append([names[id(p)] for p in bucket.parameters()])
        return topk_hook(state, bucket)

    model.register_comm_hook(state, recording_hook)
    trace = []
    for step in steps:
        layouts.append([])
        x, y = batch(n=8, seed=100 * step + rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        trace.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        if step + 1 == SAVE_AT and checkpoint is None:
            torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "hook": state.state_dict()},
                       os.path.join(out_dir, f"ckpt-{unused}-rank{rank}.pt"))  # fmt: skip
    final = {n: t.clone() for n, t in module.state_dict().items()}
    return {"layouts": layouts, "final": final, "hook": state.state_dict(), "trace": trace}


def resume_worker(rank: int, mode: str, store: str, out_dir: str) -> None:
    start_gloo(rank, WORLD, store, RESUME_WATCHDOG_S)
    rest = range(SAVE_AT, STEPS)

    def body(results: dict) -> None:
        for unused in (False, True):
            if mode == "through":
                results[unused, "through"] = _train(rank, unused, range(STEPS), None, out_dir)
                continue
            file = os.path.join(out_dir, f"ckpt-{unused}-rank{rank}.pt")
            # Read afresh for each run: SGD's load_state_dict keeps the momentum tensors and updates them in place.
            results[unused, "saved_layout"] = torch.load(file, weights_only=True)["hook"]["layout"]
            results[unused, "resumed"] = _train(rank, unused, rest, torch.load(file, weights_only=True), out_dir)
            results[unused, "control"] = _train(rank, unused, rest, torch.load(file, weights_only=True), out_dir,
                                                keep_layout=False)  # fmt: skip
            if not unused:
                results["mixed"] = _train(rank, True, rest, torch.load(file, weights_only=True), out_dir)

    record_and_exit(os.path.join(out_dir, f"{mode}-rank{rank}.pt"), body)
