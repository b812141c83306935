"""Residency by KV events: a `PrefixIndex` over a `KVEventSubscriber`. Ray-free.

Each replica started with ``kv_events=True`` publishes its prefix cache's KV events
(`KVEventPublisher`, bound to a free loopback port, with a replay socket) and reports the
two endpoints in its routing stats (`KV_ENDPOINT_KEYS`). `KVEventResidency` follows them:
`observe` subscribes to a replica the first time its stats show endpoints (again if they
change), `drop_replica` stops following one that died or left, and `prefix_blocks`
reads the subscriber's per-replica index, current to the last event rather than to the
stats period. The index keys blocks by the publishers' own hashes folded to 64 bits, so the
router's engine blocks (`BlockHasher(block_size=engine_block_size, namespace=...)`, the
replicas' keying) fold to the same keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, final

from prefixflight.core import BlockHash, UsageError

from ..kv_events import KVEventSubscriber, PublisherAddress

__all__ = ["KV_ENDPOINT_KEYS", "KVEventResidency", "publisher_address"]

KV_ENDPOINT_KEYS: Final = ("kv_endpoint", "kv_replay_endpoint")
"""The routing-stats keys where a publishing replica reports its PUB and replay endpoints."""


def publisher_address(stats: Mapping[str, Any] | None) -> PublisherAddress | None:
    """The KV-event publisher a replica's routing stats report, or ``None`` (no endpoint, or
    junk values)."""
    if not stats:
        return None
    endpoint = stats.get(KV_ENDPOINT_KEYS[0])
    replay = stats.get(KV_ENDPOINT_KEYS[1])
    if not isinstance(endpoint, str) or "://" not in endpoint:
        return None
    return PublisherAddress(endpoint, replay if isinstance(replay, str) and replay else None)


@final
class KVEventResidency:
    """Which blocks each replica holds, from its KV events (a `PrefixIndex` that
    `FollowsReplicas`).

    Owns one `KVEventSubscriber` (started at once: its thread follows every publisher,
    catching up through the replay sockets) unless ``subscriber`` is given, in which case the
    caller drives and closes it. `close` stops it.
    """

    __slots__ = ("_closed", "_known", "_owned", "_subscriber")

    def __init__(
        self,
        subscriber: KVEventSubscriber | None = None,
        *,
        replay_timeout_s: float = 2.0,
        catch_up_every_s: float = 1.0,
    ) -> None:
        if subscriber is not None and not isinstance(subscriber, KVEventSubscriber):
            raise UsageError(f"subscriber must be a KVEventSubscriber, got {subscriber!r}")
        self._owned = subscriber is None
        if subscriber is None:
            subscriber = KVEventSubscriber({}, replay_timeout_s=replay_timeout_s)
            subscriber.start(catch_up_every_s=catch_up_every_s)
        self._subscriber = subscriber
        self._known: dict[str, PublisherAddress] = dict(subscriber.publishers)
        self._closed = False

    @property
    def subscriber(self) -> KVEventSubscriber:
        return self._subscriber

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas whose publishers are followed (or asked to be)."""
        return tuple(sorted(self._known))

    def observe(self, replica: str, stats: Mapping[str, Any] | None) -> None:
        """A replica's routing stats: follow the publisher they report (once per address)."""
        address = publisher_address(stats)
        if self._closed or address is None or self._known.get(replica) == address:
            return
        self._subscriber.add_publisher(replica, address)
        self._known[replica] = address

    def prefix_blocks(self, replica: str, blocks: Sequence[BlockHash]) -> int:
        return self._subscriber.index.prefix_blocks(replica, blocks)

    def drop_replica(self, replica: str) -> None:
        if self._known.pop(replica, None) is not None:
            self._subscriber.remove_publisher(replica)

    def close(self) -> None:
        """Stop following every publisher (idempotent; a given subscriber is left open)."""
        self._closed = True
        self._known.clear()
        if self._owned:
            self._subscriber.close()
