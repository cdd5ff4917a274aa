"""The pipeline's stages: admission, cache, routing, failover, relay, fallback."""
