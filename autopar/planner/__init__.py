"""The planner: a cost model (cost.py), analytic transformer accounting (model.py), the
search over layouts with an integer program per layout (search.py), and `plan` (api.py),
which turns the fastest layout that fits into a `parallelize` config."""
from .api import Plan, plan
from .cost import A100, H100, H200, DeviceProfile, calibrate, load_profile
from .describe import ModelNames, describe
from .model import Layout, Shape, TransformerSpec, evaluate

__all__ = ["A100", "H100", "H200", "DeviceProfile", "Layout", "ModelNames", "Plan", "Shape", "TransformerSpec",
           "calibrate", "describe", "evaluate", "load_profile", "plan"]
