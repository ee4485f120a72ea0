"""autopar: auto-parallel training for PyTorch.

Mark a few tensors with placements on a ProcessMesh; autopar derives the placement of
every other tensor and op, inserts the communication, and trains on many processes with
the numbers of the single-device run.

>>> import torch, autopar as dist
>>> mesh = dist.ProcessMesh([0], dim_names=["x"])
>>> t = dist.shard_tensor(torch.arange(4.), mesh, [dist.Shard(0)])
>>> (t * 2).sum().item()
12.0
"""
from .api.dataloader import ShardDataloader, shard_dataloader
from .api.global_mesh import get_mesh, set_mesh
from .api.layer import shard_layer
from .api.local_map import LocalLayer, local_map
from .api.moe import ExpertParallel, moe_global_mesh_tensor, moe_sub_mesh_tensors
from .api.parallelize import parallelize
from .api.context_plans import ContextParallel, PrepareContextParallel, shard_sequence
from .api.plans import (
    ColWiseParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    SplitPoint,
)
from .api.optimizer import (
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_optimizer,
)
from .api.tensors import (
    dtensor_from_fn,
    dtensor_from_local,
    is_dist_tensor,
    reshard,
    shard_tensor,
    unshard_dtensor,
)
from .checkpoint import CheckpointError, CheckpointNotFoundError, load_state_dict, save_state_dict
from .comm import CommError, comm_log, get_rank, get_world_size
from .tools.simulate import representative_ranks, simulate
from .tools.explain import explain
from .runtime.local_region import local_regions
from .runtime.context_parallel import context_parallel
from .runtime.precision import MixedPrecisionPolicy
from .runtime.scaler import shard_scaler
from .tensor.dtensor import DistTensor
from .mesh import ProcessMesh
from .placement import Partial, Placement, ReduceType, Replicate, Shard
from .planner import plan
from .planner.meter import StepMeter, StepStats
from .static import CaptureError, DistModel, Strategy, to_static
from . import auto_parallel  # noqa: F401  (dist.auto_parallel.set_mesh)
from . import pipelining  # noqa: F401  (dist.pipelining.PipelineStage, schedules)
from .tensor import dispatch as _dispatch  # noqa: F401  (installs the op dispatcher)

__all__ = [
    "ColWiseParallel",
    "ContextParallel",
    "ExpertParallel",
    "LocalLayer",
    "PrepareContextParallel",
    "context_parallel",
    "local_map",
    "moe_global_mesh_tensor",
    "moe_sub_mesh_tensors",
    "shard_sequence",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
    "SplitPoint",
    "parallelize",
    "plan",
    "CaptureError",
    "DistModel",
    "Strategy",
    "to_static",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CommError",
    "load_state_dict",
    "save_state_dict",
    "ShardDataloader",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "get_mesh",
    "set_mesh",
    "shard_dataloader",
    "shard_layer",
    "shard_optimizer",
    "MixedPrecisionPolicy",
    "shard_scaler",
    "DistTensor",
    "Partial",
    "Placement",
    "ProcessMesh",
    "ReduceType",
    "Replicate",
    "Shard",
    "StepMeter",
    "StepStats",
    "comm_log",
    "simulate",
    "representative_ranks",
    "explain",
    "local_regions",
    "dtensor_from_fn",
    "dtensor_from_local",
    "get_rank",
    "get_world_size",
    "is_dist_tensor",
    "reshard",
    "shard_tensor",
    "unshard_dtensor",
]


def _reset_for_tests() -> None:
    """Drop per-process caches between tests (the test pool calls this)."""
    _dispatch.clear_cache()
