"""The one registry of ``prefixflight conform``: the machines (checks) and the engines.

`MACHINES` names each check and the machine that runs it, and which declaration selects it;
`ENGINES` lists the engines prefixflight ships adapters for, each as its checks; installed
packages add engines through the entry-point group ``prefixflight.adapters`` (`engines`).
Everything else (the CLI's choices, `prefixflight.specs.machine_for`, the conform runner,
the docs' tables) reads these. Needs only attrs (no Hypothesis), so the CLI can list the
checks without the ``specs`` extra.

To add an engine: one `Check` per machine in `ENGINES` (or, from the engine's own package,
an entry point ``NAME = "module:Adapter"`` in the group ``prefixflight.adapters``, the
adapter declaring its semantics). To add a machine: one `Machine` in `MACHINES`.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import Any

import attrs

from prefixflight.core import UsageError
from prefixflight.core.cache import POLICIES

from ._declare import (
    POLICY_MACHINES,
    EngineSemantics,
    IndexSemantics,
    PolicySemantics,
    SchedulerSemantics,
)

__all__ = [
    "CHECKS",
    "ENGINES",
    "ENTRY_POINTS",
    "MACHINES",
    "Check",
    "Machine",
    "check_for",
    "engines",
    "load_object",
]

_S = "prefixflight.specs"
_A = f"{_S}.adapters"
ENTRY_POINTS = "prefixflight.adapters"
"""The entry-point group an engine's package registers its adapter in."""


@attrs.frozen
class Machine:
    """One check: the machine class (``"module:Class"``, imported when it runs), the
    declaration that selects it, and what its factory is called with."""

    name: str
    machine: str
    semantics: type[Any]
    called_with: str


_POLICY_ARGS = {"s3fifo": "capacity=, small_ratio=, max_freq=, ghost_admit_freq="}

MACHINES: dict[str, Machine] = {
    m.name: m
    for m in (
        Machine("engine", f"{_S}._engine_machine:PrefixEngineConformance", EngineSemantics,
                "pages (an int)"),
        *(  # one per policy machine: its class is the name in capitals + "Conformance"
            Machine(p, f"{_S}._machines:{p.upper()}Conformance", PolicySemantics,
                    _POLICY_ARGS.get(p, "capacity="))
            for p in POLICY_MACHINES
        ),
        Machine("scheduler", f"{_S}._sched_machine:SchedulerConformance", SchedulerSemantics,
                "a SchedulerLimits"),
        Machine("index", f"{_S}._index_machine:KVIndexConformance", IndexSemantics,
                "nothing"),
    )
}  # fmt: skip
"""Every check, by name (``prefixflight conform --check NAME``)."""

CHECKS = tuple(MACHINES)


@attrs.frozen
class Check:
    """One machine over one engine's adapter.

    ``name``: a key of `MACHINES`, or ``None`` for the one the adapter's declaration names.
    ``base``: ``"module:Class"``, the engine class an ``--impl`` must subclass.
    ``adapter``: ``"module:Class"`` of the adapter wrapping ``base`` (built with
    ``impl_keyword=`` the ``--impl`` class); ``None`` when ``base`` itself is checked.
    ``isolated``: run it in a worker process (a crash is a finding). ``configs``:
    ``"module:function"`` returning the strategy of what the factory is called with.
    ``setup``: ``"module:function"`` to call before importing ``base``. ``always``: runs
    without ``--impl`` besides the first check of its name (another configuration of the
    engine, such as vLLM with prefixflight's plugin).
    """

    name: str | None
    base: str
    adapter: str | None = None
    impl_keyword: str = "impl"
    isolated: bool = False
    configs: str | None = None
    setup: str | None = None
    always: bool = False


ENGINES: dict[str, tuple[Check, ...]] = {
    "prefixflight": (
        Check("engine", "prefixflight.core.flight._pages:PagePool", f"{_A}:PagePoolAdapter",
              "pool_cls"),
        # every core policy, under the machine of its name
        *(Check(name, f"prefixflight.core:{cls.__name__}") for name, cls in POLICIES.items()),
        Check("scheduler", "prefixflight.core:Scheduler", f"{_A}:PrefixflightSchedulerAdapter",
              "scheduler_cls"),
        Check("index", "prefixflight.serve.kv_events:ReplicaBlockIndex",
              f"{_A}:ReplicaIndexAdapter", "index_cls"),
    ),
    "vllm": (
        Check("engine", "vllm.v1.core.kv_cache_manager:KVCacheManager", f"{_A}:VLLMAdapter"),
        Check("engine", "vllm.v1.core.block_pool:BlockPool", f"{_A}:VLLMAdapter"),
        Check("engine", "vllm.v1.core.kv_cache_manager:KVCacheManager",
              f"{_A}:VLLMPluginLRU", always=True),
        Check("engine", "vllm.v1.core.kv_cache_manager:KVCacheManager",
              f"{_A}:VLLMPluginS3FIFO", always=True),
        Check("scheduler", "vllm.v1.core.sched.scheduler:Scheduler",
              f"{_A}:VLLMSchedulerAdapter"),
    ),
    "sglang": (
        Check("engine", "sglang.srt.mem_cache.radix_cache:RadixCache", f"{_A}:SGLangAdapter",
              setup=f"{_A}:stub_torchvision"),
    ),
    "libcachesim": (
        Check("s3fifo", "libcachesim:S3FIFO", f"{_A}:LibCacheSimS3FIFO", isolated=True,
              configs=f"{_A}:libcachesim_s3fifo_configs"),
        Check("lru", "libcachesim:LRU", f"{_A}:LibCacheSimLRU", isolated=True),
    ),
    "dynamo": (
        Check("index", "dynamo.llm:RadixTree", f"{_A}:DynamoIndexAdapter", "tree_cls"),
    ),
}  # fmt: skip
"""The engines prefixflight ships adapters for (without ``--impl`` the first check of each
name runs, and the ``always`` ones; with it, the checks whose ``base`` the class
subclasses)."""


def engines() -> dict[str, tuple[Check, ...]]:
    """`ENGINES` and the engines installed packages register in the ``prefixflight.adapters``
    entry-point group (a name prefixflight ships keeps its own checks)."""
    found = dict(ENGINES)
    for point in metadata.entry_points(group=ENTRY_POINTS):
        found.setdefault(point.name, (Check(None, point.value),))
    return found


def load_object(path: str) -> Any:
    """``"module:Name"`` (or ``"module.Name"``) -> the object; `UsageError` naming what is
    missing."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise UsageError(f"expected MODULE:CLASS, got {path!r}")
    try:
        obj = import_module(module)
    except ImportError as exc:
        raise UsageError(f"cannot import {module!r}: {exc}") from None
    except Exception as exc:  # the module itself fails (a syntax error, an error at import)
        raise UsageError(f"cannot import {module!r}: {type(exc).__name__}: {exc}") from None
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module!r} has no attribute {name!r}") from None
    return obj


def check_for(semantics: Any, check: str | None, subject: str) -> str:
    """The check to run ``subject`` (an adapter's name) under: the one its declaration
    (``semantics``, ``None`` if it has none) names, else ``check``. `UsageError` when they
    disagree, or when neither says."""
    if check is not None and check not in MACHINES:
        raise UsageError(f"unknown check {check!r}; known: {', '.join(CHECKS)}")
    if semantics is None:
        if check is None:
            raise UsageError(
                f"{subject} declares no semantics: give it a `semantics` attribute "
                "(EngineSemantics, PolicySemantics(policy=...), SchedulerSemantics or "
                "IndexSemantics), or "
                f"name its check ({', '.join(CHECKS)})"
            )
        return check
    by_type = {EngineSemantics: "engine", SchedulerSemantics: "scheduler", IndexSemantics: "index"}
    named = by_type.get(type(semantics))
    if isinstance(semantics, PolicySemantics):
        named = semantics.policy
        if named is None and check is None:
            raise UsageError(
                f"{subject} declares PolicySemantics without a policy: declare "
                "PolicySemantics(policy=...) with one of "
                f"{', '.join(n for n, m in MACHINES.items() if m.semantics is PolicySemantics)},"
                " or name its check"
            )
    elif named is None:
        raise UsageError(
            f"{subject}.semantics is {semantics!r}, not an EngineSemantics, PolicySemantics, "
            "SchedulerSemantics or IndexSemantics"
        )
    if check is not None and not isinstance(semantics, MACHINES[check].semantics):
        raise UsageError(
            f"{subject} declares {type(semantics).__name__}; the {check!r} check needs "
            f"{MACHINES[check].semantics.__name__}"
        )
    if check is not None and named is not None and check != named:
        raise UsageError(f"{subject} declares policy={named!r}; it cannot run as {check!r}")
    result = check or named
    assert result is not None
    return result
