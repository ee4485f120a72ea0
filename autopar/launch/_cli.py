"""Command-line options of ``python -m autopar.launch``.

Parsing lives apart from the elastic wiring so that every usage mistake is
rejected here, by argparse (exit status 2, usage line on stderr), before a
rendezvous store or a single worker process exists. Option names follow
torchrun, in both ``--snake_case`` and ``--kebab-case`` spellings, so existing
command lines carry over.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

TOKEN_ENV = "AUTOPAR_RDZV_TOKEN"
BACKENDS = ("static", "c10d")


def _node_range(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> ``(min_nodes, max_nodes)``."""
    parts = value.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {value!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX, got {value!r}")
    return lo, hi


def _device_list(value: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]``: distinct non-negative device indices."""
    try:
        devices = [int(d) for d in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated device indices, got {value!r}") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"device indices must be distinct and >= 0, got {value!r}")
    return devices


def _rank_set(value: str) -> set[int]:
    """``"0"`` or ``"0,2"`` -> ``{0, 2}``."""
    try:
        ranks = {int(r) for r in value.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks, got {value!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be >= 0, got {value!r}")
    return ranks


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return seconds


RDZV_CONF_KEYS = ("last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
                  "keep_alive_max_attempt")


def _rdzv_conf(value: str) -> dict[str, float]:
    """``"last_call_timeout=5,keep_alive_interval=2"`` -> ``{...: 5.0, ...: 2.0}`` (c10d's timing knobs)."""
    conf = {}
    for item in filter(None, value.split(",")):
        key, _, number = item.partition("=")
        if key not in RDZV_CONF_KEYS:
            raise argparse.ArgumentTypeError(f"unknown key {key!r}; known: {', '.join(RDZV_CONF_KEYS)} "
                                             f"(the join timeout is --join_timeout)")
        conf[key] = _positive_seconds(number)
    return conf


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (no validation across options; see :func:`parse_args`)."""
    p = argparse.ArgumentParser(
        prog="python -m autopar.launch",
        description="Start the ranks of a training script on this node through torch elastic.",
    )
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=None,
                   help="ranks on this node (default: len(--devices), else 1)")
    p.add_argument("--devices", type=_device_list, default=None,
                   help="comma-separated device indices, one rank each; exported as AUTOPAR_DEVICES")
    p.add_argument("--nnodes", type=_node_range, default=(1, 1),
                   help="number of nodes, or MIN:MAX for an elastic range (default: 1)")
    p.add_argument("--node_rank", "--node-rank", type=int, default=0,
                   help="rank of this node (static rendezvous only)")
    p.add_argument("--master_addr", "--master-addr", default="127.0.0.1",
                   help="address of node 0, where its store listens (static rendezvous with several "
                        "nodes; a single node listens on 127.0.0.1 only)")
    p.add_argument("--master_port", "--master-port", type=int, default=None,
                   help="port on node 0; unset or 0 on a single node picks a free port")
    p.add_argument("--rdzv_backend", "--rdzv-backend", default="static",
                   help="rendezvous backend: static (default: fixed node ranks) or c10d (elastic "
                        "--nnodes MIN:MAX, its state signed with --rdzv_token)")
    p.add_argument("--rdzv_endpoint", "--rdzv-endpoint", default="",
                   help="rendezvous HOST:PORT (required for c10d; the node whose address it is hosts it)")
    p.add_argument("--rdzv_id", "--rdzv-id", default="none",
                   help="job id shared by all nodes of one job")
    p.add_argument("--rdzv_token", "--rdzv-token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"secret shared by every node of a c10d job, the key the rendezvous state is "
                        f"signed with (default: ${TOKEN_ENV}; prefer the variable, a command line is "
                        f"visible to other users of the machine)")
    p.add_argument("--rdzv_conf", "--rdzv-conf", type=_rdzv_conf, default={},
                   help=f"c10d timings, KEY=SECONDS,...: {', '.join(RDZV_CONF_KEYS)}")
    p.add_argument("--local_addr", "--local-addr", default=None,
                   help="address the other nodes reach this one at (c10d; default: this machine's "
                        "address on the route to --rdzv_endpoint); the workers' store listens there")
    p.add_argument("--join_timeout", "--join-timeout", type=_positive_seconds, default=300.0,
                   help="seconds to wait for every node to join (each attempt) before failing with "
                        "the missing nodes named (default: 300)")
    p.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                   help="times to restart all workers after a failure (default: 0)")
    p.add_argument("--log_dir", "--log-dir", default=None,
                   help="keep per-rank stdout/stderr/error files here (default: a temporary dir, removed)")
    p.add_argument("--log-ranks", "--log_ranks", type=_rank_set, default=None,
                   help="show only these (global) ranks' output, e.g. 0 or 0,2 (default: all); "
                        "the per-rank log files keep everything")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", type=_rank_set, default=None,
                   help="torchrun's spelling, by local rank: show only these local ranks' output")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name, like python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check launcher options; exits with status 2 on a usage error.

    On return ``nproc_per_node`` is resolved and ``min_nodes``/``max_nodes`` are set.

    >>> args = parse_args(["--devices", "0,1", "-m", "my_pkg.train", "--lr", "0.1"])
    >>> args.nproc_per_node, args.devices, args.script, args.script_args
    (2, [0, 1], 'my_pkg.train', ['--lr', '0.1'])
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.devices is not None:
        if args.nproc_per_node not in (None, len(args.devices)):
            parser.error(f"--nproc_per_node {args.nproc_per_node} disagrees with "
                         f"--devices {','.join(map(str, args.devices))} ({len(args.devices)} devices)")
        args.nproc_per_node = len(args.devices)
    elif args.nproc_per_node is None:
        args.nproc_per_node = 1
    if args.nproc_per_node < 1:
        parser.error(f"--nproc_per_node must be >= 1, got {args.nproc_per_node}")

    args.min_nodes, args.max_nodes = args.nnodes
    if not 0 <= args.node_rank < args.max_nodes:
        parser.error(f"--node_rank must be in [0, {args.max_nodes}), got {args.node_rank}")
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.master_port is not None and not 0 <= args.master_port < 65536:
        parser.error(f"--master_port must be in [0, 65536), got {args.master_port}")

    if args.rdzv_backend not in BACKENDS:
        parser.error(f"--rdzv_backend {args.rdzv_backend}: only static and c10d are offered (the etcd "
                     f"backends need an etcd server, and etcd-v2 unpickles what it reads from it)")
    if args.rdzv_backend == "static":
        if args.min_nodes != args.max_nodes:
            parser.error("an elastic --nnodes MIN:MAX range needs a dynamic backend, e.g. --rdzv_backend c10d")
        if args.max_nodes > 1 and args.master_port == 0 and not args.rdzv_endpoint:
            parser.error("a multi-node static rendezvous needs a fixed --master_port on node 0")
    elif not args.rdzv_endpoint:
        parser.error(f"--rdzv_backend {args.rdzv_backend} needs --rdzv_endpoint HOST:PORT")
    elif args.max_nodes > 1 and not args.rdzv_token:
        parser.error(f"a multi-node c10d rendezvous needs a secret shared by every node, the key its state "
                     f"is signed with: set {TOKEN_ENV} (or --rdzv_token) to the same value on every node")

    if not args.module and not os.path.isfile(args.script):
        parser.error(f"training script not found: {args.script}")
    return args
