"""`conform`: run the conformance machines of one engine (``prefixflight conform ENGINE``),
or of one adapter (``prefixflight conform --adapter MODULE:CLASS``).

The engines and checks are `prefixflight.specs._registry`'s (one registry): an engine is a
list of checks, each a machine over a declared adapter (its prefix cache, its eviction
policies, its scheduler) and the engine class that ``impl`` may replace; an adapter runs
under the machine its declaration names. `conform` runs each under one seed and returns a
`ConformReport` that lists, per check, what was run (examples, steps, rules, seed), the
declared differences, and the first undeclared difference with its shrunk example.

The engines' packages are imported only when their check runs (vLLM, SGLang and libCacheSim
live in the environment ``benchmarks/peers/setup.sh`` builds, never in prefixflight's own).
"""

from __future__ import annotations

import functools
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky, HypothesisException
from hypothesis.stateful import run_state_machine_as_test

from prefixflight.core import UsageError
from prefixflight.core._extras import install_command

from ._adapter import NO_OP, name_of, semantics_of
from ._declare import (
    EngineSemantics,
    IndexSemantics,
    PolicySemantics,
    SchedulerSemantics,
    declared_differences,
)
from ._engine_machine import PrefixEngineConformance
from ._index_machine import KVIndexConformance
from ._isolate import isolated
from ._machines import PolicyConformance
from ._registry import MACHINES, Check, check_for, engines, load_object
from ._sched_machine import SchedulerConformance

__all__ = ["CheckResult", "ConformReport", "conform", "load_class", "machine_for"]

load_class = load_object  # the name the CLI and older callers use


def machine_for(
    factory: Callable[..., Any],
    *,
    check: str | None = None,
    semantics: Any = None,
    configs: st.SearchStrategy[Any] | None = None,
) -> type[Any]:
    """The machine class that checks ``factory``'s implementations: the one its declaration
    names (``semantics``, else ``factory.semantics``), or ``check`` (a name of
    `prefixflight.specs._registry.MACHINES`: ``"engine"``, ``"s3fifo"``, ``"lru"``,
    ``"fifo"``, ``"lfu"``, ``"sieve"``, ``"scheduler"``, ``"index"``).

    ``configs`` narrows what the factory is called with (config dicts for a policy, pool
    sizes for an engine or an index, block sizes for a scheduler; default: ``factory.configs`` if it
    has one). Run it with ``run_state_machine_as_test(machine)`` or use ``machine.TestCase``.
    Raises `UsageError` when the declaration and ``check`` disagree or neither names one,
    or when the declaration promises calls the class lacks.
    """
    declared = semantics if semantics is not None else semantics_of(factory)
    name = check_for(declared, check, name_of(factory))
    machine: type[Any] = load_object(MACHINES[name].machine)
    if issubclass(machine, PolicyConformance):
        return machine.for_factory(factory, semantics=semantics, configs=configs)
    if issubclass(machine, PrefixEngineConformance):
        return machine.for_adapter(factory, semantics=semantics, pages=configs)
    if issubclass(machine, KVIndexConformance):
        return machine.for_adapter(factory, semantics=semantics, pages=configs)
    assert issubclass(machine, SchedulerConformance)
    return machine.for_adapter(factory, semantics=semantics, block_sizes=configs)


def _build(check: Check, impl: type[Any] | None) -> type[Any]:
    """The machine of one registered check, over ``impl`` when given."""
    if check.setup:
        load_object(check.setup)()
    if check.adapter is None:  # the class itself is checked (ours, or a registered adapter)
        factory: Callable[..., Any] = impl or load_object(check.base)
    else:
        factory = load_object(check.adapter)
        if impl is not None:
            factory = functools.partial(factory, **{check.impl_keyword: impl})
    if check.isolated:
        factory = isolated(factory)
    configs = load_object(check.configs)() if check.configs else None
    return machine_for(factory, check=check.name, configs=configs)


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
    found_after_examples: int | None = None
    """Examples begun (discarded ones included) up to the first that failed, before
    shrinking; ``None`` when none failed."""
    found_after_seconds: float | None = None


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
        return ("admit", "finish", *sorted(sem.ops - {"stats"}))  # stats: a check, no rule
    if isinstance(sem, IndexSemantics):
        return ("admit", "finish", "evict", "reset")
    assert isinstance(sem, PolicySemantics)
    ops = sem.ops
    names = ["access"]
    names += ["pin", "unpin"] if "pin" in ops else []
    names += ["misuse"] if {"pin", "remove"} & ops else []
    names += [op for op in ("remove", "evict") if op in ops]
    return tuple(names)


_NOISE = ("state.agrees_with_reference()", "state.teardown()", "Failing test case")


@attrs.define
class _Detection:
    """How far a run got before its first failing example: examples begun (discarded ones
    included) and seconds, up to and including the first that failed."""

    made: int = 0
    examples: int | None = None
    seconds: float | None = None
    t0: float = attrs.field(factory=time.perf_counter)


def _counted(machine: type[Any], found: _Detection) -> type[Any]:
    """``machine`` noting in ``found`` the first example that fails (before shrinking)."""

    def __init__(self: Any) -> None:
        found.made += 1
        machine.__init__(self)

    def teardown(self: Any) -> None:
        try:
            machine.teardown(self)
        finally:  # Hypothesis tears an example down in a finally: a failure is propagating
            exc = sys.exc_info()[1]
            failed = isinstance(exc, Exception) and not isinstance(exc, HypothesisException)
            if failed and found.examples is None:
                found.examples = found.made
                found.seconds = round(time.perf_counter() - found.t0, 3)

    body = {"__init__": __init__, "teardown": teardown}
    return type(machine.__name__, (machine,), body)


def _run(
    machine: type[Any], examples: int, steps: int, seed_: int, found: _Detection | None = None
) -> tuple[str | None, list[str]]:
    seeded = seed(seed_)(_counted(machine, found or _Detection()))
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
    except (ImportError, UsageError):  # not installed here, or a declaration to fix
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
        return message, _without_no_ops([n for n in notes if not n.startswith("state = ")])
    return None, []


def _without_no_ops(lines: list[str]) -> list[str]:
    """A shrunk example without the steps the machine noted as doing nothing."""
    out: list[str] = []
    skip = False
    for line in lines:
        if line == NO_OP:
            skip = True
        elif skip and line.startswith("state."):
            skip = False
        else:
            out.append(line)
    return out


def conform(
    engine: str | None = None,
    *,
    adapter: str | None = None,
    impl: type[Any] | None = None,
    examples: int = 100,
    steps: int = 50,
    seed: int | None = None,
    checks: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> ConformReport:
    """Run ``engine``'s checks, or ``adapter``'s (``"module:Class"``: any class or factory,
    run under the machine its declaration names, or the one check of ``checks``).

    ``impl``: a drop-in replacement for one of the engine's classes; ``checks``: only the
    checks of these names, e.g. ``["scheduler"]``. Raises `UsageError` for an unknown engine
    or check, an ``impl`` that replaces none of its classes (of the checks chosen), an engine
    that cannot be imported here, an adapter that cannot be loaded or whose declaration
    names no check, or a declaration that promises calls the implementation lacks.
    """
    if (engine is None) == (adapter is None):
        raise UsageError("name an ENGINE or an --adapter MODULE:CLASS (one of them)")
    if examples < 1 or steps < 1:
        raise UsageError(f"need examples >= 1 and steps >= 1, got {examples}, {steps}")
    if adapter is not None:
        if impl is not None:
            raise UsageError("--impl replaces a class of an ENGINE; --adapter names the class")
        if checks is not None and len(set(checks)) != 1:
            raise UsageError(f"an adapter runs under one check, got {list(checks)}")
        label = adapter
        chosen = [_named(Check(checks[0] if checks else None, adapter), label)]
    else:
        assert engine is not None
        label = engine
        registry = engines()
        if engine not in registry:
            raise UsageError(f"unknown engine {engine!r}; known: {', '.join(registry)}")
        chosen = _choose(engine, [_named(c, engine) for c in registry[engine]], impl, checks)
    run_seed = secrets.randbits(32) if seed is None else seed
    results = []
    for check in chosen:
        assert check.name is not None
        try:
            machine = _build(check, None if adapter else impl)
        except ImportError as exc:
            raise UsageError(_not_installed(label, exc)) from None
        if log:
            log(f"{label} {check.name}: {machine.__name__}, {examples} examples of up to "
                f"{steps} steps, seed {run_seed}")  # fmt: skip
        t0 = time.perf_counter()
        found = _Detection()
        try:
            message, example = _run(machine, examples, steps, run_seed, found)
        except ImportError as exc:
            raise UsageError(_not_installed(label, exc)) from None
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
                found_after_examples=None if message is None else found.examples,
                found_after_seconds=None if message is None else found.seconds,
            )
        )
    return ConformReport(label, tuple(results))


def _qualified(cls: type[Any]) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_PEERS = ("vllm", "sglang", "libcachesim", "dynamo")  # what benchmarks/peers/setup.sh installs


def _not_installed(engine: str, exc: ImportError) -> str:
    missing = (exc.name or "").split(".")[0]
    if engine in _PEERS or missing in _PEERS:
        return (
            f"{engine} cannot be imported here ({exc}); run in the environment that "
            "benchmarks/peers/setup.sh builds"
        )
    hint = f"; install prefixflight's extras from the clone's root with `{install_command('all')}`"
    return f"{engine} cannot import what it needs here ({exc})" + (
        hint if engine == "prefixflight" else ""
    )


def _named(check: Check, engine: str) -> Check:
    """``check`` with its name: the check its adapter's declaration names, when the
    registry leaves it to the declaration (an adapter an entry point or --adapter gives)."""
    if check.name is not None:
        return check
    found = load_object(check.base)
    return attrs.evolve(check, name=check_for(semantics_of(found), None, check.base))


def _choose(
    engine: str, checks: Sequence[Check], impl: type[Any] | None, only: Sequence[str] | None
) -> list[Check]:
    names = sorted({str(c.name) for c in checks})
    if only is not None:
        unknown = sorted(set(only) - set(names))
        if unknown or not only:
            raise UsageError(
                f"{engine} has no check {', '.join(map(repr, unknown)) or 'chosen'}; "
                f"its checks: {', '.join(names)}"
            )
    kept = [c for c in checks if only is None or c.name in only]
    if impl is None:
        named: set[str | None] = set()
        runs = []
        for c in kept:
            if c.always or c.name not in named:
                runs.append(c)
            if not c.always:
                named.add(c.name)
        return runs
    if not isinstance(impl, type):
        raise UsageError(f"--impl must name a class, got {impl!r}")
    chosen = []
    for c in kept:
        try:
            if c.setup:
                load_object(c.setup)()
            base = load_object(c.base)
        except UsageError as exc:
            raise UsageError(_not_installed(engine, ImportError(str(exc)))) from None
        if issubclass(impl, base):
            chosen.append(c)
    if not chosen:
        bases = ", ".join(c.base for c in kept)
        raise UsageError(f"{_qualified(impl)} is not a subclass of any of {bases}")
    return chosen
