"""What publishing KV events costs the engine thread, and how fast a subscriber follows.

An engine step here is one request's `PrefixCache.publish` (a 512-token prompt, 32 blocks of
16 tokens, with its token ids; the prompts of a family share a 256-token system prompt, and
an LRU of 2,048 blocks evicts as the run goes on) followed by the sink's ``flush``. Side by
side, interleaved and repeated (the minimum is reported):

- ``none``: no event sink (the cache's fast batch path);
- ``list``: ``list.append`` as the sink (the floor for any sink: the cache's own per-block
  event path);
- ``publisher``: `KVEventPublisher` on ``tcp://127.0.0.1:*``, its background thread
  encoding and sending while the steps run, a `KVEventSubscriber` following it from another
  process (as a router would).

It prints the engine-thread cost per step and the ratios, then the end to end: the time from
the first step until the subscriber has applied every batch (batches and events per second),
and checks that the subscriber's index equals the cache's resident set.

Then the codec alone, side by side with the hand-written codec it replaced (loaded from git at
``--baseline-rev``, the last commit that had it): encoding and decoding the same batches (the
first 200 steps' events: a 32-block ``BlockStored`` with its 512 token ids, and the
``BlockRemoved`` of what LRU evicted) in both encodings, interleaved rounds, the minimum per
batch and the ratio old / new.

    python benchmarks/serve/kv_events_overhead.py [--steps 2000] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from prefixflight.core import LRU, BlockHash, BlockHasher, PrefixCache
from prefixflight.core.cache import KVEvent
from prefixflight.serve.kv_events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherAddress,
    WireBatch,
    decode_batch,
    encode_batch,
    fold_hash,
    wire_events,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

ROOT = harness.ROOT
# the last commit with the hand-written codec (serve/_kv_wire.py), before msgspec structs
BASELINE_REV = "cbe2330f5da6ab271c2288d84fae94cd8f978799"

BS = 16
SYSTEM = list(range(50_000, 50_256))


def prompts(steps: int) -> list[tuple[list[int], tuple[BlockHash, ...]]]:
    hasher = BlockHasher(block_size=BS, namespace="bench")
    out = []
    for i in range(steps):
        family = i % 97  # revisits: some prompts are fully resident again
        toks = [*SYSTEM, *(family * 1000 + (i % 7) * 300 + j for j in range(256))]
        out.append((toks, hasher.hash_tokens(toks)))
    return out


def run(
    work: list[tuple[list[int], tuple[BlockHash, ...]]],
    sink: Callable[[KVEvent], None] | None,
    flush: Callable[[], None],
) -> tuple[float, PrefixCache]:
    cache = PrefixCache(LRU(2048), block_size=BS, event_sink=sink)
    t0 = time.perf_counter()
    for toks, blocks in work:
        cache.publish(blocks, token_ids=toks)
        flush()
    return time.perf_counter() - t0, cache


def follow(endpoint: str, replay: str, conn: Connection) -> None:
    """The subscriber process: follow, then report the applied batches and the index."""
    with KVEventSubscriber({"r": PublisherAddress(endpoint, replay)}) as sub:
        sub.start()
        conn.send("ready")
        target = conn.recv()
        ok = sub.wait_for_seq("r", target, 120.0)
        idx = sub.index.replica("r")
        conn.send((ok, time.perf_counter(), sorted(idx.keys()), sub.feeds["r"].lost))


def _hand_codec(rev: str) -> Any:
    """The hand-written codec as it was at ``rev``, loaded from git as a module."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:serve/prefixflight/serve/_kv_wire.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "hand_kv_wire.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hand_kv_wire", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hand_kv_wire"] = module
    spec.loader.exec_module(module)
    return module


def _as_hand(old: Any, batch: WireBatch) -> Any:
    """``batch`` as the hand codec's attrs classes (the fields they had)."""
    import attrs

    kinds = {
        "WireBlockStored": old.WireBlockStored,
        "WireBlockRemoved": old.WireBlockRemoved,
        "WireAllBlocksCleared": old.WireAllBlocksCleared,
    }
    events = []
    for e in batch.events:
        cls = kinds[type(e).__name__]
        events.append(cls(**{f.name: getattr(e, f.name) for f in attrs.fields(cls)}))
    return old.WireBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


def codec(
    work: list[tuple[list[int], tuple[BlockHash, ...]]], rev: str, rounds: int
) -> dict[str, Any]:
    """Encode and decode the same batches with both codecs (see the module docstring)."""
    old = _hand_codec(rev)
    events: list[KVEvent] = []
    cache = PrefixCache(LRU(2048), block_size=BS, event_sink=events.append)
    batches = []
    for toks, blocks in work[:200]:
        cache.publish(blocks, token_ids=toks)
        batches.append(WireBatch(time.time(), wire_events(events), 0))
        events.clear()
    hand = [_as_hand(old, b) for b in batches]
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    for enc in ("map", "array"):
        payloads = [encode_batch(b, encoding=enc) for b in batches]
        assert [old.encode_batch(b, encoding=enc) for b in hand] == payloads, enc
        decoded = [_as_hand(old, decode_batch(p)) for p in payloads]
        assert decoded == [old.decode_batch(p) for p in payloads], enc  # the same content
        cases[f"encode {enc}"] = (
            lambda enc=enc: [old.encode_batch(b, encoding=enc) for b in hand],  # type: ignore[misc]
            lambda enc=enc: [encode_batch(b, encoding=enc) for b in batches],  # type: ignore[misc]
        )
        cases[f"decode {enc}"] = (
            lambda p=payloads: [old.decode_batch(x) for x in p],  # type: ignore[misc]
            lambda p=payloads: [decode_batch(x) for x in p],  # type: ignore[misc]
        )
    best: dict[str, list[float]] = {k: [float("inf"), float("inf")] for k in cases}
    for _ in range(rounds):
        for name, fns in cases.items():
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                best[name][i] = min(best[name][i], time.perf_counter() - t0)
    n = len(batches)
    rows = {
        name: {
            "hand_us_per_batch": old_t / n * 1e6,
            "msgspec_us_per_batch": new_t / n * 1e6,
            "hand_vs_msgspec": old_t / new_t,
        }
        for name, (old_t, new_t) in best.items()
    }
    print(f"codec: {n} batches (32-block BlockStored with 512 token ids, plus the evictions); "
          f"us per batch, min of {rounds} interleaved rounds")  # fmt: skip
    print(f"{'':<14} {'hand':>9} {'msgspec':>9} {'hand/msgspec':>13}")
    for name, r in rows.items():
        print(f"{name:<14} {r['hand_us_per_batch']:9.1f} {r['msgspec_us_per_batch']:9.1f} "
              f"{r['hand_vs_msgspec']:13.2f}")  # fmt: skip
    return {"baseline_rev": rev, "batches": n, "rounds": rounds, "cases": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="the hand codec's commit")
    ap.add_argument("--codec-rounds", type=int, default=15)
    ap.add_argument("--codec-only", action="store_true", help="skip the publisher runs")
    args = ap.parse_args()
    work = prompts(args.steps)
    if args.codec_only:
        result = codec(work, args.baseline_rev, args.codec_rounds)
        if args.json:
            harness.write_json(args.json, {"codec": result})
        return
    best: dict[str, float] = {}
    end_to_end: list[dict[str, float]] = []
    for _ in range(args.repeat):
        t, _c = run(work, None, lambda: None)
        best["none"] = min(best.get("none", t), t)
        events: list[KVEvent] = []
        t, _c = run(work, events.append, events.clear)
        best["list"] = min(best.get("list", t), t)
        ep = "tcp://127.0.0.1:*"
        with KVEventPublisher(ep, replay_endpoint=ep, topic="kv@bench@m") as pub:
            parent, child = mp.Pipe()
            proc = mp.get_context("spawn").Process(
                target=follow, args=(pub.endpoint, pub.replay_endpoint, child)
            )
            proc.start()
            try:
                assert parent.poll(60.0) and parent.recv() == "ready"
                t0 = time.perf_counter()
                t, cache = run(work, pub, pub.flush)
                assert pub.drain(60.0)
                parent.send(pub.next_seq)
                assert parent.poll(120.0), "the subscriber never answered"
                ok, t_done, keys, lost = parent.recv()
            finally:
                proc.join(30.0)
            assert ok and lost == 0, "the subscriber did not catch up"
            resident = {fold_hash(b) for _, bl in work for b in bl if b in cache}
            assert set(keys) == resident, "the index diverged from the cache"
            end_to_end.append(
                {
                    "seconds": t_done - t0,
                    "batches": pub.next_seq,
                    "resident_blocks": len(resident),
                }
            )
        best["publisher"] = min(best.get("publisher", t), t)
    e2e = min(end_to_end, key=lambda r: r["seconds"])
    per = {k: v / args.steps * 1e6 for k, v in best.items()}
    print(f"{args.steps} steps of 32 blocks; engine-thread cost per step (min of {args.repeat})")
    print(f"{'sink':<10} {'us/step':>9} {'vs none':>8} {'vs list':>8}")
    for k in ("none", "list", "publisher"):
        print(f"{k:<10} {per[k]:9.1f} {per[k] / per['none']:8.2f} {per[k] / per['list']:8.2f}")
    print(
        f"end to end: {e2e['batches']} batches ({e2e['batches'] * 32} stored blocks and the "
        f"evictions) applied by another process {e2e['seconds']:.3f} s after the first step "
        f"({e2e['batches'] / e2e['seconds']:.0f} batches/s); its index == the resident set "
        f"({e2e['resident_blocks']} blocks)"
    )
    codec_result = codec(work, args.baseline_rev, args.codec_rounds)
    if args.json:
        out: dict[str, Any] = {
            "steps": args.steps,
            "blocks_per_step": 32,
            "repeat": args.repeat,
            "us_per_step": per,
            "publisher_vs_none": per["publisher"] / per["none"],
            "publisher_vs_list": per["publisher"] / per["list"],
            "end_to_end": e2e,
            "codec": codec_result,
        }
        harness.write_json(args.json, out)


if __name__ == "__main__":
    main()
