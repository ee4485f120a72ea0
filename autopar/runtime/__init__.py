"""What runs around the ops of a training step: local regions (module code verified not to
communicate, run as plain torch), gradient reduction in buckets, and ZeRO (`zero/`: sharded
optimizer states, gradients and parameters)."""
