"""Map launcher options onto torch elastic's ``LaunchConfig`` and worker command.

Process spawning, rendezvous, restarts and teardown are torch elastic's job;
this module only decides how to ask for them:

* the rendezvous: a single node with no fixed port gets a private c10d store on
  a free port (what ``torchrun --standalone`` does), so concurrent jobs on one
  machine never collide on 29500; otherwise the options pass through as
  torchrun would pass them;
* worker output: every rank's stdout/stderr goes to per-rank log files, which
  :mod:`._output` forwards onto the launcher's own streams, each line tagged
  ``[rank<N>]: `` once (``--log-ranks`` picks whose). That is what puts a failing
  rank's traceback on the launcher's stderr even when the script does not
  decorate its main with elastic's ``@record``;
* the environment every rank inherits on top of what elastic sets (RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid

from torch.distributed.launcher.api import LaunchConfig

from ._output import FollowedLogsSpecs, RankOutput

DEFAULT_MASTER_PORT = 29500
DEVICES_ENV = "AUTOPAR_DEVICES"


def _rendezvous(args: argparse.Namespace) -> tuple[str, str, str, dict]:
    """``(backend, endpoint, run_id, backend_configs)`` for the elastic agent."""
    if args.rdzv_backend != "static":
        return args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, {}
    if args.max_nodes == 1 and not args.rdzv_endpoint and not args.master_port:
        return "c10d", "localhost:0", f"standalone-{uuid.uuid4().hex}", {}
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or DEFAULT_MASTER_PORT}"
    return "static", endpoint, args.rdzv_id, {"rank": args.node_rank}


def shown(args: argparse.Namespace):
    """Whether a rank's output is shown: ``--log-ranks`` (global) and ``--local-ranks-filter``."""
    def show(rank: int, local_rank: int) -> bool:
        return ((args.log_ranks is None or rank in args.log_ranks)
                and (args.local_ranks_filter is None or local_rank in args.local_ranks_filter))

    return show


def launch_config(args: argparse.Namespace, log_dir: str, output: RankOutput) -> LaunchConfig:
    """The elastic ``LaunchConfig`` for parsed options, with per-rank logs under ``log_dir``
    forwarded by ``output``."""
    backend, endpoint, run_id, rdzv_configs = _rendezvous(args)
    return LaunchConfig(
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        nproc_per_node=args.nproc_per_node,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts,
        logs_specs=FollowedLogsSpecs(log_dir, output, shown(args)),
    )


def worker_command(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``(executable, argv)`` each rank runs: unbuffered Python running the script or module
    through :mod:`autopar.launch._worker` (which ends the rank quickly and surely)."""
    mode = ["-m"] if args.module else []
    return sys.executable, ["-u", "-m", "autopar.launch._worker", *mode, args.script, *args.script_args]


def export_worker_env(args: argparse.Namespace) -> None:
    """Put the launcher-level worker variables into ``os.environ``, which every rank inherits.

    ``OMP_NUM_THREADS`` defaults to 1 (N ranks each spinning up one OpenMP thread
    per core oversubscribes the machine); a value the user set is kept.
    ``AUTOPAR_DEVICES`` lists ``--devices`` so a rank can pick ``devices[LOCAL_RANK]``.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.devices is not None:
        os.environ[DEVICES_ENV] = ",".join(map(str, args.devices))
