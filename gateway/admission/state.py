"""Where admission state lives: in this process alone, or in Redis, shared by every
gateway process in front of the same backends (``[state] backend``).

The choice is made once, where the app is built (:func:`gateway.http.app.create_app`),
as a :class:`StateStore`: :class:`LocalState`, or
:class:`~gateway.admission.shared_state.RedisState`. Everything that differs between the
two is asked of it once, when the part is made: each backend's
:class:`~gateway.admission.grantor.Grantor` and health marks, each tenant's
:class:`~gateway.admission.tenants.Quota`; and what the probes and the status page show
of it. No caller asks which store it has; a third state store is a third implementation
of this protocol (and of :class:`gateway.fleet.pool.PoolGrantor`, for pools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gateway.admission.grantor import Grantor, LocalGrantor
from gateway.admission.tenants import Quota, local_quota
from gateway.clock import Clock

if TYPE_CHECKING:  # (the Redis side's types: memory state never makes one)
    from gateway.admission.shared_marks import BackendMarks, Values

__all__ = ["LOCAL_STATE", "LocalState", "StateStore"]


class StateStore(Protocol):
    """Where admission state lives (see the module's docstring)."""

    def grantor(self, backend: str, url: str, clock: Clock) -> Grantor:
        """Who grants the requests of the backend ``backend`` at ``url``."""
        ...

    def marks(self, backend: str, url: str, probe_s: Callable[[], float],
              on_change: Callable[[], None], on_layout: Callable[[Values], None]
              ) -> BackendMarks | None:
        """The backend's health marks and layout as every process shares them, or
        ``None`` when this process alone keeps them
        (:class:`~gateway.admission.shared_marks.BackendMarks`'s parameters)."""
        ...

    def tenant(self, name: str) -> Quota:
        """Where tenant ``name``'s quotas are counted."""
        ...

    def ready_fields(self) -> dict[str, object]:
        """What ``GET /ready`` adds to its body about the state (shown, not judged)."""
        ...

    def status_row(self) -> dict[str, object]:
        """``/status.json``'s ``state`` row: where the state lives, who shares it."""
        ...

    async def start(self) -> None:
        """The app starts: begin the store's background work (a failure is logged)."""
        ...

    async def close(self) -> None:
        """The app stops: end that work and give back what this process holds."""
        ...


class LocalState:
    """Admission state in this process's memory (``[state] backend = "memory"``): each
    backend's :class:`~gateway.admission.grantor.LocalGrantor`, no shared marks, and
    :data:`~gateway.admission.tenants.LOCAL` quotas."""

    def grantor(self, backend: str, url: str, clock: Clock) -> Grantor:
        """This process alone judges and serves the backend's queue."""
        return LocalGrantor()

    def marks(self, backend: str, url: str, probe_s: Callable[[], float],
              on_change: Callable[[], None], on_layout: Callable[[Values], None]
              ) -> BackendMarks | None:
        """None: the backend's own :class:`~gateway.core.health.Health` is the mark."""
        return None

    def tenant(self, name: str) -> Quota:
        """:data:`~gateway.admission.tenants.LOCAL`, for any tenant
        (:func:`~gateway.admission.tenants.local_quota`)."""
        return local_quota(name)

    def ready_fields(self) -> dict[str, object]:
        """Nothing: memory state is never down."""
        return {}

    def status_row(self) -> dict[str, object]:
        """``{"backend": "memory"}``."""
        return {"backend": "memory"}

    async def start(self) -> None:
        """Nothing runs in the background."""

    async def close(self) -> None:
        """Nothing to give back."""


#: The memory state (it holds nothing: one serves every app).
LOCAL_STATE = LocalState()
