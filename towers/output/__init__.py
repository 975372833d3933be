"""What a run writes: checkpoints (state dicts on disk), the logdir's lock, logs and TensorBoard.

Every file goes through the atomic writer of ``towers.files``, which the data converters share.
"""
