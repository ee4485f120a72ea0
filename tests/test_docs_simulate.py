"""docs/simulate.md's examples run in a plain process (simulating needs one outside any job)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_simulate_page_examples_run():
    with open(os.path.join(ROOT, "docs", "simulate.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True,
                          env=dict(env, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all_reduce over ranks [4, 5, 6, 7]: 3072 bytes sent" in done.stdout, done.stdout
