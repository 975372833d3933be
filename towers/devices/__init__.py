"""Where towers run: placement on GPUs or the CPU, and concurrent CPU tower threads."""
