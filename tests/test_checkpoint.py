"""Checkpoints: states to and from plain dicts, torch.save / torch.load(weights_only=True)."""

from __future__ import annotations

import collections
import io
import os
import re

import pytest
import torch

import functopk as ft
from functopk.checkpoint import CheckpointError
from tests.helpers import assert_tree_bitwise_equal, clone_tree, small_cnn

PARAMS = {
    "conv": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)),
    "half": torch.randn(5, generator=torch.Generator().manual_seed(2)).half(),
    "double": torch.randn(2, 2, generator=torch.Generator().manual_seed(3)).double(),
    "frozen": None,
}


def make_tx():
    return ft.named_chain(
        ("sparsify", ft.topk(4)),
        ("opt", ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9, nesterov=True)),
    )


def trained_state(steps=3):
    tx = make_tx()
    state = tx.init(PARAMS)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads = ft.tree.map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), PARAMS)
        _, state = tx.update(grads, state, PARAMS)
    return tx, state


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_roundtrip_through_torch_save_weights_only_is_bitwise():
    tx, state = trained_state()
    sd = ft.state_to_dict(state)
    # plain containers only: what weights_only=True can rebuild
    assert type(sd) is dict and type(sd["leaves"]) is dict
    assert all(isinstance(v, torch.Tensor) for v in sd["leaves"].values())
    assert len(sd["leaves"]) == len(ft.tree.leaves(state))
    for path in [
        "['opt'].count",
        "['opt'].hyperparams['learning_rate']",
        "['opt'].hyperparams['momentum']",
        "['opt'].inner_state[0].trace['conv']",
        "['opt'].inner_state[0].trace['double']",
        "['opt'].inner_state[0].trace['half']",
    ]:
        assert path in sd["leaves"], path
    assert torch.equal(sd["leaves"]["['opt'].inner_state[0].trace['half']"], state["opt"].inner_state[0].trace["half"])
    assert "'frozen': None" in sd["structure"]
    restored = ft.state_from_dict(tx.init(PARAMS), roundtrip(sd))
    assert_tree_bitwise_equal(restored, state)
    assert type(restored["opt"]) is ft.optim.InjectHyperparamsState
    assert int(restored["opt"].count) == 3


def test_restored_state_continues_identically():
    tx, state = trained_state()
    restored = ft.state_from_dict(tx.init(PARAMS), roundtrip(ft.state_to_dict(state)))
    grads = ft.tree.map(lambda p: torch.ones_like(p), PARAMS)
    u1, s1 = tx.update(grads, state, PARAMS)
    u2, s2 = tx.update(grads, restored, PARAMS)
    assert_tree_bitwise_equal(u1, u2)
    assert_tree_bitwise_equal(s1, s2)


def test_pure_and_file_helpers(tmp_path):
    tx, state = trained_state()
    template = tx.init(PARAMS)
    state_before, template_before = clone_tree(state), clone_tree(template)
    path = tmp_path / "opt.pt"
    ft.save_state(path, state)
    assert os.listdir(tmp_path) == ["opt.pt"]  # the temporary file was renamed, nothing left over
    ft.save_state(str(path), state)  # overwriting works too
    restored = ft.load_state(path, template)
    assert_tree_bitwise_equal(restored, state)
    assert_tree_bitwise_equal(state, state_before)
    assert_tree_bitwise_equal(template, template_before)


def test_save_state_keeps_modes_and_links_as_torch_save_does(tmp_path):
    tx, state = trained_state()
    saves = {"torch": lambda path: torch.save(ft.state_to_dict(state), path),
             "ft": lambda path: ft.save_state(path, state)}
    for writer, save in saves.items():  # the same three situations, written by torch.save and by save_state
        folder = tmp_path / writer
        folder.mkdir()
        (folder / "shared.pt").write_bytes(b"")
        (folder / "shared.pt").chmod(0o664)  # a group-writable file stays group-writable
        (folder / "real.pt").write_bytes(b"")
        (folder / "latest.pt").symlink_to("real.pt")
        for name in ("new.pt", "shared.pt", "latest.pt"):
            save(folder / name)
    modes = {w: {n: os.stat(tmp_path / w / n).st_mode & 0o7777 for n in ("new.pt", "shared.pt", "real.pt")}
             for w in saves}
    assert modes["ft"] == modes["torch"] and modes["ft"]["shared.pt"] == 0o664
    assert os.readlink(tmp_path / "ft" / "latest.pt") == "real.pt"  # still a link, its target written
    assert_tree_bitwise_equal(ft.load_state(tmp_path / "ft" / "real.pt", tx.init(PARAMS)), state)
    assert sorted(os.listdir(tmp_path / "ft")) == ["latest.pt", "new.pt", "real.pt", "shared.pt"]


def test_the_same_leaves_in_another_order_are_named_as_such():
    tx = ft.adam(0.1)
    params = [torch.zeros(2), torch.zeros(3)]
    sd = ft.state_to_dict(tx.init(params))
    reordered = {**sd, "leaves": dict(reversed(list(sd["leaves"].items())))}
    with pytest.raises(CheckpointError, match=r"the same leaves in another order \(its leaf 0 is nu\[1\], the "
                       r"current state's is count\): its 'leaves' dict was reordered"):
        ft.state_from_dict(tx.init(params), reordered)
    fields = {"x": torch.zeros(1), "y": torch.zeros(2)}  # containers that keep another order: OrderedDicts
    saved = ft.state_to_dict(collections.OrderedDict(fields))
    with pytest.raises(CheckpointError, match=r"another order .*containers order their entries otherwise: "
                       r"saved PyTreeSpec\(OrderedDict\(\{'x'"):
        ft.state_from_dict(collections.OrderedDict(reversed(fields.items())), saved)


def test_python_scalar_leaves_and_empty_states():
    tree = {"n": 3, "flag": True, "x": torch.arange(3.0), "empty": ft.EmptyState()}
    restored = ft.state_from_dict(tree, roundtrip(ft.state_to_dict(tree)))
    assert restored == {"n": 3, "flag": True, "x": restored["x"], "empty": ft.EmptyState()}
    assert torch.equal(restored["x"], tree["x"])
    with pytest.raises(CheckpointError, match=r"\['flag'\] is int 1, expected bool True"):
        ft.state_from_dict(tree, ft.state_to_dict({**tree, "flag": 1}))
    with pytest.raises(TypeError, match=r"leaf at \['s'\] is str 'text'"):
        ft.state_to_dict({"s": "text"})


def test_wrong_structure_names_the_leaves():
    _, state = trained_state()
    sd = ft.state_to_dict(state)
    other = ft.named_chain(("sparsify", ft.topk(4)), ("opt", ft.inject_hyperparams(ft.sgd)(learning_rate=0.1)))
    template = other.init(PARAMS)
    with pytest.raises(CheckpointError, match=r"structure does not match.*unexpected leaves: .*momentum"):
        ft.state_from_dict(template, sd)
    # same leaves, other container types (a plain chain instead of a named one)
    plain = ft.chain(ft.topk(4), ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(CheckpointError, match="structure does not match.*leaf 0 is \\['opt'\\]"):
        ft.state_from_dict(plain.init(PARAMS), sd)


def test_wrong_shape_and_dtype_name_the_leaf():
    tx, state = trained_state()
    sd = roundtrip(ft.state_to_dict(state))
    bigger = {**PARAMS, "conv": torch.zeros(4, 4)}
    with pytest.raises(CheckpointError, match=r"trace\['conv'\] is a tensor of shape \(4, 3\).*expected .*\(4, 4\)"):
        ft.state_from_dict(tx.init(bigger), sd)
    as_float = {**PARAMS, "double": PARAMS["double"].float()}
    with pytest.raises(CheckpointError, match=r"trace\['double'\].*torch.float64, expected .*torch.float32"):
        ft.state_from_dict(tx.init(as_float), sd)


def test_malformed_dicts():
    template = make_tx().init(PARAMS)
    with pytest.raises(CheckpointError, match="must be a dict"):
        ft.state_from_dict(template, [1, 2])
    with pytest.raises(CheckpointError, match="not a functopk state dict"):
        ft.state_from_dict(template, {"state": {}, "param_groups": []})
    sd = ft.state_to_dict(template)
    with pytest.raises(CheckpointError, match="format version 99"):
        ft.state_from_dict(template, {**sd, "version": 99})


def test_truncated_and_garbage_files_raise_clearly(tmp_path):
    tx, state = trained_state()
    path = tmp_path / "opt.pt"
    ft.save_state(path, state)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 20):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="the file is truncated(, | or )corrupted"):
            ft.load_state(bad, tx.init(PARAMS))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="truncated, corrupted"):
        ft.load_state(garbage, tx.init(PARAMS))
    with pytest.raises(FileNotFoundError):
        ft.load_state(tmp_path / "missing.pt", tx.init(PARAMS))


def test_whole_functional_training_state():
    """Any tree of tensors works: params, buffers and optimizer state together."""

    model_fn, params, buffers = ft.nn.functionalize(small_cnn())
    tx = ft.chain(ft.topk(10), ft.sgd(0.1, momentum=0.9))
    tree = {"params": params, "buffers": buffers, "opt_state": tx.init(params), "step": torch.tensor(7)}
    restored = ft.state_from_dict(tree, roundtrip(ft.state_to_dict(tree)))
    assert_tree_bitwise_equal(restored, tree)


# --------------------------------------------------------------------------- integrity


def _flipped(data: bytes, every: int = 1):
    """``(i, data with byte i inverted)`` for every ``every``-th byte."""
    for i in range(0, len(data), every):
        bad = bytearray(data)
        bad[i] ^= 0xFF
        yield i, bytes(bad)


def _small_state():
    """An SGD-with-momentum state of two small leaves, after one step: a file of about 2.6 kB."""
    tx = ft.sgd(0.1, momentum=0.9)
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(2)}
    _, state = tx.update(ft.tree.map(torch.ones_like, params), tx.init(params), params)
    return state


def test_every_damaged_byte_of_a_saved_file_raises():
    state = _small_state()
    buffer = io.BytesIO()
    ft.save_state(buffer, state)
    data = buffer.getvalue()
    assert torch.load(io.BytesIO(data), weights_only=True)["structure"]  # still a plain torch.save file
    for i, bad in _flipped(data):
        with pytest.raises(CheckpointError):
            ft.load_state(io.BytesIO(bad), state)
            pytest.fail(f"byte {i} of {len(data)} inverted: loaded without error")


def test_damaged_torch_save_of_a_state_dict_never_loads_other_numbers():
    # torch.save(state_to_dict(...)) is not sealed: the leaves' digests still catch every changed number
    # (zip metadata and padding bytes may change without effect: the state must then load bitwise equal)
    state = _small_state()
    buffer = io.BytesIO()
    torch.save(ft.state_to_dict(state), buffer)
    data = buffer.getvalue()
    raised = 0
    for i, bad in _flipped(data, every=3):
        try:
            restored = ft.state_from_dict(state, ft.checkpoint.read_state_dict(io.BytesIO(bad)))
        except CheckpointError:
            raised += 1
        else:
            same = all(torch.equal(a, b) for a, b in zip(ft.tree.leaves(restored), ft.tree.leaves(state)))
            assert same, f"byte {i} inverted: other numbers loaded without error"
    assert raised > 0


def test_a_changed_leaf_is_named():
    tx, state = trained_state(steps=1)
    sd = ft.state_to_dict(state)
    path = "['opt'].inner_state[0].trace['conv']"
    changed = {**sd, "leaves": {**sd["leaves"], path: sd["leaves"][path] + 1}}
    with pytest.raises(CheckpointError, match=r"corrupted: the contents of 1 leaves differ .*trace\['conv'\]"):
        ft.state_from_dict(tx.init(PARAMS), changed)
    count = "['opt'].count"
    with pytest.raises(CheckpointError, match=r"\['opt'\].count"):
        ft.state_from_dict(tx.init(PARAMS), {**sd, "leaves": {**sd["leaves"], count: sd["leaves"][count] + 1}})
    with pytest.raises(CheckpointError, match="digest is malformed"):
        ft.state_from_dict(tx.init(PARAMS), {**sd, "digest": "0" * 64})
    with pytest.raises(CheckpointError, match="not a functopk state dict"):
        ft.state_from_dict(tx.init(PARAMS), {**sd, "digets": sd["digest"]})


def test_python_number_leaves_are_in_the_digest():
    tree = {"n": 3, "x": torch.arange(3.0)}
    sd = ft.state_to_dict(tree)
    with pytest.raises(CheckpointError, match=r"\['n'\]"):
        ft.state_from_dict(tree, {**sd, "leaves": {**sd["leaves"], "['n']": 4}})


def test_a_dict_without_digest_loads_with_a_warning():
    # as written before digests were added
    tx, state = trained_state(steps=1)
    sd = {k: v for k, v in ft.state_to_dict(state).items() if k != "digest"}
    with pytest.warns(UserWarning, match="no digest"):
        restored = ft.state_from_dict(tx.init(PARAMS), roundtrip(sd))
    assert_tree_bitwise_equal(restored, state)


def test_torch_optimizer_state_dict_carries_the_digest():
    params = {"w": torch.nn.Parameter(torch.ones(3))}
    opt = ft.TorchOptimizer(params.items(), ft.sgd(0.1, momentum=0.9))
    params["w"].grad = torch.ones(3)
    opt.step()
    saved = roundtrip(opt.state_dict())
    leaves = saved["state"]["functopk"]["transform"]["leaves"]
    path = next(p for p in leaves if "trace" in p)
    leaves[path] = leaves[path] * 2
    with pytest.raises(CheckpointError, match="contents of 1 leaves differ"):
        opt.load_state_dict(saved)


def _stepped_torch_optimizer(lr=0.1):
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "lr": lr}, {"params": [model.bias], "lr": lr / 2}]
    opt = ft.TorchOptimizer(groups, ft.sgd(1.0, momentum=0.9))  # (group lrs: factors on the updates)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return opt


def test_torch_optimizer_param_groups_are_guarded_by_the_digest_a_flipped_byte_raises():
    import struct

    opt = _stepped_torch_optimizer()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    data = bytearray(buffer.getvalue())
    at = data.find(b"G" + struct.pack(">d", 0.1))  # pickle's float opcode and the saved lr's 8 bytes
    assert at > 0
    data[at + 1] ^= 0x20  # one bit of the exponent: 0.1 becomes 7.5e-156, which torch.load reads without a word
    damaged = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert damaged["param_groups"][0]["lr"] != 0.1
    before = clone_tree(opt.transform_state)
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\['lr'\] differs from the digest"):
        opt.load_state_dict(damaged)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 0.05  # nothing changed
    assert_tree_bitwise_equal(opt.transform_state, before)


def test_torch_optimizer_digest_covers_every_group_key_and_params_with_state():
    opt = _stepped_torch_optimizer()
    saved = roundtrip(opt.state_dict())
    edits = {
        "param_groups[1]['lr']": lambda sd: sd["param_groups"][1].__setitem__("lr", 0.07),
        "param_groups[0]['params']": lambda sd: sd["param_groups"][0].__setitem__("params", [1]),
        "param_groups[1]['extra']": lambda sd: sd["param_groups"][1].__setitem__("extra", 1),
        "params_with_state": lambda sd: sd["state"]["functopk"].__setitem__("params_with_state", [0]),
    }
    for path, edit in edits.items():
        sd = roundtrip(saved)
        edit(sd)
        with pytest.raises(CheckpointError, match=re.escape(path)):
            opt.load_state_dict(sd)
    edited = roundtrip(saved)  # edited on purpose, the digest dropped: loads, with a warning
    edited["param_groups"][1]["lr"] = 0.07
    del edited["state"]["functopk"]["digest"]
    with pytest.warns(UserWarning, match="no digest of the param groups"):
        opt.load_state_dict(edited)
    assert opt.param_groups[1]["lr"] == 0.07
    opt.load_state_dict(roundtrip(saved))  # and the untouched dict loads silently
    assert opt.param_groups[1]["lr"] == 0.05


def test_a_tensor_subclass_leaf_digests_as_its_plain_tensor():
    """A subclass leaf (as a DTensor is) is digested through the plain tensor it holds: the same bytes."""

    class Tagged(torch.Tensor):
        pass

    plain = {"w": torch.arange(6.0).reshape(2, 3)}
    tagged = {"w": plain["w"].clone().as_subclass(Tagged)}
    assert ft.state_to_dict(tagged)["digest"] == ft.state_to_dict(plain)["digest"]
