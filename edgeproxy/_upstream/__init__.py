"""Upstream: the pool interface, the HTTP/1.1 and HTTP/2 pools, regions and health."""
