"""The APIs' formats, sans I/O: which paths are served (routes), request bodies parsed and
checked (validation), streamed events and whole answers read (events, sse), and a broken stream's
continuation rebuilt (resume). Imports only ``gateway.errors`` and ``gateway.core``."""
