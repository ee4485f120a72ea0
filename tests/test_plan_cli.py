"""`python -m autopar.planner`: Llama-3 70B on 1024 H100s as JSON within the time limit, the
calibration command, and the old spelling `python -m autopar.plan`, which leaves `dist.plan`
the planner function."""
import dataclasses
import json
import os
import runpy
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_70B = ("--model llama --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab 128256 "
              "--seq 4096 --global-batch 1024 --ranks 1024 --device h100").split()


def _cli(*args, timeout=120, command="autopar.planner"):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", command, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_llama3_70b_on_1024_h100_json():
    start = time.monotonic()
    out = _cli(*LLAMA3_70B, "--compare", "tp8,pp4", "--json")
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    assert elapsed < 120
    plan = json.loads(out.stdout)
    assert {"config", "memory_per_rank_bytes", "bytes_per_step", "step_time_s", "mfu"} <= set(plan)
    assert plan["memory_per_rank_bytes"]["total"] <= 80e9
    assert 0.30 <= plan["mfu"] <= 0.50, plan["mfu"]  # Meta: 38-43% for Llama 3 405B on H100
    d = plan["degrees"]
    assert d["dp"] * d.get("sep", 1) * d["mp"] * d["pp"] == 1024 and d["mp"] <= 8
    assert plan["compare"]["layout"].startswith("dp32 tp8 pp4")
    assert plan["step_time_s"] <= plan["compare"]["step_time_s"]
    assert set(plan["bytes_per_step"]) <= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    assert plan["config"]["dp_config"]["sharding_level"] in (0, 1, 2, 3)
    assert sum(plan["stage_layers"]) == 80 and len(plan["stage_layers"]) == d["pp"]


def test_png_draws_stages_and_memory(tmp_path):
    path = tmp_path / "plan.png"
    out = _cli("--layers", "8", "--hidden", "1024", "--heads", "8", "--ffn", "4096", "--vocab", "32000",
               "--seq", "2048", "--global-batch", "32", "--ranks", "16", "--fix", "pp4", "--png", str(path))
    assert out.returncode == 0, out.stderr
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_text_output_and_bad_arguments():
    out = _cli("--layers", "4", "--hidden", "512", "--heads", "8", "--ffn", "2048", "--vocab", "8000",
               "--seq", "1024", "--global-batch", "16", "--ranks", "8", "--compare", "tp2")
    assert out.returncode == 0, out.stderr
    assert "plan: dp" in out.stdout and "MFU" in out.stdout and "compared: dp4 tp2 pp1" in out.stdout
    bad = _cli("--compare", "xx8")
    assert bad.returncode == 2 and "'xx8'" in bad.stderr
    none = _cli("--ranks", "5", "--global-batch", "3", "--layers", "4")
    assert none.returncode == 2 and "no dp x cp x tp x pp layout of 5 ranks" in none.stderr


def test_calibrate_writes_the_measured_profile(tmp_path, monkeypatch, capsys):
    """The command writes what `calibrate()` measures, as a profile that loads; the measuring
    itself (GEMMs, memory, gloo links on spawned ranks) is test_predict's calibration test."""
    from autopar.planner import cli, cost, load_profile

    measured = dataclasses.replace(cost.CPU, peak_flops_fp32=1.5e10, intra_latency=3e-5)
    monkeypatch.setattr(cli, "calibrate", lambda: measured)
    path = tmp_path / "cpu.json"
    assert cli.main(["--calibrate", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert json.loads(path.read_text())["name"] == "cpu"
    assert load_profile(str(path)) == measured


def test_the_old_spelling_runs_the_command_line():
    out = _cli("--help", command="autopar.plan")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m autopar.planner")


def test_dist_plan_stays_the_function_after_the_old_command_and_an_import_of_it(monkeypatch, capsys):
    """`autopar.plan` is the function: the old command runs without importing a module of that
    name, and importing one is refused (it would rebind `autopar.plan` to the module)."""
    import autopar as dist
    from autopar.planner.api import plan

    monkeypatch.setattr(sys, "argv", ["autopar.plan", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("autopar.plan", run_name="__main__", alter_sys=True)
    assert done.value.code == 0 and "python -m autopar.planner" in capsys.readouterr().out
    assert dist.plan is plan
    with pytest.raises(ImportError, match="python -m autopar.planner"):
        import autopar.plan  # noqa: F401
    assert dist.plan is plan


def test_parse_degrees():
    from autopar.planner.cli import parse_degrees

    assert parse_degrees("tp8,pp4") == {"mp": 8, "pp": 4}
    with pytest.raises(Exception, match="'pp'"):
        parse_degrees("pp")
