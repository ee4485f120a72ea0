"""Process groups, collectives and point-to-point transfers, all recorded in `comm_log`.

Every function takes the participating ranks as a tuple in *mesh order*; the group for
that tuple is created lazily (only its members take part) and cached, with group rank i
being ranks[i], so callers never translate between mesh and group order.
"""
from .backend import (
    CommError,
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

__all__ = [
    "CommError",
    "CommRecord",
    "Pending",
    "all_gather",
    "all_gather_into",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "broadcast",
    "comm_log",
    "current_device",
    "ensure_initialized",
    "get_rank",
    "get_world_size",
    "group_for",
    "reduce_scatter",
    "reduce_scatter_start",
    "reset_groups",
    "send_recv",
]
