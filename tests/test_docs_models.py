"""docs/models.md's example runs on 2 ranks (its asserts compare with one process)."""
import os
import re

from distpool import run_dist

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "models.md")


def _run_first_example() -> bool:
    with open(PAGE) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    exec(compile(code, PAGE, "exec"), {"__name__": "__docs__"})
    return True


def test_models_page_example_runs_on_two_ranks():
    assert all(run_dist(_run_first_example, 2))
