"""The four strategies of Paddle's auto-parallel training guide (dynamic, and static through
`to_static`), Paddle's parallelize API on a Llama and the main job, each with --check (a rank
fails unless every loss and the final weights match the single-process run).

The 4-rank guide scripts are launched once as users launch them (`python -m autopar.launch`);
their other variants, the 8-rank scripts and the main job's (launched by test_launch.py's
summary test) run on a pooled world through the launcher's own rank code
(tests/pooled_launch.py), which spares a fresh interpreter importing torch per rank (seconds
each on two cores: 10 s more for an 8-rank launch)."""
import os
import subprocess
import sys

import pytest

from pooled_launch import run_launched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--hidden", "64", "--ffn", "128", "--seq", "8"]
LAUNCHED = "launched"  # marks the case of a script run through the launcher
POOLED = "pooled"
MATCHED = "match the single-process run"  # what _check.compare prints on rank 0


@pytest.mark.parametrize(
    "script, nproc, args, how",
    [
        ("data_parallel.py", 4, SMALL, LAUNCHED),
        ("tensor_parallel.py", 4, SMALL, LAUNCHED),
        ("pipeline_parallel.py", 4, SMALL, LAUNCHED),
        ("hybrid_parallel.py", 8, SMALL, POOLED),
        # the same four programs as captured programs (dist.to_static)
        ("data_parallel.py", 4, SMALL + ["--static"], POOLED),
        ("tensor_parallel.py", 4, SMALL + ["--static"], POOLED),
        ("pipeline_parallel.py", 4, SMALL + ["--static"], POOLED),
        ("hybrid_parallel.py", 8, SMALL + ["--static"], POOLED),
        ("parallelize_llama.py", 8, SMALL, POOLED),  # dist.parallelize, dp2 x mp2 x pp2
        ("parallelize_llama.py", 8, SMALL + ["--static"], POOLED),
        ("train_gpt.py", 4, ["--steps", "6"], POOLED),
        ("train_gpt.py", 4, ["--steps", "6", "--static"], POOLED),
        ("train_gpt.py", 4, ["--steps", "6", "--merge", "3"], POOLED),  # gradient accumulation
        ("train_gpt.py", 4, ["--steps", "6", "--merge", "3", "--static"], POOLED),  # Strategy.gradient_merge
        # pipeline x tensor parallel: micro-batches in 1F1B order (dynamic), in VPP order (static)
        ("train_gpt.py", 4, ["--steps", "4", "--pp", "2", "--schedule", "1F1B", "--micro-batches", "4"], POOLED),
        ("train_gpt.py", 4, ["--steps", "4", "--pp", "2", "--schedule", "VPP", "--vpp", "2", "--layers", "4",
                             "--micro-batches", "4", "--static"], POOLED),
    ],
)
def test_example_matches_single_process(script, nproc, args, how):
    if how == LAUNCHED:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "autopar.launch", "--nproc_per_node", str(nproc), f"examples/{script}", "--check",
               *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert MATCHED in out
        return
    assert MATCHED in run_launched(os.path.join(ROOT, "examples", script), nproc, ["--check", *args])[0]
