"""`python -m autopar.plan`: the old spelling of `python -m autopar.planner`, the planner's
command line.  It is run, never imported: `autopar.plan` is the planner function
(`dist.plan`), and importing a module of that name would rebind the name to the module."""
if __name__ != "__main__":
    raise ImportError("autopar.plan is the planner function (dist.plan), not a module to import; "
                      "the planner's command line is python -m autopar.planner")

import sys

from .planner.cli import main

sys.exit(main())
