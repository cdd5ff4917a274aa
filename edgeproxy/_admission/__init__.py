"""Entry and admission: body checks, rate limits, poison bodies and their callers, the slot."""
