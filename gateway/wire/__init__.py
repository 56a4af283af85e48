"""The APIs' formats, sans I/O: the route table (routes), request bodies parsed and checked
(validation), streamed events and whole answers read (events, sse), a broken stream's
continuation rebuilt (resume), and every error rendered in its API's shape (shapes). Imports
only ``gateway.errors`` and ``gateway.core``."""
