"""prefixflight inside vLLM: its eviction, single flight and invariant checks in vLLM's own
block pool and scheduler, as a plugin (the ``vllm`` extra; install it into the environment
that has vLLM).

    python -m vllm.entrypoints.openai.api_server --model ... --enable-prefix-caching \\
        --scheduler-cls prefixflight.vllm.Scheduler \\
        --additional-config '{"prefixflight": {"eviction": "s3fifo", "checked": true}}'

`Scheduler` is the class to name; `PluginConfig` parses and checks the settings (it and
`PolicyQueue` import without vLLM). See docs/vllm.md.
"""

from __future__ import annotations

import typing

from prefixflight.core._lazy import lazy_attributes as _lazy_attributes

if typing.TYPE_CHECKING:
    from ._checks import PoolChecker
    from ._config import EvictionSettings, FlightSettings, PluginConfig
    from ._queue import PolicyQueue, QueueStats, install
    from ._scheduler import Scheduler, SyncScheduler

__all__ = [
    "EvictionSettings",
    "FlightSettings",
    "PluginConfig",
    "PolicyQueue",
    "PoolChecker",
    "QueueStats",
    "Scheduler",
    "SyncScheduler",
    "install",
]

__getattr__, __dir__ = _lazy_attributes(
    globals(),
    {
        "PoolChecker": "_checks",
        "EvictionSettings": "_config",
        "FlightSettings": "_config",
        "PluginConfig": "_config",
        "PolicyQueue": "_queue",
        "QueueStats": "_queue",
        "install": "_queue",
        "Scheduler": "_scheduler",
        "SyncScheduler": "_scheduler",
    },
)
