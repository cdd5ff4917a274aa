"""The hot-answer cache: stage, keys, plans, recording, entries, backends, coalescing."""
