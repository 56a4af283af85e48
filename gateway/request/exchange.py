"""One client request as the pipeline planned it, and as the relay carries it out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gateway.admission.lease import Lease
from gateway.admission.tenants import Tenant, TokenHold
from gateway.backends.target import Target
from gateway.core.capacity import Charge
from gateway.core.fairness import ANONYMOUS, Party
from gateway.core.prefix import Prefix
from gateway.fleet.pool import AdmitPath, Candidate, ModelQueue
from gateway.wire.routes import BY_NAME, RouteSpec

if TYPE_CHECKING:
    from gateway.observe.tracing import RequestTrace

__all__ = ["Exchange"]


@dataclass
class Exchange:
    """One client request on its way through the gateway.

    :param started: arrival time on the injected clock, seconds.
    :param headers: raw client request headers (forwarded, bytes as received, minus the
        dropped ones).
    :param client_wants_usage: the client asked for the streamed usage chunk itself.
    :param tag: the ``(param, value)`` the gateway added to identify the request
        upstream, or ``None`` (:mod:`gateway.admission.slotwatch`).
    :param api: ``"openai"``, or ``"ollama"`` for Ollama's native routes (errors then
        take Ollama's ``{"error": "..."}`` shape, and streams are NDJSON).
    :param raw_estimate: the local prompt estimate with no margin, when the backend
        could not count (compared with the count the backend reports, to calibrate).
    :param progress_s: a queued stream gets its 200 at once and an SSE comment every
        this many seconds while it waits (0: it waits silently).
    :param tracked: the ``predictive`` policy follows this request token by token and
        may preempt and continue it (:class:`gateway.relay.tracked.TrackedRelay`).
    :param admit_path: the way to a lease (:class:`gateway.fleet.pool.AdmitPath`): a
        :class:`~gateway.fleet.pool.LoneBackend` when one backend serves the model, its
        :class:`~gateway.fleet.pool.ModelQueue` for a pool. The exchange asks it and never
        branches on which it is.
    :param candidates: the request as planned on each backend it may run on (one for a
        lone backend); a grant binds the exchange to the candidate it went to.
    :param queue: the pool's queue (the same object as ``admit_path``), or ``None`` for
        a lone backend: the relay reads it to mark a failed backend down and to fail
        over.
    """

    backend: Target
    route: str
    body: dict[str, Any]
    charge: Charge
    stream: bool
    started: float
    headers: list[tuple[bytes, bytes]]
    client_wants_usage: bool
    admit_path: AdmitPath
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    status: int = 0
    tag: tuple[str, int] | None = None
    api: str = "openai"
    raw_estimate: int | None = None
    # Drops the kept count of this request's prompt (on the backend that counted it),
    # should the backend's usage disagree with it; None when none was kept.
    forget_count: Callable[[], None] | None = None
    progress_s: float = 0.0  # SSE progress comments while queued, every this many s
    tracked: bool = False  # followed token by token, preemptible (gateway.relay.tracked)
    # The request as planned on each backend it may run on (gateway.fleet.pool), and,
    # with several backends for the model, the model's queue, which picks one at
    # admission (None for a lone backend).
    candidates: list[Candidate] = field(default_factory=list)
    queue: ModelQueue | None = None
    affinity: str | None = None  # the backend that served this conversation's prefix
    affinity_key: str | None = None  # the conversation's key (gateway.fleet.pool.affinity_key)
    prefix: Prefix | None = None  # what its prompt holds, for slot affinity
    # Who it is for (gateway.admission.tenants): the tenant, its party in the queues, and the
    # tokens it holds in the tenant's tokens-per-minute window.
    tenant: Tenant | None = None
    party: Party = field(default_factory=Party)
    hold: TokenHold | None = None
    prompt_total: int = 0  # the prompt tokens of all its prompts (a batch: an upper bound)
    batched: bool = False  # several prompts: the backend's usage gives their true sum
    # For the access line (gateway.observe.logs): seconds queued, seconds to the first token,
    # and the reason it was refused after it reached the queue.
    # The id the backend is sent in X-Request-Id (gateway.observe.logs.request_id_of).
    request_id: bytes | None = None
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    reason: str | None = None
    # The last failure of the backend during it (a gateway_upstream_errors_total kind),
    # or "shutting_down" when a drain cut it: a stream's 200 may hide either.
    upstream_error: str | None = None
    # The JSON string (quotes included) each "model" of its answers is set to, whole and
    # streamed (gateway.wire.naming); None: the backend's own value is relayed.
    answer_model: bytes | None = None
    # Its trace (gateway.observe.tracing); None when tracing is off.
    trace: RequestTrace | None = None
    # The candidate of the last grant; None while it waits through its admit path.
    _bound: Candidate | None = field(default=None, repr=False)

    @property
    def spec(self) -> RouteSpec:
        """The route's entry in the route table (what it is and what its answers hold)."""
        return BY_NAME[self.route]

    @property
    def who(self) -> tuple[str, str]:
        """The ``tenant`` and ``priority`` metric labels (values from the config only)."""
        return (self.tenant.name if self.tenant else ANONYMOUS, self.party.priority)

    @property
    def may_fail_over(self) -> bool:
        """Another backend of the model could take this request if its backend fails."""
        return self.admit_path.failover and len(self.candidates) > 1

    def try_admit(self) -> Lease | None:
        """A lease now (on the best backend of the model), or ``None``."""
        got = self.admit_path.try_admit(self.candidates, self.affinity, self.party,
                                        self.prefix)
        return None if got is None else self._bind(got)

    async def admit(self, *, front: bool = False) -> Lease:
        """Wait for a lease in FIFO order (on whichever backend of the model frees room
        first; with ``front``, ahead of the others); raises as
        :meth:`gateway.admission.admission.Admission.admit`."""
        self._bound = None  # waiting through the path again (a failover)
        return self._bind(await self.admit_path.admit(
            self.candidates, self.affinity, front=front, party=self.party,
            prefix=self.prefix))

    async def readmit(self, *, front: bool = True, prefer: int | None = None) -> Lease:
        """Wait again on the backend the request is bound to, in that backend's own
        queue (with ``front``, at its head; ``prefer``: the slot to take there, where
        the request's prompt is cached), with its current charge: a preempted answer
        coming back to be continued, or an overflowed one restarted. Not through the
        admit path, which would pick a backend; raises as
        :meth:`gateway.admission.admission.Admission.admit`."""
        return await self.backend.admission.admit(self.charge, front=front, prefer=prefer,
                                                  party=self.party)

    def queue_progress(self) -> tuple[int, float | None] | None:
        """While waiting: the place in the queue (1 = next) and predicted seconds
        (``None`` when not predicted: a pool predicts none); ``None`` when not waiting.

        Before its first grant (or waiting again through the admit path), the request
        is asked about as planned; once granted, as it now stands on its backend (a
        continuation waits there with a new charge, :meth:`readmit`): a lone backend
        finds it in its own queue; a pool's queue does not hold it (``None``).
        """
        if self._bound is None:
            return self.admit_path.progress(self.candidates)
        return self.admit_path.progress([replace(self._bound, charge=self.charge)])

    def _bind(self, got: tuple[Candidate, Lease]) -> Lease:
        candidate, lease = got
        self._bound = candidate
        self.admit_path.remember(self.affinity_key, candidate.backend.name)
        self.backend, self.charge, self.body = candidate.backend, candidate.charge, candidate.body
        self.tag, self.tracked = candidate.tag, candidate.tracked
        return lease
