"""ParamGroupOptimizer's sparsify: the kept-buffer road of a constant exact top-k against the pure one.

The reference is the same optimizer with ``ft.chain(ft.topk(...), ft.identity())`` as ``sparsify``: a chain
whose last part has no in-place form runs purely, so its top-k builds the dense tree as ``ft.topk`` does; and,
independently, ``torch.optim`` in float64 on gradients top-k'd by brute force (``torch.topk`` of the
concatenated magnitudes).
"""

from __future__ import annotations

import copy

import pytest
import torch

import functopk as ft
from functopk.adapter.sparsify import Sparsify, unshared
from functopk.compress.topk import KeptBuffer
from functopk.inplace import stage_of
from functopk.sparse.selection import Indices
from tests.helpers import OpsSeen

SHAPES = [(4, 3), (3,), (2, 2, 2), (5,)]  # 28 coordinates
CLASSES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Rprop, {"lr": 0.01}),  # pure maths (no in-place step)
]


def _params(dtype: torch.dtype = torch.float32, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _pure(sparsify: ft.GradientTransformation) -> ft.GradientTransformation:
    """``sparsify`` on the pure road: a chain whose last part has no in-place form (a copy: its own buffer)."""
    return ft.chain(copy.deepcopy(sparsify), ft.identity())


def _buffer(tx: ft.GradientTransformation) -> torch.Tensor | None:
    """The buffer a top-k keeps (``None`` before its in-place form first ran)."""
    stage = stage_of(tx)
    assert isinstance(stage, KeptBuffer)
    return stage.buffer


def _pair(cls: type, kwargs: dict, sparsify: ft.GradientTransformation, groups=None, dtype=torch.float32):
    """The same optimizer twice: ``sparsify`` (the buffer) and :func:`_pure` (the pure road)."""
    out = []
    for tx in (sparsify, _pure(sparsify)):
        params = _params(dtype)
        given = params if groups is None else groups(params)
        out.append((params, ft.optimizer_from_torch(cls, given, sparsify=tx, **kwargs)))
    return out


def _run(pairs, steps: int = 3, drop=lambda step: ()) -> None:
    for step in range(steps):
        for params, opt in pairs:
            for i, (p, g) in enumerate(zip(params, _grads(params, step))):
                p.grad = None if i in drop(step) else g
            opt.step()


def _assert_same(pairs) -> None:
    (pa, oa), (pb, ob) = pairs
    for a, b in zip(pa, pb):
        assert torch.equal(a, b), "parameters differ"
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].keys() == sb[key].keys()
        for name in sa[key]:
            assert torch.equal(sa[key][name], sb[key][name]), (key, name)


def test_only_a_constant_exact_topk_keeps_a_buffer():
    for constant in (ft.topk(3), ft.topk(density=0.25), ft.topk(k=2, method="exact")):
        assert isinstance(stage_of(constant), KeptBuffer)
    for other in [ft.topk(lambda c: 1 + c), ft.topk(density=lambda c: 0.1), ft.topk(3, method="torch"),
                  ft.topk(torch.tensor(3)), ft.topk(density=torch.tensor(0.1)), ft.randk(3),
                  ft.identity()]:  # fmt: skip
        assert not isinstance(stage_of(other), KeptBuffer), other


@pytest.mark.parametrize("cls,kwargs", CLASSES, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("sparsify", [ft.topk(5), ft.topk(density=0.3)], ids=["k", "density"])
def test_bit_identical_to_the_generic_road(cls, kwargs, sparsify):
    pairs = _pair(cls, kwargs, sparsify)
    _run(pairs)
    assert _buffer(pairs[0][1].sparsify) is not None  # the buffer served the steps
    assert _buffer(pairs[1][1].sparsify.recipe[1][0]) is None  # (the chain's recipe: its parts)
    _assert_same(pairs)


def test_float64_and_param_groups_with_their_own_hyperparameters():
    def groups(ps):
        return [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "momentum": 0.0}]

    pairs = _pair(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ft.topk(7), groups, torch.float64)
    _run(pairs, steps=4)
    _assert_same(pairs)
    assert _buffer(pairs[0][1].sparsify).dtype == torch.float64


def test_params_without_grads_and_a_changing_set_of_params_with_grads():
    pairs = _pair(torch.optim.AdamW, {"lr": 0.01}, ft.topk(4))
    _run(pairs, steps=5, drop=lambda step: [(0,), (1, 3), (), (0, 1, 2), (2,)][step])
    _assert_same(pairs)


def test_state_dict_round_trip_resumes_bit_for_bit():
    pairs = _pair(torch.optim.AdamW, {"lr": 0.01}, ft.topk(5))
    _run(pairs, steps=2)
    params, opt = pairs[0]
    saved = opt.state_dict()
    fresh = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify=ft.topk(5), lr=0.01)
    fresh.load_state_dict(saved)
    _run([(params, fresh), pairs[1]], steps=2)
    _assert_same([(params, fresh), pairs[1]])
    # loading into an optimizer whose buffer holds an older step: the next step is the generic one's
    other = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify=ft.topk(5), lr=0.01)
    _run([(params, other)], steps=1)
    other.load_state_dict(pairs[1][1].state_dict())
    with torch.no_grad():
        for a, b in zip(params, pairs[1][0]):
            a.copy_(b)
    _run([(params, other), pairs[1]], steps=1)
    _assert_same([(params, other), pairs[1]])


def test_against_torch_optim_in_float64_on_brute_force_topk_grads():
    params = _params(torch.float64)
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=ft.topk(6), lr=0.1, momentum=0.9)
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for step in range(3):
        grads = _grads(params, step)
        flat = torch.cat([g.reshape(-1) for g in grads])
        kept = torch.zeros_like(flat)
        idx = flat.abs().topk(6).indices
        kept[idx] = flat[idx]
        for p, r, g, piece in zip(params, ref, grads, kept.split([g.numel() for g in grads])):
            p.grad, r.grad = g, piece.view(g.shape)
        opt.step()
        torch_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-12)


def test_the_buffer_is_reused_and_p_grad_is_left_alone(monkeypatch):
    params = _params()
    opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=ft.topk(3), lr=0.1)
    _run([(params, opt)], steps=1)
    ptr = _buffer(opt.sparsify).data_ptr()

    def no_dense_tree(self, leaves):
        raise AssertionError("a dense tree was built")

    monkeypatch.setattr(Indices, "dense", no_dense_tree)
    for step in range(1, 4):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        assert _buffer(opt.sparsify).data_ptr() == ptr
        assert int((_buffer(opt.sparsify) != 0).sum()) == 3  # the last step's values only: the others re-zeroed
        for p, g in zip(params, grads):
            assert torch.equal(p.grad, g)


def test_the_buffer_holds_exactly_the_last_top_k():
    sp = Sparsify(ft.topk(2))
    ps = [torch.zeros(3), torch.zeros(2)]
    first, sparse = sp.step({}, [ps], [[torch.tensor([5.0, 0.0, 1.0]), torch.tensor([-6.0, 2.0])]], {})
    assert sparse and [x.tolist() for x in first[0]] == [[5.0, 0.0, 0.0], [-6.0, 0.0]]
    out, _ = sp.step({}, [ps[:1], ps[1:]], [[torch.tensor([0.0, 3.0, 1.0])], [torch.tensor([0.5, -4.0])]], {})
    assert [x.tolist() for gs in out for x in gs] == [[0.0, 3.0, 0.0], [0.0, -4.0]]


def test_a_smaller_set_of_grads_uses_a_prefix_of_the_buffer():
    sp = Sparsify(ft.topk(1))
    ps = [torch.zeros(3), torch.zeros(2)]
    sp.step({}, [ps], [[torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.0, 9.0])]], {})
    out, _ = sp.step({}, [ps[:1]], [[torch.tensor([1.0, -2.0, 0.0])]], {})  # index 4 was set: re-zeroed
    assert out[0][0].tolist() == [0.0, -2.0, 0.0] and _buffer(sp.tx).tolist() == [0.0, -2.0, 0.0, 0.0, 0.0]


def test_unshared_copies_only_tensors_living_in_the_buffer():
    sp = Sparsify(ft.topk(1))
    out, _ = sp.step({}, [[torch.zeros(2)]], [[torch.tensor([1.0, 2.0])]], {})
    other, kept = torch.ones(2), {_buffer(sp.tx).untyped_storage().data_ptr()}
    entries = unshared([{"prev": out[0][0], "other": other}], kept)
    assert entries[0]["other"] is other
    assert entries[0]["prev"].untyped_storage().data_ptr() not in kept
    assert entries[0]["prev"].tolist() == [0.0, 2.0]


@pytest.mark.parametrize(
    "sparsify", [ft.topk(lambda c: 3), ft.topk(3, method="torch"), ft.topk(density=lambda c: 0.2)],
    ids=["k schedule", "torch method", "density schedule"],
)
def test_other_sparsifiers_take_the_pure_road(sparsify):
    params = _params()
    opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=sparsify, lr=0.1, momentum=0.9)
    _run([(params, opt)], steps=2)
    assert not isinstance(stage_of(sparsify), KeptBuffer)


def test_mixed_dtypes_take_the_pure_road_with_the_same_result():
    pairs = []
    for tx in (ft.topk(4), _pure(ft.topk(4))):
        params = _params()
        params[1] = params[1].detach().double().requires_grad_()
        pairs.append((params, ft.optimizer_from_torch(torch.optim.Adam, params, sparsify=tx, lr=0.01)))
    _run(pairs)
    assert _buffer(pairs[0][1].sparsify) is None
    _assert_same(pairs)


def test_complex_params_step_through_their_real_pairs_with_the_same_result():
    pairs = []
    for tx in (ft.topk(3), _pure(ft.topk(3))):
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(3, generator=gen, dtype=torch.complex64).requires_grad_(), _params()[0]]
        opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=tx, lr=0.1, momentum=0.9)
        for step in range(2):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
            opt.step()
        pairs.append((params, opt))
    assert _buffer(pairs[0][1].sparsify) is not None  # (their real pairs, float32 like the rest)
    _assert_same(pairs)


def test_k_larger_than_the_tree_raises_as_the_generic_road_does():
    messages = []
    for tx in (ft.topk(5), _pure(ft.topk(5))):
        params = _params(shapes=[(2,), (2,)])
        opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=tx, lr=0.1)
        for p in params:
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match="k") as err:
            opt.step()
        messages.append(str(err.value))
        assert all(torch.equal(p, q) for p, q in zip(params, _params(shapes=[(2,), (2,)])))
    assert messages[0] == messages[1]


def test_adam_floors_nu_before_sqrt_only_behind_a_constant_topk():
    floored = []
    for sparsify in (ft.topk(5), _pure(ft.topk(5)), None):
        params = _params()
        opt = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify=sparsify, lr=0.01)
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        with OpsSeen() as seen:
            opt.step()
        floored.append("_foreach_clamp_min" in seen.names)
    assert floored == [True, False, False]  # (the bits are the same: test_bit_identical_to_the_generic_road)


# --------------------------------------------------------------------------- sparsify_on="update": what moves

ON_UPDATE = [
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),  # (CPU: the slice-by-slice step returns its updates)
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.Rprop, {"lr": 0.01}),  # pure maths
]


def _changed(params: list[torch.Tensor], before: list[torch.Tensor]) -> int:
    return sum(int((p != b).sum()) for p, b in zip(params, before))


@pytest.mark.parametrize("cls,kwargs", ON_UPDATE, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("sparsify", [ft.topk(5), _pure(ft.topk(5))], ids=["buffer", "pure"])
def test_sparsify_on_update_moves_exactly_k_parameters(cls, kwargs, sparsify):
    params = _params()
    opt = ft.optimizer_from_torch(cls, params, sparsify=sparsify, sparsify_on="update", **kwargs)
    for step in range(5):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
        assert _changed(params, before) == 5, step
    if cls is torch.optim.Rprop:  # (it moves where the gradient is not zero: k parameters on the gradient too)
        return
    # on the gradient, momentum, the moments and weight decay move more than k
    params = _params()
    opt = ft.optimizer_from_torch(cls, params, sparsify=sparsify, **kwargs)
    moved = []
    for step in range(3):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
        moved.append(_changed(params, before))
    assert max(moved) > 5


def _against_the_pure_chain(cls, kwargs, sparsify, params, steps):
    """``steps`` of the adapter with ``sparsify_on="update"`` and of ``chain(from_torch(cls), sparsify)``, each
    step's parameters compared bit for bit; the pure chain's last state."""
    opt = ft.optimizer_from_torch(cls, params, sparsify=sparsify, sparsify_on="update", **kwargs)
    tx = ft.chain(ft.from_torch(cls, **kwargs), sparsify)
    pure = [p.detach().clone() for p in params]
    state = tx.init(pure)
    for step in range(steps):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        updates, state = tx.update(grads, state, pure)
        pure = ft.apply_updates(pure, updates)
        for p, q in zip(params, pure):
            assert torch.equal(p, q), step
    return opt, state


@pytest.mark.parametrize("cls,kwargs", ON_UPDATE, ids=lambda v: getattr(v, "__name__", ""))
def test_sparsify_on_update_is_the_pure_chain_of_the_optimizer_then_topk_bit_for_bit(cls, kwargs):
    _against_the_pure_chain(cls, kwargs, ft.topk(5), _params(), steps=4)


def test_sparsify_on_update_against_torch_optim_adamw_and_a_brute_force_topk_of_its_step():
    """Independent: torch.optim.AdamW (float64) steps a copy of the parameters; the k largest |changes| are kept."""
    params = _params(torch.float64)
    opt = ft.optimizer_from_torch(
        torch.optim.AdamW, params, sparsify=ft.topk(6), sparsify_on="update", lr=0.01, weight_decay=0.1
    )
    shadow = [p.detach().clone().requires_grad_() for p in params]
    torch_opt = torch.optim.AdamW(shadow, lr=0.01, weight_decay=0.1)
    ref = [p.detach().clone() for p in params]
    for step in range(4):
        grads = _grads(params, step)
        with torch.no_grad():
            for s, r in zip(shadow, ref):
                s.copy_(r)  # torch steps from the sparsely updated parameters
        for p, s, g in zip(params, shadow, grads):
            p.grad, s.grad = g, g.clone()
        opt.step()
        torch_opt.step()
        step_ = torch.cat([(s.detach() - r).reshape(-1) for s, r in zip(shadow, ref)])
        kept = torch.zeros_like(step_)
        idx = step_.abs().topk(6).indices
        kept[idx] = step_[idx]
        ref = [r + piece.view(r.shape) for r, piece in zip(ref, kept.split([r.numel() for r in ref]))]
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-14)


def test_sparsify_on_update_with_error_feedback_keeps_the_residual_of_the_updates():
    params = _params(torch.float64)
    kwargs = {"lr": 0.1, "momentum": 0.9}
    opt, state = _against_the_pure_chain(torch.optim.SGD, kwargs, ft.error_feedback(ft.topk(4)), params, steps=3)
    # the residual is of the updates (what the optimizer's step left unapplied), next to SGD's own state
    assert sorted(opt.state[params[0]]) == ["count", "momentum_buffer", "sparsify.residual"]
    assert torch.equal(opt.state[params[0]]["sparsify.residual"], state[1].residual[0])


def test_sparsify_on_update_resumes_pickles_and_names_its_class():
    import pickle

    params = _params()
    kwargs = {"lr": 0.01, "weight_decay": 0.05}
    opt = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify=ft.topk(5), sparsify_on="update", **kwargs)
    _run([(params, opt)], steps=2)
    copy = pickle.loads(pickle.dumps((params, opt)))
    assert copy[1].sparsify_on == "update" and opt.sparsify_on == "update"
    fresh = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify=ft.topk(5), sparsify_on="update", **kwargs)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.sparsify_on == "update"  # load_state_dict's __setstate__ keeps it
    SparseAdamW = ft.optimizer_class_from_torch(torch.optim.AdamW, ft.topk(5), sparsify_on="update")
    assert SparseAdamW is not ft.optimizer_class_from_torch(torch.optim.AdamW, ft.topk(5))
    assert SparseAdamW(params, **kwargs).sparsify_on == "update"
    assert pickle.loads(pickle.dumps(SparseAdamW)) is SparseAdamW


def test_sparsify_on_is_checked():
    params = _params()
    with pytest.raises(ValueError, match="sparsify_on must be one of"):
        ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=ft.topk(2), sparsify_on="updates", lr=0.1)
    with pytest.raises(TypeError, match="sparsify_on"):
        ft.optimizer_class_from_torch(torch.optim.SGD, ft.topk(2), sparsify_on=None)


def test_sparsify_on_update_with_k_too_large_changes_nothing():
    params = _params(shapes=[(2,), (2,)])
    opt = ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=ft.topk(5), sparsify_on="update", lr=0.1,
                                  momentum=0.9)  # fmt: skip
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="k"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, _params(shapes=[(2,), (2,)])))
    assert not opt.state
