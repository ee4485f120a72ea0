"""Every page of docs/ starts with a runnable example, and the suite runs it.

A page whose first python block starts with `# ranks: N` runs here on an N-rank world (its
asserts are the check); any other page has its own tests/test_docs_<page>.py."""
import os
import re

import pytest

from distpool import run_dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _first_example(page: str) -> str:
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    found = re.search(r"```python\n(.*?)```", text, re.S)
    first_section = text.find("\n## ")
    assert found and (first_section < 0 or found.start() < first_section), \
        f"docs/{page} must start with a runnable python example, before its first section"
    return found.group(1)


def _pages() -> list:
    return sorted(p for p in os.listdir(DOCS) if p.endswith(".md"))


def _run_example(code: str) -> bool:
    exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs__"})
    return True


@pytest.mark.parametrize("page", _pages())
def test_page_example_runs(page):
    code = _first_example(page)
    ranks = re.match(r"#\s*ranks:\s*(\d+)", code)
    if ranks is None:
        own_test = os.path.join(ROOT, "tests", f"test_docs_{page[:-3]}.py")
        assert os.path.exists(own_test), f"docs/{page}: its example has no '# ranks: N' line and no {own_test} runs it"
        return
    assert all(run_dist(_run_example, int(ranks.group(1)), code))
