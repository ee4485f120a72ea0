"""docs/zero.md: its first example runs on two ranks and prints what its comments say."""
import contextlib
import io
import os
import re

from distpool import run_dist

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "zero.md")


def _example() -> str:
    with open(DOC) as f:
        return re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)


def _run(code: str) -> list:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, DOC, "exec"), {"__name__": "__main__"})
    return out.getvalue().splitlines()


def test_the_zero_page_example_prints_what_it_says():
    code = _example()
    expected = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    assert len(expected) == 3
    for printed in run_dist(_run, 2, code):
        assert printed == expected, (printed, expected)
