"""Reference models: literal readings of the S3-FIFO prefix-cache replay task, slow and
obviously right.

They exist to be compared against. Each step reads like the task's pseudo-code
(``admit_to_S``, ``admit_to_M``, ``insert_to_G``), plus the edge cases and pinning rules
documented on `prefixflight.core.S3FIFO` and `prefixflight.core.LRU`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from prefixflight.core import BlockHash, CapacityError, TraceRecord, UsageError

__all__ = [
    "ReferenceFIFO",
    "ReferenceLFU",
    "ReferenceLRU",
    "ReferenceReplay",
    "ReferenceS3FIFO",
    "ReferenceSIEVE",
    "reference_replay",
]


class _Pinning:
    """Pins and explicit removal, the same for both models: nestable pin counts; only
    resident blocks can be pinned, only unpinned ones removed."""

    pins: Counter[BlockHash]

    def __contains__(self, h: object) -> bool:
        raise NotImplementedError

    def _drop(self, h: BlockHash) -> None:
        raise NotImplementedError

    def remove(self, h: BlockHash) -> None:
        if h not in self:
            raise UsageError(f"{h!r} is not resident")
        if h in self.pins:
            raise UsageError(f"{h!r} is pinned")
        self._drop(h)

    def pin(self, h: BlockHash) -> None:
        if h not in self:
            raise UsageError(f"{h!r} is not resident")
        self.pins[h] += 1

    def unpin(self, h: BlockHash) -> None:
        if self.pins[h] == 0:
            raise UsageError(f"{h!r} is not pinned")
        self.pins[h] -= 1
        if self.pins[h] == 0:
            del self.pins[h]

    def pin_count(self, h: BlockHash) -> int:
        return self.pins.get(h, 0)


class ReferenceS3FIFO(_Pinning):
    """S3FIFO exactly as the replay task writes it: three FIFO queues and a saturating freq.

    The keyword-only arguments select a declared variant (see `PolicySemantics`): ``sizing``
    (``"round"``: banker's rounding of ``capacity * small_ratio``, ``"floor"``, or
    ``"floor-min-1"``: at least one block), ``ghost_size`` (the ghost remembers as many
    blocks as ``"main"``, the ``"capacity"`` or ``"small"``), ``main_evictions`` (``"ghost"``:
    main's victims enter the ghost; ``"drop"``: they are forgotten), ``on_promote`` (the
    frequency a promoted block carries into main: ``"keep"``, ``"reset"`` to 0,
    ``"decrement"`` by one), ``promote_at`` (the frequency that promotes a small-queue head
    to main), ``small_queue`` (``"bounded"``: the task's flow; ``"when-full"``: libCacheSim's
    ``S3FIFO.c`` flow, which evicts only when the whole cache is full) and
    ``min_small_blocks``. The defaults are the replay task's.
    """

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        max_freq: int = 3,
        ghost_admit_freq: int = 0,
        *,
        sizing: str = "round",
        promote_at: int = 1,
        small_queue: str = "bounded",
        min_small_blocks: int = 1,
        ghost_size: str = "main",
        main_evictions: str = "ghost",
        on_promote: str = "keep",
    ) -> None:
        self.capacity = capacity
        self.max_freq = max_freq
        self.ghost_admit_freq = ghost_admit_freq
        if sizing == "round":
            self.small_cap = round(capacity * small_ratio)  # banker's rounding
        elif sizing == "floor":
            self.small_cap = int(capacity * small_ratio)
        else:  # "floor-min-1": never below one block (nor above the capacity)
            self.small_cap = min(capacity, max(1, int(capacity * small_ratio)))
        self.main_cap = capacity - self.small_cap
        # the replay task's ghost is as large as main, not small
        self.ghost_cap = {"main": self.main_cap, "capacity": capacity, "small": self.small_cap}[
            ghost_size
        ]
        self.ghost_main = main_evictions == "ghost"
        self.on_promote = on_promote
        self.promote_at = promote_at
        self.when_full = small_queue == "when-full"
        self.min_small_blocks = min_small_blocks
        self.has_evicted = False  # "when-full": before the first eviction S overflows to M
        self.S: deque[BlockHash] = deque()  # head = left, tail = right
        self.M: deque[BlockHash] = deque()
        self.G: dict[BlockHash, None] = {}  # an ordered set: first key = head
        self.freq: dict[BlockHash, int] = {}
        self.pins: Counter[BlockHash] = Counter()

    # residency ------------------------------------------------------------------------
    def is_resident(self, h: BlockHash) -> bool:
        return h in self.freq  # h in S or M; ghost entries are not resident

    def __contains__(self, h: object) -> bool:
        return h in self.freq

    def __len__(self) -> int:
        return len(self.S) + len(self.M)  # final_cache_blocks = |S| + |M|, never |G|

    def resident(self) -> frozenset[BlockHash]:
        return frozenset(self.S) | frozenset(self.M)

    def small_queue(self) -> tuple[tuple[BlockHash, int], ...]:
        return tuple((h, self.freq[h]) for h in self.S)

    def main_queue(self) -> tuple[tuple[BlockHash, int], ...]:
        return tuple((h, self.freq[h]) for h in self.M)

    def ghost_queue(self) -> tuple[BlockHash, ...]:
        return tuple(self.G)

    def resident_prefix(self, blocks: Sequence[BlockHash]) -> int:
        k = 0
        while k < len(blocks) and self.is_resident(blocks[k]):
            k += 1
        return k

    # the access rule --------------------------------------------------------------------
    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        for applied, h in enumerate(blocks):
            try:
                evicted += self.access_one(h)
            except CapacityError as exc:
                raise CapacityError(str(exc), applied=applied) from None
        return evicted

    def access_one(self, h: BlockHash) -> list[BlockHash]:
        if self.when_full:
            return self._access_when_full(h)
        evicted: list[BlockHash] = []
        if self.is_resident(h):  # in S or in M: the same rule
            self.freq[h] = min(self.freq[h] + 1, self.max_freq)  # saturating
        elif h in self.G and self.main_cap > 0 and self._main_can_take():
            del self.G[h]
            self.admit_to_M(h, self.ghost_admit_freq, evicted)
        else:
            self.admit_new(h, evicted)
        return evicted

    def _main_can_take(self) -> bool:
        return (
            len(self.M) < self.main_cap or not self.pins or any(v not in self.pins for v in self.M)
        )

    def admit_new(self, h: BlockHash, evicted: list[BlockHash]) -> None:
        if self.small_cap == 0:  # the documented edge case: straight to main with freq 0
            if self.main_cap == 0:  # capacity 0: nothing is resident
                return
            if not self._main_can_take():
                raise CapacityError(f"cannot admit {h!r}")
            self.G.pop(h, None)
            self.admit_to_M(h, 0, evicted)
            return
        if len(self.S) >= self.small_cap:
            head = self.S[0]
            to_main = self.freq[head] >= self.promote_at or head in self.pins
            if to_main and (
                (self.main_cap == 0 and head in self.pins)
                or (self.main_cap > 0 and not self._main_can_take())
            ):
                raise CapacityError(f"cannot admit {h!r}")
        self.G.pop(h, None)
        self.admit_to_S(h, evicted)

    def admit_to_S(self, h: BlockHash, evicted: list[BlockHash]) -> None:
        while len(self.S) >= self.small_cap:
            victim = self.S.popleft()
            vf = self.freq[victim]
            if vf >= self.promote_at or victim in self.pins:  # warm (or pinned): promote
                if self.main_cap > 0:
                    self.admit_to_M(victim, self.promoted(vf), evicted)
                else:  # main of size 0: nothing enters main and nothing is ghosted
                    del self.freq[victim]
                    evicted.append(victim)
            else:  # cold: to the ghost
                del self.freq[victim]
                self.insert_to_G(victim)
                evicted.append(victim)
        self.S.append(h)
        self.freq[h] = 0

    def admit_to_M(self, h: BlockHash, f: int, evicted: list[BlockHash]) -> None:
        while len(self.M) >= self.main_cap:
            victim = self.M[0]
            vf = self.freq[victim]
            if vf >= 1:  # second chance: requeue at the tail with freq - 1
                self.M.popleft()
                self.freq[victim] = vf - 1
                self.M.append(victim)
                continue
            if victim in self.pins:  # pinned: requeue at the tail, never evicted
                self.M.popleft()
                self.M.append(victim)
                continue
            self.M.popleft()  # exactly one real eviction
            del self.freq[victim]
            self.evicted_from_M(victim)
            evicted.append(victim)
            break
        self.M.append(h)
        self.freq[h] = f

    def promoted(self, f: int) -> int:
        """The frequency a block promoted from S carries into M (the declared variant)."""
        if self.on_promote == "keep":
            return f
        return 0 if self.on_promote == "reset" else max(0, f - 1)

    def evicted_from_M(self, h: BlockHash) -> None:
        if self.ghost_main:
            self.insert_to_G(h)

    def insert_to_G(self, h: BlockHash) -> None:
        if self.ghost_cap == 0:
            return
        if h in self.G:
            del self.G[h]
        elif len(self.G) >= self.ghost_cap:
            del self.G[next(iter(self.G))]
        self.G[h] = None

    # the "when-full" variant (libCacheSim's S3FIFO.c) -----------------------------------
    def _access_when_full(self, h: BlockHash) -> list[BlockHash]:
        """``cache_get_base`` over ``S3FIFO_find``/``S3FIFO_evict``/``S3FIFO_insert``."""
        if h in self.S or h in self.M:
            self.freq[h] = min(self.freq[h] + 1, self.max_freq)
            return []
        ghost_hit = h in self.G
        self.G.pop(h, None)
        evicted: list[BlockHash] = []
        while len(self) + 1 > self.capacity:
            self._evict_when_full(evicted)
        if ghost_hit:
            self.M.append(h)
        elif self.small_cap < self.min_small_blocks:
            return evicted  # a block as large as the small queue is never admitted
        elif not self.has_evicted and len(self.S) >= self.small_cap:
            self.M.append(h)  # before the first eviction, S overflows straight into M
        else:
            self.S.append(h)
        self.freq[h] = 0
        return evicted

    def _evict_when_full(self, evicted: list[BlockHash]) -> None:
        """One ``S3FIFO_evict``: from M if M is over its size or S is empty, else from S
        (promoting warm heads to M until one cold head is ghosted and evicted)."""
        self.has_evicted = True
        if len(self.M) > self.main_cap or not self.S:
            while self.M:
                victim = self.M.popleft()
                if self.freq[victim] >= 1:
                    self.freq[victim] -= 1
                    self.M.append(victim)
                    continue
                del self.freq[victim]
                self.evicted_from_M(victim)
                evicted.append(victim)
                return
            return
        while self.S:
            head = self.S.popleft()
            if self.freq[head] >= self.promote_at:
                self.M.append(head)
                self.freq[head] = self.promoted(self.freq[head])
                continue
            del self.freq[head]
            self.insert_to_G(head)
            evicted.append(head)
            return

    # engine operations -------------------------------------------------------------------
    def evict(self) -> BlockHash | None:
        if self.when_full:
            out: list[BlockHash] = []
            self._evict_when_full(out)
            return out[0] if out else None
        if all(h in self.pins for h in self.freq):
            return None
        for _ in range(len(self.S)):
            if not self.S:
                break
            head = self.S[0]
            pinned = head in self.pins
            if self.freq[head] < self.promote_at and not pinned:
                self.S.popleft()
                del self.freq[head]
                self.insert_to_G(head)
                return head
            if self.main_cap > 0 and self._main_can_take():
                self.S.popleft()
                moved: list[BlockHash] = []
                self.admit_to_M(head, self.promoted(self.freq[head]), moved)
                if moved:
                    return moved[0]
            elif not pinned:
                self.S.popleft()
                del self.freq[head]
                self.insert_to_G(head)
                return head
            else:
                self.S.rotate(-1)
        while True:
            victim = self.M.popleft()
            if self.freq[victim] >= 1:
                self.freq[victim] -= 1
                self.M.append(victim)
            elif victim in self.pins:
                self.M.append(victim)
            else:
                del self.freq[victim]
                self.evicted_from_M(victim)
                return victim

    def _drop(self, h: BlockHash) -> None:
        (self.S if h in self.S else self.M).remove(h)
        del self.freq[h]


class ReferenceLRU(_Pinning):
    """LRU by timestamps: the victim is the unpinned resident block used longest ago.

    A pinned block found at the LRU end counts as just used (it is in use).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.last_use: dict[BlockHash, int] = {}
        self.pins: Counter[BlockHash] = Counter()
        self._clock = itertools.count()
        self._heap: list[tuple[int, int, BlockHash]] = []  # (tick, tiebreak, block), lazy

    def __contains__(self, h: object) -> bool:
        return h in self.last_use

    def __len__(self) -> int:
        return len(self.last_use)

    def resident(self) -> frozenset[BlockHash]:
        return frozenset(self.last_use)

    def order(self) -> tuple[BlockHash, ...]:
        return tuple(sorted(self.last_use, key=self.last_use.__getitem__))

    def resident_prefix(self, blocks: Sequence[BlockHash]) -> int:
        k = 0
        while k < len(blocks) and blocks[k] in self.last_use:
            k += 1
        return k

    def _touch(self, h: BlockHash) -> None:
        tick = next(self._clock)
        self.last_use[h] = tick
        heapq.heappush(self._heap, (tick, tick, h))

    def _lru_victim(self) -> BlockHash:
        while True:
            tick, _, h = heapq.heappop(self._heap)
            if self.last_use.get(h) != tick:
                continue  # stale entry
            if h in self.pins:
                self._touch(h)
                continue
            return h

    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        for applied, h in enumerate(blocks):
            if h in self.last_use:
                self._touch(h)
                continue
            if self.capacity == 0:
                continue
            if len(self.last_use) >= self.capacity:
                if all(b in self.pins for b in self.last_use):
                    raise CapacityError(f"cannot admit {h!r}", applied=applied)
                victim = self._lru_victim()
                del self.last_use[victim]
                evicted.append(victim)
            self._touch(h)
        return evicted

    def evict(self) -> BlockHash | None:
        if all(b in self.pins for b in self.last_use):
            return None
        victim = self._lru_victim()
        del self.last_use[victim]
        return victim

    def _drop(self, h: BlockHash) -> None:
        del self.last_use[h]


class _Queue(_Pinning):
    """A list of resident blocks, oldest first, and the shared rules of the queue policies:
    a victim is chosen only among unpinned blocks; if every block is pinned, admission
    raises `CapacityError` (``applied`` says how many blocks of the call went in) and
    ``evict`` returns ``None``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queue: list[BlockHash] = []  # oldest first
        self.pins: Counter[BlockHash] = Counter()

    def __contains__(self, h: object) -> bool:
        return h in self.queue

    def __len__(self) -> int:
        return len(self.queue)

    def resident(self) -> frozenset[BlockHash]:
        return frozenset(self.queue)

    def resident_prefix(self, blocks: Sequence[BlockHash]) -> int:
        k = 0
        while k < len(blocks) and blocks[k] in self.queue:
            k += 1
        return k

    def hit(self, h: BlockHash) -> None:
        raise NotImplementedError

    def victim(self) -> BlockHash:
        """The block to evict (some block is unpinned)."""
        raise NotImplementedError

    def admitted(self, h: BlockHash) -> None:
        self.queue.append(h)

    def _drop(self, h: BlockHash) -> None:
        self.queue.remove(h)

    def access(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        for applied, h in enumerate(blocks):
            if h in self.queue:
                self.hit(h)
                continue
            if self.capacity == 0:
                continue
            if len(self.queue) >= self.capacity:
                if all(b in self.pins for b in self.queue):
                    raise CapacityError(f"cannot admit {h!r}", applied=applied)
                victim = self.victim()
                self._drop(victim)
                evicted.append(victim)
            self.admitted(h)
        return evicted

    def evict(self) -> BlockHash | None:
        if all(b in self.pins for b in self.queue):
            return None
        victim = self.victim()
        self._drop(victim)
        return victim


class ReferenceFIFO(_Queue):
    """FIFO: a hit changes nothing; the victim is the oldest unpinned block (pinned blocks
    keep their place)."""

    def order(self) -> tuple[BlockHash, ...]:
        return tuple(self.queue)

    def hit(self, h: BlockHash) -> None:
        pass

    def victim(self) -> BlockHash:
        return next(b for b in self.queue if b not in self.pins)


class ReferenceLFU(_Queue):
    """LFU: every block counts its uses since it was admitted (1 at admission); the victim
    is the unpinned block of the lowest count, the least recently used among equals. A
    block's count is forgotten when it leaves."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.count: dict[BlockHash, int] = {}
        self.last_use: dict[BlockHash, int] = {}
        self._clock = itertools.count()

    def hit(self, h: BlockHash) -> None:
        self.count[h] += 1
        self.last_use[h] = next(self._clock)

    def admitted(self, h: BlockHash) -> None:
        super().admitted(h)
        self.count[h] = 1
        self.last_use[h] = next(self._clock)

    def victim(self) -> BlockHash:
        free = [b for b in self.queue if b not in self.pins]
        return min(free, key=lambda b: (self.count[b], self.last_use[b]))

    def _drop(self, h: BlockHash) -> None:
        super()._drop(h)
        del self.count[h], self.last_use[h]


class ReferenceSIEVE(_Queue):
    """SIEVE (Zhang et al., NSDI '24): a FIFO queue with a visited bit and a hand. A hit
    sets the block's bit; a new block enters as the newest, unvisited. To evict, the hand
    walks from where it stopped (first: the oldest block) toward the newest, wrapping around
    to the oldest: a visited block has its bit cleared and is passed, a pinned one is
    passed as it is; the first unvisited, unpinned block is evicted and the hand stays at
    the block newer than it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.visited: set[BlockHash] = set()
        self.hand: BlockHash | None = None  # None: start from the oldest

    def hit(self, h: BlockHash) -> None:
        self.visited.add(h)

    def victim(self) -> BlockHash:
        i = self.queue.index(self.hand) if self.hand is not None else 0
        while True:
            h = self.queue[i]
            if h in self.visited:
                self.visited.discard(h)
            elif h not in self.pins:
                self.hand = h  # dropping it moves the hand on to the next newer block
                return h
            i = (i + 1) % len(self.queue)

    def _drop(self, h: BlockHash) -> None:
        i = self.queue.index(h)
        if self.hand == h:  # (an explicit removal at the hand moves it on, too)
            self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
        self.queue.pop(i)
        self.visited.discard(h)


class ReferenceReplay:
    """The replay task's loop, literally: scan the prefix, clamp, access every block."""

    def __init__(self, policy: ReferenceS3FIFO | ReferenceLRU, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.per_request: list[tuple[int, int]] = []  # (prompt_tokens, hit_tokens)

    def request(self, hash_ids: Sequence[BlockHash], input_length: int) -> int:
        k = 0
        while k < len(hash_ids) and self.policy.resident_prefix(hash_ids[k : k + 1]) == 1:
            k += 1  # stop at the first miss: no skip-ahead, no set intersection
        hit = min(k * self.block_size, input_length)  # always clamp
        self.policy.access(hash_ids)  # every block, hit or miss, in order
        self.per_request.append((input_length, hit))
        return hit

    @property
    def total_prompt_tokens(self) -> int:
        return sum(p for p, _ in self.per_request)

    @property
    def total_hit_tokens(self) -> int:
        return sum(h for _, h in self.per_request)

    @property
    def final_cache_blocks(self) -> int:
        return len(self.policy)


def reference_replay(
    records: Iterable[TraceRecord],
    *,
    policy: str = "s3fifo",
    cache_capacity_blocks: int,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    ghost_admit_freq: int = 0,
) -> ReferenceReplay:
    """Replay with the reference models; compare its numbers with `prefixflight.core.replay`."""
    model: ReferenceS3FIFO | ReferenceLRU
    if policy.lower() == "lru":
        model = ReferenceLRU(cache_capacity_blocks)
    else:
        model = ReferenceS3FIFO(cache_capacity_blocks, small_ratio, max_freq, ghost_admit_freq)
    run = ReferenceReplay(model, block_size)
    for rec in records:
        run.request(rec.hash_ids, rec.input_length)
    return run
