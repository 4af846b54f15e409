#!/usr/bin/env bash
# The GPU check: one command, within a time budget on one GPU.
#
#   bash benchmarks/gpu_check.sh        # $PY (default: .venv/bin/python if present, else python3),
#                                       # $BUDGET seconds in all (default 540), $OUT_DIR for the results,
#                                       # $PARTS: which parts (default "triton tests topk optim compiled
#                                       # examples profile")
#
# functopk is imported from this checkout (PYTHONPATH), so no install is needed: the GPU image's own
# torch and Triton are used whatever pyproject.toml pins.
#
# Parts, most important first; each has its own time limit, cut to what is left of the budget,
# and a failing part does not stop the others:
# 0. the Triton top-k kernel's CUDA tests (tests/sparse/test_kernels_triton_cuda.py: the CPU kernel's
#    selection bit for bit, bf16 and mixed trees, determinism, no host synchronisation, torch.compile,
#    CUDA graph capture) and tests/sparse/test_cuda.py (no host synchronisation in the default path);
# 1. the other CUDA tests (pytest -m "cuda and not slow": every device-parametrised test's CUDA case),
#    over several pytest-xdist workers when the plugin is installed;
# 2. benchmarks/device_topk.py: ft.topk_indices (ATen and Triton) / topk_sparsify against torch.topk on
#    the GPU (resnet50 tree and a 100M-coordinate tree, k = 1000 and 1%), and the bandwidth reached;
# 3. benchmarks/optim.py --device cuda: optimizer steps against torch.optim (resnet50 tree);
# 4. benchmarks/compiled_step.py --device cuda --tables 1: eager and compiled resnet18 steps;
# 5. examples/ddp_topk.py on one GPU (a 1-rank NCCL group, --deterministic): straight through, and
#    killed after step 30 and resumed by torchrun from its checkpoint; the two parameter hashes must agree;
# 6. the same for examples/fsdp_topk.py (FSDP2 with fsdp_topk, a DCP checkpoint);
# 7. benchmarks/device_profile.py: kernels launched and device-busy time per top-k call and optimizer step.
# Tables and logs go to benchmarks/results/gpu/ (or $OUT_DIR). The exit status is that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-benchmarks/results/gpu}
BUDGET=${BUDGET:-540}
PARTS=${PARTS:-triton tests topk optim compiled examples profile}
want() { [[ " $PARTS " == *" $1 "* ]]; }
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# fewer hypothesis examples per CUDA test: each one launches kernels, and the CPU run draws the full 100
export FUNCTOPK_HYPOTHESIS_EXAMPLES=${FUNCTOPK_HYPOTHESIS_EXAMPLES:-25}
mkdir -p "$OUT"
start=$(date +%s)

# limit SECONDS: SECONDS, or what is left of the budget less a 5 s margin if that is smaller
limit() {
    local left=$(( BUDGET - ($(date +%s) - start) - 5 ))
    if [ "$left" -lt "$1" ]; then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi
}
part() {  # part NAME LOG SECONDS COMMAND...: run COMMAND with its output in LOG, say how it went
    local name=$1 log=$2 secs; secs=$(limit "$3"); shift 3
    local t0; t0=$(date +%s)
    timeout "$secs" "$@" > "$log" 2>&1
    local rc=$?
    echo "[$(( $(date +%s) - start )) s] $name: exit $rc after $(( $(date +%s) - t0 )) s (limit $secs s; log $log)"
    return $rc
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    $PY -c "import torch, optree; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available(), 'optree', optree.__version__)"
    $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    nproc
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

tests_rc=0
triton_tests="tests/sparse/test_kernels_triton_cuda.py tests/sparse/test_cuda.py"
if want triton; then
    # shellcheck disable=SC2086
    part triton_tests "$OUT/triton_tests.txt" 240 $PY -m pytest -q -p no:cacheprovider -m cuda -ra $triton_tests
    tests_rc=$?
    tail -15 "$OUT/triton_tests.txt"
fi
if want tests; then
    workers=""
    if $PY -c "import xdist" 2>/dev/null; then workers="-n 6"; fi
    # shellcheck disable=SC2086
    part tests "$OUT/tests.txt" 240 $PY -m pytest -q -p no:cacheprovider -m "cuda and not slow" -ra $workers \
        --continue-on-collection-errors $(printf -- "--ignore=%s " $triton_tests) tests
    rc=$?
    [ "$tests_rc" -ne 0 ] || tests_rc=$rc
    tail -15 "$OUT/tests.txt"
fi

want topk && part device_topk "$OUT/topk.log" 150 $PY benchmarks/device_topk.py --device cuda --rounds 15 \
    --out "$OUT/topk.md"
want optim && part optim "$OUT/optim.md" 80 $PY benchmarks/optim.py --device cuda --rounds 20 --no-compile \
    --opts sgd-momentum,adam,adamw --out "$OUT/optim.png"
# torch.compile of functopk's steps needs torch >= 2.13 (older dynamo cannot trace optree's treedef comparisons)
if ! want compiled; then
    :
elif $PY -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 13))"; then
    part compiled_step "$OUT/compiled_step.log" 120 $PY benchmarks/compiled_step.py --device cuda --tables 1 \
        --rounds 10 --out "$OUT/compiled_step.md"
else
    echo "compiled_step: skipped, torch.compile of functopk's steps needs torch >= 2.13" | tee "$OUT/compiled_step.log"
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
ckpt=$(mktemp -d)
want examples && for example in ddp fsdp; do
    for run in whole crashed; do
        extra=""; [ "$run" = crashed ] && extra="--crash-at-step 30"
        # shellcheck disable=SC2086
        part "${example}_topk.py $run" "$OUT/${example}_nccl_$run.txt" 45 \
            $PY -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts 1 \
            "examples/${example}_topk.py" --epochs 2 --checkpoint-dir "$ckpt/$example-$run" \
            --checkpoint-every 10 --deterministic $extra
    done
done
rm -rf "$ckpt"
want examples && grep -H "ranks (\|resumed\|crashing\|sha256\|UserWarning" "$OUT"/ddp_nccl_*.txt "$OUT"/fsdp_nccl_*.txt
want profile && part device_profile "$OUT/profile.log" 120 $PY benchmarks/device_profile.py --device cuda \
    --out "$OUT/profile.md"

echo "gpu_check: $(( $(date +%s) - start )) s; tests exit status $tests_rc; results in $OUT/"
cat "$OUT"/*.md 2>/dev/null | grep -v '^$' | head -150
exit $tests_rc
