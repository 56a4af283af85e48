"""The Redis :class:`~gateway.admission.state.StateStore` (``[state] backend =
"redis"``): every part is made over the :class:`~gateway.admission.shared.SharedStore`
that links this process to the others.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.admission.grantor import Grantor
from gateway.admission.shared import SharedAccount, SharedStore
from gateway.admission.shared_grant import SharedGrantor
from gateway.admission.shared_marks import BackendMarks, Values
from gateway.admission.tenants import Quota
from gateway.clock import Clock

__all__ = ["RedisState"]


class RedisState:
    """Admission state shared in Redis by every gateway process in front of the same
    backends.

    :param shared: the link to Redis (its calls, heartbeat and subscription).
    """

    def __init__(self, shared: SharedStore) -> None:
        self.shared = shared

    def account(self, backend: str, url: str) -> SharedAccount:
        """The shared budget of ``backend`` at ``url``
        (:meth:`~gateway.admission.shared.SharedStore.account`)."""
        return self.shared.account(backend, url)

    def grantor(self, backend: str, url: str, clock: Clock) -> Grantor:
        """The backend's :class:`~gateway.admission.shared_grant.SharedGrantor`: every
        request queues in the queue all processes share."""
        return SharedGrantor(self.account(backend, url), clock)

    def marks(self, backend: str, url: str, probe_s: Callable[[], float],
              on_change: Callable[[], None], on_layout: Callable[[Values], None]
              ) -> BackendMarks | None:
        """The backend's marks every process shares (one half-open probe, the newest
        layout)."""
        return BackendMarks(self.account(backend, url), probe_s, on_change, on_layout)

    def tenant(self, name: str) -> Quota:
        """The tenant's :class:`~gateway.admission.shared_tenants.TenantShare`."""
        return self.shared.tenant(name)

    def ready_fields(self) -> dict[str, object]:
        """``{"state": {"backend": "redis", "up": ...}}``: shown, not judged (a
        process grants alone or refuses while Redis is down, by
        ``[state] on_unavailable``)."""
        return {"state": {"backend": "redis", "up": self.shared.up}}

    def status_row(self) -> dict[str, object]:
        """Redis, whether it answers, this process's id and every live process's."""
        shared = self.shared
        return {"backend": "redis", "up": shared.up, "process": shared.owner,
                "processes": shared.processes or [shared.owner]}

    async def start(self) -> None:
        """Start the heartbeat and the subscription
        (:meth:`~gateway.admission.shared.SharedStore.start`)."""
        await self.shared.start()

    async def close(self) -> None:
        """Stop them and give back this process's leases and tickets
        (:meth:`~gateway.admission.shared.SharedStore.close`)."""
        await self.shared.close()
