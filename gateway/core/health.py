"""Pure health of one backend as routing sees it: a circuit breaker over failed requests.

Rules of this module: no I/O and no clock of its own (every time is passed in, seconds on
the gateway's clock); it imports nothing but the standard library.

After a request failed on a backend before any byte reached its client (refused, timed
out, or a 5xx), the backend is skipped until :attr:`Health.down_until`, for a backoff
doubled with each failure in a row. Once that time has passed, the next request sent
there is the half-open probe: others skip the backend until it succeeds
(:meth:`Health.request_served`) or fails again, or for the probe's time-out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Health"]


@dataclass
class Health:
    """A backend's failures in a row and when it may take requests again.

    :param failures: consecutive failed requests (0: healthy).
    :param down_until: clock time (seconds) before which new requests skip the backend;
        0.0 when it is up.
    """

    failures: int = 0
    down_until: float = 0.0

    def usable(self, now: float) -> bool:
        """Not marked down at ``now`` (up, or due its half-open probe)."""
        return now >= self.down_until

    def down_for_s(self, now: float) -> float:
        """Seconds left of the backoff at ``now`` (0.0 when up)."""
        return max(0.0, self.down_until - now)

    def request_failed(self, now: float, initial_s: float, max_s: float) -> float:
        """A request failed at ``now``: mark the backend down for ``initial_s`` seconds,
        doubled for each failure in a row, at most ``max_s``.

        :returns: how long it is down, seconds.
        """
        self.failures += 1
        down = min(max_s, initial_s * 2.0 ** (self.failures - 1))
        self.down_until = now + down
        return down

    def probe_started(self, now: float, probe_s: float) -> None:
        """A request was sent at ``now``. After failures, once the backoff has passed,
        it is the probe: the backend is skipped for ``probe_s`` seconds (its connect
        time-out and a second) unless the probe ends first. Without failures, nothing
        changes."""
        if self.failures and now >= self.down_until:
            self.down_until = now + probe_s

    def request_served(self) -> None:
        """A request got an answer: the backend is up, with no failures."""
        self.failures = 0
        self.down_until = 0.0
