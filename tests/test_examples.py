"""The four strategies of Paddle's auto-parallel training guide (dynamic, and static through
`to_static`), Paddle's parallelize API on a Llama and the main job, launched as users launch
them, with --check (each exits non-zero unless every loss and the final weights match the
single-process run)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--hidden", "64", "--ffn", "128", "--seq", "8"]


@pytest.mark.parametrize(
    "script, nproc, args",
    [
        ("data_parallel.py", 4, SMALL),
        ("tensor_parallel.py", 4, SMALL),
        ("pipeline_parallel.py", 4, SMALL),
        ("hybrid_parallel.py", 8, SMALL),
        # the same four programs as captured programs (dist.to_static)
        ("data_parallel.py", 4, SMALL + ["--static"]),
        ("tensor_parallel.py", 4, SMALL + ["--static"]),
        ("pipeline_parallel.py", 4, SMALL + ["--static"]),
        ("hybrid_parallel.py", 8, SMALL + ["--static"]),
        ("parallelize_llama.py", 8, SMALL),  # dist.parallelize, dp2 x mp2 x pp2
        ("parallelize_llama.py", 8, SMALL + ["--static"]),
        ("train_gpt.py", 4, ["--steps", "6"]),
        ("train_gpt.py", 4, ["--steps", "6", "--static"]),
        ("train_gpt.py", 4, ["--steps", "6", "--merge", "3"]),  # gradient accumulation
        ("train_gpt.py", 4, ["--steps", "6", "--merge", "3", "--static"]),  # Strategy.gradient_merge
        # pipeline x tensor parallel: micro-batches in 1F1B order (dynamic), in VPP order (static)
        ("train_gpt.py", 4, ["--steps", "4", "--pp", "2", "--schedule", "1F1B", "--micro-batches", "4"]),
        ("train_gpt.py", 4, ["--steps", "4", "--pp", "2", "--schedule", "VPP", "--vpp", "2", "--layers", "4",
                             "--micro-batches", "4", "--static"]),
    ],
)
def test_example_matches_single_process(script, nproc, args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "autopar.launch", "--nproc_per_node", str(nproc), f"examples/{script}", "--check", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "match the single-process run" in out
