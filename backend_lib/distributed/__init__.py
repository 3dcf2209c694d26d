"""torch.distributed pieces below the model runner: the driver-to-worker step channel."""
