"""Moving a stage's outputs to the next stage, and input gradients back, asynchronously.

One direction of one stage edge is an `Outbox` on the sending rank and an `Inbox` on the
receiving one (a `LocalPipe` when both stages are on the same rank).  Its first message
after a change of batch signature is preceded by a *meta* message (each tensor's local
shape, dtype, whether it needs a gradient and, for a distributed tensor, its placements and
global shape), so the receiver can post its receives before the data is computed; later
micro-batches and steps send the data alone, the sender comparing each one's meta with the
one agreed.  A distributed tensor travels as its local piece and arrives with the same
placements on the receiving stage's mesh (a Partial piece stays Partial: no reduction is
spent on the way).

A sender that failed keeps the edge's promise: zeros of the agreed shapes, or, before
anything was agreed, a meta message saying it failed (then nothing more this step), so no
peer waits for a message that will not come and no receive is posted with a wrong size.
"""
from __future__ import annotations

import collections
import json
from typing import Optional

import torch

from .. import comm
from ..tensor.dtensor import DistTensor, new_dist
from ..mesh import ProcessMesh
from ..placement import Partial, Placement, Replicate, Shard
from ..spec import DistSpec, TensorMeta

META_BYTES = 8192  # one fixed-size meta message: a receiver can post it before it knows anything


class UpstreamFailed(Exception):
    """The sending stage failed this step: nothing more comes on this edge."""


def _placement_code(p: Placement) -> str:
    if type(p) is Shard:
        return f"S{p.dim}"
    if type(p) is Partial:
        return f"P{p.reduce_type.value}"
    return "R"


def _placement(code: str) -> Placement:
    if code[0] == "S":
        return Shard(int(code[1:]))
    if code[0] == "P":
        return Partial(code[1:])
    return Replicate()


def describe(values: tuple) -> list:
    """The meta of each value (None for a value that carries no tensor).

    >>> describe((torch.zeros(2, 3), None))
    [{'shape': [2, 3], 'dtype': 'float32', 'grad': False}, None]
    """
    out = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        local = v._local if type(v) is DistTensor else v
        meta = {"shape": list(local.shape), "dtype": str(local.dtype).removeprefix("torch."), "grad": v.requires_grad}
        if type(v) is DistTensor:
            spec = v._spec
            meta["dist"] = {"mesh": list(spec.mesh.shape), "placements": [_placement_code(p) for p in spec.placements],
                            "shape": list(spec.meta.shape), "at": list(spec.mesh.coordinate(comm.get_rank()) or ())}
        out.append(meta)
    return out


def _local_pieces(values: tuple) -> list:
    return [(v._local if type(v) is DistTensor else v).detach().contiguous() for v in values if v is not None]


def _buffers(meta: list, device) -> list:
    return [None if m is None else torch.empty(m["shape"], dtype=getattr(torch, m["dtype"]), device=device) for m in meta]


def _encode(obj) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(data) > META_BYTES:
        raise ValueError(f"a stage's outputs need {len(data)} bytes of description, more than {META_BYTES}")
    buf = torch.zeros(META_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor):
    raw = bytes(buf.cpu().numpy())
    return json.loads(raw[: raw.index(0)] if 0 in raw else raw)


class Outbox:
    """The sending end of a stage edge on another rank."""

    def __init__(self, channel: str, peer: int, what: str, device):
        self.channel, self.peer, self.what, self.device = channel, peer, what, device
        self.agreed: Optional[list] = None
        self.failed_sent = False

    def renew(self) -> None:
        """A new batch signature: the next message states its meta again."""
        self.agreed, self.failed_sent = None, False

    def send(self, values: tuple) -> list:
        """Post `values`; raises ValueError (sending nothing) if their meta differs from the agreed one."""
        meta = describe(values)
        works = []
        if self.agreed is None:
            works.append(comm.isend(_encode({"meta": meta}).to(self.device), self.peer, self.channel))
            self.agreed = meta
        elif meta != self.agreed:
            raise ValueError(f"{self.what}: {_difference(self.agreed, meta)}")
        return works + [comm.isend(t, self.peer, self.channel) for t in _local_pieces(values)]

    def send_failed(self, reason: str) -> list:
        """Keep the edge's promise for a step that failed here."""
        if self.agreed is None:
            if self.failed_sent:
                return []
            self.failed_sent = True
            return [comm.isend(_encode({"failed": reason}).to(self.device), self.peer, self.channel)]
        return [comm.isend(b.zero_(), self.peer, self.channel) for b in _buffers(self.agreed, self.device) if b is not None]


def _difference(agreed: list, meta: list) -> str:
    if len(agreed) != len(meta):
        return f"{len(meta)} values where the receiving stage was told {len(agreed)}"
    for n, (a, b) in enumerate(zip(agreed, meta)):
        if a != b:
            return (f"value {n} is {_show(b)} where the receiving stage was told {_show(a)} at this batch shape's "
                    f"first micro-batch (a stage's outputs must keep their shapes while its inputs do)")
    return "no difference"


def _show(m: Optional[dict]) -> str:
    if m is None:
        return "None"
    text = f"{m['dtype']}{m['shape']}"
    if "dist" in m:
        text += f" (piece of {m['dist']['shape']} placed {m['dist']['placements']})"
    return text


class Inbox:
    """The receiving end of a stage edge from another rank: receives are posted ahead of use."""

    def __init__(self, channel: str, peer: int, what: str, device, mesh: Optional[ProcessMesh]):
        self.channel, self.peer, self.what, self.device, self.mesh = channel, peer, what, device, mesh
        self.agreed: Optional[list] = None
        self.meta_work = None
        self.posted: collections.deque = collections.deque()
        self.upstream_failed: Optional[str] = None

    def renew(self) -> None:
        """A new batch signature: the sender states its meta first; post its receive now."""
        self.agreed, self.upstream_failed, self.posted = None, None, collections.deque()
        self.meta_work = comm.irecv(torch.empty(META_BYTES, dtype=torch.uint8, device=self.device), self.peer, self.channel)

    def _read_meta(self) -> None:
        got = _decode(self.meta_work.wait())
        self.meta_work = None
        if "failed" in got:
            self.upstream_failed = got["failed"]
        else:
            self.agreed = got["meta"]

    def post_ahead(self) -> bool:
        """Post the receives of one more message if that needs no wait; False if it would."""
        if self.upstream_failed is not None:
            return True
        if self.agreed is None:
            if not self.meta_work.is_completed():
                return False
            self._read_meta()
            if self.upstream_failed is not None:
                return True
        self.posted.append([comm.irecv(b, self.peer, self.channel) if b is not None else None
                            for b in _buffers(self.agreed, self.device)])
        return True

    def take(self) -> tuple:
        """The next message's values (waiting for it); raises UpstreamFailed if the sender failed."""
        if not self.posted:
            if self.agreed is None and self.upstream_failed is None:
                self._read_meta()
            if self.upstream_failed is not None:
                raise UpstreamFailed(self.upstream_failed)
            self.post_ahead()
        works = self.posted.popleft()
        pieces = [None if w is None else w.wait() for w in works]
        return tuple(self._wrap(p, m) for p, m in zip(pieces, self.agreed))

    def _wrap(self, piece: Optional[torch.Tensor], meta: Optional[dict]):
        """The received piece as the receiving stage's input: an autograd leaf when the sender's
        value needed a gradient, distributed when it was."""
        if piece is None:
            return None
        if "dist" not in meta:
            return piece.requires_grad_(meta["grad"])
        dist = meta["dist"]
        here = list(self.mesh.coordinate(comm.get_rank()) or ()) if self.mesh is not None else None
        if here is not None and here != dist["at"] and list(self.mesh.shape) == dist["mesh"]:
            raise ValueError(
                f"{self.what}: the piece sent from mesh coordinate {dist['at']} arrives at coordinate {here} of "
                f"{self.mesh}: pair each rank with the rank at its coordinate on the next stage's mesh in `group`"
            )
        if self.mesh is None or list(self.mesh.shape) != dist["mesh"]:
            raise ValueError(
                f"{self.what}: a distributed tensor placed {dist['placements']} on a mesh of shape {dist['mesh']} "
                f"arrives, but the receiving stage's module "
                + ("holds no distributed parameters to say which mesh it lives on" if self.mesh is None
                   else f"lives on {self.mesh}")
            )
        spec = DistSpec(self.mesh, [_placement(c) for c in dist["placements"]],
                        TensorMeta.contiguous(dist["shape"], piece.dtype))
        return new_dist(piece, spec, requires_grad=meta["grad"])


class LocalPipe:
    """Both ends of a stage edge on this rank: the values themselves, in order."""

    def __init__(self):
        self.queue: collections.deque = collections.deque()

    def renew(self) -> None:
        self.queue.clear()

    def send(self, values: tuple) -> list:
        self.queue.append(tuple(None if v is None else v.detach().requires_grad_(v.requires_grad) for v in values))
        return []

    def send_failed(self, reason: str) -> list:
        self.queue.append(UpstreamFailed(reason))
        return []

    def post_ahead(self) -> bool:
        return True

    def take(self) -> tuple:
        got = self.queue.popleft()
        if isinstance(got, UpstreamFailed):
            raise got
        return got
