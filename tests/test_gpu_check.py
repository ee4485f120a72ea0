"""benchmarks/gpu/check.sh --dry-run: the GPU check runs on this machine's CPU at toy size, so
that it cannot rot before a GPU runs it."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_runs_dry_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    done = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(env, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("torch ") and lines[1].startswith("CPU: Llama"), lines
    for variant in ("plain", "autopar", "simulated"):
        assert any(re.match(rf"  {variant} +[\d,]+ tok/s  MFU [\d.]+%  peak [\d,]+ MiB  comm \d+%", line) for line in lines), (
            variant, lines)
    assert re.search(r"autopar .*x plain's step", done.stdout)
    assert re.search(r"worst relative difference 0\.00e\+00 .* simulated rank: \d+ collectives, 0 attention gathers",
                     done.stdout), done.stdout
