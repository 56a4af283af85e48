"""The background tasks of one app, owned by its state (never a module global).

Discovery loops, reload retirements and, for the relay, the reading of finished streams'
tails all run as tasks of the app's :class:`TaskSet`
(:attr:`gateway.fleet.state.GatewayState.tasks`). The app's lifespan cancels them at
shutdown (:meth:`TaskSet.cancel_all`), so that one app stopping never touches another
app's tasks in the same process (tests build many apps).
"""

from __future__ import annotations

from gateway import tasks

__all__ = ["CANCEL_ALL_S", "TaskSet"]

#: Seconds the app's background tasks get to end once cancelled at shutdown (their
#: ``finally`` blocks give back what they hold, in Redis too).
CANCEL_ALL_S = 5.0


class TaskSet(tasks.TaskSet):
    """The app's background tasks (:class:`gateway.tasks.TaskSet`)."""

    async def cancel_all(self, seconds: float = CANCEL_ALL_S) -> None:
        """Cancel them and wait, for at most :data:`CANCEL_ALL_S` seconds by default."""
        await super().cancel_all(seconds)
