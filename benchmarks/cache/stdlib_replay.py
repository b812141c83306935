"""A standard-library-only replay: the yardstick for ``prefixflight replay``'s start-up cost.

What a careful engineer writes in one sitting from the S-3-FIFO replay task's specification
(the S3-FIFO prefix-cache replay task): read a Mooncake trace (plain or gzipped JSON lines),
take the longest resident prefix of each request, then access every block against S3FIFO
(or LRU), and print the same JSON report as ``prefixflight replay``. No validation beyond
what ``json`` does, no options beyond the ones below, nothing imported but the standard
library. ``benchmarks/cache/startup.py`` times it against ``prefixflight replay`` as whole
processes; both must print the same numbers.

    python benchmarks/cache/stdlib_replay.py TRACE.jsonl[.gz] --capacity-blocks 4096
        [--policy s3fifo|lru] [--block-size 512] [--small-ratio 0.1] [--max-freq 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator


class S3FIFO:
    """Small, main and ghost FIFO queues with a saturating per-block frequency."""

    def __init__(self, capacity: int, small_ratio: float = 0.1, max_freq: int = 3) -> None:
        self.small_cap = round(capacity * small_ratio)  # banker's rounding, as specified
        self.main_cap = capacity - self.small_cap
        self.max_freq = max_freq
        self.freq: dict[int, int] = {}  # resident blocks (small and main) -> freq
        self.small: deque[int] = deque()
        self.main: deque[int] = deque()
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def access(self, block: int) -> None:
        f = self.freq.get(block)
        if f is not None:
            self.freq[block] = min(f + 1, self.max_freq)
        elif block in self.ghost:
            del self.ghost[block]
            self._admit_main(block, 0)
        else:
            self._admit_small(block)

    def _admit_small(self, block: int) -> None:
        if self.small_cap == 0:  # no small queue: straight to main, cold
            self._admit_main(block, 0)
            return
        while len(self.small) >= self.small_cap:
            victim = self.small.popleft()
            vf = self.freq.pop(victim)
            if vf >= 1:
                self._admit_main(victim, vf)
            else:
                self._insert_ghost(victim)
        self.small.append(block)
        self.freq[block] = 0

    def _admit_main(self, block: int, freq: int) -> None:
        if self.main_cap == 0:  # no main queue: nothing is admitted to it
            return
        while len(self.main) >= self.main_cap:
            victim = self.main.popleft()
            vf = self.freq[victim]
            if vf >= 1:
                self.freq[victim] = vf - 1
                self.main.append(victim)
            else:
                del self.freq[victim]
                self._insert_ghost(victim)
                break
        self.main.append(block)
        self.freq[block] = freq

    def _insert_ghost(self, block: int) -> None:
        if self.main_cap == 0:
            return
        if block in self.ghost:
            del self.ghost[block]
        elif len(self.ghost) >= self.main_cap:
            self.ghost.popitem(last=False)
        self.ghost[block] = None


class LRU:
    """Least recently used, on an ordered dict."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.order

    def __len__(self) -> int:
        return len(self.order)

    def access(self, block: int) -> None:
        if block in self.order:
            self.order.move_to_end(block)
            return
        if self.capacity == 0:
            return
        if len(self.order) >= self.capacity:
            self.order.popitem(last=False)
        self.order[block] = None


def records(path: str) -> Iterator[dict[str, object]]:
    """One dict per non-blank line of a plain or gzipped JSON-lines file."""
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def replay(
    trace: Iterable[dict[str, object]], cache: S3FIFO | LRU, block_size: int
) -> dict[str, int]:
    requests = prompt_tokens = hit_tokens = mismatches = 0
    for rec in trace:
        ids = rec["hash_ids"]
        length = rec["input_length"]
        assert isinstance(ids, list) and isinstance(length, int)
        k = 0
        for h in ids:  # the longest resident prefix, at arrival
            if h not in cache:
                break
            k += 1
        for h in ids:  # then every block, hit or miss, in order
            cache.access(h)
        requests += 1
        prompt_tokens += length
        hit_tokens += min(k * block_size, length)
        if len(ids) != -(-length // block_size):
            mismatches += 1
    return {
        "total_requests": requests,
        "total_prompt_tokens": prompt_tokens,
        "total_hit_tokens": hit_tokens,
        "length_mismatch_lines": mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity-blocks", type=int, required=True)
    parser.add_argument("--policy", choices=("s3fifo", "lru"), default="s3fifo")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--small-ratio", type=float, default=0.1)
    parser.add_argument("--max-freq", type=int, default=3)
    args = parser.parse_args()
    cap = args.capacity_blocks
    cache = S3FIFO(cap, args.small_ratio, args.max_freq) if args.policy == "s3fifo" else LRU(cap)
    totals = replay(records(args.trace), cache, args.block_size)
    report: dict[str, object] = {
        "policy": args.policy,
        "block_size": args.block_size,
        "cache_capacity_blocks": cap,
        "total_requests": totals["total_requests"],
        "total_prompt_tokens": totals["total_prompt_tokens"],
        "total_hit_tokens": totals["total_hit_tokens"],
        "overall_hit_rate": (
            totals["total_hit_tokens"] / totals["total_prompt_tokens"]
            if totals["total_prompt_tokens"]
            else 0.0
        ),
        "final_cache_blocks": len(cache),
    }
    if totals["length_mismatch_lines"]:
        report["length_mismatch_lines"] = totals["length_mismatch_lines"]
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
