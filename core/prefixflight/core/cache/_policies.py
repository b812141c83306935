"""Eviction policies over block hashes: S3FIFO exactly as the S3-FIFO
prefix-cache replay task specifies it, and LRU.

A policy owns *residency*: which blocks are cached and which one goes next. It knows nothing
about pages, tokens or requests. Both policies support pinning: a pinned block is never
evicted (see each class for where a pinned block goes instead). Without pins, the behaviour
is exactly the task's, so trace replays never depend on the pinning code.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, final

from .._errors import CapacityError, UsageError
from ..validate import CheckedFloat, CheckedInt, check_int, check_ratio

if TYPE_CHECKING:
    from ._hashing import BlockHash

__all__ = ["LRU", "S3FIFO", "EvictionPolicy"]


class EvictionPolicy(Protocol):
    """What `PrefixCache` needs from a policy. Implement it to plug in your own.

    Every method that changes state either completes or raises and leaves the state as it
    was (for `access`, per block: blocks before the failing one stay applied).

    Optional batch methods, used by `PrefixCache` when a policy has them (the built-in
    policies do): ``access_into(blocks, evicted) -> hits`` (`access` appending to the
    caller's list), ``evict_many(count) -> list`` (repeated `evict`), and
    ``resident_view() -> Container`` (a live membership view).
    """

    @property
    def capacity(self) -> int:
        """The most blocks that may be resident at once."""
        ...

    def __len__(self) -> int:
        """How many blocks are resident now."""
        ...

    def __contains__(self, block: object) -> bool:
        """Whether ``block`` is resident (a hit if looked up now)."""
        ...

    def resident_prefix(self, blocks: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``blocks`` are resident (stops at the first miss)."""
        ...

    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        """Access every block in order (hit: update; miss: admit); return the evicted blocks.

        Raises `CapacityError` if a block cannot be admitted because every candidate victim
        is pinned; ``error.applied`` says how many blocks were applied before it.
        """
        ...

    def evict(self) -> BlockHash | None:
        """Evict one unpinned block in the policy's order; ``None`` if every block is pinned."""
        ...

    def remove(self, block: BlockHash) -> None:
        """Drop a resident, unpinned block without remembering it (no ghost)."""
        ...

    def pin(self, block: BlockHash) -> None:
        """Protect a resident block from eviction; pins nest."""
        ...

    def unpin(self, block: BlockHash) -> None:
        """Undo one `pin`."""
        ...

    def pin_count(self, block: BlockHash) -> int:
        """How many times ``block`` is pinned now (0 if not)."""
        ...

    def resident(self) -> frozenset[BlockHash]:
        """A copy of the resident set."""
        ...

    def clear(self) -> None:
        """Forget everything; fails with `UsageError` while any block is pinned."""
        ...

    def check_invariants(self) -> None:
        """Raise `AssertionError` if internal state is inconsistent."""
        ...


def _capacity_error(block: BlockHash, applied: int) -> CapacityError:
    return CapacityError(
        f"cannot admit block {block!r}: every candidate victim is pinned", applied=applied
    )


class _Pins:
    """Nestable pin counts, shared by both policies."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[BlockHash, int] = {}

    def pin(self, block: BlockHash) -> bool:
        """Pin; return True if it was the first pin."""
        n = self.counts.get(block, 0)
        self.counts[block] = n + 1
        return n == 0

    def unpin(self, block: BlockHash) -> bool:
        """Unpin; return True if it was the last pin."""
        n = self.counts.get(block, 0)
        if n == 0:
            raise UsageError(f"block {block!r} is not pinned")
        if n == 1:
            del self.counts[block]
            return True
        self.counts[block] = n - 1
        return False


class _Residency:
    """What both policies share: the resident set (``_members``, a dict keyed by block),
    pins, the prefix scan and the batch wrappers around ``access_into``."""

    __slots__ = ("_members", "_pins")

    _members: Mapping[BlockHash, object]
    _pins: _Pins

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, block: object) -> bool:
        return block in self._members

    def resident(self) -> frozenset[BlockHash]:
        return frozenset(self._members)

    def resident_view(self) -> Container[BlockHash]:
        """A live, read-only view of the resident blocks, for fast membership tests."""
        return self._members.keys()

    def pin_count(self, block: BlockHash) -> int:
        return self._pins.counts.get(block, 0)

    def resident_prefix(self, blocks: Sequence[BlockHash]) -> int:
        members = self._members
        k = 0
        for b in blocks:
            if b not in members:
                break
            k += 1
        return k

    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        self.access_into(blocks, evicted)
        return evicted

    def access_stream(self, blocks: Iterable[BlockHash]) -> int:
        """Access every block in order, each as its own one-block request; return how
        many were resident when accessed (the hits). The batch-shaped way to replay a
        stream of single-object requests."""
        return self.access_into(blocks, [])

    def access_into(self, blocks: Iterable[BlockHash], evicted: list[BlockHash]) -> int:
        raise NotImplementedError


@final
class S3FIFO(_Residency):
    """S3FIFO (Yang et al., SOSP 2023) as the S3-FIFO prefix-cache replay task specifies it.

    Three FIFO queues: small ``S`` (``round(capacity * small_ratio)``, banker's rounding), main
    ``M`` (the rest) and ghost ``G`` (hashes only, as large as ``M``). A resident hit
    increments a saturating freq (at most ``max_freq``); a ghost hit enters ``M`` with
    ``ghost_admit_freq``; a new block enters ``S`` with freq 0. Admission to a full ``S`` pops
    its head to ``M`` (freq >= 1, freq kept) or to ``G`` (freq 0). Admission to a full ``M``
    runs second chance: a head with freq >= 1 is requeued at the tail with freq - 1, the first
    head with freq 0 goes to ``G``.

    Edge cases pinned by the design: a small queue of size 0 sends new blocks straight to
    ``M`` with freq 0; a main queue of size 0 admits nothing to ``M`` and ghosts nothing;
    capacity 0 keeps nothing resident.

    Pinning: a pinned block at the head of ``S`` is promoted to ``M`` as if it were warm; a
    pinned block at the head of a full ``M`` is requeued at the tail like a second chance
    (its freq is decremented if positive). A ghost hit that finds ``M`` full of pinned blocks
    is admitted to ``S`` as a new block instead.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ("small_ratio", "max_freq", "ghost_admit_freq")
    """Its keyword settings beyond ``capacity`` (`make_policy` passes these on)."""

    __slots__ = (
        "_capacity",
        "_freq",
        "_ghost",
        "_ghost_admit_freq",
        "_in_main",
        "_main",
        "_main_cap",
        "_max_freq",
        "_pinned_main",
        "_small",
        "_small_cap",
        "_small_ratio",
    )

    def __init__(
        self,
        capacity: CheckedInt,
        small_ratio: CheckedFloat = 0.1,
        max_freq: CheckedInt = 3,
        ghost_admit_freq: CheckedInt = 0,
    ) -> None:
        check_int("capacity", capacity, minimum=0)
        small_ratio = check_ratio("small_ratio", small_ratio)
        check_int("max_freq", max_freq, minimum=0)
        check_int("ghost_admit_freq", ghost_admit_freq, minimum=0)
        if ghost_admit_freq > max_freq:
            from .._errors import ConfigError

            raise ConfigError(
                f"ghost_admit_freq must be <= max_freq ({max_freq}), got {ghost_admit_freq!r}"
            )
        self._capacity = capacity
        self._small_ratio = small_ratio
        self._max_freq = max_freq
        self._ghost_admit_freq = ghost_admit_freq
        self._small_cap = round(capacity * small_ratio)  # banker's rounding, as the task says
        self._main_cap = capacity - self._small_cap
        self._freq: dict[BlockHash, int] = {}  # resident blocks (S and M) -> freq
        self._members = self._freq
        self._small: deque[BlockHash] = deque()
        self._main: deque[BlockHash] = deque()
        self._in_main: set[BlockHash] = set()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._pins = _Pins()
        self._pinned_main = 0

    # -- configuration -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def small_ratio(self) -> float:
        return self._small_ratio

    @property
    def max_freq(self) -> int:
        return self._max_freq

    @property
    def ghost_admit_freq(self) -> int:
        return self._ghost_admit_freq

    @property
    def small_capacity(self) -> int:
        return self._small_cap

    @property
    def main_capacity(self) -> int:
        return self._main_cap

    @property
    def ghost_capacity(self) -> int:
        return self._main_cap

    def __repr__(self) -> str:
        return (
            f"S3FIFO(capacity={self._capacity}, small_ratio={self._small_ratio}, "
            f"max_freq={self._max_freq}, ghost_admit_freq={self._ghost_admit_freq})"
        )

    # -- read-only views -----------------------------------------------------------------
    def small_queue(self) -> tuple[tuple[BlockHash, int], ...]:
        """``S`` from head (next out) to tail, with each block's freq."""
        return tuple((b, self._freq[b]) for b in self._small)

    def main_queue(self) -> tuple[tuple[BlockHash, int], ...]:
        """``M`` from head to tail, with each block's freq."""
        return tuple((b, self._freq[b]) for b in self._main)

    def ghost_queue(self) -> tuple[BlockHash, ...]:
        """``G`` from head (oldest) to tail."""
        return tuple(self._ghost)

    def freq(self, block: BlockHash) -> int | None:
        """The freq of a resident block, ``None`` if not resident."""
        return self._freq.get(block)

    # -- the hot path --------------------------------------------------------------------
    def access_into(self, blocks: Iterable[BlockHash], evicted: list[BlockHash]) -> int:
        """`access`, appending the evicted blocks to ``evicted`` as they go (so a caller
        still has them if a `CapacityError` stops the batch part way); return how many
        blocks were resident when accessed.

        Each block takes one of three steps: a resident hit raises its freq; a ghost hit
        enters ``M`` (`_admit_from_ghost`); a new block enters ``S``, whose cold head leaves
        for ``G`` if ``S`` is full (a warm or pinned head: `_admit_past_warm_head`). The hit
        and the cold head, nine accesses in ten on the bundled traces, run inline: this is
        the replay's hot loop, and a call per access would cost it 15%."""
        freq = self._freq
        fget = freq.get
        max_freq = self._max_freq
        ghost = self._ghost
        small = self._small
        small_cap = self._small_cap
        main_cap = self._main_cap
        pins = self._pins.counts
        small_append, small_popleft = small.append, small.popleft  # bound once: 6% faster
        ghost_popitem = ghost.popitem
        evict = evicted.append
        hits = misses = 0
        for b in blocks:
            f = fget(b)
            if f is not None:
                if f < max_freq:
                    freq[b] = f + 1
                hits += 1
                continue
            misses += 1
            if b in ghost:
                self._admit_from_ghost(b, hits + misses - 1, evicted)
                continue
            if not small_cap:  # no S: the full path (straight to M)
                self._admit_new(b, hits + misses - 1, evicted)
                continue
            if len(small) >= small_cap:
                head = small[0]
                if freq[head] or (pins and head in pins):  # (no pins: no lookup)
                    self._admit_past_warm_head(b, hits + misses - 1, evicted)
                    continue
                small_popleft()  # a cold head leaves for the ghost (`_drain_small_head`)
                del freq[head]
                if main_cap:  # `_insert_ghost`; a resident block is never in G
                    if len(ghost) >= main_cap:
                        ghost_popitem(False)
                    ghost[head] = None
                evict(head)
            small_append(b)
            freq[b] = 0
        return hits

    def _admit_from_ghost(self, b: BlockHash, applied: int, evicted: list[BlockHash]) -> None:
        """A ghost hit enters ``M``'s tail with ``ghost_admit_freq``, after a second-chance
        drain if ``M`` is full; if every block of a full ``M`` is pinned, it enters ``S`` as a
        new block instead. ``applied``: the blocks of the batch before it."""
        main = self._main
        n_main = len(main)
        if n_main < self._main_cap:  # room in M: no drain, no eviction
            del self._ghost[b]
            main.append(b)
            self._freq[b] = self._ghost_admit_freq
            self._in_main.add(b)
        elif self._pinned_main < n_main:
            del self._ghost[b]
            self._admit_main(b, self._ghost_admit_freq, evicted)
        else:
            self._admit_new(b, applied, evicted)

    def _admit_past_warm_head(self, b: BlockHash, applied: int, evicted: list[BlockHash]) -> None:
        """A new block at a full ``S`` whose head is warm or pinned: an unpinned warm head
        moves to ``M``'s tail with its freq (``M`` has room, or a victim after second
        chance), then ``b`` enters ``S``; a pinned head, or an ``M`` with no victim, takes
        the full path, `_admit_new`."""
        small = self._small
        head = small[0]
        if head not in self._pins.counts:
            main = self._main
            n_main = len(main)
            if n_main < self._main_cap:  # room in M: the head moves, nothing is evicted
                small.popleft()
                main.append(head)
                self._in_main.add(head)
                small.append(b)
                self._freq[b] = 0
                return
            if self._pinned_main < n_main:  # M is full but has a victim
                small.popleft()
                self._admit_main(head, self._freq[head], evicted)
                small.append(b)
                self._freq[b] = 0
                return
        self._admit_new(b, applied, evicted)

    # -- admission -----------------------------------------------------------------------
    def _main_has_room_or_victim(self) -> bool:
        n = len(self._main)
        return n < self._main_cap or self._pinned_main < n

    def _admit_new(self, b: BlockHash, applied: int, evicted: list[BlockHash]) -> None:
        if self._small_cap == 0:
            if self._main_cap == 0:  # capacity 0: nothing is resident
                return
            if not self._main_has_room_or_victim():
                raise _capacity_error(b, applied)
            self._ghost.pop(b, None)
            self._admit_main(b, 0, evicted)
            return
        small = self._small
        if len(small) >= self._small_cap:
            head = small[0]
            pinned = head in self._pins.counts
            if (self._freq[head] >= 1 or pinned) and (
                (self._main_cap == 0 and pinned)
                or (self._main_cap > 0 and not self._main_has_room_or_victim())
            ):
                raise _capacity_error(b, applied)
            self._ghost.pop(b, None)
            while len(small) >= self._small_cap:
                self._drain_small_head(evicted)
        else:
            self._ghost.pop(b, None)
        small.append(b)
        self._freq[b] = 0

    def _drain_small_head(self, evicted: list[BlockHash]) -> BlockHash | None:
        """Pop ``S``'s head to ``M`` or ``G``; return the block that left residency, if any."""
        victim = self._small.popleft()
        vf = self._freq[victim]
        pinned = victim in self._pins.counts
        if vf >= 1 or pinned:
            if self._main_cap > 0:
                return self._admit_main(victim, vf, evicted)
            del self._freq[victim]  # main of size 0: nothing enters main, nothing is ghosted
            evicted.append(victim)
            return victim
        del self._freq[victim]
        self._insert_ghost(victim)
        evicted.append(victim)
        return victim

    def _admit_main(self, b: BlockHash, f: int, evicted: list[BlockHash]) -> BlockHash | None:
        """Second-chance drain of a full ``M``, then append ``b``; return the evicted block."""
        main = self._main
        freq = self._freq
        pins = self._pins.counts
        main_cap = self._main_cap
        out: BlockHash | None = None
        if len(main) >= main_cap:
            pop = main.popleft
            push = main.append
            while len(main) >= main_cap:
                victim = pop()
                vf = freq[victim]
                if vf >= 1:
                    freq[victim] = vf - 1
                    push(victim)
                    continue
                if victim in pins:  # pinned: requeue at the tail like a second chance
                    push(victim)
                    continue
                del freq[victim]
                self._in_main.discard(victim)
                ghost = self._ghost  # `_insert_ghost` (main_cap > 0 here)
                if victim in ghost:
                    del ghost[victim]
                elif len(ghost) >= main_cap:
                    ghost.popitem(last=False)
                ghost[victim] = None
                evicted.append(victim)
                out = victim
                break
        main.append(b)
        freq[b] = f
        self._in_main.add(b)
        if b in pins:
            self._pinned_main += 1
        return out

    def _insert_ghost(self, b: BlockHash) -> None:
        cap = self._main_cap
        if cap == 0:
            return
        ghost = self._ghost
        if b in ghost:
            del ghost[b]
        elif len(ghost) >= cap:
            ghost.popitem(last=False)
        ghost[b] = None

    # -- engine operations ---------------------------------------------------------------
    def evict(self) -> BlockHash | None:
        if len(self._freq) == len(self._pins.counts):
            return None
        evicted: list[BlockHash] = []
        small = self._small
        for _ in range(len(small)):
            if not small:
                break
            head = small[0]
            pinned = head in self._pins.counts
            if self._freq[head] == 0 and not pinned:
                return self._drain_small_head(evicted)
            if self._main_cap > 0 and self._main_has_room_or_victim():
                out = self._drain_small_head(evicted)
                if out is not None:
                    return out
            elif not pinned:  # warm, but main cannot take it: it leaves
                small.popleft()
                del self._freq[head]
                self._insert_ghost(head)
                return head
            else:
                small.rotate(-1)  # pinned and nowhere to go: look further
        # every unpinned resident block is now in M
        main = self._main
        freq = self._freq
        pins = self._pins.counts
        while True:
            victim = main.popleft()
            vf = freq[victim]
            if vf >= 1:
                freq[victim] = vf - 1
                main.append(victim)
            elif victim in pins:
                main.append(victim)
            else:
                del freq[victim]
                self._in_main.discard(victim)
                self._insert_ghost(victim)
                return victim

    def evict_many(self, count: int) -> list[BlockHash]:
        """`evict` up to ``count`` times; stops early when every resident block is pinned."""
        out: list[BlockHash] = []
        evict = self.evict
        for _ in range(count):
            victim = evict()
            if victim is None:
                break
            out.append(victim)
        return out

    def remove(self, block: BlockHash) -> None:
        if block not in self._freq:
            raise UsageError(f"block {block!r} is not resident")
        if block in self._pins.counts:
            raise UsageError(f"block {block!r} is pinned and cannot be removed")
        if block in self._in_main:
            self._main.remove(block)
            self._in_main.discard(block)
        else:
            self._small.remove(block)
        del self._freq[block]

    def pin(self, block: BlockHash) -> None:
        if block not in self._freq:
            raise UsageError(f"cannot pin block {block!r}: it is not resident")
        if self._pins.pin(block) and block in self._in_main:
            self._pinned_main += 1

    def unpin(self, block: BlockHash) -> None:
        if self._pins.unpin(block) and block in self._in_main:
            self._pinned_main -= 1

    def clear(self) -> None:
        if self._pins.counts:
            raise UsageError(f"cannot clear: {len(self._pins.counts)} blocks are pinned")
        self._freq.clear()
        self._small.clear()
        self._main.clear()
        self._in_main.clear()
        self._ghost.clear()

    def check_invariants(self) -> None:
        small, main, ghost = self._small, self._main, self._ghost
        assert len(small) <= self._small_cap, (len(small), self._small_cap)
        assert len(main) <= self._main_cap, (len(main), self._main_cap)
        assert len(ghost) <= self._main_cap, (len(ghost), self._main_cap)
        s, m, g = set(small), set(main), set(ghost)
        assert len(s) == len(small) and len(m) == len(main), "duplicate queue entry"
        assert not (s & m) and not (s & g) and not (m & g), "queues overlap"
        assert m == self._in_main
        assert s | m == set(self._freq), "freq table out of sync with queues"
        assert all(0 <= f <= self._max_freq for f in self._freq.values())
        assert len(self._freq) <= self._capacity
        assert set(self._pins.counts) <= set(self._freq), "a pinned block is not resident"
        assert all(n >= 1 for n in self._pins.counts.values())
        assert self._pinned_main == len(m & set(self._pins.counts))


@final
class LRU(_Residency):
    """Least recently used: a hit moves a block to the MRU end; a full cache evicts the LRU end.

    Pinning: a pinned block that reaches the LRU end is moved to the MRU end (it is in use)
    and the next one is considered.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ()
    """Its keyword settings beyond ``capacity``: none."""

    __slots__ = ("_capacity", "_order")

    def __init__(self, capacity: CheckedInt) -> None:
        check_int("capacity", capacity, minimum=0)
        self._capacity = capacity
        self._order: OrderedDict[BlockHash, None] = OrderedDict()  # LRU first
        self._members = self._order
        self._pins = _Pins()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __repr__(self) -> str:
        return f"LRU(capacity={self._capacity})"

    def order(self) -> tuple[BlockHash, ...]:
        """Resident blocks from least to most recently used."""
        return tuple(self._order)

    def access_into(self, blocks: Iterable[BlockHash], evicted: list[BlockHash]) -> int:
        """`access`, appending the evicted blocks to ``evicted`` as they go (so a caller
        still has them if a `CapacityError` stops the batch part way); return how many
        blocks were resident when accessed."""
        order = self._order
        move = order.move_to_end
        cap = self._capacity
        hits = 0
        for applied, b in enumerate(blocks):
            if b in order:
                move(b)
                hits += 1
                continue
            if cap == 0:
                continue
            if len(order) >= cap:
                if len(self._pins.counts) >= len(order):
                    raise _capacity_error(b, applied)
                victim = self._pop_lru()
                evicted.append(victim)
            order[b] = None
        return hits

    def _pop_lru(self) -> BlockHash:
        order = self._order
        pins = self._pins.counts
        while True:
            victim, _ = order.popitem(last=False)
            if victim not in pins:
                return victim
            order[victim] = None

    def evict(self) -> BlockHash | None:
        if len(self._pins.counts) >= len(self._order):
            return None
        return self._pop_lru()

    def evict_many(self, count: int) -> list[BlockHash]:
        """`evict` up to ``count`` times; stops early when every resident block is pinned."""
        order = self._order
        pop = order.popitem
        pins = self._pins.counts
        out: list[BlockHash] = []
        append = out.append
        # every pinned block is resident, so this many can go; a pinned block met at the
        # LRU end is requeued (as `_pop_lru` does) and does not change the count
        for _ in range(min(count, len(order) - len(pins))):
            while True:  # `_pop_lru`
                victim, _ = pop(last=False)
                if victim not in pins:
                    break
                order[victim] = None
            append(victim)
        return out

    def remove(self, block: BlockHash) -> None:
        if block not in self._order:
            raise UsageError(f"block {block!r} is not resident")
        if block in self._pins.counts:
            raise UsageError(f"block {block!r} is pinned and cannot be removed")
        del self._order[block]

    def pin(self, block: BlockHash) -> None:
        if block not in self._order:
            raise UsageError(f"cannot pin block {block!r}: it is not resident")
        self._pins.pin(block)

    def unpin(self, block: BlockHash) -> None:
        self._pins.unpin(block)

    def clear(self) -> None:
        if self._pins.counts:
            raise UsageError(f"cannot clear: {len(self._pins.counts)} blocks are pinned")
        self._order.clear()

    def check_invariants(self) -> None:
        assert len(self._order) <= self._capacity, (len(self._order), self._capacity)
        assert set(self._pins.counts) <= set(self._order), "a pinned block is not resident"
        assert all(n >= 1 for n in self._pins.counts.values())
