"""The user-facing API: creating and resharding distributed tensors, sharding layers,
dataloaders and optimizers (the names are re-exported by `autopar`)."""
