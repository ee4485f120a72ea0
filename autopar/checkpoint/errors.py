"""The errors a checkpoint save or load raises (the same one on every rank)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the tensor and the file.

    Raised on every rank together: a failure seen by one rank is agreed on by all before
    anything is swapped into place (save) or written into the targets (load).
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the path (no directory, or no metadata file in it), for any
    rank.  A damaged checkpoint (a data file missing or cut short, metadata unreadable) or one
    only some ranks see is a plain CheckpointError, so `except FileNotFoundError: start over`
    never silently throws a run away."""

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
    lines = [f"  [{_who(ranks, len(per_rank))}] {msg}" for msg, ranks in seen.items()]
    text = f"{what} failed; {consequence}:\n" + "\n".join(lines)
    if kinds == {"not_found"}:
        found = [r for r, items in enumerate(per_rank) if not items]
        if not found:
            raise CheckpointNotFoundError(text)
        # some ranks see a checkpoint the others do not: not a missing one to start over without
        text += (f"\n  {_who(found, len(per_rank))} found it: the path must be on a filesystem shared by "
                 f"all ranks")
    raise CheckpointError(text)


def _who(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "all ranks"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
