"""Distributed checkpoints: `save_state_dict` / `load_state_dict` of DistTensors, plain tensors
and JSON-like values, one safetensors file per rank plus metadata.json, resharded on load.

>>> import autopar as dist
>>> from autopar.checkpoint import save_state_dict, load_state_dict   # also dist.save_state_dict

See `save.py` (what each rank writes, the atomic swap), `claim.py` (the names a running save
owns, so concurrent saves leave each other's alone), `load.py` (resharding reads, checks) and
`metadata.py` (the directory layout).  `save_state_dict(..., async_save=True)` returns an
`AsyncSave` (`wait()`, `done()`).
"""
from .errors import CheckpointError, CheckpointNotFoundError
from .load import load_state_dict
from .save import AsyncSave, save_state_dict

__all__ = ["AsyncSave", "CheckpointError", "CheckpointNotFoundError", "load_state_dict", "save_state_dict"]
