"""The hook's selection on real DDP-sized buckets of torchvision models: ``exact`` vs ``threshold``, same ``acc``.

Trains a torchvision model (10 classes, batches of 8 random 3x32x32 images,
SGD with momentum) on one process through :func:`topk_hook` with
``selection="threshold"`` (a world of 1 gloo rank, hand-made 25 MB buckets in
reverse parameter order, as DDP builds them), and at each bucket also runs
the exact selection on the same ``grad + residual`` (alternating which goes
first; checked equal). One thread. Prints a markdown row: per-step time of
the selections summed over buckets (median over the steps after the 4th),
and the threshold fallbacks.

    python benchmarks/hook_selection_models.py 0.01 resnet18 16
"""

import statistics as S
import sys
import time

import torch
import torch.distributed as dist
import torchvision

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # this checkout's functopk
import functopk.distributed.hook as H  # noqa: E402
from functopk.distributed import TopKHookState, topk_hook  # noqa: E402
from functopk.distributed.exchange import _local_topk  # noqa: E402
from tests.distributed.common import FakeBucket  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
name = sys.argv[2]
m = getattr(torchvision.models, name)(num_classes=10)
ps = list(m.parameters())[::-1]
buckets, cur, acc = [], [], 0
for p in ps:
    cur.append(p)
    acc += p.numel()
    if acc * 4 >= 25 * 2**20:
        buckets.append(cur)
        cur, acc = [], 0
if cur:
    buckets.append(cur)
dens = float(sys.argv[1])
st = TopKHookState(density=dens, warmup_iters=2, selection="threshold")
ex, th, fbs, calls = {}, {}, 0, []
orig = H.threshold_select
step = [0]


def wrapped(flat, k, t, **kw):
    global fbs
    if step[0] % 2:
        t0 = time.perf_counter()
        r = orig(flat, k, t, **kw)
        t1 = time.perf_counter()
        e = _local_topk(flat, k)
        t2 = time.perf_counter()
        dt_t, dt_e = t1 - t0, t2 - t1
    else:
        t0 = time.perf_counter()
        e = _local_topk(flat, k)
        t1 = time.perf_counter()
        r = orig(flat, k, t, **kw)
        t2 = time.perf_counter()
        dt_e, dt_t = t1 - t0, t2 - t1
    assert torch.equal(e[0], r[0])
    if step[0] >= 4:
        ex.setdefault(step[0], []).append(dt_e)
        th.setdefault(step[0], []).append(dt_t)
        fbs += r[3]
        calls.append(1)
    return r


H.threshold_select = wrapped
opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
for s in range(int(sys.argv[3])):
    step[0] = s
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(m(x), y).backward()
    for i, b in enumerate(buckets):
        buf = torch.cat([p.grad.reshape(-1) for p in b])
        out = topk_hook(st, FakeBucket(i, buf, b, last=i == len(buckets) - 1)).wait()
        o = 0
        for p in b:
            p.grad.copy_(out[o : o + p.numel()].view_as(p))
            o += p.numel()
    opt.step()
    opt.zero_grad()
nb = len(buckets)
E = [sum(v) for v in ex.values()]
T = [sum(v) for v in th.values()]
print(
    f"| {name} | {dens:g} | {nb} | {len(E)} | {S.median(E) * 1e3:.1f} | {S.median(T) * 1e3:.1f} | "
    f"{S.median(E) / S.median(T):.2f}x | {fbs}/{len(calls)} |"
)
