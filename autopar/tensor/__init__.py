"""The distributed tensor: `DistTensor` (global meta + this rank's piece), the dispatch of every
aten op through the SPMD rules, the differentiable conversions between pieces and global
values, and the one random stream all ranks share.  Below it: mesh/placement/spec, comm, the
rules (spmd) and redistribute; above it: the runtime, checkpoints and the public API."""
