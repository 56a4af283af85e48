"""The ASGI response that admits, runs attempts and acts on each one's next step
(response) with the parts it shares with its strategy (parts); the lease obtained (admit)
with queue and prefill progress (progress); one upstream try and its phase (attempt), a
request's tries (tries), and the steps after a failed one (retry); the plain strategy
(plain) and its stream relay (stream); the tracked strategy that survives preemption
(tracked) and one followed attempt (follow); a stream read event by event without I/O
(inspect); the tokens a request used (usage); the send helpers (send) and the disconnect
watcher (watcher)."""
