"""Async waiting and leases over the pure model: a backend's admission queue (admission),
the tenant gate (tenants), and the hold on abandoned requests until the backend frees their slot
(slotwatch)."""
