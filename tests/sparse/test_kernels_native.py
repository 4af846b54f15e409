"""functopk.sparse.kernels.native: the compiled scan finds exactly |x| > t (and NaN), and its fallback."""

from __future__ import annotations

import math
import shutil
import warnings

import pytest
import torch

from functopk.sparse import KernelConfig
from functopk.sparse.kernels import native
from functopk.sparse.kernels.base import INT_OF, round_down
from functopk.sparse.kernels.scan import Scanner

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
CPU = torch.device("cpu")
LIB = native.library()
needs_lib = pytest.mark.skipif(LIB is None, reason=f"the scan could not be built: {native.build_error}")


def brute(x: torch.Tensor, t: float) -> torch.Tensor:
    """Reference: positions of ``|x| > t`` or NaN, compared in float64."""
    return ((x.double().abs() > t) | x.isnan()).nonzero().view(-1)


def special_leaf(n: int, dtype: torch.dtype, t: float, seed: int) -> torch.Tensor:
    """Normal values with NaN, +-inf, -0.0, t itself and its neighbours sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    tt = torch.tensor(t, dtype=dtype)
    up = torch.nextafter(tt.double(), torch.tensor(math.inf, dtype=torch.float64)).to(dtype)
    specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0], dtype=dtype)
    specials = torch.cat([specials, tt.view(1), -tt.view(1), up.view(1), -up.view(1)])
    pos = torch.randint(0, n, (min(n, 3 * specials.numel()),), generator=g)
    x[pos] = specials.repeat(3)[: pos.numel()]
    return x


@needs_lib
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scan_leaf_finds_exactly_the_values_above_t(dtype, fast):
    # lengths around the 32/64-value blocks; thresholds that make nearly all, some and few values candidates
    for n in (1, 31, 63, 64, 65, 129, 3000):
        for t in (0.0, 0.5, 2.0, math.inf):
            x = special_leaf(n, dtype, t, seed=n)
            t_leaf = round_down(t, dtype, torch.float64)  # what the scanner passes: t rounded into the leaf dtype
            out = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=dtype)
            written, read = native.scan_leaf(LIB, x, native.threshold_bits(t_leaf, dtype), 7, out, fast=fast)
            expected = brute(x, t)
            assert read == n and written == expected.numel(), (n, t)
            assert torch.equal(out[0][:written], expected + 7), (n, t)
            assert torch.equal(out[1][:written].view(INT_OF[dtype]), x[expected].view(INT_OF[dtype])), (n, t)


@needs_lib
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "portable"])
def test_scan_leaf_stops_when_its_room_is_full_and_resumes(fast):
    x = special_leaf(5000, torch.float32, 1.0, seed=3)
    expected = brute(x, 1.0)
    out = torch.empty(expected.numel() + 10, dtype=torch.int64), torch.empty(expected.numel() + 10)
    used = read = 0
    calls = 0
    while read < x.numel():  # 37 at a time: every call stops at a full room, mid-block
        written, done = native.scan_leaf(LIB, x[read:], native.threshold_bits(1.0, torch.float32), read, out, used,
                                         min(37, out[0].numel() - used), fast=fast)
        assert written <= 37 and (written == 37 or done == x.numel() - read)
        used, read, calls = used + written, read + done, calls + 1
    assert calls > expected.numel() // 37
    assert torch.equal(out[0][:used], expected)
    assert torch.equal(out[1][:used].view(torch.int32), x[expected].view(torch.int32))


@needs_lib
@pytest.mark.parametrize("fraction", [0.001, 0.3])
def test_native_scanner_equals_the_aten_scanner_on_mixed_trees(fraction):
    # mixed dtypes (outputs per leaf dtype, merged), tiny and empty leaves, outputs that must grow
    g = torch.Generator().manual_seed(8)
    dtypes = [torch.float32, torch.float16, torch.float64, torch.bfloat16]
    flats = [torch.randn(s, generator=g).to(dtypes[i % 4]) for i, s in enumerate([3, 0, 5000, 70, 9000, 1, 20_000])]
    flats[4][[0, 17]] = math.nan
    for t in (0.0, 1.0006, 3.0):
        ref = Scanner(t, torch.float64, CPU, fraction, KernelConfig(native=False)).run(flats)
        got = Scanner(t, torch.float64, CPU, fraction).run(flats)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1].view(torch.int64), ref[1].view(torch.int64)), t


@pytest.fixture()
def first_use(monkeypatch):
    """:func:`native.library` as at its first call in a process (its result is cached), cached again afterwards."""
    native.library.cache_clear()
    monkeypatch.setattr(native, "build_error", native.build_error)  # restored after the test
    yield
    native.library.cache_clear()  # the next call builds or loads with the test's settings undone


def test_without_a_compiler_the_aten_scan_runs_and_a_warning_says_why_once(monkeypatch, tmp_path, first_use):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path))
    flats = [special_leaf(3000, torch.float32, 1.0, seed=1)]
    with pytest.warns(UserWarning, match="compiled top-k scan is unavailable .*no-such-compiler.*FUNCTOPK_NATIVE=0") \
            as record:
        assert native.library() is None
        idx, vals = Scanner(1.0, torch.float32, CPU, 0.3).run(flats)  # asks for the library again
        assert native.library() is None
    assert len(record) == 1
    assert "no-such-compiler" in str(native.build_error)
    assert torch.equal(idx, brute(flats[0], 1.0))
    assert torch.equal(vals.view(torch.int32), flats[0][idx].view(torch.int32))


def test_the_environment_variable_turns_the_compiled_scan_off(monkeypatch, tmp_path, first_use):
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUNCTOPK_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen, so no warning
        assert native.library() is None
    assert native.build_error == "turned off by FUNCTOPK_NATIVE='0'"
    assert not (tmp_path / "cache").exists()  # nothing was built
    native.library.cache_clear()
    monkeypatch.setenv("FUNCTOPK_NATIVE", "maybe")
    with pytest.raises(ValueError, match="FUNCTOPK_NATIVE='maybe': expected 0 .* or 1"):
        native.library()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_scan_builds_without_warnings_in_an_empty_cache_with_a_compiler_given_with_arguments(
        monkeypatch, tmp_path, first_use):
    # -Werror: any warning of -Wall -Wextra fails the build; CC with arguments used to mean "no compiler"
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -Werror")
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = native.library()
    assert lib is not None, native.build_error
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".sha256", ".so"]  # no leftover build files
    x = special_leaf(1000, torch.float32, 1.0, seed=2)
    out = torch.empty(1000, dtype=torch.int64), torch.empty(1000)
    written, _ = native.scan_leaf(lib, x, native.threshold_bits(1.0, torch.float32), 0, out)
    assert torch.equal(out[0][:written], brute(x, 1.0))


@needs_lib
def test_a_cache_folder_others_can_write_gives_a_private_build_and_a_warning(monkeypatch, tmp_path, first_use):
    # the folder's rules are tested in test_kernels_libcache.py; here: what a user of the scan sees
    tmp_path.chmod(0o777)
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match=f"{tmp_path} is writable by group or others .*chmod 700 .*each process "
                      "compiles the top-k scan again") as record:
        lib = native.library()
        assert native.library() is lib
    assert len(record) == 1 and lib is not None and native.has_fast(lib) in (True, False)
    assert list(tmp_path.iterdir()) == []


@needs_lib
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scan_leaf_with_an_upper_bound_keeps_t_below_abs_at_most_h(dtype, fast):
    x = special_leaf(3000, dtype, 1.0, seed=4)
    for t, h in [(0.0, 1.0), (0.5, 2.0), (1.0, 1.0), (2.0, math.inf)]:
        out = torch.empty(3000, dtype=torch.int64), torch.empty(3000, dtype=dtype)
        written, _ = native.scan_leaf(LIB, x, native.threshold_bits(t, dtype), 0, out,
                                      upper_bits=native.threshold_bits(h, dtype), fast=fast)
        a = x.double().abs()
        expected = ((a > t) & (a <= h)).nonzero().view(-1)  # NaN lies above every bound, +inf included
        assert torch.equal(out[0][:written], expected), (t, h)
