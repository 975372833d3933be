"""Keeping replicas together: the all-reduce and the sync modes."""
