"""The update after the all-reduce: learning-rate schedule, SGD and Adam, the EMA."""
