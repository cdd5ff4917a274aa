"""The hot-answer cache: stage, entries, backends, coalescing."""
