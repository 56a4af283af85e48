"""Development tooling: the local llama-server and model behind ``make run``/``make test``
(localbackend), the soak (soak) and the two-tenant run (tenants_run). Not imported by the
server."""
