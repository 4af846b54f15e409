"""Argument checks shared by every module: one place, one exception policy.

Policy (docs/design.md, "Errors"):

* ``TypeError`` when a value has the wrong *type* (a float where an int is
  needed, a tuple where a state NamedTuple is needed, an integer tensor where a
  gradient is needed);
* ``ValueError`` when the type is right but the *value* is not (out of range,
  wrong shape, wrong tree structure);
* every message names the argument, and for trees the leaf path, and says what
  was expected;
* checks run before anything is written, so a failed call changes nothing.

Nothing here reads a tensor's value (no host sync): 0-d tensors pass the type
checks and their values are the caller's responsibility.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch

from functopk._compat import check_compiling, same_structure

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating-point dtypes functopk computes with (gradients, parameters, states)."""


# --------------------------------------------------------------------------- formatting


def path_str(path: Sequence[Any]) -> str:
    """A leaf path as Python indexing, e.g. ``['layer1']['weight']``; ``<root>`` for a bare leaf."""
    return "".join(f"[{p!r}]" for p in path) if path else "<root>"


def describe(x: Any) -> str:
    """A short description of a value for an error message (type, and shape/dtype for tensors)."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# --------------------------------------------------------------------------- scalars


def listed(items: Sequence[str], limit: int = 5) -> str:
    """``"a, b, c and 4 more"``: the first ``limit`` items of a message's list; ``"(none)"`` when empty."""
    if not items:
        return "(none)"
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {describe(value)}")
    return value


def check_choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``: ``TypeError`` if its type is none of theirs, else ``ValueError``.

    Example:
        >>> check_choice("tree", "exchange", ("allgather", "tree"))
        'tree'
        >>> check_choice("ring", "exchange", ("allgather", "tree"))
        Traceback (most recent call last):
        ...
        ValueError: exchange must be one of ('allgather', 'tree'), got str 'ring'
    """
    choices = tuple(choices)
    if not any(type(value) is type(c) for c in choices):  # exact types: True is not the choice 1
        raise TypeError(f"{name} must be one of {choices}, got {describe(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {describe(value)}")
    return value


def check_int(value: Any, name: str, *, minimum: int | None = None, below: int | None = None) -> int:
    """``value`` as an int after checking its type (not bool) and range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    return _in_range(int(value), name, minimum, below)


def check_number(value: Any, name: str, *, minimum: float | None = None, below: float | None = None) -> float:
    """``value`` as a float after checking its type (a real number, not bool), that it is not NaN, and its range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return _in_range(value, name, minimum, below)


def _in_range(value: Any, name: str, minimum: float | None, below: float | None) -> Any:
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return value


def check_scalar_tensor(
    value: torch.Tensor, name: str, *, kind: str = "float", expected: str | None = None
) -> torch.Tensor:
    """A 0-d tensor of the given kind (``"float"``, ``"int"`` or ``"real"``), else ``TypeError`` saying ``expected``."""
    ok = value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    if kind == "float":
        ok = ok and value.is_floating_point()
    elif kind == "int":
        ok = ok and not value.is_floating_point()
    if not ok:
        what = {"float": "a 0-d float tensor", "int": "a 0-d integer tensor", "real": "a 0-d real tensor"}[kind]
        raise TypeError(f"{name} must be {expected or what}, got {describe(value)}")
    return value


def check_hyperparam(
    value: Any, name: str, *, minimum: float | None = None, below: float | None = None
) -> float | torch.Tensor:
    """A hyperparameter: a real number (type- and range-checked) or a 0-d float tensor.

    Tensors come from :func:`functopk.inject_hyperparams`; their value is not
    range-checked, since reading it would be a host sync. A 0-d integer tensor
    (an int injected as int64) is returned as float32.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            # inject_hyperparams stores a Python int as int64 (so counts stay exact): ``weight_decay=0``
            # arrives as one and is used as the float it stands for
            value = value.to(torch.float32)
        return check_scalar_tensor(value, name, expected="a real number or a 0-d float tensor")
    return check_number(value, name, minimum=minimum, below=below)


def check_scalar_or_schedule(value: Any, name: str, *, minimum: float | None = None) -> Any:
    """A schedule (any callable ``step -> value``), or a hyperparameter as :func:`check_hyperparam`."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return value
    return check_hyperparam(value, name, minimum=minimum)


def is_zero(value: float | torch.Tensor) -> bool:
    """True for the Python number 0; a tensor is never taken as zero (that would need its value)."""
    return not isinstance(value, torch.Tensor) and value == 0.0


# --------------------------------------------------------------------------- counts: k and density


def check_k(k: Any, name: str = "k", *, allow_tensor: bool = True) -> int | torch.Tensor:
    """A count ``k >= 1``: an int, or (``allow_tensor``) a 0-d real tensor, not range-checked."""
    if allow_tensor and isinstance(k, torch.Tensor):
        return check_scalar_tensor(k, name, kind="real", expected="an int or a 0-d real tensor")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        what = "an int or a 0-d tensor" if allow_tensor else "an int"
        raise TypeError(f"{name} must be {what}, got {describe(k)}")
    return check_int(k, name, minimum=1)


def check_density(density: Any, name: str = "density", *, allow_tensor: bool = True) -> float | torch.Tensor:
    """A fraction in ``(0, 1]``: a real number, or (``allow_tensor``) a 0-d float tensor, not range-checked."""
    if allow_tensor and isinstance(density, torch.Tensor):
        return check_scalar_tensor(density, name, expected="a number in (0, 1] or a 0-d float tensor")
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"{name} must be a number in (0, 1], got {describe(density)}")
    density = float(density)
    if not 0.0 < density <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in (0, 1], got {density}")
    return density


def check_k_or_density(
    k: Any, density: Any, *, allow_tensor: bool = True, allow_schedule: bool = False
) -> tuple[Any, Any]:
    """Exactly one of ``k`` (a count) or ``density`` (a fraction), each checked; the other is ``None``.

    With ``allow_schedule`` either may be a callable ``step -> value`` (checked when it is called).
    """
    if (k is None) == (density is None):
        raise ValueError(f"give exactly one of k or density, got k={k!r} and density={density!r}")
    if k is not None:
        if allow_schedule and callable(k) and not isinstance(k, torch.Tensor):
            return k, None
        return check_k(k, allow_tensor=allow_tensor), None
    if allow_schedule and callable(density) and not isinstance(density, torch.Tensor):
        return None, density
    return None, check_density(density, allow_tensor=allow_tensor)


# --------------------------------------------------------------------------- trees


def check_tree(tree: Any, name: str) -> Any:
    """Reject what is not a pytree of tensors but is often passed for one (iterators, generators).

    Every tree functopk reads passes here first, so this is also where a
    compiled step on a torch too old to trace functopk stops (``RuntimeError``).
    """
    check_compiling()
    if isinstance(tree, Iterator):
        raise TypeError(
            f"{name} must be a pytree of tensors (a dict, list or tuple), got {type(tree).__name__}, an iterator "
            "that the first read would use up; for a module's parameters pass dict(model.named_parameters())"
        )
    return tree


def first_difference(expected: optree.PyTreeSpec, actual: optree.PyTreeSpec) -> str:
    """A readable account of where two tree structures first differ (not both structures in full)."""
    exp_paths, act_paths = expected.paths(), actual.paths()
    for i, (a, b) in enumerate(zip(exp_paths, act_paths)):
        if a != b:
            return f"leaf {i} is at {path_str(b)} but expected at {path_str(a)}"
    if len(exp_paths) != len(act_paths):
        missing = len(exp_paths) > len(act_paths)
        longer = exp_paths if missing else act_paths
        first = path_str(longer[min(len(exp_paths), len(act_paths))])
        which = "missing" if missing else "extra"
        return f"{len(act_paths)} leaves where {len(exp_paths)} were expected; first {which}: {first}"
    return f"the leaf paths agree but the node types differ: {actual} vs {expected}"


def check_same_structure(expected: Any, actual: Any, *, name: str, expected_name: str) -> None:
    """``ValueError`` naming the first differing leaf path when two trees differ in structure."""
    expected_def = optree.tree_structure(expected)
    actual_def = optree.tree_structure(actual)
    if not same_structure(expected_def, actual_def):
        raise ValueError(
            f"{name} does not have the tree structure of {expected_name}: "
            f"{first_difference(expected_def, actual_def)}"
        )


_REAL_FLOATS = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))


def check_leaves(
    tree: Any, name: str, *, floating: bool = False, dtypes: Sequence[torch.dtype] | None = None
) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree`` and check that every leaf is a tensor (of a floating or a listed dtype)."""
    check_tree(tree, name)
    leaves, treedef = optree.tree_flatten(tree)
    passing = None if dtypes is None else frozenset(dtypes)  # dtypes that pass at once (None: all)
    if floating:
        passing = _REAL_FLOATS if passing is None else passing & _REAL_FLOATS
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (passing is None or leaf.dtype in passing):
            continue  # (the common cases in one test; below, the full checks, which name a failure)
        path = treedef.paths()[i]
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name} leaf at {path_str(path)} is {describe(leaf)}; expected a torch.Tensor")
        if dtypes is not None and leaf.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(
                f"{name} leaf at {path_str(path)} has dtype {leaf.dtype}; expected a floating-point tensor of "
                f"dtype {allowed}"
            )
        if floating and leaf.is_complex():
            raise TypeError(
                f"{name} leaf at {path_str(path)} has dtype {leaf.dtype}; functopk computes on real tensors: "
                "pass torch.view_as_real(x) for each complex x (parameters, gradients and state alike), which is how "
                "torch.optim steps complex parameters; optimizer_from_torch does this for you"
            )
        if floating and not leaf.is_floating_point():
            raise TypeError(
                f"{name} leaf at {path_str(path)} has dtype {leaf.dtype}; expected a floating-point tensor "
                "(integer and bool tensors are not gradients)"
            )
    return leaves, treedef


def one_device(leaves: Sequence[torch.Tensor], name: str) -> torch.device:
    """The one device of ``leaves`` (CPU when empty), else ``ValueError``."""
    devices = {leaf.device for leaf in leaves}
    if len(devices) > 1:
        raise ValueError(f"{name} leaves are on several devices {sorted(map(str, devices))}; expected one device")
    return leaves[0].device if leaves else torch.device("cpu")


def check_shapes(
    treedef: optree.PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    name: str,
    expected_name: str,
) -> None:
    """``ValueError`` at the first leaf whose shape differs from its counterpart's (no broadcasting)."""
    for path, x, y in zip(treedef.paths(), leaves, expected):
        if x.shape != y.shape:
            raise ValueError(
                f"{name} leaf at {path_str(path)} has shape {tuple(x.shape)}, but {expected_name} has shape "
                f"{tuple(y.shape)} there"
            )


def require_params(params: Any, name: str) -> Any:
    """``params`` if given, else ``ValueError`` saying that transformation ``name`` needs them."""
    if params is None:
        raise ValueError(f"{name} needs the parameters: call update(updates, state, params) with params")
    return params


def check_state(state: Any, cls: type, owner: str) -> Any:
    """``state`` if it is a ``cls``, else ``TypeError`` saying whose state was expected."""
    if not isinstance(state, cls):
        raise TypeError(
            f"state must be a {cls.__name__} (the state {owner}'s init returns), got {type(state).__name__}; "
            "was it made by a different transformation, or by a chain with other members?"
        )
    return state


def check_callable(value: Any, name: str, what: str = "a callable") -> Callable[..., Any]:
    """``value`` if callable, else ``TypeError``."""
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {describe(value)}")
    return value


# --------------------------------------------------------------------------- param groups


def check_distinct_params(group: dict[str, Any], index: int) -> None:
    """``ValueError`` when param group ``index`` lists one tensor twice (named by position and name).

    ``torch.optim`` only warns (deprecated) and steps such a parameter twice; a
    global top-k would give it two of its ``k`` slots. Run it after torch's
    ``add_param_group`` has made ``group["params"]`` a list, inside
    :func:`torch_duplicate_warning_ignored`.
    """
    names = group.get("param_names")
    first: dict[int, int] = {}
    for i, p in enumerate(group["params"]):
        j = first.setdefault(id(p), i)
        if j != i:
            named = f" (named {names[j]!r} and {names[i]!r})" if names else ""
            raise ValueError(
                f"param group {index} lists one parameter twice, at positions {j} and {i}{named}; torch.optim "
                "would step it twice (a deprecated case it warns about) and a top-k would count it twice: list "
                "each parameter once"
            )


@contextlib.contextmanager
def torch_duplicate_warning_ignored() -> Iterator[None]:
    """Silence ``torch.optim``'s duplicate-parameter warning, for code that raises :func:`check_distinct_params`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
        yield


def group_scalar(value: Any) -> Any:
    """A ``torch.optim`` param group's value as functopk's hyperparameters take it.

    Used by both sides of torch interop: the ``TORCH_BUILDERS`` tables of :mod:`functopk.optim`
    and the adapter's registry (:mod:`functopk.adapter.registry`), hence here, below both layers.
    A number stays as given; a one-element tensor of any shape (torch accepts
    ``betas=(torch.tensor([[0.9]]), ...)``) becomes a 0-d view of it, so a
    scheduler's in-place change still reaches the update and its value is not
    read; a tuple or list (``betas``, ``etas``, ...) is converted element by element.

    Raises:
        ValueError: a tensor with other than one element.
    """
    if isinstance(value, (tuple, list)):
        return tuple(group_scalar(v) for v in value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a tensor hyperparameter must have one element, got shape {tuple(value.shape)}")
        return value.reshape(())
    return value


# --------------------------------------------------------------------------- saved state


def check_keys(
    saved: Any, required: Collection[str], optional: Collection[str] = (), *, name: str,
    error: type[Exception] = ValueError, type_error: type[Exception] = TypeError,
) -> None:  # fmt: skip
    """The one check of a saved dict's keys (a functopk state dict, a sparse optimizer's state, a DDP hook's).

    ``saved`` must be a dict (else ``type_error``) with every key of ``required`` and none outside
    ``required`` and ``optional`` (else ``error``, naming what is missing and what is unknown after ``name``).

    Example:
        >>> check_keys({"a": 1, "c": 2}, ["a", "b"], name="state_dict")
        Traceback (most recent call last):
        ValueError: state_dict misses the keys 'b' and has unknown keys 'c'
    """
    if not isinstance(saved, Mapping):
        raise type_error(f"{name} must be a dict, got {describe(saved)}")
    missing = [repr(k) for k in required if k not in saved]
    unknown = [repr(k) for k in saved if k not in required and k not in optional]
    if missing or unknown:
        pairs = (("misses the keys", missing), ("has unknown keys", unknown))
        wrong = [f"{what} {listed(keys)}" for what, keys in pairs if keys]
        raise error(f"{name} {' and '.join(wrong)}")


def check_saved(
    value: Any, want: Any, name: str, *, error: type[Exception] = ValueError, type_error: type[Exception] = TypeError,
    exact: bool = True, why: str = "",
) -> None:  # fmt: skip
    """The one check of a saved value where ``want`` is kept (every saved state's leaves, entries and vectors).

    A tensor must be one (else ``type_error``) of ``want``'s shape and, when ``exact`` (not where a load
    converts it, as ``torch.optim``'s does), dtype and layout; any other value of ``want``'s type; else
    ``error`` saying what it is and what was expected (and ``why``, appended).

    Example:
        >>> check_saved(torch.zeros(2), torch.zeros(3), "mu")
        Traceback (most recent call last):
        ValueError: mu is a tensor of shape (2,) and dtype torch.float32, expected a tensor of shape (3,) and ...
    """
    if isinstance(want, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise type_error(f"{name} must be a tensor ({describe(want)}), got {describe(value)}")
        same = value.shape == want.shape and (not exact or (value.dtype, value.layout) == (want.dtype, want.layout))
    else:
        same = type(value) is type(want)
    if not same:
        raise error(f"{name} is {describe(value)}, expected {describe(want)}{why}")


def check_like(
    expected: Any,
    leaves: Sequence[torch.Tensor],
    treedef: optree.PyTreeSpec,
    *,
    name: str,
    expected_name: str,
) -> list[Any]:
    """The leaves of ``expected`` (a state tree, the parameters), checked against flattened ``leaves``.

    ``ValueError`` naming the first differing leaf path when ``expected`` does
    not have the structure ``treedef`` of the tree ``leaves`` come from, or a
    leaf's shape differs from its counterpart's (no broadcasting).
    """
    expected_leaves, expected_def = optree.tree_flatten(expected)
    if not same_structure(expected_def, treedef):
        raise ValueError(
            f"{name} does not have the tree structure of {expected_name}: {first_difference(expected_def, treedef)}"
        )
    check_shapes(treedef, leaves, expected_leaves, name=name, expected_name=expected_name)
    return expected_leaves
