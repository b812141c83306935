"""Routing requests across replicas: the `Router` protocol and its values, the windowed
`BurstRouter` (joint placement of prompt-sharing requests, as llm-d's burst prefix-affinity
PR specifies) and the baselines it is measured against."""

from ._baselines import (
    ApproxPrefixConfig,
    ApproxPrefixRouter,
    BurstAffinityRouter,
    LeastLoadedRouter,
)
from ._burst import (
    Assignment,
    BalanceBy,
    BurstConfig,
    BurstRouter,
    FullBatch,
    NoAffinity,
    Placed,
    assign_batch,
)
from ._protocol import PrefixIndex, ReplicaLoad, Rng, Routed, Router, RouteRequest

__all__ = [
    "ApproxPrefixConfig",
    "ApproxPrefixRouter",
    "Assignment",
    "BalanceBy",
    "BurstAffinityRouter",
    "BurstConfig",
    "BurstRouter",
    "FullBatch",
    "LeastLoadedRouter",
    "NoAffinity",
    "Placed",
    "PrefixIndex",
    "ReplicaLoad",
    "Rng",
    "RouteRequest",
    "Routed",
    "Router",
    "assign_batch",
]
