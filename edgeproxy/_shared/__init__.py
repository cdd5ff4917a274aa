"""State shared with the other PoPs through Redis: the one client builder, the shared load."""
