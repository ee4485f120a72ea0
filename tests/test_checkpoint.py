"""Distributed checkpoints on real gloo worlds: round trips, resharding across meshes and world
sizes, who writes what, optimizer state, atomic replacement, and every rank failing together."""
import contextlib
import glob
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import autopar as dist
from autopar.checkpoint import CheckpointError, CheckpointNotFoundError, load_state_dict, save_state_dict
from autopar.checkpoint import load as load_mod
from autopar.checkpoint import save as save_mod
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _full(shape, dtype=torch.float32, offset=0.0):
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 - 3 + offset
    return t.to(dtype)


def _failure(fn, *args):
    """Run fn expecting a CheckpointError; return (class name, message, is FileNotFoundError)."""
    try:
        fn(*args)
    except CheckpointError as e:
        return type(e).__name__, str(e), isinstance(e, FileNotFoundError)
    raise AssertionError("expected a CheckpointError")


# -- round trip on a 2-D mesh ------------------------------------------------------------------------
# name: (shape, dtype, placements on [[0, 1], [2, 3]] or None for a plain tensor)
LAYOUT_2D = {
    "w_ss": ((5, 7), torch.float32, [S0, S1]),        # uneven both ways
    "w_nested": ((7, 3), torch.float32, [S0, S0]),    # nested cut of one dim
    "w_tiny": ((3, 2), torch.float32, [S0, S0]),      # 3 rows on 4 shards: one empty piece
    "w_rr": ((4, 4), torch.float32, [R, R]),
    "w_s1r": ((3, 5), torch.float64, [S1, R]),
    "w_psum": ((6, 4), torch.float32, [P, S0]),
    "w_pmax": ((2, 3), torch.float32, [Partial("max"), R]),
    "b_bf16": ((9,), torch.bfloat16, [R, S0]),
    "scale": ((), torch.float32, [R, R]),
    "plain": ((3, 3), torch.float32, None),
    "plain_int": ((5,), torch.int64, None),
    "num_batches": ((), torch.int64, None),
}


def _dist_2d(name, mesh, values):
    shape, dtype, placements = LAYOUT_2D[name]
    full = _full(shape, dtype) if values else torch.zeros(shape, dtype=dtype)
    if placements is None:
        return full
    if values and placements[0] == P:  # genuine terms on both rows of the mesh: 0.25 + 0.75
        x = mesh.coordinate(dist.get_rank())[0]
        spec_piece = dist.shard_tensor(full, mesh, [R, placements[1]]).local_value()
        return dist.dtensor_from_local(spec_piece * (0.25 if x == 0 else 0.75), mesh, placements, shape)
    if values and placements[0] == Partial("max"):
        x = mesh.coordinate(dist.get_rank())[0]
        return dist.dtensor_from_local(full - (0 if x == 1 else 5), mesh, placements, shape)
    return dist.shard_tensor(full, mesh, placements)


def _round_trip_2d(path):
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    sd = {name: _dist_2d(name, mesh, True) for name in LAYOUT_2D}
    sd["extra"] = {"epoch": 3, "tag": "run-7", "betas": (0.9, 0.99), "ids": [1, 2], "none": None}
    save_state_dict(sd, path)

    target = {name: _dist_2d(name, mesh, False) for name in LAYOUT_2D}
    target["extra"] = {"epoch": 0, "tag": "", "betas": (0.0, 0.0), "ids": [], "none": 1}
    objects = {k: v for k, v in target.items() if k != "extra"}
    load_state_dict(target, path)
    for name, (shape, dtype, placements) in LAYOUT_2D.items():
        t = target[name]
        assert t is objects[name], name  # in place
        assert t.dtype == dtype and tuple(t.shape) == shape
        if placements is not None:
            assert t.placements == placements
            assert torch.equal(dist.unshard_dtensor(t), _full(shape, dtype)), name
        else:
            assert torch.equal(t, _full(shape, dtype)), name
    # a Partial(sum) target holds the value on the first coordinate, zeros on the others
    x = mesh.coordinate(dist.get_rank())[0]
    assert (target["w_psum"].local_value() == 0).all() == (x != 0)
    assert target["extra"] == {"epoch": 3, "tag": "run-7", "betas": (0.9, 0.99), "ids": [1, 2], "none": None}

    # an empty dict receives everything, under the saved mesh and placements (they fit this job)
    everything = {}
    load_state_dict(everything, path)
    assert set(everything) == set(target) and everything["extra"] == target["extra"]
    for name, (shape, dtype, placements) in LAYOUT_2D.items():
        t = everything[name]
        if placements is None:
            assert type(t) is torch.Tensor and torch.equal(t, _full(shape, dtype)), name
        else:
            assert t.placements == placements and t.process_mesh == mesh, name
            assert torch.equal(dist.unshard_dtensor(t), _full(shape, dtype)), name
    return dist.get_rank()


def test_round_trip_2d_mesh_every_placement(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_dist(_round_trip_2d, 4, path) == [0, 1, 2, 3]
    meta = json.load(open(os.path.join(path, "metadata.json")))
    pieces = {name: [(p["file"], p["box"]) for p in e["pieces"]] for name, e in meta["tensors"].items()}
    f = "rank{:05d}.safetensors".format
    # small replicated pieces are written once, by the lowest rank holding them
    assert pieces["w_rr"] == [(f(0), [[0, 4], [0, 4]])]
    assert pieces["plain"] == [(f(0), [[0, 3], [0, 3]])]
    assert pieces["scale"] == [(f(0), [])]
    assert sorted(p[0] for p in pieces["w_s1r"]) == [f(0), f(2)]
    assert sorted(p[0] for p in pieces["w_psum"]) == [f(0), f(1)]  # reduced, then [R, S0]
    assert len(pieces["w_ss"]) == 4 and len({p[0] for p in pieces["w_ss"]}) == 4
    assert len(pieces["w_tiny"]) == 3  # the empty piece is not written
    assert meta["tensors"]["w_ss"]["placements"] == [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    assert meta["tensors"]["w_psum"]["mesh"]["process_ids"] == [0, 1, 2, 3]
    assert meta["values"]["extra.betas"]["value"] == {"__tuple__": [0.9, 0.99]}
    assert all(p["checksum"].startswith("crc32:") for e in meta["tensors"].values() for p in e["pieces"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left


def _save_data_parallel_model(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sd = {"big": dist.shard_tensor(_full((65, 256)), mesh, [R]), "small": dist.shard_tensor(_full((4, 4)), mesh, [R])}
    save_state_dict(sd, path)


def test_a_large_piece_every_rank_holds_is_written_by_all_of_them(tmp_path):
    """Under data parallel every rank holds the whole model: its large pieces are written in
    row slices by all their holders (none writes the model alone), a small one by the first."""
    path = str(tmp_path / "ckpt")
    run_dist(_save_data_parallel_model, 2, path)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    pieces = {name: [(p["file"], p["box"]) for p in e["pieces"]] for name, e in meta["tensors"].items()}
    assert pieces["big"] == [("rank00000.safetensors", [[0, 33], [0, 256]]),
                             ("rank00001.safetensors", [[33, 65], [0, 256]])]
    assert pieces["small"] == [("rank00000.safetensors", [[0, 4], [0, 4]])]
    sd = {"big": torch.zeros(65, 256), "small": torch.zeros(4, 4)}
    load_state_dict(sd, path)
    assert torch.equal(sd["big"], _full((65, 256))) and torch.equal(sd["small"], _full((4, 4)))


# -- resharding: 4-way tensor parallel -> 2x2 mesh / one process --------------------------------------
TP_SHAPES = {"fc1.weight": (16, 8), "fc1.bias": (16,), "fc2.weight": (8, 16), "head.weight": (9, 4)}


def _tp_value(name):
    return _full(TP_SHAPES[name], offset=len(name))


def _save_tp(path):
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
    sd = {name: dist.shard_tensor(_tp_value(name), mesh, [S0]) for name in TP_SHAPES}
    save_state_dict(sd, path)


def _load_2x2(path):
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    placements = {name: [S1 if len(shape) == 2 else S0, R] for name, shape in TP_SHAPES.items()}
    target = {name: dist.shard_tensor(torch.zeros(shape), mesh, placements[name]) for name, shape in TP_SHAPES.items()}
    read = {}
    original = load_mod._Files.read

    def counting_read(self, name, entry, piece, region, verify):
        data = original(self, name, entry, piece, region, verify)
        read[name] = read.get(name, 0) + data.numel()
        return data

    load_mod._Files.read = counting_read
    try:
        load_state_dict(target, path)
    finally:
        load_mod._Files.read = original
    for name, shape in TP_SHAPES.items():
        # its own piece, plus at most one saved piece read whole to check its checksum
        need, saved_piece = target[name].local_value().numel(), -(-shape[0] // 4) * torch.Size(shape[1:]).numel()
        assert need <= read[name] <= need + saved_piece, (name, read[name], need)
    for name in TP_SHAPES:
        expected = dist.shard_tensor(_tp_value(name), mesh, placements[name]).local_value()
        assert torch.equal(target[name].local_value(), expected), name
        assert target[name].placements == placements[name]
    return True


def _load_plain(path):
    target = {name: torch.zeros(shape) for name, shape in TP_SHAPES.items()}
    load_state_dict(target, path)
    return all(torch.equal(target[name], _tp_value(name)) for name in TP_SHAPES)


def _load_2_ranks(path):
    mesh = dist.ProcessMesh([1, 0], dim_names=["x"])  # another rank order, another world size
    target = {name: dist.shard_tensor(torch.zeros(shape), mesh, [Shard(len(shape) - 1)])
              for name, shape in TP_SHAPES.items()}
    load_state_dict(target, path)
    return all(torch.equal(dist.unshard_dtensor(target[n]), _tp_value(n)) for n in TP_SHAPES)


def _load_everything(path):
    everything = {}
    load_state_dict(everything, path)  # the saved 4-rank mesh does not fit: plain tensors
    return sorted(everything) == sorted(TP_SHAPES) and all(
        type(everything[n]) is torch.Tensor and torch.equal(everything[n], _tp_value(n)) for n in TP_SHAPES)


def test_save_4way_tp_load_other_meshes_and_world_sizes(tmp_path):
    path = str(tmp_path / "tp")
    run_dist(_save_tp, 4, path)
    # each rank wrote only its own quarter
    meta = json.load(open(os.path.join(path, "metadata.json")))
    total = sum(4 * torch.Size(s).numel() for s in TP_SHAPES.values())
    per_file = {}
    for e in meta["tensors"].values():
        for p in e["pieces"]:
            n = 4
            for a, b in p["box"]:
                n *= b - a
            per_file[p["file"]] = per_file.get(p["file"], 0) + n
    assert sorted(per_file) == [f"rank{r:05d}.safetensors" for r in range(4)]
    for fname, nbytes in per_file.items():
        assert 0.2 * total <= nbytes <= 0.3 * total, (fname, nbytes, total)
        size = os.path.getsize(os.path.join(path, fname))
        assert size == meta["files"][fname]["size"] and nbytes < size < nbytes + 2048

    assert run_dist(_load_2x2, 4, path) == [True] * 4
    assert run_dist(_load_2_ranks, 2, path) == [True] * 2
    assert run_dist(_load_everything, 2, path) == [True] * 2
    assert run_dist(_load_plain, 1, path) == [True]


def _plain_round_trip(path):
    sd = {"a": {"w": torch.arange(6.).reshape(2, 3)}, "step": 5, "lr": [0.1, 0.01]}
    save_state_dict(sd, path)
    target = {"a": {"w": torch.zeros(2, 3)}, "step": 0, "lr": []}
    load_state_dict(target, path)
    return torch.equal(target["a"]["w"], sd["a"]["w"]) and target["step"] == 5 and target["lr"] == [0.1, 0.01]


_NO_GROUP = """
import sys, torch
sys.path[:0] = {paths!r}
import test_checkpoint as t
assert t._plain_round_trip({path!r}) and t._load_plain({tp!r})
assert not torch.distributed.is_initialized()
print("ok")
"""


def test_plain_state_dict_with_and_without_process_group(tmp_path):
    # a fresh process that never starts a process group (this one may have, for other tests)
    tests = os.path.dirname(os.path.abspath(__file__))
    tp = str(tmp_path / "tp")
    run_dist(_save_tp, 4, tp)
    code = _NO_GROUP.format(paths=[tests, os.path.dirname(tests)], path=str(tmp_path / "nopg"), tp=tp)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert run_dist(_plain_round_trip, 1, str(tmp_path / "one")) == [True]
    assert run_dist(_plain_round_trip, 2, str(tmp_path / "two")) == [True, True]
    # plain tensors are replicated: only rank 0 writes them
    assert os.listdir(tmp_path / "two") and sorted(os.listdir(tmp_path / "two")) == [
        "metadata.json", "rank00000.safetensors"]


# -- optimizer state -------------------------------------------------------------------------------
def _model(mesh, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    layout = {"0.weight": [S0], "0.bias": [S0], "2.weight": [S1], "2.bias": [R]}
    for name, placements in layout.items():
        mod, attr = model[int(name[0])], name.split(".")[1]
        setattr(mod, attr, torch.nn.Parameter(dist.shard_tensor(getattr(mod, attr).detach(), mesh, placements)))
    return model


def _train_step(model, opt, i):
    torch.manual_seed(100 + i)
    x = torch.randn(5, 4)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _params(model):
    return {k: dist.unshard_dtensor(v.detach()) for k, v in model.named_parameters()}


def _optimizer_round_trip(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    model = _model(mesh, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for i in range(2):
        _train_step(model, opt, i)
    state = opt.state_dict()["state"][0]
    assert isinstance(state["exp_avg"], dist.DistTensor) and not isinstance(state["step"], dist.DistTensor)
    save_state_dict({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    _train_step(model, opt, 2)
    reference = _params(model)

    results = []
    for fresh in (True, False):
        model2 = _model(mesh, 1)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, betas=(0.5, 0.5))
        if not fresh:  # state exists already: loaded in place
            _train_step(model2, opt2, 7)
        sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        load_state_dict(sd, path)
        opt2.load_state_dict(sd["optim"])
        group = opt2.param_groups[0]
        assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
        for p, p_ref in zip(opt2.param_groups[0]["params"], opt.param_groups[0]["params"]):
            s = opt2.state[p]
            assert float(s["step"]) == 2.0
            assert isinstance(s["exp_avg"], dist.DistTensor) and s["exp_avg"].placements == p.placements
        _train_step(model2, opt2, 2)
        got = _params(model2)
        results.append(all(torch.allclose(got[k], reference[k], atol=1e-6) for k in reference))
    return results


def test_optimizer_state_round_trip_then_optimizer_load_state_dict(tmp_path):
    assert run_dist(_optimizer_round_trip, 2, str(tmp_path / "opt")) == [[True, True]] * 2


# -- atomicity ---------------------------------------------------------------------------------------
def _sd(mesh, value):
    return {"w": dist.shard_tensor(torch.full((6, 4), float(value)), mesh, [S0]), "b": torch.full((3,), float(value)),
            "step": value}


def _loaded_value(mesh, path):
    target = _sd(mesh, -1)
    load_state_dict(target, path)
    w = dist.unshard_dtensor(target["w"])
    assert (w == w[0, 0]).all() and (target["b"] == w[0, 0]).all() and target["step"] == int(w[0, 0])
    return int(target["step"])


def _crash_while_writing(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    save_state_dict(_sd(mesh, 1), path)
    write = save_mod._write_rank_file

    def write_then_fail(tensors, filename):
        write(tensors, filename)
        raise OSError("No space left on device (simulated)")

    if dist.get_rank() == 1:
        save_mod._write_rank_file = write_then_fail
    try:
        failure = _failure(save_state_dict, _sd(mesh, 2), path)
    finally:
        save_mod._write_rank_file = write
    leftovers = glob.glob(os.path.join(os.path.dirname(path), ".*"))
    before = _loaded_value(mesh, path)
    save_state_dict(_sd(mesh, 3), path)  # and the next save works
    return failure, leftovers, before, _loaded_value(mesh, path)


def test_failed_write_on_one_rank_keeps_previous_checkpoint(tmp_path):
    results = run_dist(_crash_while_writing, 2, str(tmp_path / "ckpt"))
    for failure, leftovers, before, after in results:
        name, msg, _ = failure
        assert name == "CheckpointError" and "rank 1" in msg and "No space left" in msg, msg
        assert "unchanged" in msg
        assert leftovers == [] and before == 1 and after == 3


class _Crash(BaseException):
    """Stands for the process dying: no cleanup code runs."""


@pytest.mark.parametrize("stage,exchange,survivor", [
    ("files_written", True, 1),
    ("metadata_written", True, 1),
    ("swapped", True, 2),
    ("metadata_written", False, 1),
    ("old_moved_away", False, 1),   # the path is briefly missing: load finds the old one
    ("new_in_place", False, 2),
])
def test_crash_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, stage, exchange, survivor):
    path = str(tmp_path / "ckpt")
    sd = lambda v: {"w": torch.full((6, 4), float(v)), "b": torch.full((3,), float(v)), "step": v}  # noqa: E731
    save_state_dict(sd(1), path)

    def crash(at):
        if at == stage:
            raise _Crash(at)

    with monkeypatch.context() as m:
        m.setattr(save_mod, "_crash_point", crash)
        if not exchange:
            m.setattr(save_mod, "_exchange", lambda a, b: False)
        with pytest.raises(_Crash):
            save_state_dict(sd(2), path)
    target = sd(0)
    with pytest.warns(UserWarning, match="interrupted save") if stage == "old_moved_away" else contextlib.nullcontext():
        load_state_dict(target, path)
    assert target["step"] == survivor and (target["w"] == survivor).all() and (target["b"] == survivor).all()
    save_state_dict(sd(3), path)  # a later save succeeds and removes what the crash left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)
    load_state_dict(target, path)
    assert target["step"] == 3


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        save_state_dict({"w": torch.ones(2)}, str(tmp_path / "data"))
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["data"]


def _differing_state_dicts(path):
    sd = {"w": torch.ones(2)} if dist.get_rank() == 0 else {"w": torch.ones(3)}
    return _failure(save_state_dict, sd, path)


def test_state_dicts_differing_across_ranks_fail_everywhere(tmp_path):
    for name, msg, _ in run_dist(_differing_state_dicts, 2, str(tmp_path / "ckpt")):
        assert "differ across ranks" in msg
    assert not os.path.exists(tmp_path / "ckpt")


# -- verification ----------------------------------------------------------------------------------------
def _save_small(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    sd = {"layer.weight": dist.shard_tensor(_full((8, 4)), mesh, [S0]),
          "layer.bias": dist.shard_tensor(_full((8,)), mesh, [S0]),
          "norm": torch.ones(4)}
    save_state_dict(sd, path)


def _targets_2(shape=(8, 4), extra=False):
    """Sentinel targets (all 7) under another layout: Shard(1), so pieces are read in slices."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    t = {"layer.weight": dist.shard_tensor(torch.full(shape, 7.0), mesh, [S1]),
         "layer.bias": dist.shard_tensor(torch.full((8,), 7.0), mesh, [R]),
         "norm": torch.full((4,), 7.0)}
    if extra:
        t["extra.weight"] = torch.full((2,), 7.0)
    return t


def _load_expecting_failure(path, shape=(8, 4), extra=False):
    target = _targets_2(shape, extra)
    failure = _failure(load_state_dict, target, path)
    unchanged = all((v.local_value() if isinstance(v, dist.DistTensor) else v).eq(7).all() for v in target.values())
    return failure + (bool(unchanged),)


def _tensor_span(filename, key):
    """Byte range of tensor `key`'s data in a safetensors file."""
    with open(filename, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    a, b = header[key]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _assert_everywhere(results, *needles, not_found=False):
    messages = {msg for _, msg, _, _ in results}
    assert len(messages) == 1, messages  # the same error on every rank
    for name, msg, is_fnf, unchanged in results:
        assert unchanged, "a target was modified"
        assert is_fnf == not_found, (name, msg)
        for needle in needles:
            assert needle in msg, (needle, msg)


def test_flipped_byte_is_caught_on_every_rank_targets_unchanged(tmp_path):
    path = str(tmp_path / "ckpt")
    run_dist(_save_small, 2, path)
    fname = os.path.join(path, "rank00001.safetensors")
    start, stop = _tensor_span(fname, "layer.weight")
    with open(fname, "r+b") as f:
        f.seek(start + 5)
        byte = f.read(1)
        f.seek(start + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    # rank 1 alone reads that piece whole (the other rank only slices it), yet both fail
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path),
                       "'layer.weight'", "rank00001.safetensors", "checksum mismatch")
    # a one-process plain load reads it whole
    (_, msg, _), = [_failure(load_state_dict, {"layer.weight": torch.zeros(8, 4)}, path)]
    assert "'layer.weight'" in msg and "rank00001.safetensors" in msg and "checksum" in msg


def test_truncated_file_is_caught_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_dist(_save_small, 2, path)
    fname = os.path.join(path, "rank00000.safetensors")
    with open(fname, "r+b") as f:
        f.truncate(os.path.getsize(fname) - 10)
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), "rank00000.safetensors", "truncated", "tensor '")


def test_corrupted_metadata_and_header(tmp_path):
    path = str(tmp_path / "ckpt")
    run_dist(_save_small, 2, path)
    meta = os.path.join(path, "metadata.json")
    text = open(meta).read()
    open(meta, "w").write(text[: len(text) // 2])
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), "metadata.json", "not valid JSON")
    open(meta, "w").write(text)
    fname = os.path.join(path, "rank00001.safetensors")
    with open(fname, "r+b") as f:  # clobber the header, same size
        f.seek(8)
        f.write(b"#")
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), "rank00001.safetensors", "tensor '")


def test_edited_metadata_that_stays_valid_is_caught(tmp_path):
    """Swapping the boxes of two pieces keeps metadata.json valid, would load the rows in the
    wrong places, and is caught by the metadata's own checksum on every rank."""
    path = str(tmp_path / "ckpt")
    run_dist(_save_small, 2, path)
    meta_path = os.path.join(path, "metadata.json")
    meta = json.load(open(meta_path))
    pieces = meta["tensors"]["layer.weight"]["pieces"]
    assert len(pieces) == 2
    pieces[0]["box"], pieces[1]["box"] = pieces[1]["box"], pieces[0]["box"]
    json.dump(meta, open(meta_path, "w"), indent=1)
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), "metadata.json", "does not match its checksum")


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = str(tmp_path / "ckpt")
    run_dist(_save_small, 2, path)
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path, (8, 6)),
                       "'layer.weight'", "shape [8, 4]", "shape [8, 6]")
    (_, msg, _), = [_failure(load_state_dict, {"norm": torch.zeros(4, dtype=torch.float16)}, path)]
    assert "'norm'" in msg and "float32" in msg and "float16" in msg


def test_missing_path_key_and_file(tmp_path):
    path = str(tmp_path / "ckpt")
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), str(tmp_path / "ckpt"), "does not exist",
                       not_found=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict({"w": torch.zeros(2)}, path)
    run_dist(_save_small, 2, path)
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path, (8, 4), True), "'extra.weight'", "not in the checkpoint")
    os.remove(os.path.join(path, "rank00001.safetensors"))
    _assert_everywhere(run_dist(_load_expecting_failure, 2, path), "rank00001.safetensors", "missing", "tensor '")
    with pytest.raises(CheckpointNotFoundError):
        load_state_dict({"w": torch.zeros(2)}, str(tmp_path))  # a directory without metadata
