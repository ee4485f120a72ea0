"""A PNG of a plan: the pipeline stages with their layers and rank groups, and each
stage's memory per rank by category against the limit (matplotlib, imported here only)."""
from __future__ import annotations

from .model import MEMORY

GB = 1e9
_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52", "activations": "#8172b2",
           "reserved": "#aaaaaa"}


def draw(plan, path: str) -> None:
    """Write the picture of `plan` (an autopar.planner.Plan) to `path`."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--png needs matplotlib: pip install 'autopar[plan]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    est, layout = plan.estimate, plan.estimate.layout
    shape = layout.shape
    fig, (mesh_ax, mem_ax) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.5 * min(shape.pp, 16)),
                                          gridspec_kw={"width_ratios": [3, 2]})
    start, labels = 0, []
    ys = [shape.pp - 1 - s for s in range(shape.pp)]
    for s, (n, r) in enumerate(zip(layout.stage_layers, layout.recompute)):
        mesh_ax.barh(ys[s], n - r, left=start, color="#4c72b0", edgecolor="white")
        mesh_ax.barh(ys[s], r, left=start + n - r, color="#dd8452", edgecolor="white")
        mesh_ax.text(start + n / 2, ys[s], f"{n}" + (f" ({r} re)" if r else ""), ha="center", va="center",
                     color="white", fontsize=7)
        extra = (" + embedding" if s == 0 else "") + (" + head" if s == shape.pp - 1 else "")
        labels.append(f"stage {s}: layers {start}-{start + n - 1}{extra}")
        start += n
    mesh_ax.set_yticks(ys, labels, fontsize=8)
    mesh_ax.set_xlabel("decoder layers (orange: recomputed)")
    mesh_ax.set_title(f"{shape.world} ranks: pp {shape.pp} stages, each dp {shape.dp} x mp {shape.tp} ranks; "
                      f"ZeRO-{shape.zero}, {shape.micro_batches} micro-batches of {shape.micro_batch}", fontsize=9)
    bottom = [0.0] * shape.pp
    for key in MEMORY:
        widths = [m[key] / GB for m in est.memory_by_stage]
        mem_ax.barh(ys, widths, left=bottom, color=_COLORS[key], label=key)
        bottom = [b + w for b, w in zip(bottom, widths)]
    mem_ax.axvline(plan.memory_limit / GB, color="black", linestyle="--", label="limit")
    mem_ax.set_yticks(ys, [f"stage {s}" for s in range(shape.pp)], fontsize=8)
    mem_ax.set_xlabel("GB per rank")
    mem_ax.set_title(f"step {est.step_time:.4g} s, MFU {est.mfu:.1%}", fontsize=9)
    mem_ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
