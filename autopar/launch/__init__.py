"""``python -m autopar.launch``: start the ranks of a training script, torchrun-style.

autopar programs are SPMD: one process per device, all running the same
script. This package starts those processes through torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``) rather than spawning them
itself, so rendezvous (single- and multi-node), restarts and teardown are the
battle-tested torchrun machinery. On top of it the launcher adds what autopar
relies on:

* stores that listen on one address: loopback for a single node (on a free port
  when the job names none: no collisions on 29500), an explicit address for
  several; the c10d rendezvous state HMAC-signed with the job's secret
  (``AUTOPAR_RDZV_TOKEN``) and verified before it is unpickled;
* ``--max_restarts N`` that restarts: each attempt's ranks get a fresh store;
* ``--join_timeout SECONDS``: a node that never joins ends the job, named;
* ``--devices 0,1,...``: one rank per listed device, the list exported as
  ``AUTOPAR_DEVICES`` so a rank uses ``devices[int(os.environ["LOCAL_RANK"])]``;
* ``OMP_NUM_THREADS=1`` unless the user set it;
* every rank's output on the launcher's stdout/stderr, each line tagged
  ``[rank<N>]: `` once; a progress bar's carriage-return updates redraw the line
  on a terminal and leave only its last state in a log; ``--log-ranks 0,2`` (or
  torchrun's ``--local-ranks-filter``) shows chosen ranks only;
* a rank that fails stops the whole job at once: the other ranks are killed,
  the failing rank's traceback is on stderr (quoted in the summary when its
  output was hidden; the summary's root cause is the rank that failed first),
  the launcher exits non-zero;
* each rank runs the script through :mod:`._worker`, which ends it with
  ``os._exit`` after its threads and atexit handlers: a correct job exits 0,
  and a rank that exits early ends the job in seconds (see docs/failures.md).

Run ``python -m autopar.launch --help`` for the options; see :func:`main` and
docs/failures.md.
"""
from ._run import main

__all__ = ["main"]
