"""The ASGI response that admits, forwards, relays and releases (response), its tracked
variant that survives preemption (tracked), the send helpers (send) and the disconnect watcher
(watcher)."""
