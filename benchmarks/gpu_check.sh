#!/usr/bin/env bash
# The GPU check of issues 12 and 14: one command, under 10 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh            # uses $PY (default: .venv/bin/python if present, else python3)
#
# 1. the CUDA tests (pytest -m "cuda and not slow": every device-parametrised test's CUDA case,
#    and tests/sparse/test_cuda.py, which fails on any host synchronisation in the default path);
# 2. benchmarks/device_topk.py: ft.topk_indices / topk_sparsify against torch.topk on the GPU
#    (resnet50 tree and a 100M-coordinate tree, k = 1000 and 1%);
# 3. benchmarks/optim.py --device cuda: optimizer steps against torch.optim (resnet50 tree);
# 4. benchmarks/compiled_step.py --device cuda --tables 1: eager and compiled resnet18 steps;
# 5. examples/ddp_topk.py on one GPU (a 1-rank NCCL group, issue 14): straight through, and killed after
#    step 30 and resumed by torchrun from its checkpoint; the two parameter hashes must agree;
# 6. the same for examples/fsdp_topk.py (FSDP2 with fsdp_topk, a DCP checkpoint) on a 1-rank NCCL group.
# Tables and logs go to benchmarks/results/gpu/ (or $OUT_DIR). Each part has its own time limit,
# and a failing part does not stop the others; the exit status is that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-benchmarks/results/gpu}
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
start=$(date +%s)
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

timeout 200 $PY -m pytest -q -p no:cacheprovider -m "cuda and not slow" -ra tests > "$OUT/tests.txt" 2>&1
tests_rc=$?
tail -5 "$OUT/tests.txt"

timeout 90 $PY benchmarks/device_topk.py --device cuda --rounds 15 --out "$OUT/topk.md" > "$OUT/topk.log" 2>&1 \
    || echo "device_topk.py failed or timed out (see $OUT/topk.log)"
timeout 80 $PY benchmarks/optim.py --device cuda --rounds 20 --no-compile --opts sgd-momentum,adam,adamw --out "$OUT/optim.png" \
    > "$OUT/optim.md" 2>&1 || echo "optim.py failed or timed out (see $OUT/optim.md)"
timeout 120 $PY benchmarks/compiled_step.py --device cuda --tables 1 --rounds 10 --out "$OUT/compiled_step.md" \
    > "$OUT/compiled_step.log" 2>&1 || echo "compiled_step.py failed or timed out (see $OUT/compiled_step.log)"

ckpt=$(mktemp -d)
for example in ddp fsdp; do
    for run in whole crashed; do
        extra=""; [ "$run" = crashed ] && extra="--crash-at-step 30"
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 timeout 45 $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
            --max-restarts 1 "examples/${example}_topk.py" --epochs 2 --checkpoint-dir "$ckpt/$example-$run" \
            --checkpoint-every 10 $extra > "$OUT/${example}_nccl_$run.txt" 2>&1 \
            || echo "${example}_topk.py ($run) failed or timed out (see $OUT/${example}_nccl_$run.txt)"
    done
done
rm -rf "$ckpt"
grep -H "ranks (\|resumed\|crashing\|sha256" "$OUT"/ddp_nccl_*.txt "$OUT"/fsdp_nccl_*.txt

echo "gpu_check: $(( $(date +%s) - start )) s; tests exit status $tests_rc; results in $OUT/"
cat "$OUT"/*.md 2>/dev/null
exit $tests_rc
