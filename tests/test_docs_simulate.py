"""docs/simulate.md's examples run in a plain process (simulating needs one outside any job)."""
import os
import re

from plain_process import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_simulate_page_examples_run():
    with open(os.path.join(ROOT, "docs", "simulate.md")) as f:
        page = f.read()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 4
    out = run_forked("\n".join(blocks))
    assert "all_reduce over ranks [4, 5, 6, 7]: 3072 bytes sent" in out, out
    printed = re.search(r"prints, in a few seconds:\n\n```\n(.*?)```", page, re.S).group(1)
    assert printed in out, out  # the meta simulation of 1024 ranks prints what the page shows
    assert re.search(r"predicted step [\d.]+ ms \(rank \d+: compute", out), out  # and prices its step
