"""ZeRO: optimizer states, gradients (stage 2) and parameters (stage 3) sharded over a mesh dim,
moved in flat buckets."""
