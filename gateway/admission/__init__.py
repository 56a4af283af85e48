"""Async waiting and leases over the pure model: the one waiting room (waitroom), a backend's
admission queue (admission) with its leases (lease) and live accounting (live), the tenant gate
(tenants), and the hold on abandoned requests until the backend frees their slot (slotwatch)."""
