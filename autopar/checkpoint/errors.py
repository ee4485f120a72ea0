"""The errors a checkpoint save or load raises (the same one on every rank)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the tensor and the file.

    Raised on every rank together: a failure seen by one rank is agreed on by all before
    anything is swapped into place (save) or written into the targets (load).
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the path (no directory, or no metadata file in it)."""

    def __init__(self, message: str):
        # OSError's (errno, strerror) convention would swallow a single message: keep it plain.
        RuntimeError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (type(self), (str(self),))


class Problems:
    """Errors one rank found, collected instead of raised so every rank reaches the agreement."""

    LIMIT = 20

    def __init__(self):
        self.items: list[dict] = []

    def add(self, message: str, kind: str = "error") -> None:
        if len(self.items) < self.LIMIT:
            self.items.append({"kind": kind, "msg": message})
        elif len(self.items) == self.LIMIT:
            self.items.append({"kind": "error", "msg": "(further errors not shown)"})

    def not_found(self, message: str) -> None:
        self.add(message, "not_found")

    def __bool__(self) -> bool:
        return bool(self.items)


def raise_agreed(per_rank: list[list[dict]], what: str, consequence: str) -> None:
    """Raise one error built from every rank's problems, if any rank had one.

    Identical messages from several ranks are shown once, with the ranks that saw them.
    """
    seen: dict[str, list[int]] = {}
    kinds = set()
    for rank, items in enumerate(per_rank):
        for item in items:
            seen.setdefault(item["msg"], []).append(rank)
            kinds.add(item["kind"])
    if not seen:
        return
    lines = []
    for msg, ranks in seen.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        if len(ranks) == len(per_rank) and len(per_rank) > 1:
            who = "all ranks"
        lines.append(f"  [{who}] {msg}")
    text = f"{what} failed; {consequence}:\n" + "\n".join(lines)
    if kinds == {"not_found"}:
        raise CheckpointNotFoundError(text)
    raise CheckpointError(text)
