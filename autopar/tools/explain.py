"""`explain`: what autopar decided for each op of a piece of code, and what it moved.

Each distributed op the dispatch runs is recorded with the placements of its inputs, the
placements its SPMD rule chose (where they differ, the input was resharded), the output's
placements, and the collectives and transfers it caused with their bytes: the record a
planner reasons over, for a real run or one under `simulate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..tensor.observers import watching
from ..comm.log import comm_log
from ..runtime.local_region import local_regions


def _short(placements) -> str:
    names = {"Shard": "S", "Replicate": "R", "Partial": "P", "StridedShard": "SS"}
    out = []
    for p in placements:
        text = repr(p)
        head = text.split("(")[0]
        out.append(names.get(head, head) + text[len(head):].replace("()", "").replace("'", ""))
    return "[" + ", ".join(out) + "]"


@dataclass
class OpRecord:
    """One dispatched op: its inputs' placements, those the rule chose, the outputs', and the
    reshards (input index, from, to) and communication it caused."""

    op: str
    inputs: list
    chosen: list
    outputs: list
    reshards: list = field(default_factory=list)
    comm: list = field(default_factory=list)

    def __str__(self) -> str:
        line = f"{self.op}: {' '.join(self.inputs)} -> {' '.join(self.outputs)}"
        for i, src, dst in self.reshards:
            line += f"\n    input {i} resharded {src} -> {dst}"
        for r in self.comm:
            line += f"\n    {r.op} over ranks {list(r.ranks)}: {r.bytes} bytes sent"
        return line


class explain:
    """Record every distributed op run inside: the rule's placements, reshards and bytes.

    Local regions are off inside (a module's forward runs op by op, so each op shows; the
    numbers are the same).

    >>> import torch, autopar as dist
    >>> mesh = dist.ProcessMesh([0], dim_names=["x"])
    >>> a = dist.shard_tensor(torch.ones(4, 3), mesh, [dist.Shard(0)])
    >>> b = dist.shard_tensor(torch.ones(3, 2), mesh, [dist.Replicate()])
    >>> with dist.explain() as ex:
    ...     c = a @ b
    >>> print(ex)
    aten.mm.default: [S(0)] [R] -> [S(0)]
    >>> ex.total_bytes()
    0
    """

    def __init__(self):
        self.records: list[OpRecord] = []
        self._log = comm_log()
        self._starts: list[int] = []
        self._regions = local_regions(False)
        self._watching = watching(self)

    def see(self, func, dec, flat) -> None:
        if dec is None or dec.in_specs is None:
            return
        specs = [getattr(t, "_spec", None) for t in flat]
        inputs = [_short(s.placements) if s is not None else "plain" for s in specs]
        chosen = [_short(s.placements) if s is not None else "-" for s in dec.in_specs]
        reshards = [(i, inputs[i], chosen[i]) for i, (s, d) in enumerate(zip(specs, dec.in_specs))
                    if s is not None and d is not None and (s.mesh != d.mesh or s.placements != d.placements)]
        outputs = [_short(s.placements) for s in dec.out_specs or ()]
        self._starts.append(len(self._log.records))
        self.records.append(OpRecord(str(func), inputs, chosen, outputs, reshards))

    def __enter__(self) -> "explain":
        self._regions.__enter__()
        self._log.__enter__()
        self._watching.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._watching.__exit__(*exc)
        self._log.__exit__(*exc)
        self._regions.__exit__(*exc)
        bounds = self._starts + [len(self._log.records)]
        for rec, a, b in zip(self.records, bounds, bounds[1:]):
            rec.comm = list(self._log.records[a:b])

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def resharded(self) -> list[OpRecord]:
        """The ops whose rule moved an input."""
        return [r for r in self.records if r.reshards]

    def total_bytes(self) -> int:
        """Bytes this rank sent inside the block."""
        return self._log.total_bytes()

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.records)
