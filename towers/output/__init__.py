"""What a run writes: atomic files, checkpoints (state dicts on disk), logs and TensorBoard."""
