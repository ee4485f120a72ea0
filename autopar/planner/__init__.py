"""The planner: a cost model (cost.py), analytic transformer accounting (model.py), the
search over layouts with an integer program per layout (search.py), and `plan` (api.py),
which turns the fastest layout that fits into a `parallelize` config; `predict_step`
(predict.py) prices a recorded run of the real program on a calibrated profile."""
from ..api.parallelize import use_auto_planner
from .api import Plan, plan
from .cost import A100, H100, H200, DeviceProfile, calibrate, load_profile
from .describe import ModelNames, describe
from .model import LatentAttention, Layout, Shape, TransformerSpec, evaluate
from .predict import Prediction, predict_step

use_auto_planner(plan)  # parallelize(config="auto") asks it

__all__ = ["A100", "H100", "H200", "DeviceProfile", "LatentAttention", "Layout", "ModelNames", "Plan", "Prediction",
           "Shape", "TransformerSpec", "calibrate", "describe", "evaluate", "load_profile", "plan", "predict_step"]
