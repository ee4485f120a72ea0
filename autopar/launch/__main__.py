"""Entry point of ``python -m autopar.launch`` (see :mod:`autopar.launch`)."""
import sys

from . import main

if __name__ == "__main__":
    # Worker lines reach our stdout from a tailing thread; flush them line by
    # line even when stdout is a pipe (``... | tee train.log``), not at exit.
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
