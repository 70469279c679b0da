"""Route a request's calls to the pool replica that holds its KV cache.

Every pool call carries a request id (ProposeRequest / VerifyRequest, or the id itself for
`release`). The first call of a request goes to the less loaded of two random replicas; later
calls prefer the replica that served it before. When that replica is gone or full, any other
replica takes the call and recomputes the cache from the token ids the call carries, so
affinity is an optimisation, never a requirement. Calls without a request id (pool stats) go to
a uniformly random replica.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import LocalityMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

ROUTER_CLASS = "specserve.serve.affinity:CacheAffinityRouter"


def request_id_of(pending: PendingRequest | None) -> str | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    if isinstance(first, str):
        return first
    return getattr(first, "request_id", None)


class CacheAffinityRouter(LocalityMixin, RequestRouter):
    def initialize_state(self, max_tracked_requests: int = 100_000, **kwargs) -> None:
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()
        self._max_tracked = max_tracked_requests

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        rid = request_id_of(pending_request)
        if rid is None:  # calls about the pool (stats): any replica, uniformly, whatever its load
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        owner = self._owner.get(rid)
        ranks = [[r for r in candidate_replicas if r.replica_id == owner]] if owner else []
        others = [r for r in candidate_replicas if r.replica_id != owner]
        if others:
            ranks.append(random.sample(others, min(2, len(others))))
        return [rank for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = request_id_of(pending_request)
        if rid is None:
            return
        if pending_request.metadata.call_method == "release":
            self._owner.pop(rid, None)
            return
        self._owner[rid] = replica_id
        self._owner.move_to_end(rid)
        while len(self._owner) > self._max_tracked:
            self._owner.popitem(last=False)
