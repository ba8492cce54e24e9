"""Shared core: engine configuration, checkpoints, the cache key, post-processing, autotune, rank layout."""
