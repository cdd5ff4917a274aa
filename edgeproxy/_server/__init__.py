"""The aiohttp server: the proxy app, the guarded listener, the admin listener."""
