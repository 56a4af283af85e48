"""Offline capacity planning, used by the CLI only: ``gateway plan`` (KV arithmetic, model
shapes, sizing from metrics) and ``gateway probe``. Nothing here runs in the server."""
