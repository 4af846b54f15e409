"""``optimizer_from_torch`` with sparse gradients and complex parameters, side by side with torch.optim.

torch steps a sparse gradient with ``SGD`` and ``Adagrad`` (without weight
decay) and refuses it elsewhere; it steps a complex parameter through its
``torch.view_as_real`` view with every class but ``Adafactor``, ``Muon`` (and
``SparseAdam``). The adapter does the same (functopk.adapter.views), in float64
and complex128 here, so that the numbers are compared to rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import functopk as ft
from functopk.adapter import views
from tests.helpers import assert_tree_bitwise_equal
from tests.test_from_torch import default_dtype_for

STEPS = 4

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's Adagrad


def _sparse_grad(step: int) -> torch.Tensor:
    """A (6, 3) embedding gradient: row 2 twice (summed), rows 3 and 4 in turn, rows 1 and 5 never."""
    rows = torch.tensor([[0, 2, 2, 3 + step % 2]])
    values = torch.arange(12, dtype=torch.float64).reshape(4, 3).sin() * (step + 1)
    return torch.sparse_coo_tensor(rows, values, (6, 3), check_invariants=True)


def _run(make, params, grad_at, steps=STEPS):
    """``steps`` steps of ``make(params)`` with ``p.grad = grad_at(step, p)``; the parameters and the optimizer."""
    params = [p.clone().requires_grad_() for p in params]
    opt = make(params)
    for step in range(steps):
        for p in params:
            p.grad = grad_at(step, p.detach())
        opt.step()
    return [p.detach() for p in params], opt


SCALARS = ("step", "eta", "mu", "mu_product")
"""torch's per-parameter scalar state keys (functopk's ``step`` is an integer count)."""


def _assert_state_like_torch(ours, theirs, p_ours, p_theirs):
    """Every per-parameter tensor both keep (not the scalars) has torch's dtype, shape and values, densified."""
    shared = [k for k in theirs.state[p_theirs] if k not in SCALARS and k in ours.state[p_ours]]
    for key in shared:
        mine, torchs = ours.state[p_ours][key], theirs.state[p_theirs][key].to_dense()
        assert mine.dtype == torchs.dtype and mine.shape == p_ours.shape, key
        torch.testing.assert_close(mine, torchs, rtol=1e-12, atol=1e-14)
    return shared


# --------------------------------------------------------------------------- sparse gradients

SPARSE_ACCEPTED = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.2, "maximize": True}),
]


@pytest.mark.parametrize("cls, kwargs", SPARSE_ACCEPTED)
def test_sparse_gradients_step_as_torch(cls, kwargs):
    p0 = torch.randn(6, 3, dtype=torch.float64)
    theirs, t_opt = _run(lambda ps: cls(ps, **kwargs), [p0], lambda s, p: _sparse_grad(s))
    ours, o_opt = _run(lambda ps: ft.optimizer_from_torch(cls, ps, **kwargs), [p0], lambda s, p: _sparse_grad(s))
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)
    assert torch.equal(ours[0][[1, 5]], p0[[1, 5]])  # rows no gradient touched
    t_p, o_p = t_opt.param_groups[0]["params"][0], o_opt.param_groups[0]["params"][0]
    compared = _assert_state_like_torch(o_opt, t_opt, o_p, t_p)
    assert compared == [k for k in ("sum", "momentum_buffer") if k in t_opt.state[t_p]]


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.Adam, {}),
        (torch.optim.RMSprop, {}),
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}),
        (torch.optim.Adagrad, {"weight_decay": 0.1}),
    ],
)
def test_sparse_gradients_are_refused_where_torch_refuses_them(cls, kwargs):
    def with_grads():
        dense = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        sparse = torch.zeros(6, 3, dtype=torch.float64, requires_grad=True)
        dense.grad, sparse.grad = torch.ones(2, dtype=torch.float64), _sparse_grad(0)
        return dense, sparse

    with pytest.raises(RuntimeError):
        cls(list(with_grads()), **kwargs).step()
    dense, sparse = with_grads()
    opt = ft.optimizer_from_torch(cls, [dense, sparse], **kwargs)
    with pytest.raises(NotImplementedError, match=f"{cls.__name__}.*sparse gradients"):
        opt.step()
    assert not opt.state and torch.equal(dense, torch.zeros(2, dtype=torch.float64))  # nothing changed


def test_sparse_adagrad_without_eps_or_initial_accumulator_is_refused():
    """torch's sparse step leaves untouched coordinates alone; a dense one would divide 0 by 0 there."""
    p0 = torch.randn(6, 3, dtype=torch.float64)
    theirs, _ = _run(lambda ps: torch.optim.Adagrad(ps, eps=0.0), [p0], lambda s, p: _sparse_grad(s), 1)
    assert torch.equal(theirs[0][[1, 5]], p0[[1, 5]])
    p = p0.clone().requires_grad_()
    p.grad = _sparse_grad(0)
    opt = ft.optimizer_from_torch(torch.optim.Adagrad, [p], eps=0.0)
    with pytest.raises(NotImplementedError, match="eps > 0 or initial_accumulator_value > 0"):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), p0)


def test_sparse_gradient_joins_the_global_topk_as_its_dense_values():
    p0 = [torch.randn(6, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    other = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

    def grad_at(dense):
        def grad(step, p):
            if p.dim() == 1:
                return other * (step + 1)
            return _sparse_grad(step).to_dense() if dense else _sparse_grad(step)

        return grad

    def make(ps):
        return ft.optimizer_from_torch(torch.optim.Adagrad, ps, sparsify=ft.topk(3), lr=0.1)

    sparse, s_opt = _run(make, p0, grad_at(False))
    dense, d_opt = _run(make, p0, grad_at(True))
    assert_tree_bitwise_equal(sparse, dense)
    for ps, pd in zip(s_opt.param_groups[0]["params"], d_opt.param_groups[0]["params"]):
        assert_tree_bitwise_equal(dict(s_opt.state[ps]), dict(d_opt.state[pd]))
    one, _ = _run(make, p0, grad_at(False), steps=1)
    assert sum(int((a != b).sum()) for a, b in zip(one, p0)) == 3  # Adagrad moves exactly the kept coordinates


def test_a_sparse_momentum_buffer_from_torch_is_read_as_dense():
    p0 = torch.randn(6, 3, dtype=torch.float64)
    theirs, t_opt = _run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), [p0], lambda s, p: _sparse_grad(s), 1)
    ours, o_opt = _run(
        lambda ps: ft.optimizer_from_torch(torch.optim.SGD, ps, lr=0.1, momentum=0.9),
        [p0],
        lambda s, p: _sparse_grad(s),
        1,
    )
    t_p, o_p = t_opt.param_groups[0]["params"][0], o_opt.param_groups[0]["params"][0]
    o_opt.state[o_p]["momentum_buffer"] = t_opt.state[t_p]["momentum_buffer"].clone()  # torch's: sparse
    for step in (1, 2):
        t_p.grad, o_p.grad = _sparse_grad(step), _sparse_grad(step)
        t_opt.step()
        o_opt.step()
    torch.testing.assert_close(o_p.detach(), t_p.detach(), rtol=1e-12, atol=1e-14)
    assert o_opt.state[o_p]["momentum_buffer"].layout == torch.strided


# --------------------------------------------------------------------------- complex parameters

COMPLEX_ACCEPTED = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Adadelta, {"weight_decay": 0.1}),
    (torch.optim.Adamax, {"lr": 0.1}),
    (torch.optim.NAdam, {"lr": 0.1, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.RAdam, {"lr": 0.1}),
    (torch.optim.Rprop, {"lr": 0.05}),
    (torch.optim.ASGD, {"lr": 0.05, "t0": 1}),
]


def _complex_params():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 2, dtype=torch.complex128, generator=g),
        torch.randn((), dtype=torch.complex128, generator=g),
        torch.randn(2, dtype=torch.float64, generator=g),
    ]


def _smooth(step, p):
    return torch.sin(p) + 0.1 * p**2


@pytest.mark.parametrize("cls, kwargs", COMPLEX_ACCEPTED, ids=[c.__name__ for c, _ in COMPLEX_ACCEPTED])
def test_complex_parameters_step_as_torch_with_complex_state(cls, kwargs):
    with default_dtype_for(torch.float64):  # the scalars torch keeps in the default dtype (ASGD's eta)
        theirs, t_opt = _run(lambda ps: cls(ps, **kwargs), _complex_params(), _smooth, 3)
        ours, o_opt = _run(lambda ps: ft.optimizer_from_torch(cls, ps, **kwargs), _complex_params(), _smooth, 3)
    for mine, torchs in zip(ours, theirs):
        assert mine.dtype == torchs.dtype
        torch.testing.assert_close(mine, torchs, rtol=1e-12, atol=1e-14)
    for t_p, o_p in list(zip(t_opt.param_groups[0]["params"], o_opt.param_groups[0]["params"]))[:2]:
        assert _assert_state_like_torch(o_opt, t_opt, o_p, t_p)
        assert all(v.is_complex() for k, v in o_opt.state[o_p].items() if k not in SCALARS + ("count",))


def test_complex_state_dict_goes_to_torch_and_back():
    """A checkpoint of a complex parameter (complex ``exp_avg``) resumes in either class as in torch alone.

    (One parameter: several share one ``step`` tensor in functopk's checkpoints, which torch reads otherwise.)
    """
    p0 = _complex_params()[:1]
    make_t = lambda ps: torch.optim.Adam(ps, lr=0.1)  # noqa: E731
    make_o = lambda ps: ft.optimizer_from_torch(torch.optim.Adam, ps, lr=0.1)  # noqa: E731
    truth, _ = _run(make_t, p0, _smooth, 4)
    for first, second in ((make_o, make_t), (make_t, make_o)):
        half, opt = _run(first, p0, _smooth, 2)
        params = [p.clone().requires_grad_() for p in half]
        resumed = second(params)
        resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert resumed.state[params[0]]["exp_avg"].dtype == torch.complex128
        for step in (2, 3):
            params[0].grad = _smooth(step, params[0].detach())
            resumed.step()
        torch.testing.assert_close(params[0].detach(), truth[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.Muon])
def test_complex_parameters_are_refused_where_torch_refuses_them(cls):
    p = torch.randn(3, 2, dtype=torch.complex128, requires_grad=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="does not support complex"):
        cls([p]).step()
    with pytest.raises(TypeError, match=f"{cls.__name__} does not support complex parameters.*complex128"):
        ft.optimizer_from_torch(cls, [p])


def test_a_complex_coordinate_is_two_real_ones_in_the_global_topk():
    def make(ps):
        return ft.optimizer_from_torch(torch.optim.SGD, ps, sparsify=ft.topk(3), lr=0.1)

    complex_ps = [p.requires_grad_() for p in _complex_params()]
    real_ps = [views.real(p).clone().requires_grad_() for p in _complex_params()]
    c_opt, r_opt = make(complex_ps), make(real_ps)
    for step in range(3):
        before = [views.real(p.detach()).clone() for p in complex_ps]
        for c, r in zip(complex_ps, real_ps):
            c.grad = _smooth(step, c.detach())
            r.grad = views.real(c.grad).clone()
        c_opt.step()
        r_opt.step()
        after = [views.real(p.detach()) for p in complex_ps]
        assert_tree_bitwise_equal(after, [r.detach() for r in real_ps])
        assert sum(int((a != b).sum()) for a, b in zip(after, before)) == 3  # real and imaginary parts apart


def test_functional_complex_leaves_are_refused_naming_the_view_as_real_route():
    params = {"w": _complex_params()[0]}
    with pytest.raises(TypeError, match=r"\['w'\] has dtype torch.complex128.*torch.view_as_real"):
        ft.adam(0.1).init(params)
    # the route the message names gives torch's numbers
    theirs, _ = _run(lambda ps: torch.optim.Adam(ps, lr=0.1), [params["w"]], _smooth, 3)
    tx = ft.from_torch(torch.optim.Adam, lr=0.1)
    real = {"w": torch.view_as_real(params["w"]).clone()}
    state = tx.init(real)
    for step in range(3):
        grads = {"w": torch.view_as_real(_smooth(step, torch.view_as_complex(real["w"])))}
        updates, state = tx.update(grads, state, real)
        real = ft.apply_updates(real, updates)
    torch.testing.assert_close(torch.view_as_complex(real["w"]), theirs[0], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the meta device

META_CLASSES = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop",
                "ASGD", "Adafactor", "Muon"]  # fmt: skip


@pytest.mark.parametrize("name", META_CLASSES)
def test_parameters_on_the_meta_device_step_with_state_on_the_meta_device(name):
    """torch.optim steps meta parameters (shapes only; its ASGD and Adafactor read a value and fail); so does
    the adapter, every class, its state on the meta device too."""
    cls = getattr(torch.optim, name)
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(3, 4)), torch.nn.Parameter(torch.empty(4, 2))]
        for p in params:
            p.grad = torch.empty_like(p)
    opt = ft.optimizer_from_torch(cls, params, lr=0.1, **({"momentum": 0.9} if name == "SGD" else {}))
    for _ in range(2):
        opt.step()
    assert all(p.is_meta and p.shape == s for p, s in zip(params, [(3, 4), (4, 2)]))
    tensors = [v for entry in opt.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(v.is_meta for v in tensors)
