"""WebSocket sessions: the Realtime API and plain WebSockets, relayed to the regions."""
