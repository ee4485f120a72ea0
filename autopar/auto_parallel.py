"""`dist.auto_parallel.set_mesh / get_mesh`, as Paddle's parallelize docs spell them."""
from .api.global_mesh import get_mesh, set_mesh

__all__ = ["get_mesh", "set_mesh"]
