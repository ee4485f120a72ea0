"""`python -m autopar.plan`: the planner's command line (autopar/planner/cli.py).

`autopar.plan` is also the planner function (`dist.plan(...)`).  Running this file with
`-m` leaves that name alone (runpy executes it as __main__); importing it as the module
`autopar.plan` rebinds the name to the module, so the module is made callable as the
function: `dist.plan(...)` works either way.
"""
import sys
import types

from .planner.api import plan as _plan
from .planner.cli import main


class _CallablePlanModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _plan(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallablePlanModule
