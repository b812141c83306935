"""What an implementation declares about itself, so a conformance machine checks it against
the right rules instead of the user shadowing rules.

Three declarations: `EngineSemantics` for an engine's prefix cache (driven by
`PrefixEngineConformance`), `PolicySemantics` for an eviction policy (driven by
`S3FIFOConformance`, `LRUConformance` and `CacheConformance`) and `SchedulerSemantics` for a
continuous-batching scheduler (driven by `SchedulerConformance`). Every field has a default:
the semantics of prefixflight's own reference (the S3-FIFO prefix-cache replay task) and of
its own `Scheduler`. A field set
to anything else is a *declared difference*: the machine's reference follows it, and
`declared_differences` lists it, with what it means, for reports. Both need only attrs (no
Hypothesis), so an adapter module can declare itself without the ``specs`` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias, get_args

import attrs

from prefixflight.core import PrefixflightError, UsageError

__all__ = [
    "EngineCrashed",
    "EngineSemantics",
    "IndexSemantics",
    "POLICY_MACHINES",
    "PolicySemantics",
    "SchedulerSemantics",
    "Unsupported",
    "declared_differences",
]


class Unsupported(PrefixflightError):
    """Raised by an adapter or factory for a configuration the implementation declares it
    does not support (a declared outcome: the example is discarded, not failed)."""


class EngineCrashed(AssertionError):
    """The implementation's process died (a C abort, a segfault) while running ``call``.

    Raised by an isolated implementation (`prefixflight.specs.isolated`), so a crash is a
    failure Hypothesis shrinks to the shortest sequence of calls that still crashes, not a
    dead run. ``signal`` is the signal that killed it (``None`` for a plain exit) and
    ``stderr`` the tail of what it printed.
    """

    def __init__(self, call: str, returncode: int, stderr: str) -> None:
        self.call = call
        self.returncode = returncode
        self.signal = -returncode if returncode < 0 else None
        self.stderr = stderr
        how = f"signal {self.signal}" if self.signal is not None else f"exit status {returncode}"
        tail = f"; it printed: {stderr.strip()[-400:]}" if stderr.strip() else ""
        super().__init__(f"the engine's process died ({how}) during {call}{tail}")


def _one_of(*values: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in values:
            raise UsageError(f"{attribute.name} must be one of {values}, got {value!r}")

    return check


def _at_least(low: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UsageError(f"{attribute.name} must be an integer >= {low}, got {value!r}")

    return check


def _frozen(ops: Iterable[str]) -> frozenset[str]:
    return frozenset(ops)


def _ops(*allowed: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        bad = sorted(set(value) - set(allowed))
        if bad:
            raise UsageError(f"{attribute.name}: unknown operations {bad} (known: {allowed})")

    return check


PolicyMachine: TypeAlias = Literal["s3fifo", "lru", "fifo", "lfu", "sieve"]
POLICY_MACHINES: tuple[PolicyMachine, ...] = get_args(PolicyMachine)
"""The eviction policies a `PolicySemantics` or an `EngineSemantics` can name, each with its
machine (`_registry.MACHINES` builds their entries from this list)."""


@attrs.frozen(kw_only=True)
class EngineSemantics:
    """An engine's prefix cache, as its adapter declares it (defaults: the replay task's).

    ``hit_cap``: ``"full"`` -- a hit covers every cached full block of the prompt;
    ``"n-1"`` -- at most ``num_tokens - 1`` tokens hit, so the last token is always computed.

    ``publish``: ``"at-finish"`` -- a request's computed blocks become hits when it ends;
    ``"at-admit"`` -- they are registered when its pages are allocated (before computing).

    ``touch``: the order a request's blocks are stamped in when they are used together:
    ``"in-order"`` (the tail is the most recent, so a parent can be evicted before its
    child) or ``"tail-first"`` (the tail is the least recent: a chain is evicted tail first).

    ``pins``: what stamps a block's recency, and what a running request's hold does:
    ``"ours"`` -- admission (hits) and publication stamp; releasing does not; an eviction
    scan that passes a held block stamps it (it is in use); ``"release-is-use"`` -- a
    block's recency is when its last holder released it (lookups stamp nothing);
    ``"unlock-no-touch"`` -- lookups (even of a request that is then not admitted) and
    inserts stamp; locking and unlocking do not.

    ``unit``: what one eviction removes: ``"block"``, or ``"node"`` (a radix-tree leaf:
    every block inserted with it, so one eviction may free several pages).

    ``capacity``: ``"fixed"`` -- the cache holds at most ``pages`` blocks and running
    requests' own pages are not counted; ``"shared-pool"`` -- one pool of ``pages`` pages
    holds cached blocks and running requests' pages, and admission evicts what it needs
    (or is refused when not enough can be freed).

    ``duplicates``: a request that computed a block another request cached first:
    ``"freed"`` (its page is freed, the cache keeps one copy) or ``"kept"`` (both pages stay
    cached under the same block; a lookup hits the copy registered first).

    ``orphans``: when a block is evicted, its cached descendants (which no lookup can reach
    any more) are ``"kept"`` until evicted in their turn, or ``"removed"`` with it.

    ``invalidated``: a cached, unused block removed by ``invalidate``: its page is
    ``"reused-first"`` (like any free page) or stays ``"in-place"`` in the eviction order.

    ``evictions``: ``"observed"`` (the machine compares resident sets) or ``"reported"``
    (the adapter also reports KV events; a mirror rebuilt from them must equal the cache,
    counting copies).

    ``ops``: the optional operations the adapter supports: ``"evict"`` (free at least ``n``
    pages of unused cached blocks), ``"invalidate"`` (drop one block), ``"reset"`` (drop
    everything while nothing runs), ``"stats"`` (``hit_stats()``: the prompt tokens the
    engine reports as looked up and as hit, which must count every admitted request once
    and a refused one not at all).

    ``policy``: ``None`` -- the engine's own LRU over pages, as ``touch`` and ``pins``
    declare; or the name of a prefixflight eviction policy (``"lru"``, ``"s3fifo"``, ...) that
    decides which cached block is evicted, keyed by block, as ``prefixflight.vllm`` runs it in
    vLLM's pool: hits and newly cached blocks are its accesses (deepest first), and so are
    releases with ``pins="release-is-use"`` (not with ``"ours"``); a block is pinned while a
    page holding it is in use; a free page is reused in this order: pages holding nothing,
    then redundant copies (a free page of a block whose first page is in use or is another;
    the one redundant longest first), then the policy's victim, every page of it. Needs
    ``unit="block"``, ``capacity="shared-pool"``, ``invalidated="reused-first"`` and
    ``orphans="removed"``.
    """

    hit_cap: Literal["full", "n-1"] = attrs.field(default="full", validator=_one_of("full", "n-1"))
    publish: Literal["at-finish", "at-admit"] = attrs.field(
        default="at-finish", validator=_one_of("at-finish", "at-admit")
    )
    touch: Literal["in-order", "tail-first"] = attrs.field(
        default="in-order", validator=_one_of("in-order", "tail-first")
    )
    pins: Literal["ours", "release-is-use", "unlock-no-touch"] = attrs.field(
        default="ours", validator=_one_of("ours", "release-is-use", "unlock-no-touch")
    )
    unit: Literal["block", "node"] = attrs.field(
        default="block", validator=_one_of("block", "node")
    )
    capacity: Literal["fixed", "shared-pool"] = attrs.field(
        default="fixed", validator=_one_of("fixed", "shared-pool")
    )
    duplicates: Literal["freed", "kept"] = attrs.field(
        default="freed", validator=_one_of("freed", "kept")
    )
    orphans: Literal["kept", "removed"] = attrs.field(
        default="kept", validator=_one_of("kept", "removed")
    )
    invalidated: Literal["reused-first", "in-place"] = attrs.field(
        default="reused-first", validator=_one_of("reused-first", "in-place")
    )
    evictions: Literal["observed", "reported"] = attrs.field(
        default="observed", validator=_one_of("observed", "reported")
    )
    ops: frozenset[str] = attrs.field(
        default=frozenset(),
        converter=_frozen,
        validator=_ops("evict", "invalidate", "reset", "stats"),
    )
    policy: PolicyMachine | None = attrs.field(
        default=None, validator=attrs.validators.optional(_one_of(*POLICY_MACHINES))
    )

    def __attrs_post_init__(self) -> None:
        if self.policy is not None:
            wanted = {
                "unit": "block",
                "capacity": "shared-pool",
                "invalidated": "reused-first",
                "orphans": "removed",
            }
            wrong = {k: getattr(self, k) for k, v in wanted.items() if getattr(self, k) != v}
            if wrong or self.pins == "unlock-no-touch":
                got = ", ".join(f"{k}={v!r}" for k, v in wrong.items()) or "pins='unlock-no-touch'"
                raise UsageError(
                    f"policy={self.policy!r} is modelled for unit='block', "
                    "capacity='shared-pool', invalidated='reused-first', orphans='removed' and "
                    f"pins 'ours' or 'release-is-use'; got {got}"
                )
        if self.unit == "node":
            if self.pins != "unlock-no-touch" or self.duplicates != "freed":
                raise UsageError(
                    "unit='node' (a radix tree) needs pins='unlock-no-touch' and "
                    f"duplicates='freed', got pins={self.pins!r}, duplicates={self.duplicates!r}"
                )
            if "invalidate" in self.ops:
                raise UsageError("unit='node' does not support the 'invalidate' operation")
        elif self.pins == "unlock-no-touch":
            raise UsageError("pins='unlock-no-touch' is modelled for unit='node' (a radix tree)")
        if self.pins == "release-is-use" and self.capacity != "shared-pool":
            raise UsageError("pins='release-is-use' needs capacity='shared-pool'")
        if self.capacity == "fixed" and (self.unit == "node" or "invalidate" in self.ops):
            raise UsageError("capacity='fixed' supports unit='block' without 'invalidate'")

    @property
    def chain_safe(self) -> bool:
        """Whether the engine promises that every cached block's parent is cached."""
        return self.unit == "node" or self.orphans == "removed"


_S3FIFO_ONLY = (
    "sizing",
    "promote_at",
    "small_queue",
    "min_small_blocks",
    "max_freq",
    "ghost_size",
    "main_evictions",
    "on_promote",
)


@attrs.frozen(kw_only=True)
class PolicySemantics:
    """An eviction policy, as its factory declares it (defaults: prefixflight's policies).

    ``policy``: the machine that checks it (``"s3fifo"``, ``"lru"``, ``"fifo"``, ``"lfu"``,
    ``"sieve"``), so ``prefixflight conform --adapter`` knows which to run; ``None`` (the
    default) leaves it to whoever builds the machine.

    ``ops``: the optional calls the policy supports (``pin``/``unpin``/``pin_count``,
    ``remove``, ``evict``); the machine runs only those rules.

    ``evictions``: ``"reported"`` -- ``access`` and ``evict`` return the evicted blocks, in
    order; ``"observed"`` -- they return nothing useful, and the machine compares the
    resident set before and after.

    S3-FIFO variant (only with ``policy`` ``"s3fifo"`` or ``None``): ``sizing`` is how the
    small queue's size is derived from ``capacity * small_ratio``: ``"round"`` (banker's
    rounding), ``"floor"``, or ``"floor-min-1"`` (``max(1, floor(...))``, at most the
    capacity); ``max_freq`` fixes the frequency cap (the factory is then called without a
    ``max_freq`` keyword; ``None``: the config's); ``ghost_size`` is how many blocks the
    ghost queue remembers: as many as ``"main"`` holds, as the whole ``"capacity"``, or as
    ``"small"`` holds; ``main_evictions`` says whether a block evicted from main enters the
    ghost (``"ghost"``) or is forgotten (``"drop"``: only small-queue evictions are ghosted);
    ``on_promote`` is the frequency a block promoted from small to main carries: it
    ``"keep"``s its frequency, ``"reset"``s it to 0, or ``"decrement"``s it by one;
    ``promote_at`` is the frequency at which a block leaving the small queue is promoted to
    main; ``small_queue`` is ``"bounded"`` (every admission keeps the small queue within its
    size, promoting or ghosting its head) or ``"when-full"`` (nothing is evicted until the
    whole cache is full; then one eviction comes from main if main is over its size or the
    small queue is empty, else from the small queue; before the first eviction a new block
    that finds the small queue full goes to main); ``min_small_blocks`` is the smallest
    small queue that admits anything (a small queue of fewer blocks caches nothing new).
    """

    policy: PolicyMachine | None = attrs.field(
        default=None, validator=attrs.validators.optional(_one_of(*POLICY_MACHINES))
    )
    ops: frozenset[str] = attrs.field(
        default=frozenset({"pin", "remove", "evict"}),
        converter=_frozen,
        validator=_ops("pin", "remove", "evict"),
    )
    evictions: Literal["reported", "observed"] = attrs.field(
        default="reported", validator=_one_of("reported", "observed")
    )
    sizing: Literal["round", "floor", "floor-min-1"] = attrs.field(
        default="round", validator=_one_of("round", "floor", "floor-min-1")
    )
    max_freq: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_at_least(0))
    )
    ghost_size: Literal["main", "capacity", "small"] = attrs.field(
        default="main", validator=_one_of("main", "capacity", "small")
    )
    main_evictions: Literal["ghost", "drop"] = attrs.field(
        default="ghost", validator=_one_of("ghost", "drop")
    )
    on_promote: Literal["keep", "reset", "decrement"] = attrs.field(
        default="keep", validator=_one_of("keep", "reset", "decrement")
    )
    promote_at: int = attrs.field(default=1, validator=_at_least(1))
    small_queue: Literal["bounded", "when-full"] = attrs.field(
        default="bounded", validator=_one_of("bounded", "when-full")
    )
    min_small_blocks: int = attrs.field(default=1, validator=_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.policy not in (None, "s3fifo"):
            base = PolicySemantics()
            odd = [f for f in _S3FIFO_ONLY if getattr(self, f) != getattr(base, f)]
            if odd:
                raise UsageError(
                    f"{', '.join(odd)} declare an S3-FIFO variant, but policy is {self.policy!r}"
                )
        if self.small_queue == "when-full" and "pin" in self.ops:
            raise UsageError("small_queue='when-full' is modelled without pins")
        if self.min_small_blocks > 1 and self.small_queue != "when-full":
            raise UsageError("min_small_blocks > 1 is modelled for small_queue='when-full'")


@attrs.frozen(kw_only=True)
class IndexSemantics:
    """A KV-event consumer (a router's index of what an engine caches), as its adapter
    declares it (defaults: the most an engine may send).

    ``order``: the order of one engine step's ``stored`` events: ``"any"`` (the machine
    draws it) or ``"parents-first"`` -- a block's ``stored`` event comes after its parent's.

    ``removals``: the order of one engine step's ``removed`` events: ``"any"`` (vLLM frees a
    chain tail first, but a step may evict blocks of several chains) or
    ``"children-first"`` -- a block's ``removed`` event comes before its parent's (an index
    whose removed parent takes its descendants with it). Either way the machine draws how a
    step's ``stored`` and ``removed`` events interleave.

    ``copies``: ``"counted"`` -- the engine may cache a block twice (vLLM's duplicates: a
    ``stored`` event per copy, a ``removed`` per copy), so a block is cached until its last
    copy is removed; ``"single"`` -- the index assumes one copy per block (the machine's
    engine never caches a block twice).
    """

    order: Literal["any", "parents-first"] = attrs.field(
        default="any", validator=_one_of("any", "parents-first")
    )
    removals: Literal["any", "children-first"] = attrs.field(
        default="any", validator=_one_of("any", "children-first")
    )
    copies: Literal["counted", "single"] = attrs.field(
        default="counted", validator=_one_of("counted", "single")
    )


_POLICIES = ("fcfs", "priority")


@attrs.frozen(kw_only=True)
class SchedulerSemantics:
    """A continuous-batching scheduler, as its adapter declares it (defaults: prefixflight's
    `Scheduler` with same-step sharing on).

    ``same_step_reads``: whether a row may attend to a page another row of the same step
    writes: ``"declared"`` -- only from the writers its `Row.reads_from` names, which come
    earlier in the step (prefixflight's plan); ``"any"`` -- yes, from any row: the forward
    pass writes every row's new KV in a layer before any row attends (vLLM); ``"none"`` --
    never.

    ``publish``: when a block being computed becomes a hit for other requests:
    ``"at-schedule"`` -- when the step that writes it is planned (registered at allocation;
    the machine then checks that the step does write it); ``"after-step"`` -- only once that
    step has run.

    ``preemption``: ``"none"`` -- a running request decodes in every step until it ends (its
    pages are its own until then); ``"recompute"`` -- a running request may be preempted
    when pages run out: its pages are freed and it is recomputed later from its prompt and
    outputs (vLLM).

    ``chunking``: ``"budget"`` -- a prompt is cut into chunks only when the step's token
    budget runs out; ``"any"`` -- it may be cut short with budget left.

    ``policies``: the admission orders the scheduler supports (the machine draws one per
    example): ``"fcfs"``, ``"priority"`` (a lower priority value goes first and may preempt).
    """

    same_step_reads: Literal["declared", "any", "none"] = attrs.field(
        default="declared", validator=_one_of("declared", "any", "none")
    )
    publish: Literal["at-schedule", "after-step"] = attrs.field(
        default="at-schedule", validator=_one_of("at-schedule", "after-step")
    )
    preemption: Literal["none", "recompute"] = attrs.field(
        default="none", validator=_one_of("none", "recompute")
    )
    chunking: Literal["budget", "any"] = attrs.field(
        default="budget", validator=_one_of("budget", "any")
    )
    policies: frozenset[str] = attrs.field(
        default=frozenset({"fcfs"}), converter=_frozen, validator=_ops(*_POLICIES)
    )

    def __attrs_post_init__(self) -> None:
        if not self.policies:
            raise UsageError(f"policies must name at least one of {_POLICIES}")


_MEANING: Mapping[tuple[str, str], str] = {
    ("hit_cap", "n-1"): "at most num_tokens - 1 tokens hit: the last token is always computed",
    ("publish", "at-admit"): "blocks are registered when allocated, before they are computed",
    ("touch", "tail-first"): "a request's blocks are stamped tail first: chains evict tail first",
    ("pins", "release-is-use"): "a block's recency is when its last holder released it",
    ("pins", "unlock-no-touch"): "lookups and inserts stamp recency; unlocking does not",
    ("unit", "node"): "one eviction removes a whole radix-tree leaf (all its pages)",
    ("capacity", "shared-pool"): "cached blocks and running requests share one page pool",
    ("duplicates", "kept"): "a block computed twice stays cached twice (two pages)",
    ("orphans", "removed"): "evicting a block removes its cached descendants too",
    ("invalidated", "in-place"): "an invalidated page keeps its place in the eviction order",
    ("evictions", "observed"): "evictions are not returned; resident sets are compared",
    ("sizing", "floor"): "the small queue holds floor(capacity * small_ratio) blocks",
    ("sizing", "floor-min-1"): "the small queue holds max(1, floor(capacity * small_ratio)) blocks",
    ("ghost_size", "capacity"): "the ghost remembers as many blocks as the cache holds",
    ("ghost_size", "small"): "the ghost remembers as many blocks as the small queue holds",
    ("main_evictions", "drop"): "a block evicted from main is forgotten (only small-queue "
    "evictions enter the ghost)",
    ("on_promote", "reset"): "a block promoted from small to main starts at frequency 0",
    ("on_promote", "decrement"): "a block promoted from small to main loses one frequency",
    ("small_queue", "when-full"): "evicts only when the whole cache is full (S3FIFO.c's flow)",
    ("order", "parents-first"): "a block's stored event must come after its parent's",
    ("removals", "children-first"): "a block's removed event must come before its parent's",
    ("copies", "single"): "copies are not counted: the first removed event of a block cached "
    "twice removes it",
    ("same_step_reads", "any"): "every row's KV is written before any row attends: a row may "
    "read pages any other row of its step writes",
    ("same_step_reads", "none"): "a page written in a step is read by no other row of it",
    ("publish", "after-step"): "a block becomes a hit only after the step computing it ran",
    ("preemption", "recompute"): "running requests may be preempted (pages freed) and "
    "recomputed from their prompt and outputs",
    ("chunking", "any"): "a prompt may be chunked with token budget left",
}


def declared_differences(
    semantics: EngineSemantics | PolicySemantics | SchedulerSemantics | IndexSemantics,
) -> list[dict[str, Any]]:
    """How the declaration departs from prefixflight's semantics, as ``{"name", "value",
    "default", "meaning"}`` dicts (for reports and ``prefixflight conform --json``).

    Capabilities that only add checks (an engine's optional ``ops``, its KV events, a
    scheduler's extra ``policies``) are not differences; a policy's missing ``ops`` and
    unreported evictions are.
    """
    default = type(semantics)()
    out: list[dict[str, Any]] = []
    for field in attrs.fields(type(semantics)):
        value, base = getattr(semantics, field.name), getattr(default, field.name)
        if value == base:
            continue
        if isinstance(semantics, EngineSemantics) and field.name in ("ops", "evictions"):
            continue
        if isinstance(semantics, SchedulerSemantics) and field.name == "policies":
            continue
        if field.name == "policy" and isinstance(semantics, PolicySemantics):
            continue  # which machine, not how it differs
        if isinstance(value, frozenset):
            missing = sorted(set(base) - set(value))
            if not missing:
                continue
            meaning = f"unsupported: {', '.join(missing)}"
            value, base = sorted(value), sorted(base)
        elif field.name == "promote_at":
            meaning = f"a small-queue block is promoted at frequency >= {value}"
        elif field.name == "max_freq":
            meaning = f"the frequency cap is fixed at {value} (max_freq is not configurable)"
        elif field.name == "policy":
            meaning = (
                f"prefixflight's {value} policy, keyed by block, decides evictions; a "
                "redundant copy is reused before any eviction"
            )
        elif field.name == "min_small_blocks":
            meaning = f"a small queue of fewer than {value} blocks caches nothing new"
        else:
            meaning = _MEANING.get((field.name, str(value)), "")
        out.append({"name": field.name, "value": value, "default": base, "meaning": meaning})
    return out
