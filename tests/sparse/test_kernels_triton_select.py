"""functopk.sparse.kernels.triton_select / triton_kernels: the Triton top-k kernel, without a GPU.

* The kernels themselves run on CPU tensors under Triton's interpreter, which must be switched on
  before ``triton`` is imported: ``tests/sparse/triton_interpreted.py`` runs in its own pytest
  process, and the test here checks that all of it ran and passed.
* Every kernel compiles for an H100/H200 (``sm_90``) with the Triton here, no GPU needed: Triton's
  own compiler and ``ptxas`` turn the launches :func:`~triton_select.launches` would make into cubins.
* The host side (the routing rules and their errors, the buffer sizes) runs as is; where the leaves
  are read from is ``tests/sparse/test_kernels_triton_layout.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functopk as ft
from functopk._compat import too_old_for
from functopk.sparse.kernels import triton_layout, triton_scatter, triton_select

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not triton_select.available(), reason="triton is not installed")


@needs_triton
def test_interpreted_kernels_all_run_and_pass():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    # a torch too old to compile functopk runs all but the one compile case, which it deselects
    old = too_old_for("torch.compile of functopk code") is not None
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "tests/sparse/triton_interpreted.py", "tests/sparse/triton_scatter_interpreted.py",
         *(["-m", "not compile"] if old else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    expected = r"\d+ passed, 1 deselected in .*" if old else r"\d+ passed in .*"
    assert re.fullmatch(expected, summary), summary  # nothing skipped or xfailed
    assert int(summary.split()[0]) >= (24 if old else 25), summary


def test_serves_cuda_leaves_by_default_and_cpu_leaves_only_when_forced():
    cpu = [torch.ones(3)]
    assert not triton_select.serves(cpu, 3, "auto")  # CPU tensors keep the CPU kernels
    assert not triton_select.serves(cpu, 3, "aten")
    meta = [torch.ones(3, device="meta")]
    assert not triton_select.serves(meta, 3, "auto")
    if triton_select.available() and not triton_select.interpreting():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            triton_select.serves(cpu, 3, "triton")
        with pytest.raises(ValueError, match="got meta tensors"):
            triton_select.serves(meta, 3, "triton")


@needs_triton
def test_forcing_triton_on_cpu_tensors_without_the_interpreter_says_why():
    config = ft.sparse.KernelConfig(backend="triton")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors, or on CPU tensors under"):
        ft.topk_sparsify({"w": torch.ones(4)}, 2, config=config)


def test_capacity_grows_with_k_and_the_margin():
    n = 1_000_000
    caps = [triton_select.capacity(n, k) for k in (1, 1000, 10_000, 100_000)]
    assert caps == sorted(caps) and caps[-1] > 100_000 and caps[0] == ft.sparse.KernelConfig().abandon_min
    tight = ft.sparse.KernelConfig(abandon_min=0, triton_room=1.0, margin=0.0)
    assert triton_select.capacity(n, 1000, tight) < triton_select.capacity(n, 1000)
    assert triton_select.capacity(100, 5) == 100  # at most the tree


_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8"}


def _compile_for_sm90(kernel, args, meta):
    """Compile one launch (``kernel[grid](*args, **meta)``) for an sm_90 GPU with Triton's compiler."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants = {}, {}
    for name, value in zip(kernel.arg_names, args):
        if value is None:
            signature[name], constants[name] = "constexpr", None
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    for name, value in meta.items():
        if name != "num_warps":
            signature[name], constants[name] = "constexpr", value
    options = {"num_warps": meta.get("num_warps", 4)}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)


@needs_triton
@pytest.mark.skipif(triton_select.interpreting(), reason="compiles kernels: not under the interpreter")
def test_every_kernel_compiles_for_an_sm90_gpu():
    """Codegen problems show here, before a GPU is at hand (tile shapes, dtypes, pointer casts, atomics)."""
    cases = [
        ([torch.zeros(5000), torch.zeros(70, dtype=torch.float16), torch.zeros(9, dtype=torch.bfloat16),
          torch.zeros(8, 4, 3, 3).to(memory_format=torch.channels_last)], 100, "indices"),
        ([torch.zeros(4000, dtype=torch.bfloat16)], torch.tensor(7), "dense"),
        ([torch.zeros(300, dtype=torch.float64), torch.zeros(30)], 3, "masks"),
    ]
    for leaves, k, output in cases:
        p = triton_layout.plan(leaves)
        steps, _, _ = triton_select.launches(p, k, output, triton_select.capacity(p.n, 100))
        seen = set()
        for kernel, _, args, meta in steps:
            if kernel.fn.__name__ not in seen:  # the radix passes differ only in a runtime argument
                seen.add(kernel.fn.__name__)
                assert _compile_for_sm90(kernel, args, meta).asm["cubin"]
        assert len(seen) == 5
    table = triton_layout.plan(cases[0][0])
    for dtypes in ({torch.float32}, {torch.float32, torch.float16, torch.bfloat16, torch.float64}):
        kernel, _, args, meta = triton_scatter.launch(table, torch.zeros(9, dtype=torch.int64), torch.zeros(9), dtypes)
        assert _compile_for_sm90(kernel, args, meta).asm["cubin"]


@needs_triton
def test_the_sparse_apply_refuses_a_forced_triton_on_cpu_tensors_without_the_interpreter():
    sparse = ft.topk_indices({"w": torch.ones(4)}, 2)
    with pytest.raises(TypeError, match="config must be a functopk.sparse.KernelConfig or None, got str"):
        ft.apply_sparse_updates_({"w": torch.ones(4)}, sparse, config="triton")
    if not triton_select.interpreting():
        with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors, or on CPU tensors under"):
            ft.apply_sparse_updates_({"w": torch.ones(4)}, sparse, config=ft.sparse.KernelConfig(backend="triton"))
