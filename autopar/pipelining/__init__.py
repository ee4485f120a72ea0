"""Pipeline parallelism by micro-batches (Paddle's `distributed.auto_parallel.pipelining`).

A model cut into stages (`PipelineStage`, one or several per rank) runs a batch as
micro-batches in the order of a schedule: `ScheduleFThenB` (GPipe), `Schedule1F1B`,
`ScheduleVPP` (interleaved 1F1B over virtual stages), `ScheduleZBH1` (zero bubble: the
backward split into input- and weight-gradient steps) or `ScheduleZBVPP` (both).  `build_schedule` runs an annotated
model (layers on their stages' meshes) the same way without cutting it.  Transfers are asynchronous and
posted ahead; `schedule.format_order()` shows who runs what, `format_times()` where the
time went.  See docs/pipeline.md.
"""
from .annotated import ModelSchedule, build_schedule
from .orders import Action
from .schedules import PipelineSchedule, Schedule1F1B, ScheduleFThenB, ScheduleVPP, ScheduleZBH1, ScheduleZBVPP
from .stage import PipelineStage

__all__ = ["Action", "ModelSchedule", "build_schedule", "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleFThenB", "ScheduleVPP", "ScheduleZBH1", "ScheduleZBVPP"]
