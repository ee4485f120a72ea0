"""`dist.plan`: the layout to train a model with, as a `parallelize` config, and why."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .cost import DeviceProfile, load_profile
from .describe import HF_LLAMA, ModelNames, apply_recompute, config_json, describe, parallelize_config
from .model import Estimate, TransformerSpec
from .search import SOLVE_SECONDS, VPP_DEGREES, search
from .profile_check import check_profile

GB = 1e9


@dataclass
class Plan:
    """The chosen layout and what it costs per rank.  `config` goes to `dist.parallelize`
    on `mesh()`, `apply_recompute(model)` checkpoints the layers the plan recomputes
    (`parallelize(..., config="auto")` does both); gradient accumulation (pp = 1, several
    micro-batches) is the training loop's."""

    estimate: Estimate
    runner_up: Optional[Estimate]
    compared: Optional[Estimate]  # the best layout with the degrees asked for by `compare`
    config: dict
    spec: TransformerSpec
    profile: DeviceProfile
    memory_limit: float
    why: str
    names: ModelNames = HF_LLAMA

    @property
    def degrees(self) -> dict:
        """Ranks along each mesh dim: dp, mp, pp, and sep (context parallel) where the plan
        splits sequences; ep, the experts' split folded over dp x sep, where it splits them."""
        s = self.estimate.layout.shape
        return {"dp": s.dp, "mp": s.tp, "pp": s.pp, **({"sep": s.cp} if s.cp > 1 else {}),
                **({"ep": s.ep} if s.ep > 1 else {})}

    @property
    def name(self) -> str:
        """The layout in short: "dp4 tp1 pp2 zero1 mb1x2" (sp: sequence parallel; cp4 /
        cp4a2a: context parallel by ring / all-to-all; ep8: expert parallel)."""
        return _name(self.estimate)

    @property
    def memory_per_rank_bytes(self) -> dict:
        return {**self.estimate.memory, "total": self.estimate.peak_memory}

    @property
    def bytes_per_step(self) -> dict:
        return self.estimate.bytes_per_step

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time

    @property
    def mfu(self) -> float:
        return self.estimate.mfu

    def apply_recompute(self, model: torch.nn.Module) -> list:
        """Checkpoint the decoder layers the plan recomputes (before or after `parallelize`);
        returns their names.

        >>> import torch, autopar as dist
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
        >>> p = dist.plan(model, torch.zeros(1, 64, dtype=torch.long), 1, device="cpu", precision="fp32",
        ...               memory_per_rank=2.1e6)  # 2.5 MB without recompute
        >>> p.apply_recompute(model)
        ['model.layers.0', 'model.layers.1']
        """
        return apply_recompute(model, self.names, self.estimate.layout)

    def mesh(self, process_ids: Optional[list] = None):
        """The ProcessMesh the config runs on: dims ["pp", "dp", "mp"], mp fastest, with
        "sep" between dp and mp where the plan splits sequences."""
        import numpy as np

        from ..mesh import ProcessMesh

        s = self.estimate.layout.shape
        ids = list(range(s.world)) if process_ids is None else list(process_ids)
        if len(ids) != s.world:
            raise ValueError(f"the plan is for {s.world} ranks, got {len(ids)} process ids")
        if s.cp > 1:
            return ProcessMesh(np.array(ids).reshape(s.pp, s.dp, s.cp, s.tp).tolist(),
                               dim_names=["pp", "dp", "sep", "mp"])
        return ProcessMesh(np.array(ids).reshape(s.pp, s.dp, s.tp).tolist(), dim_names=["pp", "dp", "mp"])

    def to_json(self) -> dict:
        layout = self.estimate.layout
        return {
            "config": config_json(self.config),
            "degrees": self.degrees,
            "micro_batch": layout.shape.micro_batch,
            "micro_batches": layout.shape.micro_batches,
            "sequence_parallel": layout.shape.sequence_parallel,
            "vpp_degree": layout.shape.vpp,
            "context_parallel": layout.shape.cp_mode if layout.shape.cp > 1 else None,
            "stage_layers": list(layout.stage_layers),
            "recompute_layers": list(layout.recompute),
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "memory_limit_bytes": self.memory_limit,
            "bytes_per_step": self.bytes_per_step,
            "step_time_s": self.step_time_s,
            "time_s": self.estimate.time,
            "mfu": self.mfu,
            "compare": None if self.compared is None else _summary(self.compared),
            "runner_up": None if self.runner_up is None else _summary(self.runner_up),
            "why": self.why,
        }

    def __str__(self) -> str:
        layout, est = self.estimate.layout, self.estimate
        s = layout.shape
        lines = [
            f"plan: dp {s.dp} x {_cp_words(s)}mp {s.tp} x pp {s.pp} on {s.world} {self.profile.name} ranks"
            + (f", experts split over {s.ep} ranks" if s.ep > 1 else "") + f", ZeRO-{s.zero}, "
            f"sequence parallel {'on' if s.sequence_parallel else 'off'}, {s.micro_batches} micro-batches of "
            f"{s.micro_batch}" + (f", interleaved 1F1B over {s.vpp} chunks per stage" if s.vpp > 1 else ""),
            f"  layers per stage {list(layout.stage_layers)}, recomputed {list(layout.recompute)}",
            f"  step time {est.step_time:.4g} s, MFU {est.mfu:.1%}",
            "  memory per rank (fullest stage): " + ", ".join(
                f"{k} {v / GB:.2f} GB" for k, v in self.memory_per_rank_bytes.items())
            + f" (limit {self.memory_limit / GB:.1f} GB)",
            "  time: " + ", ".join(f"{k} {v:.4g} s" for k, v in est.time.items() if v),
            "  bytes per step per rank: " + (", ".join(
                f"{k} {v / GB:.2f} GB" for k, v in est.bytes_per_step.items()) or "none"),
        ]
        if self.compared is not None:
            c = self.compared
            lines.append(f"  compared: {_name(c)}: step {c.step_time:.4g} s, MFU {c.mfu:.1%}, "
                         f"memory {c.peak_memory / GB:.1f} GB ({c.step_time / est.step_time - 1:+.1%} time)")
        lines.append("  why: " + self.why)
        return "\n".join(lines)


def _cp_words(s) -> str:
    return f"sep {s.cp} ({'ring' if s.cp_mode == 'ring' else 'all-to-all'}) x " if s.cp > 1 else ""


def _name(est: Estimate) -> str:
    s = est.layout.shape
    cp = f" cp{s.cp}{'a2a' if s.cp_mode == 'all2all' else ''}" if s.cp > 1 else ""
    return (f"dp{s.dp}{cp} tp{s.tp} pp{s.pp}{f' vpp{s.vpp}' if s.vpp > 1 else ''}{f' ep{s.ep}' if s.ep > 1 else ''}"
            f" zero{s.zero}{' sp' if s.sequence_parallel else ''} mb{s.micro_batch}x{s.micro_batches}")


def _summary(est: Estimate) -> dict:
    return {"layout": _name(est), "step_time_s": est.step_time, "mfu": est.mfu,
            "memory_per_rank_bytes": est.peak_memory}


def _batch_dims(sample_batch: Any) -> tuple[int, int]:
    """(batch, sequence) of a sample batch: token ids [b, s], or a tuple / dict holding them first."""
    if isinstance(sample_batch, dict):
        sample_batch = sample_batch.get("input_ids", next(iter(sample_batch.values())))
    if isinstance(sample_batch, (list, tuple)):
        sample_batch = sample_batch[0]
    if not isinstance(sample_batch, torch.Tensor) or sample_batch.dim() < 2:
        raise ValueError(f"sample_batch must hold token ids of shape [batch, seq], got {sample_batch!r:.80}")
    return sample_batch.shape[0], sample_batch.shape[1]


def plan(
    model: Union[torch.nn.Module, TransformerSpec],
    sample_batch: Any = None,
    world_size: Optional[int] = None,
    device: Union[str, DeviceProfile] = "h100",
    memory_per_rank: Optional[float] = None,
    *,
    global_batch: Optional[int] = None,
    precision: str = "bf16",
    fixed: Optional[dict] = None,
    compare: Optional[dict] = None,
    names: Optional[ModelNames] = None,
) -> Plan:
    """The fastest layout of `model` on `world_size` ranks of `device` that fits
    `memory_per_rank` bytes (default: the device's memory).

    `model` is a module (its dimensions read by `describe`) or a `TransformerSpec`;
    `sample_batch` (token ids [global batch, seq]) gives the batch and sequence length, or
    `global_batch` does with the spec's seq.  `fixed` pins degrees or settings
    ({"mp": 8, "pp": 4, "zero": 1, ...}); `compare` prices the best layout with the degrees
    it names next to the plan (a hand configuration: without context or expert parallel
    unless it names "cp" / "ep").
    """
    seq = None
    if sample_batch is not None:
        global_batch, seq = _batch_dims(sample_batch)
    if isinstance(model, TransformerSpec):
        spec, names = model, names or HF_LLAMA
    else:
        spec, found = describe(model, seq)
        names = names or found
    if seq is not None:
        spec = dataclasses.replace(spec, seq=seq)
    if global_batch is None:
        raise ValueError("plan needs a sample_batch (token ids [batch, seq]) or a global_batch")
    if world_size is None:
        from ..comm import get_world_size

        world_size = get_world_size()
    profile = load_profile(device)
    check_profile(profile)  # a cpu profile made elsewhere warns, saying what moved
    result = search(spec, world_size, global_batch, profile, memory_per_rank, precision, fixed)
    limit = profile.memory_bytes if memory_per_rank is None else memory_per_rank
    compared = None
    if compare:
        compared = search(spec, world_size, global_batch, profile, memory_per_rank, precision,
                          {"cp": 1, "ep": 1, **(fixed or {}), **compare}).best
    best = result.best
    why = (
        f"searched {result.searched} layouts of {world_size} ranks (dp x sep x mp x pp with mp within a node of "
        f"{profile.ranks_per_node} dividing {spec.heads} heads and {spec.kv_heads} kv heads, sep splitting "
        f"sequences of {spec.seq} by ring or all-to-all"
        + (f", experts split over ep ranks dividing {spec.experts} experts" if spec.experts else "")
        + f", pp <= {spec.layers} "
        f"layers, every micro-batch size dividing the batch, ZeRO 0-3, sequence parallel on/off, 1F1B or "
        f"interleaved over {'/'.join(map(str, VPP_DEGREES[1:]))} chunks per stage"
        + (f", fixed {fixed}" if fixed else "") + f"); for {result.solved} of them HiGHS solved the integer "
        f"program of layers and recomputed layers per stage ({result.infeasible} cannot fit {limit / GB:.1f} GB"
        + (f", {result.cut_off} have no split that fits and beats the layouts found before them"
           if result.cut_off else "")
        + (f"; {result.too_big} more hold more than that in parameters and states alone" if result.too_big else "")
        + (f", {result.unproven} stopped at {SOLVE_SECONDS:g} s without proof" if result.unproven else "") + "), "
        f"{result.bounded} were bounded out by a step-time lower bound. "
        f"Chose {_name(best)}: {best.step_time:.4g} s per step, MFU {best.mfu:.1%}, "
        f"{best.peak_memory / GB:.1f} GB per rank."
    )
    if result.runner_up is not None:
        r = result.runner_up
        why += (f" Runner-up with other degrees: {_name(r)}, {r.step_time:.4g} s "
                f"({r.step_time / best.step_time - 1:+.1%}), {r.peak_memory / GB:.1f} GB.")
    if best.layout.recompute and any(best.layout.recompute):
        why += (f" Recomputes {sum(best.layout.recompute)} of {spec.layers} layers (per stage "
                f"{list(best.layout.recompute)}) to fit.")
    return Plan(best, result.runner_up, compared, parallelize_config(names, best.layout), spec, profile, limit,
                why, names)
