"""The ops: each op's arithmetic written once, its NumPy, compiled-CPU and GPU forms derived from it."""
