"""The running set of backends: which backends exist and what they serve (fleet), a model's
shared queue over several backends and the one way to a lease (pool), reload as a diff then
an apply (reload), the app's background tasks (tasks), and the state the handlers share,
with the drain (state)."""
