"""The running set of backends: a model's shared queue over several backends (pool) and the
state the handlers share, with reload and drain (state)."""
