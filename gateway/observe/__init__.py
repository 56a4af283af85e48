"""What is measured and logged: the Prometheus metrics (metrics) and the access line and
log set-up (logs)."""
