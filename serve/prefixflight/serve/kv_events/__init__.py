"""KV events on vLLM's wire: publish a `PrefixCache`'s events over ZMQ, follow publishers.

`KVEventPublisher` is a `prefixflight.core.cache.EventSink`: give it to ``PrefixCache(event_sink=)``
(or to the engine) and it publishes the cache's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` as vLLM's ``ZmqEventPublisher`` does (vLLM 0.32,
``vllm/distributed/kv_events.py``), in the encoding vLLM 0.32 decodes by default.

`KVEventSubscriber` follows one or more publishers (ours or vLLM's), each named by a replica
id, recovers missed batches through their replay sockets, and keeps a `ClusterBlockIndex`
that ``ApproxPrefixRouter(index=...)`` reads.

The package: ``_wire`` (the msgspec structs and codec, frames, topics, hashes; pure),
``_endpoints`` (vLLM's bind-or-connect rule), ``_publisher``, ``_subscriber`` (the sockets and
threads) and ``_index`` (the block indexes and the seq bookkeeping; pure). The package exports
what a user calls: the publisher, the subscriber and its index, topics, and the wire's event
structs and codec for reading vLLM's events; frame parsing and hash encodings stay inside.
docs/kv-events.md describes the wire, the endpoints and what the events reveal.
"""

from ._index import ClusterBlockIndex, IndexStats, ReplicaBlockIndex, ReplicaFeed
from ._publisher import KVEventPublisher
from ._subscriber import ErrorKind, KVEventSubscriber, PublisherAddress, ReplicaStatus
from ._wire import (
    KVEventFormatError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    encode_batch,
    fold_hash,
    kv_topic,
    parse_topic,
    wire_events,
)

__all__ = [
    "ClusterBlockIndex",
    "ErrorKind",
    "IndexStats",
    "KVEventFormatError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "PublisherAddress",
    "ReplicaBlockIndex",
    "ReplicaFeed",
    "ReplicaStatus",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "decode_batch",
    "encode_batch",
    "fold_hash",
    "kv_topic",
    "parse_topic",
    "wire_events",
]
