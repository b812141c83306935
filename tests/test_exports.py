"""The public surface is what `__all__` says, and every name in it exists."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = [
    "prefixflight.core",
    "prefixflight.core.cache",
    "prefixflight.core.flight",
    "prefixflight.core.routing",
    "prefixflight.sim",
    "prefixflight.specs",
    "prefixflight.cli",
    "prefixflight.backends",
    "prefixflight.serve",
]
TORCH_PACKAGES = ["prefixflight.backends.torch"]  # need the torch extra


@pytest.mark.parametrize(
    "name", [*PACKAGES, *(pytest.param(n, marks=pytest.mark.torch) for n in TORCH_PACKAGES)]
)
def test_all_is_complete_and_sorted(name: str) -> None:
    if name in TORCH_PACKAGES:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda s: (not s.isupper(), s))
    for item in exported:
        assert hasattr(module, item), item
    public = {n for n in dir(module) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(module, n)).__name__ == "module"}
    assert public - submodules - {"annotations"} == set(exported)


# The public surface of the pure core, pinned name by name: adding or removing an export must be
# a deliberate change here too (simulations and experiments belong to prefixflight.sim).
CORE_SURFACE = frozenset({
    "LRU", "S3FIFO", "Aborted", "AllBlocksCleared", "ApproxPrefixConfig", "ApproxPrefixRouter",
    "Arrived", "Assignment", "BalanceBy", "BlockHash", "BlockHasher", "BlockRemoved",
    "BlockStored", "BurstAffinityRouter", "BurstConfig", "BurstRouter", "CacheStats",
    "CapacityError", "ConfigError", "CurvePoint", "DecodeWork", "EventSink", "EvictionPolicy",
    "FinishReason", "Finished", "FlightConfig", "FlightCoordinator", "FlightDecision",
    "FlightEvent", "FlightKey", "FlightStats", "FullBatch", "HashAlgorithm", "Independent",
    "KVEvent",
    "LRUCurve", "Lead", "LeastLoadedRouter", "NoAffinity", "PageUsage", "Placed", "Placement",
    "PolicyName", "PrefillDone", "PrefillWork", "PrefixCache", "PrefixIndex", "PrefixflightError",
    "Progress",
    "Promote", "PublishMode", "Release", "ReleasePolicy", "ReleaseReason", "ReplayConfig",
    "ReplayReport", "ReplicaLoad", "RequestId", "RequestReport", "RequestResult", "RequestState",
    "Rng", "Role", "RouteRequest", "Routed", "Router", "Scheduler", "SchedulerConfig",
    "SchedulerStats", "StepOutcome", "StepPlan", "StepResult", "Tick", "TraceFormatError",
    "TraceReader", "TraceRecord", "UsageError", "Wait", "assign_batch", "auto_capacities",
    "compiled", "lru_curve", "parse_trace_line", "replay",
})  # fmt: skip

SIM_SURFACE = frozenset({
    "Arrival", "ClusterConfig", "CostModel", "FindingsRow", "FlightRow", "FlightSimConfig",
    "RouterReport", "SimRequest", "SimulationResult", "Workload", "grpo_workload",
    "simulate_cluster", "simulate_engine", "simulate_findings", "simulate_incremental_publication",
    "simulate_late_arrival", "simulate_partial_prefix", "simulate_single_flight", "trace_workload",
})  # fmt: skip


@pytest.mark.parametrize(
    ("name", "expected"), [("prefixflight.core", CORE_SURFACE), ("prefixflight.sim", SIM_SURFACE)]
)
def test_public_surface_is_pinned(name: str, expected: frozenset[str]) -> None:
    exported = set(importlib.import_module(name).__all__)
    assert sorted(exported - expected) == [], "new exports: add them here on purpose"
    assert sorted(expected - exported) == [], "removed exports: remove them here on purpose"


def test_core_exports_no_simulations_or_experiment_rows() -> None:
    core = importlib.import_module("prefixflight.core")
    assert not {n for n in core.__all__ if n.startswith("simulate") or n.endswith("Row")}
    assert not set(core.__all__) & SIM_SURFACE
