"""Process groups, collectives and point-to-point transfers, all recorded in `comm_log`.

Every function takes the participating ranks as a tuple in *mesh order*; the group for
that tuple is created lazily (only its members take part) and cached, with group rank i
being ranks[i], so callers never translate between mesh and group order.  What watches the transfers (a
program capture, the planner's recorder) attaches through `comm.observers`.
"""
from .backend import (
    CommError,
    channel_group,
    current_device,
    ensure_initialized,
    get_rank,
    get_world_size,
    group_for,
    reset_groups,
)
from .collectives import (
    Pending,
    all_gather,
    all_gather_into,
    all_gather_start,
    all_reduce,
    all_reduce_start,
    all_to_all,
    broadcast,
    reduce_scatter,
    reduce_scatter_start,
    send_recv,
)
from .log import CommRecord, comm_log
from .p2p import P2PWork, deferred_sends, exchange, irecv, isend

__all__ = [
    "CommError",
    "CommRecord",
    "P2PWork",
    "Pending",
    "all_gather",
    "all_gather_into",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "broadcast",
    "channel_group",
    "comm_log",
    "current_device",
    "deferred_sends",
    "ensure_initialized",
    "exchange",
    "get_rank",
    "get_world_size",
    "group_for",
    "irecv",
    "isend",
    "reduce_scatter",
    "reduce_scatter_start",
    "reset_groups",
    "send_recv",
]
