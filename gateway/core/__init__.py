"""The pure capacity and scheduling model: KV and slot arithmetic, fair ordering, slot prefixes,
output prediction. No I/O, no asyncio, no clock: every module here is a set of functions and
frozen or plain classes over numbers (tokens, seconds), enforced by ``tests/test_imports.py``."""
