"""The bottom layer: the request model, errors and the config schema."""
