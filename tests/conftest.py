"""Shared pytest setup.  Keep generic; add fixtures below."""
import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:  # `from distpool import run_dist` (pytest.ini also sets this)
    sys.path.insert(0, _TESTS_DIR)


def pytest_sessionfinish(session, exitstatus):
    # Stop the rank-process pools of tests/distpool.py while pytest can still report.
    distpool = sys.modules.get("distpool")
    if distpool is not None:
        distpool.shutdown()
