"""The static mode: a step captured once as a program of local ops and transfers, then replayed."""
from .dist_model import DistModel, to_static
from .program import CaptureError, Program
from .strategy import Strategy

__all__ = ["CaptureError", "DistModel", "Program", "Strategy", "to_static"]
