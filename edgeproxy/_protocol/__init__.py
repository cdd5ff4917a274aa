"""Protocol helpers: OpenAI endpoints and bodies, headers, SSE, usage, client IPs."""
