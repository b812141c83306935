"""Exact LRU hit-rate curves for every capacity in one pass: Mattson's stack distances,
adapted to longest-prefix hits.

An LRU cache of capacity ``C`` holds exactly the ``C`` most recently used distinct blocks
(the inclusion property), so one recency stack serves every capacity at once. A block's
*stack distance* at a request's arrival is its depth in that stack: 1 for the most recently
used block, infinite for a block never seen. It is resident under capacity ``C`` exactly when
its distance is at most ``C``. A request's prefix hit under ``C`` is therefore the number of
leading blocks whose *running maximum* distance is at most ``C``; its hit tokens are
``min(k * block_size, input_length)`` as in the S3-FIFO prefix-cache replay task. After the
scan, every block of the request is accessed in order, moving it to the top of the stack.

Depths are counted over access times: each block marks the time of its last access, and its
depth is the number of marks at or after that time. Times are grouped in chunks of 1024: a
chunk's marks are one int used as a bitmask (counted within the chunk with ``bit_count``),
and a Fenwick tree over the chunks counts the marks before it. Clearing an old mark and
setting a new one (always in the last chunk) and reading a depth cost ``O(log(n / 1024))``
Python steps, independent of how many capacities are asked for; memory is
``O(distinct blocks + accesses / 1024)``. A request credits each capacity with a binary
search in its running maxima, only for the capacities inside its range of distances.

S3FIFO has no inclusion property, so its curve needs one replay per capacity (the CLI runs
them in parallel processes).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any, final

import attrs

from .._errors import ConfigError, UsageError
from ..validate import CheckedInt, check_int
from ._hashing import BlockHash
from ._trace import TraceRecord

__all__ = ["CurvePoint", "LRUCurve", "auto_capacities", "lru_curve"]

_SHIFT = 10
_MASK = (1 << _SHIFT) - 1
_BIT = tuple(1 << i for i in range(1 << _SHIFT))


@final
@attrs.frozen(kw_only=True)
class CurvePoint:
    """One capacity's replay outcome; the same numbers `replay` reports for it."""

    capacity: int
    total_requests: int
    total_prompt_tokens: int
    total_hit_tokens: int
    final_cache_blocks: int

    @property
    def overall_hit_rate(self) -> float:
        if not self.total_prompt_tokens:
            return 0.0
        return self.total_hit_tokens / self.total_prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        """The sweep JSON's entry: capacity, total_hit_tokens, overall_hit_rate,
        final_cache_blocks."""
        return {
            "capacity": self.capacity,
            "total_hit_tokens": self.total_hit_tokens,
            "overall_hit_rate": self.overall_hit_rate,
            "final_cache_blocks": self.final_cache_blocks,
        }


def _capacities(values: Iterable[int]) -> tuple[int, ...]:
    given: tuple[object, ...] = tuple(values)  # objects: see CheckedInt
    caps = tuple(check_int("capacity", c, minimum=0) for c in given)
    if not caps:
        raise ConfigError("give at least one capacity")
    if len(set(caps)) != len(caps):
        dup = sorted({c for c in caps if caps.count(c) > 1})
        raise ConfigError(f"capacities must be distinct, got duplicates {dup!r}")
    return caps


@final
class LRUCurve:
    """LRU replays at many capacities at once, exact per request (Mattson's algorithm).

    ``curve.access(hash_ids, input_length)`` returns the request's hit tokens under each
    capacity, in the order of `capacities`; it equals
    ``PrefixCache(LRU(c), block_size).access(hash_ids, input_length)`` for every ``c``.
    `points` gives the totals so far.
    """

    __slots__ = (
        "_active",
        "_block_size",
        "_capacities",
        "_counts",
        "_hits",
        "_last",
        "_masks",
        "_max_cap",
        "_now",
        "_order",
        "_prompt_tokens",
        "_requests",
        "_sorted_caps",
        "_zeros",
    )

    def __init__(self, capacities: Iterable[int], block_size: CheckedInt = 512) -> None:
        check_int("block_size", block_size, minimum=1)
        caps = _capacities(capacities)
        self._capacities = caps
        self._block_size = block_size
        order = sorted(range(len(caps)), key=caps.__getitem__)
        self._order = tuple(order)  # position in sorted order -> index in caps
        self._sorted_caps = tuple(caps[i] for i in order)
        self._max_cap = self._sorted_caps[-1]
        self._zeros = (0,) * len(caps)
        self._hits = [0] * len(caps)
        self._requests = 0
        self._prompt_tokens = 0
        # The recency stack as access times: block -> the time of its last access. Time t
        # lives in chunk t >> _SHIFT, whose bitmask marks the times that are still some
        # block's last access; a Fenwick tree over the chunks counts those marks.
        self._last: dict[BlockHash, int] = {}
        self._now = 0  # the next access time
        self._active = 0  # distinct blocks seen == marks
        self._masks: list[int] = []
        self._counts: list[int] = [0]  # Fenwick tree over chunks, 1-based

    @property
    def capacities(self) -> tuple[int, ...]:
        return self._capacities

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def distinct_blocks(self) -> int:
        """How many distinct blocks have been accessed."""
        return self._active

    def stack_distances(self, blocks: Sequence[BlockHash]) -> list[int | None]:
        """Each block's depth in the recency stack now (1 = most recent, ``None`` = never
        seen). Changes nothing."""
        last = self._last
        out: list[int | None] = []
        for b in blocks:
            t = last.get(b)
            out.append(None if t is None else self._depth(t))
        return out

    def _depth(self, t: int) -> int:
        c = t >> _SHIFT
        tree = self._counts
        s = 0
        i = c + 1
        while i:
            s += tree[i]
            i &= i - 1
        return self._active - s + (self._masks[c] >> (t & _MASK)).bit_count()

    def access(self, blocks: Sequence[BlockHash], num_tokens: CheckedInt) -> tuple[int, ...]:
        """One request: its hit tokens under each capacity, then every block is accessed."""
        if type(num_tokens) is not int or num_tokens < 0:  # the fast accept, else the check
            check_int("num_tokens", num_tokens, minimum=0, error=UsageError)
        tokens: int = num_tokens
        running = self._scan(blocks)
        self._touch(blocks)
        self._requests += 1
        self._prompt_tokens += tokens
        if not running:
            return self._zeros
        bs = self._block_size
        hits = self._hits
        out = [0] * len(hits)
        for caps_i, cap in zip(self._order, self._sorted_caps, strict=True):
            k = bisect_right(running, cap)
            if k:
                h = min(k * bs, tokens)
                out[caps_i] = h
                hits[caps_i] += h
        return tuple(out)

    def feed(self, records: Iterable[TraceRecord]) -> None:
        """Access every record in order, like `access`, without per-request results.

        Faster for whole curves: a request's credit costs O(log K) plus the capacities that
        fall strictly inside its range of stack distances, instead of O(K).
        """
        k_caps = len(self._sorted_caps)
        diff = [0] * (k_caps + 1)  # diff[p] is owed to every sorted position >= p
        try:
            self._feed(records, diff)
        finally:
            hits = self._hits
            order = self._order
            acc = 0
            for p in range(k_caps):
                acc += diff[p]
                hits[order[p]] += acc

    def _feed(self, records: Iterable[TraceRecord], diff: list[int]) -> None:
        scan = self._scan
        touch = self._touch
        sorted_caps = self._sorted_caps
        order = self._order
        hits = self._hits
        bs = self._block_size
        for rec in records:
            blocks = rec.hash_ids
            n = rec.input_length
            running = scan(blocks)
            touch(blocks)
            self._requests += 1
            self._prompt_tokens += n
            if not running:
                continue
            lo = bisect_left(sorted_caps, running[0])  # below: no hit
            hi = bisect_left(sorted_caps, running[-1], lo)  # from here: the whole scan hits
            diff[hi] += min(len(running) * bs, n)
            for p in range(lo, hi):
                hits[order[p]] += min(bisect_right(running, sorted_caps[p]) * bs, n)

    def _scan(self, blocks: Sequence[BlockHash]) -> list[int]:
        """The running maximum of the leading resident blocks' stack distances, stopping at
        the first block never seen or deeper than the largest capacity."""
        last = self._last
        masks = self._masks
        tree = self._counts
        active = self._active
        limit = self._max_cap
        running: list[int] = []
        m = 0
        for b in blocks:
            t = last.get(b)
            if t is None:
                break
            c = t >> _SHIFT
            s = 0
            i = c + 1
            while i:  # marks in chunks 0..c
                s += tree[i]
                i &= i - 1
            d = active - s + (masks[c] >> (t & _MASK)).bit_count()
            if d > m:
                if d > limit:
                    break
                m = d
            running.append(m)
        return running

    def _touch(self, blocks: Sequence[BlockHash]) -> None:
        """Access every block in order: move it to the top of the stack."""
        last = self._last
        masks = self._masks
        tree = self._counts
        bit = _BIT
        active = self._active
        now = self._now
        n = len(masks)  # chunks == Fenwick size
        for b in blocks:
            t = last.get(b)
            if t is None:
                active += 1
            else:  # clear its old mark
                c = t >> _SHIFT
                masks[c] ^= bit[t & _MASK]
                i = c + 1
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
            c = now >> _SHIFT
            if c == n:  # open a new chunk: append the Fenwick node over (c + 1 - low, c + 1]
                masks.append(0)
                low = (c + 1) & -(c + 1)
                s = 0
                i = c
                while i > c + 1 - low:
                    s += tree[i]
                    i &= i - 1
                tree.append(s)
                n += 1
            masks[c] |= bit[now & _MASK]
            i = c + 1
            while i <= n:
                tree[i] += 1
                i += i & -i
            last[b] = now
            now += 1
        self._now = now
        self._active = active

    def points(self) -> tuple[CurvePoint, ...]:
        """Totals so far, one point per capacity in the order given."""
        return tuple(
            CurvePoint(
                capacity=c,
                total_requests=self._requests,
                total_prompt_tokens=self._prompt_tokens,
                total_hit_tokens=h,
                final_cache_blocks=min(c, self._active),
            )
            for c, h in zip(self._capacities, self._hits, strict=True)
        )


def lru_curve(
    records: Iterable[TraceRecord], capacities: Iterable[int], block_size: int = 512
) -> tuple[CurvePoint, ...]:
    """Exact LRU replay totals for every capacity in one pass over ``records``."""
    curve = LRUCurve(capacities, block_size)
    curve.feed(records)
    return curve.points()


def auto_capacities(
    distinct_blocks: CheckedInt, points: CheckedInt = 24, smallest: CheckedInt = 16
) -> tuple[int, ...]:
    """About ``points`` log-spaced capacities from ``smallest`` up to ``distinct_blocks``
    (from there on LRU never evicts, so its curve is flat), ascending, distinct."""
    check_int("distinct_blocks", distinct_blocks, minimum=0)
    check_int("points", points, minimum=2)
    check_int("smallest", smallest, minimum=1)
    if distinct_blocks <= smallest:
        return (distinct_blocks,)
    ratio = (distinct_blocks / smallest) ** (1 / (points - 1))
    caps = {round(smallest * ratio**i) for i in range(points - 1)}
    caps.add(distinct_blocks)
    return tuple(sorted(c for c in caps if c <= distinct_blocks))
