"""Map launcher options onto torch elastic's ``LaunchConfig`` and worker command.

Process spawning, rendezvous, restarts and teardown are torch elastic's job;
this module only decides how to ask for them:

* the rendezvous (:mod:`._rendezvous`): a single node hosts its store on
  127.0.0.1 only, on a free port unless ``--master_port`` names one (so concurrent
  jobs on one machine never collide on 29500); several nodes use a static
  rendezvous hosted by node 0 on ``--master_addr``, or a c10d one whose state is
  signed with the job's ``--rdzv_token``; every wait for nodes is bounded by
  ``--join_timeout``;
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
import secrets
import sys
import uuid

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from . import _rendezvous as rdzv
from ._cli import TOKEN_ENV
from ._output import FollowedLogsSpecs, RankOutput

DEFAULT_MASTER_PORT = 29500
DEVICES_ENV = "AUTOPAR_DEVICES"


def _rendezvous_options(args: argparse.Namespace) -> tuple[str, str, str, dict, str | None]:
    """``(backend, endpoint, run_id, backend_configs, local_addr)`` for the elastic agent."""
    configs: dict = {"join_timeout": args.join_timeout}
    if args.rdzv_backend == "c10d":
        # A single node's secret need not be shared: a random one still refuses foreign writes.
        token = args.rdzv_token.encode() if args.rdzv_token else secrets.token_bytes(32)
        configs.update(args.rdzv_conf, secret=rdzv.Secret(token))
        local_addr = args.local_addr or rdzv.address_towards(args.rdzv_endpoint)
        return rdzv.C10D, args.rdzv_endpoint, args.rdzv_id, configs, local_addr
    configs["rank"] = args.node_rank
    if args.max_nodes == 1:  # nobody else needs to reach it: loopback only
        port = args.master_port or 0
        if args.rdzv_endpoint:
            port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=0)[1]
        run_id = f"standalone-{uuid.uuid4().hex}" if not port else args.rdzv_id
        return rdzv.STATIC, f"127.0.0.1:{port}", run_id, configs, None
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or DEFAULT_MASTER_PORT}"
    return rdzv.STATIC, endpoint, args.rdzv_id, configs, None


def shown(args: argparse.Namespace):
    """Whether a rank's output is shown: ``--log-ranks`` (global) and ``--local-ranks-filter``."""
    def show(rank: int, local_rank: int) -> bool:
        return ((args.log_ranks is None or rank in args.log_ranks)
                and (args.local_ranks_filter is None or local_rank in args.local_ranks_filter))

    return show


def launch_config(args: argparse.Namespace, log_dir: str, output: RankOutput) -> LaunchConfig:
    """The elastic ``LaunchConfig`` for parsed options, with per-rank logs under ``log_dir``
    forwarded by ``output``."""
    backend, endpoint, run_id, rdzv_configs, local_addr = _rendezvous_options(args)
    rdzv.register()
    return LaunchConfig(
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        nproc_per_node=args.nproc_per_node,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        local_addr=local_addr,
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
    The rendezvous secret (``AUTOPAR_RDZV_TOKEN``) is the launcher's alone: the ranks do not get it.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop(TOKEN_ENV, None)  # read already; a rank that logs its environment must not leak it
    if args.devices is not None:
        os.environ[DEVICES_ENV] = ",".join(map(str, args.devices))
