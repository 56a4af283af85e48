"""What is measured and logged: one request's record (record), the Prometheus metrics
(metrics), and the access line and log set-up (logs)."""
