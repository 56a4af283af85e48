"""The ASGI response that admits, forwards, relays and releases (response); one upstream try
and its phase (attempt); a stream read event by event without I/O (inspect); the tokens a
request used (usage); the tracked variant that survives preemption (tracked); the send
helpers (send) and the disconnect watcher (watcher)."""
