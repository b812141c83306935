"""prefixflight side by side with vLLM, SGLang and libCacheSim, in one process.

Three workloads (the shapes of a performance probe of vLLM, SGLang and libCacheSim; see
docs/performance.md):

* engine: 10,000 prompts of 512-4096 tokens, block size 16, 30% starting with one shared
  1024-token prefix; a pool of 16,384 blocks and 32 requests in flight, finishing in FIFO
  order. Per request: hash, look up the longest cached prefix, pin the hit, allocate the new
  blocks (evicting cached ones), and on completion publish the new full blocks and release.
* policy: 2M keys, Zipf(0.9) over 200k objects, ranks shuffled; each key is looked up and
  inserted on a miss; capacities 4,096 and 65,536.
* traces: the block streams of the real Mooncake traces (bundled with
  the package): every hash id of every request, in order, through S3FIFO and LRU; and our
  exact prefix replay (the S3-FIFO prefix-cache replay task's rule) of each trace.

Every implementation runs over the same generated data, interleaved over several rounds in
rotating order so machine noise hits all alike; the table shows medians, the ratio of each
peer's time to ours, and each one's hit rate (they must agree: equal work).

Peers are optional. Run inside the environment that ``setup.sh`` builds:

    bash benchmarks/peers/setup.sh            # once: .venv-peers with vLLM, SGLang, libCacheSim
    .venv-peers/bin/python benchmarks/peers/run.py --json out/peers.json

A peer that does not import is skipped with a message. libCacheSim is GPL-licensed: it is
imported only here, inside that separate environment, never by the prefixflight package.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from functools import partial
from importlib import import_module
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from prefixflight.core import (
    LRU,
    S3FIFO,
    BlockHasher,
    PrefixCache,
    TraceRecord,
    replay,
)
from prefixflight.core.cache import compiled
from prefixflight.specs.adapters import stub_torchvision

BLOCK = 16
POOL_BLOCKS = 16_384
IN_FLIGHT = 32


class Outcome(NamedTuple):
    """One timed run: seconds, the work's hit rate, and optional phase times."""

    seconds: float
    hit_rate: float
    phases: dict[str, float]


Runner = Callable[[], Outcome]


# -- workloads ---------------------------------------------------------------------------
def engine_prompts(
    n: int = 10_000,
    min_len: int = 512,
    max_len: int = 4096,
    shared: float = 0.3,
    prefix_len: int = 1024,
    vocab: int = 32_000,
    seed: int = 0,
) -> list[array[int]]:
    """Prompts as int64 arrays; a shared prompt shorter than the prefix is a prefix of it."""
    rng = random.Random(seed)
    prefix = array("q", (rng.randrange(vocab) for _ in range(prefix_len)))
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        if rng.random() < shared:
            head = prefix[:length]
            tail = array("q", (rng.randrange(vocab) for _ in range(length - len(head))))
            out.append(head + tail)
        else:
            out.append(array("q", (rng.randrange(vocab) for _ in range(length))))
    return out


def zipf_stream(
    n: int = 2_000_000, objects: int = 200_000, alpha: float = 0.9, seed: int = 1
) -> list[int]:
    """``n`` keys with Zipf(alpha) popularity over ``objects`` ids, ranks shuffled."""
    rng = random.Random(seed)
    weights = [1.0 / (r**alpha) for r in range(1, objects + 1)]
    cum = list(itertools.accumulate(weights))
    ranks = rng.choices(range(objects), cum_weights=cum, k=n)
    ids = list(range(objects))
    rng.shuffle(ids)
    return [ids[r] for r in ranks]


def load_trace(name: str) -> list[TraceRecord]:
    """A real Mooncake trace: the package's bundled copy (the published
    ``NAME_trace.jsonl``, gzipped)."""
    from prefixflight.cli import read_trace

    with read_trace(f"bundled:{name}") as reader:
        return list(reader)


# -- engine path: ours -------------------------------------------------------------------
def ours_engine(
    prompts: Sequence[array[int]],
    policy: str,
    pool: int = POOL_BLOCKS,
    in_flight: int = IN_FLIGHT,
    block: int = BLOCK,
) -> Outcome:
    """The engine path on prefixflight's public API, one call per request per step."""
    hasher = BlockHasher(block)  # sha256, stable across processes
    cache = PrefixCache(S3FIFO(pool) if policy == "s3fifo" else LRU(pool), block)
    hash_tokens = hasher.hash_tokens
    lookup, pin, unpin = cache.lookup, cache.pin, cache.unpin
    evict_many, publish_pages = cache.evict_many, cache.publish_pages
    free: list[Any] = list(range(pool - 1, -1, -1))  # every cached block has a page here
    second = itemgetter(1)
    running: deque[tuple[tuple[Any, ...], int, list[int]]] = deque()
    clock = time.perf_counter
    hashing = 0.0
    hit_tokens = prompt_tokens = 0

    def finish(hashes: tuple[Any, ...], k: int, own: list[int]) -> None:
        n_new = len(hashes) - k
        evicted, unused = publish_pages(hashes[k:], own[:n_new])
        if evicted:
            free.extend(map(second, evicted))
        free.extend(unused)
        free.extend(own[n_new:])  # the partial tail block's page
        if k:
            unpin(hashes[:k])

    t0 = clock()
    for prompt in prompts:
        n = len(prompt)
        h0 = clock()
        hashes = hash_tokens(prompt)
        hashing += clock() - h0
        k = min(lookup(hashes), (n - 1) // block)  # the last token is always computed
        if k:
            pin(hashes[:k])
        need = -(-n // block) - k
        if len(free) < need:
            free.extend(map(second, evict_many(need - len(free))))
        own = free[-need:]
        del free[-need:]
        running.append((hashes, k, own))
        if len(running) > in_flight:
            finish(*running.popleft())
        hit_tokens += k * block
        prompt_tokens += n
    while running:
        finish(*running.popleft())
    total = clock() - t0
    cache.check_invariants()
    return Outcome(total, hit_tokens / prompt_tokens, {"hashing": hashing})


def minimal_engine(
    prompts: Sequence[array[int]],
    pool: int = POOL_BLOCKS,
    in_flight: int = IN_FLIGHT,
    block: int = BLOCK,
) -> Outcome:
    """A minimal plain-Python block-hash cache, as a performance probe wrote it: one flat LRU of
    block ids, chained sha256 over token bytes, no API layer, no pins, no policies. The floor of a
    plain-Python block-hash cache, for reference."""
    import hashlib

    sha256 = hashlib.sha256
    none = b"\0" * 32
    step = block * 8
    ref = [0] * pool
    hash_of: list[bytes | None] = [None] * pool
    table: dict[bytes, int] = {}
    evictable: OrderedDict[int, None] = OrderedDict()
    free = list(range(pool - 1, -1, -1))
    owned: deque[list[int]] = deque()
    clock = time.perf_counter
    hashing = 0.0
    hit_tokens = prompt_tokens = 0

    def release(blocks: list[int]) -> None:
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if hash_of[b] is None:
                    free.append(b)
                else:
                    evictable[b] = None

    t0 = clock()
    for arr in prompts:
        n_tokens = len(arr)
        h0 = clock()
        data = arr.tobytes()
        hashes = []
        parent = none
        for i in range(0, len(data) - step + 1, step):
            parent = sha256(parent + data[i : i + step]).digest()
            hashes.append(parent)
        hashing += clock() - h0
        hit = []
        for h in hashes[: (n_tokens - 1) // block]:
            b = table.get(h)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
        need = -(-n_tokens // block) - len(hit)
        blocks = list(hit)
        n_full = len(hashes)
        i = len(hit)
        for _ in range(need):
            if free:
                b = free.pop()
            else:
                b, _ = evictable.popitem(last=False)
                old = hash_of[b]
                assert old is not None
                del table[old]
                hash_of[b] = None
            ref[b] = 1
            if i < n_full:
                h = hashes[i]
                if h not in table:
                    table[h] = b
                    hash_of[b] = h
            blocks.append(b)
            i += 1
        owned.append(blocks)
        if len(owned) > in_flight:
            release(owned.popleft())
        hit_tokens += len(hit) * block
        prompt_tokens += n_tokens
    while owned:
        release(owned.popleft())
    total = clock() - t0
    return Outcome(total, hit_tokens / prompt_tokens, {"hashing": hashing})


# -- engine path: vLLM -------------------------------------------------------------------
def vllm_engine_factory(prompts: Sequence[array[int]]) -> Runner:
    import logging

    logging.disable(logging.WARNING)
    torch = import_module("torch")
    SamplingParams = import_module("vllm.sampling_params").SamplingParams
    get_hash_fn_by_name = import_module("vllm.utils.hashing").get_hash_fn_by_name
    KVCacheManager = import_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    utils = import_module("vllm.v1.core.kv_cache_utils")
    get_request_block_hasher, init_none_hash = utils.get_request_block_hasher, utils.init_none_hash
    iface = import_module("vllm.v1.kv_cache_interface")
    FullAttentionSpec, KVCacheConfig = iface.FullAttentionSpec, iface.KVCacheConfig
    KVCacheGroupSpec = iface.KVCacheGroupSpec
    Request = import_module("vllm.v1.request").Request

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    pool_ints = list(range(32_000))

    def run() -> Outcome:
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        config = KVCacheConfig(
            num_blocks=POOL_BLOCKS + 1,  # + vLLM's reserved null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        manager = KVCacheManager(
            config,
            max_model_len=8192,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )
        hasher = get_request_block_hasher(BLOCK, hash_fn)
        params = SamplingParams(max_tokens=1)
        requests = []
        for i, prompt in enumerate(prompts):  # outside the timed region, like ours
            req = Request(str(i), list(map(pool_ints.__getitem__, prompt)), params, None)
            req._block_hasher = hasher
            requests.append(req)
        clock = time.perf_counter
        hashing = 0.0
        hit_tokens = prompt_tokens = 0
        running: deque[Any] = deque()
        t0 = clock()
        for req in requests:
            h0 = clock()
            req.update_block_hashes()
            hashing += clock() - h0
            blocks, computed = manager.get_computed_blocks(req)[:2]
            n = req.num_tokens
            got = manager.allocate_slots(req, n - computed, computed, blocks)
            assert got is not None, "vLLM could not allocate"
            running.append(req)
            if len(running) > IN_FLIGHT:
                manager.free(running.popleft())
            hit_tokens += computed
            prompt_tokens += n
        while running:
            manager.free(running.popleft())
        total = clock() - t0
        return Outcome(total, hit_tokens / prompt_tokens, {"hashing": hashing})

    return run


# -- engine path: SGLang -----------------------------------------------------------------
def sglang_engine_factory(prompts: Sequence[array[int]]) -> Runner:
    import logging

    logging.disable(logging.WARNING)
    stub_torchvision()  # SGLang imports torchvision; the CUDA wheel fails on CPU torch
    torch = import_module("torch")
    base = import_module("sglang.srt.mem_cache.base_prefix_cache")
    EvictParams, InsertParams = base.EvictParams, base.InsertParams
    MatchPrefixParams = base.MatchPrefixParams
    radix = import_module("sglang.srt.mem_cache.radix_cache")
    RadixCache, RadixKey = radix.RadixCache, radix.RadixKey

    class _MockAllocator:
        device = "cpu"

        def free_segment(self, *args: Any, **kwargs: Any) -> None:
            return None

    budget = POOL_BLOCKS * BLOCK
    kv_rows = torch.arange(8192, dtype=torch.int64)

    def run() -> Outcome:
        tree = RadixCache.create_simulated(mock_allocator=_MockAllocator(), page_size=BLOCK)
        clock = time.perf_counter
        hit_tokens = prompt_tokens = 0
        in_flight_tokens = 0
        running: deque[tuple[Any, Any, int, int]] = deque()

        def finish(key: Any, node: Any, n: int, new: int) -> None:
            nonlocal in_flight_tokens
            tree.insert(InsertParams(key=key, value=kv_rows[:n]))
            tree.dec_lock_ref(node)
            in_flight_tokens -= new

        t0 = clock()
        for prompt in prompts:
            n = len(prompt)
            match = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt[: n - 1])))
            hit = match.device_prefix_len
            node = match.last_device_node
            tree.inc_lock_ref(node)
            new = n - hit
            over = tree.evictable_size() + tree.protected_size() + in_flight_tokens + new - budget
            if over > 0:
                tree.evict(EvictParams(num_tokens=over))
            in_flight_tokens += new
            running.append((RadixKey(prompt), node, n, new))
            if len(running) > IN_FLIGHT:
                finish(*running.popleft())
            hit_tokens += hit
            prompt_tokens += n
        while running:
            finish(*running.popleft())
        total = clock() - t0
        return Outcome(total, hit_tokens / prompt_tokens, {})

    return run


# -- policy stream -----------------------------------------------------------------------
def ours_policy(stream: Sequence[int], capacity: int, policy: str) -> Outcome:
    """Our policy over the stream in one batch-shaped call (each key its own request)."""
    pol = S3FIFO(capacity) if policy == "s3fifo" else LRU(capacity)
    t0 = time.perf_counter()
    hits = pol.access_stream(stream)
    total = time.perf_counter() - t0
    return Outcome(total, hits / len(stream), {})


def ours_policy_per_call(stream: Sequence[int], capacity: int) -> Outcome:
    """Our S3FIFO with one call per key (the per-call shape, for comparison)."""
    pol = S3FIFO(capacity)
    access = pol.access_stream
    one = [0]
    hits = 0
    t0 = time.perf_counter()
    for key in stream:
        one[0] = key
        hits += access(one)
    total = time.perf_counter() - t0
    return Outcome(total, hits / len(stream), {})


def baseline_s3fifo(stream: Sequence[int], cap: int) -> Outcome:
    """A tight plain-Python S3-FIFO (promotion at freq >= 2), the plain ceiling."""
    s_cap = max(1, cap // 10)
    m_cap = cap - s_cap
    g_cap = max(1, int(cap * 0.9))
    freq: dict[int, int] = {}
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    s_pop, s_push = small.popleft, small.append
    m_pop, m_push = main.popleft, main.append
    g_pop = ghost.popitem
    fget = freq.get
    hits = n = 0
    t0 = time.perf_counter()
    for k in stream:
        f = fget(k)
        if f is not None:
            if f < 3:
                freq[k] = f + 1
            hits += 1
            continue
        if n >= cap:
            if len(small) >= s_cap:
                while True:
                    t = s_pop()
                    if freq[t] >= 2:
                        freq[t] = 0
                        m_push(t)
                        if len(main) > m_cap:
                            while True:
                                u = m_pop()
                                fu = freq[u]
                                if fu:
                                    freq[u] = fu - 1
                                    m_push(u)
                                else:
                                    del freq[u]
                                    n -= 1
                                    break
                            break
                    else:
                        del freq[t]
                        n -= 1
                        ghost[t] = None
                        if len(ghost) > g_cap:
                            g_pop(last=False)
                        break
                    if not small:
                        break
            else:
                while True:
                    u = m_pop()
                    fu = freq[u]
                    if fu:
                        freq[u] = fu - 1
                        m_push(u)
                    else:
                        del freq[u]
                        n -= 1
                        break
        if k in ghost:
            del ghost[k]
            m_push(k)
        else:
            s_push(k)
        freq[k] = 0
        n += 1
    total = time.perf_counter() - t0
    return Outcome(total, hits / len(stream), {})


def libcachesim_factories(
    stream: Sequence[int], capacity: int, policy: str, workdir: Path
) -> dict[str, Runner]:
    """libCacheSim per call from Python (``cache.get``) and whole loop in C
    (``process_trace`` over an oracleGeneral binary trace). ``hashpower=18``, as a performance
    probe found: the default 24 makes it 3-5x slower. Object sizes are 1, so sizes count objects."""
    import struct

    lcs = import_module("libcachesim")  # GPL: only ever imported here, in the peers venv

    cls = lcs.S3FIFO if policy == "s3fifo" else lcs.LRU
    path = workdir / f"stream_{len(stream)}.oracleGeneral"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rec = struct.Struct("<IQIq")
        with path.open("wb") as fh:
            fh.write(b"".join(rec.pack(i, k, 1, -1) for i, k in enumerate(stream)))

    def per_call() -> Outcome:
        cache = cls(capacity, hashpower=18)
        req = lcs.Request()
        req.obj_size = 1
        get = cache.get
        hits = 0
        t0 = time.perf_counter()
        for key in stream:
            req.obj_id = key
            hits += get(req)
        total = time.perf_counter() - t0
        return Outcome(total, hits / len(stream), {})

    def whole_loop() -> Outcome:
        cache = cls(capacity, hashpower=18)
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        t0 = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        total = time.perf_counter() - t0
        return Outcome(total, 1.0 - miss_ratio, {})

    return {
        f"libCacheSim {policy} per call": per_call,
        f"libCacheSim {policy} whole loop in C": whole_loop,
    }


# -- traces --------------------------------------------------------------------------------
def ours_trace_replay(records: Sequence[TraceRecord], policy: str, capacity: int) -> Outcome:
    """The replay task's exact prefix replay (token hit rate; not comparable to block rates)."""
    t0 = time.perf_counter()
    report = replay(records, policy=policy, cache_capacity_blocks=capacity)
    total = time.perf_counter() - t0
    return Outcome(total, report.overall_hit_rate, {})


# -- the harness ---------------------------------------------------------------------------
class Group:
    """Runners over the same work: timed together, in rotating order, for several rounds."""

    def __init__(
        self, title: str, ours: str, unit: str, units: int, same_rate_tolerance: float
    ) -> None:
        self.title = title
        self.ours = ours
        self.unit = unit
        self.units = units
        self.tolerance = same_rate_tolerance
        self.runners: dict[str, Runner] = {}
        self.outcomes: dict[str, list[Outcome]] = {}
        self.same_as: dict[str, str] = {}

    def add(self, name: str, runner: Runner, same_as: str | None = None) -> None:
        """Add a runner; its hit rate must equal ``same_as``'s (default: ours) within the
        group's tolerance, or the table flags it."""
        self.runners[name] = runner
        self.outcomes[name] = []
        self.same_as[name] = same_as or self.ours

    def run(self, rounds: int, log: Callable[[str], None]) -> None:
        names = list(self.runners)
        for rnd in range(rounds):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                out = self.runners[name]()
                self.outcomes[name].append(out)
                log(
                    f"  [{self.title}] round {rnd + 1}/{rounds} {name}: "
                    f"{out.seconds:.3f} s, hit rate {out.hit_rate:.4%}"
                )

    def summary(self) -> dict[str, Any]:
        ours_rounds = [o.seconds for o in self.outcomes[self.ours]]
        rows = []
        for name, outs in self.outcomes.items():
            med = statistics.median(o.seconds for o in outs)
            phases = {p: statistics.median(o.phases[p] for o in outs) for p in outs[0].phases}
            rate = outs[0].hit_rate
            ref = self.same_as[name]
            ref_rate = self.outcomes[ref][0].hit_rate
            rows.append(
                {
                    "name": name,
                    "median_s": med,
                    "best_s": min(o.seconds for o in outs),
                    "us_per_unit": 1e6 * med / self.units,
                    "phases_us_per_unit": {p: 1e6 * v / self.units for p, v in phases.items()},
                    # paired per round (each round runs everyone back to back), then the median:
                    # steadier than a ratio of medians when the machine's load drifts
                    "ratio_to_ours": statistics.median(
                        o.seconds / t for o, t in zip(outs, ours_rounds, strict=True)
                    ),
                    "hit_rate": rate,
                    "same_as": ref,
                    "same_work": abs(rate - ref_rate) <= self.tolerance
                    and all(o.hit_rate == rate for o in outs),
                    "rounds": [o.seconds for o in outs],
                }
            )
        return {
            "title": self.title,
            "ours": self.ours,
            "unit": self.unit,
            "units": self.units,
            "rows": rows,
        }


def format_group(summary: dict[str, Any]) -> str:
    unit = summary["unit"]
    lines = [
        f"### {summary['title']}",
        "",
        f"| implementation | median s | best s | us/{unit} | time / ours (paired) | hit rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["rows"]:
        phases = "".join(f" ({p} {v:.2f})" for p, v in r["phases_us_per_unit"].items())
        flag = "" if r["same_work"] else f" (differs from {r['same_as']})"
        name = f"**{r['name']}**" if r["name"] == summary["ours"] else r["name"]
        lines.append(
            f"| {name} | {r['median_s']:.3f} | {r['best_s']:.3f} | "
            f"{r['us_per_unit']:.2f}{phases} | {r['ratio_to_ours']:.2f}x | "
            f"{100 * r['hit_rate']:.3f}%{flag} |"
        )
    return "\n".join(lines) + "\n"


def try_peer(name: str, make: Callable[[], Any], log: Callable[[str], None]) -> Any:
    """``make()``, or None with a message if the peer is not installed or fails to import."""
    try:
        return make()
    except Exception as exc:  # any import-time failure means: not available here
        log(f"skipping {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def build_groups(args: argparse.Namespace, log: Callable[[str], None]) -> list[Group]:
    groups: list[Group] = []
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if "engine" in args.workloads:
        prompts = engine_prompts(n=args.requests)
        blocks = sum(-(-len(p) // BLOCK) for p in prompts)
        g = Group(
            f"engine path: {len(prompts)} requests, {sum(map(len, prompts))} tokens, "
            f"{blocks} blocks of {BLOCK}",
            "prefixflight S3FIFO",
            "block",
            blocks,
            0.001,
        )
        g.add("prefixflight S3FIFO", lambda: ours_engine(prompts, "s3fifo"))
        g.add("prefixflight LRU", lambda: ours_engine(prompts, "lru"))
        g.add("plain-Python minimal block cache", lambda: minimal_engine(prompts))
        if "vllm" not in args.skip:
            run = try_peer("vLLM", lambda: vllm_engine_factory(prompts), log)
            if run is not None:
                g.add("vLLM 0.33 KVCacheManager (sha256)", run)
        if "sglang" not in args.skip:
            run = try_peer("SGLang", lambda: sglang_engine_factory(prompts), log)
            if run is not None:
                g.add("SGLang 0.5 RadixCache page 16", run)
        groups.append(g)
    if "policy" in args.workloads:
        stream = zipf_stream(n=args.keys, objects=args.objects)
        for cap in args.capacities:
            g = Group(
                f"policy stream: {len(stream)} Zipf(0.9) keys over {args.objects} "
                f"objects, capacity {cap}",
                "prefixflight S3FIFO",
                "key",
                len(stream),
                1e-9,
            )
            g.add("prefixflight S3FIFO", partial(ours_policy, stream, cap, "s3fifo"))
            g.add(
                "prefixflight S3FIFO, one call per key", partial(ours_policy_per_call, stream, cap)
            )
            g.add(
                "prefixflight LRU",
                partial(ours_policy, stream, cap, "lru"),
                same_as="prefixflight LRU",
            )
            if "libcachesim" not in args.skip:
                for policy in ("s3fifo", "lru"):
                    runs = try_peer(
                        "libCacheSim",
                        partial(libcachesim_factories, stream, cap, policy, workdir),
                        log,
                    )
                    for name, run in (runs or {}).items():
                        # S3FIFO variants differ by design (see docs/performance.md): the
                        # exact check is LRU against LRU
                        ref = "prefixflight LRU" if policy == "lru" else name
                        g.add(name, run, same_as=ref)
            g.add(
                "plain-Python S3-FIFO (tight baseline)",
                partial(baseline_s3fifo, stream, cap),
                same_as="plain-Python S3-FIFO (tight baseline)",
            )
            groups.append(g)
    if "traces" in args.workloads:
        for trace in ("conversation", "synthetic"):
            records = load_trace(trace)
            stream = [b for r in records for b in r.hash_ids]
            cap = args.trace_capacity
            g = Group(
                f"trace {trace}: {len(records)} requests, block stream of "
                f"{len(stream)} accesses, capacity {cap}",
                "prefixflight LRU",
                "block",
                len(stream),
                1e-9,
            )
            g.add("prefixflight LRU", partial(ours_policy, stream, cap, "lru"))
            g.add(
                "prefixflight S3FIFO",
                partial(ours_policy, stream, cap, "s3fifo"),
                same_as="prefixflight S3FIFO",
            )
            if "libcachesim" not in args.skip:
                for policy in ("lru", "s3fifo"):
                    runs = try_peer(
                        "libCacheSim",
                        partial(libcachesim_factories, stream, cap, policy, workdir / trace),
                        log,
                    )
                    for name, run in (runs or {}).items():
                        g.add(name, run, same_as=None if policy == "lru" else name)
            replay_name = "prefixflight exact prefix replay S3FIFO (token hit rate)"
            g.add(
                replay_name, partial(ours_trace_replay, records, "s3fifo", cap), same_as=replay_name
            )
            groups.append(g)
    return groups


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workloads",
        default="engine,policy,traces",
        type=lambda s: set(s.split(",")),
        help="engine,policy,traces",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument(
        "--capacities", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 65536]
    )
    ap.add_argument("--trace-capacity", type=int, default=4096)
    ap.add_argument(
        "--skip",
        default="",
        type=lambda s: set(filter(None, s.split(","))),
        help="peers to leave out: vllm,sglang,libcachesim",
    )
    ap.add_argument("--workdir", default="out/peers")
    ap.add_argument("--json", default=None, help="write the summaries here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] | None = None) -> int:
    args = parse_args(argv)
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    groups = build_groups(args, say)
    summaries = []
    for g in groups:
        say(f"running {g.title} ({', '.join(g.runners)})")
        g.run(args.rounds, say)
        summary = g.summary()
        summaries.append(summary)
        print(format_group(summary), flush=True)
        for r in summary["rows"]:
            if not r["same_work"]:
                print(
                    f"note: {r['name']} hit rate {r['hit_rate']:.4%} differs from "
                    f"{r['same_as']}'s by more than {g.tolerance:.2%}\n",
                    flush=True,
                )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "python": sys.version.split()[0],
            "rounds": args.rounds,
            "prefixflight_compiled": compiled,  # the optional mypyc build (docs/performance.md)
            "groups": summaries,
        }
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
