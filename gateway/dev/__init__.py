"""Development tooling: the local llama-server and model behind ``make run``/``make test``.
Not imported by the server."""
