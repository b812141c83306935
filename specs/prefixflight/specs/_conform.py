"""`conform`: run the conformance machines of one engine (``prefixflight conform ENGINE``).

An engine is a list of checks: a machine class built over a declared adapter (its prefix
cache, its eviction policies, its scheduler), and the engine class that ``impl`` may
replace. `conform` runs each under one seed and returns a
`ConformReport` that lists, per check, what was run (examples, steps, rules, seed), the
declared differences, and the first undeclared difference with its shrunk example.

The engines' packages are imported only when their check runs (vLLM, SGLang and libCacheSim
live in the environment ``benchmarks/peers/setup.sh`` builds, never in prefixflight's own).
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import LRU, S3FIFO, UsageError

from ._adapter import name_of
from ._declare import EngineSemantics, PolicySemantics, SchedulerSemantics, declared_differences
from ._engine_machine import PrefixEngineConformance
from ._isolate import isolated
from ._machines import LRUConformance, PolicyConformance, S3FIFOConformance
from ._sched_machine import SchedulerConformance

__all__ = ["CHECKS", "ENGINES", "Check", "CheckResult", "ConformReport", "conform", "load_class"]


@attrs.frozen
class Check:
    """One machine over one adapter.

    ``base`` is ``"module:Class"``, the engine class an ``impl`` must subclass for this
    check to run; ``build(impl)`` makes the machine class (``impl`` is ``None`` for the
    engine's own class).
    """

    name: str
    base: str
    build: Callable[[type[Any] | None], type[Any]]
    setup: str | None = None  # "module:function" to call before importing ``base``


def _engine(adapter: str, keyword: str = "impl") -> Callable[[type[Any] | None], type[Any]]:
    def build(impl: type[Any] | None) -> type[Any]:
        cls = load_class(adapter)
        factory = cls if impl is None else functools.partial(cls, **{keyword: impl})
        return PrefixEngineConformance.for_adapter(factory)

    return build


def _scheduler(adapter: str, keyword: str = "impl") -> Callable[[type[Any] | None], type[Any]]:
    def build(impl: type[Any] | None) -> type[Any]:
        cls = load_class(adapter)
        factory = cls if impl is None else functools.partial(cls, **{keyword: impl})
        return SchedulerConformance.for_adapter(factory)

    return build


def _policy(
    machine: type[PolicyConformance], adapter: str | None, default: Any, configs: str | None = None
) -> Callable[[type[Any] | None], type[Any]]:
    def build(impl: type[Any] | None) -> type[Any]:
        if adapter is None:  # prefixflight's own policies: the class itself is the factory
            return machine.for_factory(impl or default)
        cls = load_class(adapter)
        factory = isolated(cls if impl is None else functools.partial(cls, impl=impl))
        strategy = load_class(configs)() if configs else None
        return machine.for_factory(factory, configs=strategy)

    return build


_A = "prefixflight.specs.adapters"
ENGINES: dict[str, tuple[Check, ...]] = {
    "prefixflight": (
        Check(
            "engine",
            "prefixflight.core.flight._pages:PagePool",
            _engine(f"{_A}:PagePoolAdapter", "pool_cls"),
        ),
        Check("s3fifo", "prefixflight.core:S3FIFO", _policy(S3FIFOConformance, None, S3FIFO)),
        Check("lru", "prefixflight.core:LRU", _policy(LRUConformance, None, LRU)),
        Check(
            "scheduler",
            "prefixflight.core:Scheduler",
            _scheduler(f"{_A}:PrefixflightSchedulerAdapter", "scheduler_cls"),
        ),
    ),
    "vllm": (
        Check(
            "engine",
            "vllm.v1.core.kv_cache_manager:KVCacheManager",
            _engine(f"{_A}:VLLMAdapter"),
        ),
        Check("engine", "vllm.v1.core.block_pool:BlockPool", _engine(f"{_A}:VLLMAdapter")),
        Check(
            "scheduler",
            "vllm.v1.core.sched.scheduler:Scheduler",
            _scheduler(f"{_A}:VLLMSchedulerAdapter"),
        ),
    ),
    "sglang": (
        Check(
            "engine",
            "sglang.srt.mem_cache.radix_cache:RadixCache",
            _engine(f"{_A}:SGLangAdapter"),
            setup=f"{_A}:stub_torchvision",
        ),
    ),
    "libcachesim": (
        Check(
            "s3fifo",
            "libcachesim:S3FIFO",
            _policy(
                S3FIFOConformance,
                f"{_A}:LibCacheSimS3FIFO",
                None,
                f"{_A}:libcachesim_s3fifo_configs",
            ),
        ),
        Check("lru", "libcachesim:LRU", _policy(LRUConformance, f"{_A}:LibCacheSimLRU", None)),
    ),
}
"""Every engine ``prefixflight conform`` knows, with its checks (without ``--impl`` the
first check of each name runs; with it, the checks whose ``base`` the class subclasses;
``--check`` keeps only the checks of the names it gives)."""

CHECKS = tuple(sorted({c.name for checks in ENGINES.values() for c in checks}))
"""Every check name (``prefixflight conform --check``)."""


def load_class(path: str) -> Any:
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
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module!r} has no attribute {name!r}") from None
    return obj


@attrs.frozen
class CheckResult:
    """What one check ran and found."""

    name: str
    machine: str
    adapter: str
    impl: str
    rules: tuple[str, ...]
    semantics: dict[str, Any]
    declared: tuple[dict[str, Any], ...]
    examples: int
    steps: int
    seed: int
    seconds: float
    passed: bool
    message: str | None = None
    example: tuple[str, ...] = ()


@attrs.frozen
class ConformReport:
    """Every check of one engine; ``passed`` when none found an undeclared difference."""

    engine: str
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "passed": self.passed,
            "checks": [attrs.asdict(r, recurse=False) for r in self.results],
        }


def _rules(machine: type[Any]) -> tuple[str, ...]:
    sem = machine.semantics
    if isinstance(sem, SchedulerSemantics):
        return ("add", "add_identical", "schedule", "complete", "step", "abort", "drain")
    if isinstance(sem, EngineSemantics):
        return ("admit", "finish", *sorted(sem.ops))
    assert isinstance(sem, PolicySemantics)
    ops = sem.ops
    names = ["access"]
    names += ["pin", "unpin"] if "pin" in ops else []
    names += ["misuse"] if {"pin", "remove"} & ops else []
    names += [op for op in ("remove", "evict") if op in ops]
    return tuple(names)


_NOISE = ("state.agrees_with_reference()", "state.teardown()", "Failing test case")


def _run(machine: type[Any], examples: int, steps: int, seed_: int) -> tuple[str | None, list[str]]:
    seeded = seed(seed_)(type(machine.__name__, (machine,), {}))
    try:
        run_state_machine_as_test(
            seeded,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                deadline=None,
                database=None,
                derandomize=False,
                print_blob=False,
                report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.generate, Phase.shrink),
                suppress_health_check=list(HealthCheck),
            ),
        )
    except ImportError:  # the engine is not installed here: not a finding
        raise
    except Exception as exc:  # an undeclared difference, or anything else the run raised
        first: BaseException = exc
        flaky = isinstance(exc, Flaky)
        while getattr(first, "exceptions", None):  # an exception group: show the first
            first = first.exceptions[0]  # type: ignore[attr-defined]
        message = (
            str(first) if type(first) is AssertionError else f"{type(first).__name__}: {first}"
        )
        if flaky:
            message = (
                "the failure did not replay: the engine (or its adapter) depends on something "
                f"outside its inputs (clock, hash or memory order): {message}"
            )
        notes = [n for n in getattr(first, "__notes__", ()) if not n.startswith(_NOISE)]
        return message, [n for n in notes if not n.startswith("state = ")]
    return None, []


def conform(
    engine: str,
    *,
    impl: type[Any] | None = None,
    examples: int = 100,
    steps: int = 50,
    seed: int | None = None,
    checks: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> ConformReport:
    """Run ``engine``'s checks (``impl``: a drop-in replacement for one of its classes;
    ``checks``: only the checks of these names, e.g. ``["scheduler"]``).

    Raises `UsageError` for an unknown engine or check, an ``impl`` that replaces none of
    its classes (of the checks chosen), or an engine that cannot be imported here.
    """
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if examples < 1 or steps < 1:
        raise UsageError(f"need examples >= 1 and steps >= 1, got {examples}, {steps}")
    names = sorted({c.name for c in ENGINES[engine]})
    if checks is not None:
        unknown = sorted(set(checks) - set(names))
        if unknown or not checks:
            raise UsageError(
                f"{engine} has no check {', '.join(map(repr, unknown)) or 'chosen'}; "
                f"its checks: {', '.join(names)}"
            )
    chosen = _choose(engine, impl, checks)
    run_seed = secrets.randbits(32) if seed is None else seed
    results = []
    for check in chosen:
        try:
            machine = check.build(impl)
        except ImportError as exc:
            raise UsageError(_not_installed(engine, exc)) from None
        if log:
            log(f"{engine} {check.name}: {machine.__name__}, {examples} examples of up to "
                f"{steps} steps, seed {run_seed}")  # fmt: skip
        t0 = time.perf_counter()
        try:
            message, example = _run(machine, examples, steps, run_seed)
        except ImportError as exc:
            raise UsageError(_not_installed(engine, exc)) from None
        results.append(
            CheckResult(
                name=check.name,
                machine=machine.__mro__[1].__name__,
                adapter=name_of(machine.factory),
                impl=_qualified(impl) if impl is not None else check.base,
                rules=_rules(machine),
                semantics={
                    k: sorted(v) if isinstance(v, frozenset) else v
                    for k, v in attrs.asdict(machine.semantics).items()
                },
                declared=tuple(declared_differences(machine.semantics)),
                examples=examples,
                steps=steps,
                seed=run_seed,
                seconds=round(time.perf_counter() - t0, 3),
                passed=message is None,
                message=message,
                example=tuple(example),
            )
        )
    return ConformReport(engine, tuple(results))


def _qualified(cls: type[Any]) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _not_installed(engine: str, exc: ImportError) -> str:
    return (
        f"{engine} cannot be imported here ({exc}); run in the environment that "
        "benchmarks/peers/setup.sh builds"
    )


def _choose(engine: str, impl: type[Any] | None, only: Sequence[str] | None) -> list[Check]:
    checks = tuple(c for c in ENGINES[engine] if only is None or c.name in only)
    if impl is None:
        seen: dict[str, Check] = {}
        for c in checks:
            seen.setdefault(c.name, c)
        return list(seen.values())
    if not isinstance(impl, type):
        raise UsageError(f"--impl must name a class, got {impl!r}")
    chosen = []
    for c in checks:
        try:
            if c.setup:
                load_class(c.setup)()
            base = load_class(c.base)
        except UsageError as exc:
            raise UsageError(_not_installed(engine, ImportError(str(exc)))) from None
        if issubclass(impl, base):
            chosen.append(c)
    if not chosen:
        bases = ", ".join(c.base for c in checks)
        raise UsageError(f"{_qualified(impl)} is not a subclass of any of {bases}")
    return chosen
