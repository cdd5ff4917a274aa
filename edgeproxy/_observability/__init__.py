"""Observability: metrics, tracing, the status page."""
