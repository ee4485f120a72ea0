"""The global mesh that `parallelize` and friends use when no mesh is passed."""
from __future__ import annotations

from ..mesh import ProcessMesh

_GLOBAL: list = [None]


def set_mesh(mesh: ProcessMesh) -> None:
    """Set the global mesh.

    >>> import autopar as dist
    >>> dist.set_mesh(dist.ProcessMesh([0], dim_names=["dp"]))
    >>> dist.get_mesh().dim_names
    ['dp']
    """
    if mesh is not None and not isinstance(mesh, ProcessMesh):
        raise TypeError(f"set_mesh needs a ProcessMesh, got {type(mesh).__name__}")
    _GLOBAL[0] = mesh


def get_mesh() -> ProcessMesh | None:
    """The mesh given to `set_mesh` (None if none was)."""
    return _GLOBAL[0]
