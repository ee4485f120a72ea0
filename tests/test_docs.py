"""Every docstring example of the public API runs (on a one-rank world) and prints what it says."""
import doctest
import importlib
import pkgutil

import autopar
from distpool import run_dist


def _doctest_all():
    failed, attempted = {}, {}
    names = ["autopar"] + [m.name for m in pkgutil.walk_packages(autopar.__path__, "autopar.")]
    for name in names:
        if name.startswith("autopar.launch"):
            continue  # the launcher's examples are shell commands
        if name == "autopar.plan":
            continue  # the old spelling of python -m autopar.planner: run, never imported
        if name == "autopar.tools.simulate":
            continue  # simulating needs a process outside any job: test_simulate runs its example
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
        attempted[name] = result.attempted
        if result.failed:
            failed[name] = result.failed
    return failed, attempted


def test_docstring_examples_run():
    failed, attempted = run_dist(_doctest_all, 1)[0]
    assert not failed, failed
    for name in ("autopar", "autopar.api.tensors", "autopar.api.optimizer", "autopar.static.dist_model",
                 "autopar.comm.log", "autopar.api.parallelize", "autopar.api.plans", "autopar.runtime.local_region"):
        assert attempted[name] > 0, (name, attempted)
