"""A module's forward run inside a context manager, entered and left by its forward hooks."""
from __future__ import annotations

from typing import Callable, ContextManager

import torch


def forward_within(module: torch.nn.Module, context: Callable[[], ContextManager]) -> None:
    """Every call of `module`'s forward runs inside a fresh `context()`: a pre-hook enters it, a
    post-hook leaves it, also when the forward raises (calls nest: each leaves its own)."""
    entered: list = []

    def enter(_module, _args):
        manager = context()
        manager.__enter__()
        entered.append(manager)

    def leave(_module, _args, _out):
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
