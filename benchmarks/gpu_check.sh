#!/usr/bin/env bash
# The GPU check: one command, within a time budget on one GPU.
#
#   bash benchmarks/gpu_check.sh        # $PY (default: .venv/bin/python if present, else python3),
#                                       # $BUDGET seconds in all (default 540), $OUT_DIR for the results,
#                                       # $PARTS: which parts (default "triton capture tests topk optim
#                                       # whole_step compiled examples profile")
#
# functopk is imported from this checkout (PYTHONPATH), so no install is needed: the GPU image's own
# torch and Triton are used whatever pyproject.toml pins.
#
# Parts, most important first; each has its own time limit, cut to what is left of the budget (a part
# that would get less than 10 s is skipped), and a failing part does not stop the others. Without a
# CUDA device (a dry run of the script) the test parts collect their tests and skip them, and every
# other part says it is skipped:
# 0. triton: the Triton top-k kernel's CUDA tests (tests/sparse/test_kernels_triton_cuda.py: the CPU
#    kernel's selection bit for bit, bf16 and mixed trees, determinism, no host synchronisation,
#    torch.compile, CUDA graph capture) and tests/sparse/test_cuda.py (no host synchronisation in the
#    default path);
# 1. capture: the whole training step in a CUDA graph (tests/test_capture.py: replays against eager steps
#    bit for bit, reduce-overhead) and docs/gpu.md's recipe run as written (tests/test_docs.py);
# 2. tests: the other CUDA tests (pytest -m "cuda and not slow": every device-parametrised test's CUDA
#    case), over several pytest-xdist workers when the plugin is installed;
# 3. topk: benchmarks/device_topk.py: ft.topk_indices (ATen and Triton) / topk_sparsify against torch.topk
#    on the GPU (the resnet50 tree flat, channels_last and 99.9% zeros, and a 100M-coordinate tree,
#    k = 1000 and 1%), and the bandwidth reached;
# 4. optim: benchmarks/optim.py --device cuda: optimizer steps against torch.optim (resnet50 tree);
# 5. whole_step: benchmarks/whole_step.py: ResNet-50 training steps (batch 128, bf16), the top-k step
#    against the dense one, eager (torch.optim loop) and captured in a CUDA graph (functional step);
# 6. compiled: benchmarks/compiled_step.py --device cuda --tables 1: eager and compiled resnet18 steps;
# 7. examples: examples/ddp_topk.py on one GPU (a 1-rank NCCL group, --deterministic): straight through,
#    and killed after step 30 and resumed by torchrun from its checkpoint; the two parameter hashes must
#    agree; the same for examples/fsdp_topk.py (FSDP2 with fsdp_topk, a DCP checkpoint);
# 8. profile: benchmarks/device_profile.py: kernels launched and device-busy time per top-k call and
#    optimizer step, and what a fresh tensor costs the host (a foreach multiply into new tensors against
#    the same in place).
# Time: the parts' own limits add up to more than BUDGET; what is left when the budget runs out is
# skipped, naming it. With the machine's start (a few minutes) the default BUDGET of 540 s keeps a
# 15-minute lease with room for one short rerun.
# Tables and logs go to benchmarks/results/gpu/ (or $OUT_DIR). The exit status is that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-benchmarks/results/gpu}
BUDGET=${BUDGET:-540}
PARTS=${PARTS:-triton capture tests topk optim whole_step compiled examples profile}
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
    if [ "$secs" -lt 10 ]; then
        echo "$name: skipped, the budget ($BUDGET s) is spent" | tee "$log"
        return 0
    fi
    local t0; t0=$(date +%s)
    timeout -k 10 "$secs" "$@" > "$log" 2>&1  # (-k: killed outright 10 s after a TERM it ignored)
    local rc=$?
    echo "[$(( $(date +%s) - start )) s] $name: exit $rc after $(( $(date +%s) - t0 )) s (limit $secs s; log $log)"
    return $rc
}
bench() {  # bench NAME LOG SECONDS COMMAND...: a part that needs a GPU (the tests skip themselves without one)
    if [ "$cuda" -ne 1 ]; then
        echo "$1: skipped, no CUDA device" | tee "$2"
        return 0
    fi
    part "$@"
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
cuda=0
$PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null && cuda=1

tests_rc=0
triton_tests="tests/sparse/test_kernels_triton_cuda.py tests/sparse/test_cuda.py"
capture_tests="tests/test_capture.py tests/test_docs.py"
if want triton; then
    # shellcheck disable=SC2086
    part triton_tests "$OUT/triton_tests.txt" 240 $PY -m pytest -q -p no:cacheprovider -m cuda -ra $triton_tests
    tests_rc=$?
    tail -15 "$OUT/triton_tests.txt"
fi
if want capture; then
    # shellcheck disable=SC2086
    part capture_tests "$OUT/capture_tests.txt" 180 $PY -m pytest -q -p no:cacheprovider -m cuda -ra $capture_tests
    rc=$?
    [ "$tests_rc" -ne 0 ] || tests_rc=$rc
    tail -15 "$OUT/capture_tests.txt"
fi
if want tests; then
    workers=""
    if $PY -c "import xdist" 2>/dev/null; then workers="-n 6"; fi
    # shellcheck disable=SC2086
    part tests "$OUT/tests.txt" 240 $PY -m pytest -q -p no:cacheprovider -m "cuda and not slow" -ra $workers \
        --continue-on-collection-errors $(printf -- "--ignore=%s " $triton_tests $capture_tests) tests
    rc=$?
    [ "$tests_rc" -ne 0 ] || tests_rc=$rc
    tail -15 "$OUT/tests.txt"
fi

want topk && bench device_topk "$OUT/topk.log" 150 $PY benchmarks/device_topk.py --device cuda --rounds 15 \
    --out "$OUT/topk.md"
want optim && bench optim "$OUT/optim.md" 80 $PY benchmarks/optim.py --device cuda --rounds 20 --no-compile \
    --opts sgd-momentum,adam,adamw --out "$OUT/optim.png"
want whole_step && bench whole_step "$OUT/whole_step.log" 150 $PY benchmarks/whole_step.py --device cuda \
    --rounds 10 --steps 5 --out "$OUT/whole_step.md"
# torch.compile of functopk's steps needs the torch functopk/_compat.py names (2.10)
if ! want compiled; then
    :
elif too_old=$($PY -c "from functopk._compat import COMPILE_TOO_OLD as t; print(t or '')") && [ -z "$too_old" ]; then
    bench compiled_step "$OUT/compiled_step.log" 120 $PY benchmarks/compiled_step.py --device cuda --tables 1 \
        --rounds 10 --out "$OUT/compiled_step.md"
else
    echo "compiled_step: skipped, ${too_old:-functopk does not import}" | tee "$OUT/compiled_step.log"
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
ckpt=$(mktemp -d)
want examples && for example in ddp fsdp; do
    for run in whole crashed; do
        extra=""; [ "$run" = crashed ] && extra="--crash-at-step 30"
        # shellcheck disable=SC2086
        bench "${example}_topk.py $run" "$OUT/${example}_nccl_$run.txt" 45 \
            $PY -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts 1 \
            "examples/${example}_topk.py" --epochs 2 --checkpoint-dir "$ckpt/$example-$run" \
            --checkpoint-every 10 --deterministic $extra
    done
done
rm -rf "$ckpt"
want examples && grep -H "ranks (\|resumed\|crashing\|sha256\|UserWarning" "$OUT"/ddp_nccl_*.txt "$OUT"/fsdp_nccl_*.txt
want profile && bench device_profile "$OUT/profile.log" 120 $PY benchmarks/device_profile.py --device cuda \
    --out "$OUT/profile.md"

echo "gpu_check: $(( $(date +%s) - start )) s; tests exit status $tests_rc; results in $OUT/"
cat "$OUT"/*.md 2>/dev/null | grep -v '^$' | head -150
exit $tests_rc
