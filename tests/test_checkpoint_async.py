"""save_state_dict(..., async_save=True): the checkpoint holds the values at the call while
training changes them, errors reach every rank at wait() or the next save, a second save and
the process's exit wait for the first."""
import os
import textwrap

import pytest
import torch

import autopar as dist
from autopar.checkpoint import CheckpointError, load_state_dict, save_state_dict
from autopar.checkpoint import save as save_mod
from autopar.placement import Partial, Replicate, Shard
from distpool import run_dist
from plain_process import run_plain


def _state(mesh, offset=0.0):
    """Sharded (uneven), replicated, Partial, a plain tensor, an int and a bf16 piece."""
    g = torch.Generator().manual_seed(3)
    full = {k: torch.randn(*s, generator=g) + offset for k, s in (("w", (5, 3)), ("b", (4,)), ("p", (2, 2)))}
    return {
        "model": {"w": dist.shard_tensor(full["w"], mesh, [Shard(0)]),
                  "b": dist.shard_tensor(full["b"].bfloat16(), mesh, [Replicate()]),
                  "p": dist.dtensor_from_local(full["p"] / 2, mesh, [Partial()])},
        "plain": full["w"][:2].clone() + 1,
        "step": 7,
    }


def _values(sd):
    return {"w": dist.unshard_dtensor(sd["model"]["w"]).clone(), "b": dist.unshard_dtensor(sd["model"]["b"]).clone(),
            "p": dist.unshard_dtensor(sd["model"]["p"]).clone(), "plain": sd["plain"].clone(), "step": sd["step"]}


def _zeros_like(sd):
    return {"model": {k: dist.dtensor_from_fn(torch.zeros, v.process_mesh, [Shard(0)], list(v.shape), dtype=v.dtype)
                      for k, v in sd["model"].items()},
            "plain": torch.zeros_like(sd["plain"]), "step": 0}


def _train_while_saving(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sd = _state(mesh)
    at_call = _values(sd)
    handle = save_state_dict(sd, path, async_save=True)
    with torch.no_grad():  # training goes on while the thread writes
        for t in list(sd["model"].values()) + [sd["plain"]]:
            t.mul_(-3).add_(1)
    changed = _values(sd)
    handle.wait()
    assert handle.done()
    back = _zeros_like(sd)
    load_state_dict(back, path)
    loaded = _values(back)
    return at_call, changed, loaded


def test_an_async_save_holds_the_values_at_the_call_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    for at_call, changed, loaded in run_dist(_train_while_saving, 2, path):
        assert not torch.equal(changed["w"], at_call["w"])
        for k in ("w", "b", "p", "plain"):
            assert loaded[k].dtype == at_call[k].dtype
            assert torch.equal(loaded[k], at_call[k]), k
        assert loaded["step"] == 7
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or lock file left


def _calls_collectives(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sd = _state(mesh)
    logs = []
    for async_save in (True, False):
        with dist.comm_log() as log:
            handle = save_state_dict(sd, path, async_save=async_save)
        if handle is not None:
            handle.wait()
        logs.append([r.op for r in log])
    return logs


def test_an_async_save_call_meets_the_other_ranks_once(tmp_path):
    """The call agrees once (an all-gather of the lengths, one of the JSON) and reduces the
    Partial tensor; the thread does the rest on its own group.  A blocking save agrees four
    times on the training's groups (the claim and the entries; every rank sees the claim;
    the files are written; the checkpoint is in place)."""
    for async_ops, blocking_ops in run_dist(_calls_collectives, 2, str(tmp_path / "ckpt")):
        assert async_ops == ["all_gather", "all_gather", "all_reduce"], async_ops
        assert blocking_ops == ["all_gather", "all_gather", "all_reduce"] + ["all_gather"] * 6, blocking_ops

def _second_save_waits(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    first, second = _state(mesh), _state(mesh, offset=100.0)
    save_state_dict(first, path, async_save=True)
    save_state_dict(second, path)  # waits for the first, then replaces it
    back = _zeros_like(second)
    load_state_dict(back, path)
    return _values(second), _values(back)


def test_a_second_save_waits_for_the_first(tmp_path):
    path = str(tmp_path / "ckpt")
    for want, got in run_dist(_second_save_waits, 2, path):
        for k in ("w", "b", "p", "plain"):
            assert torch.equal(got[k], want[k]), k
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _failing_async_save(path, wait):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    save_state_dict(_state(mesh), path)
    original = save_mod._write_rank_file

    def fail_on_rank1(payload, filename):
        if dist.get_rank() == 1:
            raise OSError("disk full")
        original(payload, filename)

    save_mod._write_rank_file = fail_on_rank1
    try:
        handle = save_state_dict(_state(mesh, offset=5.0), path, async_save=True)
        try:
            handle.wait() if wait else save_state_dict(_state(mesh, offset=9.0), path)
        except CheckpointError as e:
            message = str(e)
        else:
            raise AssertionError("the failed save's error was lost")
    finally:
        save_mod._write_rank_file = original
    save_state_dict(_state(mesh, offset=9.0), path, async_save=True).wait()  # seen: not raised again
    back = _zeros_like(_state(mesh))
    load_state_dict(back, path)
    return message, _values(back)["w"], _values(_state(mesh, offset=9.0))["w"]


@pytest.mark.parametrize("wait", [True, False], ids=["at_wait", "at_next_save"])
def test_an_async_save_error_reaches_every_rank(tmp_path, wait):
    path = str(tmp_path / "ckpt")
    for message, w, want in run_dist(_failing_async_save, 2, path, wait):
        assert "[rank 1]" in message and "disk full" in message and "is unchanged" in message, message
        assert torch.equal(w, want)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_the_process_exit_waits_for_an_async_save(tmp_path):
    path = str(tmp_path / "ckpt")
    run_plain(textwrap.dedent(f"""
        import time, torch
        from autopar.checkpoint import save as save_mod
        write = save_mod._write_rank_file
        save_mod._write_rank_file = lambda *a: (time.sleep(1.0), write(*a))
        save_mod.save_state_dict({{"w": torch.arange(6.)}}, {path!r}, async_save=True)
        print("returned")  # the script ends here, the thread still writing
    """))
    sd = {"w": torch.zeros(6)}
    load_state_dict(sd, path)
    assert torch.equal(sd["w"], torch.arange(6.))


def test_the_rank_files_are_safetensors_files_safetensors_reads_back(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from autopar.checkpoint.safetensors_file import DTYPE_NAMES, write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {f"t_{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=g) * 20).to(d)
               for d in DTYPE_NAMES}
    tensors["empty"] = torch.zeros(0, 4)
    write_safetensors(tensors, str(tmp_path / "f.safetensors"), {"writer": "autopar"})
    back = load_file(str(tmp_path / "f.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert f.metadata() == {"writer": "autopar"}
        assert torch.equal(f.get_slice("t_float32")[1:3], tensors["t_float32"][1:3])


def _load_right_after(path):
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sd = _state(mesh, offset=42.0)
    save_state_dict(sd, path, async_save=True)  # not waited for
    back = _zeros_like(sd)
    load_state_dict(back, path)
    return _values(sd), _values(back)


def test_a_load_sees_an_async_save_made_before_it(tmp_path):
    for want, got in run_dist(_load_right_after, 2, str(tmp_path / "ckpt")):
        for k in ("w", "b", "p", "plain"):
            assert torch.equal(got[k], want[k]), k
