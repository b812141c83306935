"""Pure simulations built on the core, for experiments rather than embedding: a simulated-time
engine (`simulate_engine` with a `CostModel`), the single-flight experiments run on it, and the
cluster simulator that routes workloads across simulated replicas (`simulate_cluster`).

Like the core, it imports only the standard library, attrs and `prefixflight.core`.
"""

from ._cluster import (
    ClusterConfig,
    RouterReport,
    SimRequest,
    Workload,
    grpo_workload,
    simulate_cluster,
    trace_workload,
)
from ._engine import Arrival, CostModel, SimulationResult, simulate_engine
from ._flight import (
    FindingsRow,
    FlightRow,
    FlightSimConfig,
    simulate_findings,
    simulate_incremental_publication,
    simulate_late_arrival,
    simulate_partial_prefix,
    simulate_single_flight,
)

__all__ = [
    "Arrival",
    "ClusterConfig",
    "CostModel",
    "FindingsRow",
    "FlightRow",
    "FlightSimConfig",
    "RouterReport",
    "SimRequest",
    "SimulationResult",
    "Workload",
    "grpo_workload",
    "simulate_cluster",
    "simulate_engine",
    "simulate_findings",
    "simulate_incremental_publication",
    "simulate_late_arrival",
    "simulate_partial_prefix",
    "simulate_single_flight",
    "trace_workload",
]
