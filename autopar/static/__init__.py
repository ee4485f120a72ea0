"""The static mode: a step captured once as a program of local ops and transfers, then replayed."""
from .dist_model import DistModel, to_static
from .program import CaptureError, Program

__all__ = ["CaptureError", "DistModel", "Program", "to_static"]
