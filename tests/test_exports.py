"""The public surface is what `__all__` says, and every name in it exists."""

from __future__ import annotations

import ast
import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
SERVE_PACKAGES = ["prefixflight.serve.kv_events"]  # need the serve extra (zmq, msgspec)


@pytest.mark.parametrize(
    "name",
    [
        *PACKAGES,
        *SERVE_PACKAGES,
        *(pytest.param(n, marks=pytest.mark.torch) for n in TORCH_PACKAGES),
    ],
)
def test_all_is_complete_and_sorted(name: str) -> None:
    if name in TORCH_PACKAGES:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    if name in SERVE_PACKAGES:
        pytest.importorskip("zmq")
        pytest.importorskip("msgspec")
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda s: (not s.isupper(), s))
    for item in exported:
        assert hasattr(module, item), item
    public = {n for n in dir(module) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(module, n)).__name__ == "module"}
    assert public - submodules - {"annotations"} == set(exported)


# The public surface of the pure core, pinned name by name at both levels: adding or removing
# an export must be a deliberate change here too. The top level is what an engine builds and the
# values that cross the components' main methods, plus the errors (at most 45 names); events,
# decisions, stats rows, baselines and the build flag stay in their capability subpackage, and
# simulations and experiments belong to prefixflight.sim.
CORE_SURFACE = frozenset({
    "LRU", "S3FIFO", "BlockHash", "BlockHasher", "BurstConfig", "BurstRouter", "CapacityError",
    "ConfigError", "DecodeWork", "EvictionPolicy", "FinishReason", "FlightConfig",
    "FlightCoordinator", "FlightKey", "PrefillWork", "PrefixCache", "PrefixIndex",
    "PrefixflightError", "PublishMode", "ReleasePolicy", "ReplayConfig", "ReplayReport",
    "ReplicaLoad", "RequestId", "RequestReport", "RouteRequest", "Routed", "Router", "Scheduler",
    "SchedulerConfig", "StepOutcome", "StepPlan", "StepResult", "TraceFormatError", "TraceRecord",
    "UsageError", "parse_trace_line", "replay",
})  # fmt: skip

CACHE_SURFACE = frozenset({
    "LRU", "S3FIFO", "AllBlocksCleared", "BlockHash", "BlockHasher", "BlockRemoved",
    "BlockStored", "CacheStats", "CurvePoint", "EventSink", "EvictionPolicy", "HashAlgorithm",
    "KVEvent", "LRUCurve", "POLICIES", "PolicyName", "PrefixCache", "ReplayConfig",
    "ReplayReport", "RequestResult", "TraceReader", "TraceRecord", "auto_capacities", "compiled",
    "lru_curve", "make_policy", "parse_trace_line", "replay",
})  # fmt: skip

FLIGHT_SURFACE = frozenset({
    "Aborted", "Arrived", "DecodeWork", "FinishReason", "Finished", "FlightConfig",
    "FlightCoordinator", "FlightDecision", "FlightEvent", "FlightKey", "FlightStats",
    "Independent", "Lead", "PageUsage", "Placement", "PrefillDone", "PrefillWork", "Progress",
    "Promote", "PublishMode", "Release", "ReleasePolicy", "ReleaseReason", "RequestId",
    "RequestReport", "RequestState", "Role", "Scheduler", "SchedulerCall", "SchedulerConfig",
    "SchedulerStats", "StepOutcome", "StepPhase", "StepPlan", "StepResult", "Tick", "Wait",
})  # fmt: skip

ROUTING_SURFACE = frozenset({
    "ApproxPrefixConfig", "ApproxPrefixRouter", "Assignment", "BalanceBy", "BurstAffinityRouter",
    "BurstConfig", "BurstRouter", "FullBatch", "LeastLoadedRouter", "NoAffinity", "Placed",
    "PrefixIndex", "ReplicaLoad", "Rng", "RouteRequest", "Routed", "Router", "assign_batch",
})  # fmt: skip

VALIDATE_SURFACE = frozenset({
    "INT64_MAX", "INT64_MIN", "CheckedFloat", "CheckedInt", "assert_never", "check_block_hashes",
    "check_choice", "check_instance", "check_int", "check_name", "check_number", "check_ratio",
    "check_request_id", "check_time", "check_token_ids", "choice_field", "instance_field",
    "int_field", "is_int", "is_real", "number_field", "optional_int_field", "ratio_field",
    "renamed", "renamed_attribute", "request_id_field", "time_field", "deprecated_alias",
})  # fmt: skip

# what users of the KV-event wire call: publisher, subscriber and its index, topics, and the
# wire's event structs and codec; frame parsing and hash encodings stay in its modules
KV_EVENTS_SURFACE = frozenset({
    "ClusterBlockIndex", "ErrorKind", "IndexStats", "KVEventFormatError", "KVEventPublisher",
    "KVEventSubscriber", "PublisherAddress", "ReplicaBlockIndex", "ReplicaFeed", "ReplicaStatus",
    "WireAllBlocksCleared", "WireBatch", "WireBlockRemoved", "WireBlockStored", "decode_batch",
    "encode_batch", "fold_hash", "kv_topic", "parse_topic", "wire_events",
})  # fmt: skip

SIM_SURFACE = frozenset({
    "Arrival", "ClusterConfig", "CostModel", "FindingsRow", "FlightRow", "FlightSimConfig",
    "RouterReport", "SimRequest", "SimulationResult", "Workload", "grpo_workload",
    "simulate_cluster", "simulate_engine", "simulate_findings", "simulate_incremental_publication",
    "simulate_late_arrival", "simulate_partial_prefix", "simulate_single_flight", "trace_workload",
})  # fmt: skip


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("prefixflight.core", CORE_SURFACE),
        ("prefixflight.core.cache", CACHE_SURFACE),
        ("prefixflight.core.flight", FLIGHT_SURFACE),
        ("prefixflight.core.routing", ROUTING_SURFACE),
        ("prefixflight.core.validate", VALIDATE_SURFACE),
        ("prefixflight.sim", SIM_SURFACE),
        ("prefixflight.serve.kv_events", KV_EVENTS_SURFACE),
    ],
)
def test_public_surface_is_pinned(name: str, expected: frozenset[str]) -> None:
    if name in SERVE_PACKAGES:
        pytest.importorskip("zmq")
        pytest.importorskip("msgspec")
    exported = set(importlib.import_module(name).__all__)
    assert sorted(exported - expected) == [], "new exports: add them here on purpose"
    assert sorted(expected - exported) == [], "removed exports: remove them here on purpose"


def test_core_exports_no_simulations_or_experiment_rows() -> None:
    core = importlib.import_module("prefixflight.core")
    assert not {n for n in core.__all__ if n.startswith("simulate") or n.endswith("Row")}
    assert not set(core.__all__) & SIM_SURFACE


def test_the_top_level_is_small_and_reexports_its_subpackages() -> None:
    core = importlib.import_module("prefixflight.core")
    assert len(core.__all__) <= 45
    homes = {
        sub: importlib.import_module(f"prefixflight.core.{sub}")
        for sub in ("cache", "flight", "routing")
    }
    errors = importlib.import_module("prefixflight.core._errors")
    for name in core.__all__:
        owners = [sub for sub, mod in homes.items() if name in mod.__all__]
        if name in errors.__all__:
            assert owners == [], name
            continue
        assert len(owners) == 1, (name, owners)  # one home per name
        assert getattr(core, name) is getattr(homes[owners[0]], name), name


# The packages that compute their __all__ (prefixflight.core._lazy.lazy_attributes): a type
# checker reads their explicit re-exports (`from .cache import LRU as LRU`) instead, and so does
# the API reference (griffe_reexports.py). The lazy map is the other copy of each lazy name.
LAZY_PACKAGES = [
    "prefixflight.core",
    "prefixflight.core.cache",
    "prefixflight.specs",
    "prefixflight.vllm",
    "prefixflight.serve.ray",
]
ROOT = Path(__file__).resolve().parent.parent
TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def reexports(name: str) -> dict[str, tuple[str | None, bool]]:
    """The names the package's source re-exports as themselves: name -> (the module it is
    imported from, relative; whether only for type checkers)."""
    module = importlib.import_module(name)
    assert module.__file__ is not None
    found: dict[str, tuple[str | None, bool]] = {}
    for statement in ast.parse(Path(module.__file__).read_text(encoding="utf-8")).body:
        nodes, guarded = [statement], False
        if isinstance(statement, ast.If) and ast.unparse(statement.test) in TYPE_CHECKING:
            nodes, guarded = statement.body, True
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.asname == alias.name:
                        found[alias.name] = (node.module, guarded)
    return found


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_a_lazy_package_reexports_its_all_and_its_lazy_map_says_from_where(name: str) -> None:
    module = importlib.import_module(name)
    found = reexports(name)
    assert sorted(found) == sorted(module.__all__)
    lazy = {(item, home) for home, items in module._LAZY.items() for item in items}
    assert {(item, home) for item, (home, guarded) in found.items() if guarded} == lazy


def test_importing_the_core_loads_none_of_its_subpackages() -> None:
    code = "import json, sys, prefixflight.core; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = [m for m in json.loads(out.stdout) if m.startswith("prefixflight")]
    assert loaded == ["prefixflight", "prefixflight.core", "prefixflight.core._errors",
                      "prefixflight.core._lazy"]  # fmt: skip


def test_a_lazy_name_is_loaded_on_first_use_and_an_unknown_one_is_an_attribute_error() -> None:
    core = importlib.import_module("prefixflight.core")
    assert {"UsageError", "PrefixCache", "__all__"} <= set(dir(core))
    assert core.PrefixCache is importlib.import_module("prefixflight.core.cache").PrefixCache
    assert vars(core)["PrefixCache"] is core.PrefixCache  # loaded once, then a plain attribute
    with pytest.raises(AttributeError, match=r"'prefixflight\.core' has no attribute 'Nope'"):
        _ = core.Nope


@functools.cache
def griffe_package(name: str) -> Any:
    """``name`` as the API reference loads it (mkdocs.yml's paths and griffe extension)."""
    griffe = pytest.importorskip("griffe")  # the docs dependency group
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(str(ROOT / "griffe_reexports.py")),
        search_paths=[str(ROOT / r) for r in ("core", "specs", "backends", "serve")],
    )
    return loader.load(name)


@pytest.mark.parametrize("name", LAZY_PACKAGES[:3])  # the last two are not documented
def test_the_api_reference_documents_what_a_lazy_packages_all_holds(name: str) -> None:
    package = griffe_package(name)
    documented = {
        item
        for item, member in package.members.items()
        if not item.startswith("_") and item not in package.modules and member.is_public
    }
    assert documented == set(importlib.import_module(name).__all__)
