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
    from ._checks import PoolChecker as PoolChecker
    from ._config import EvictionSettings as EvictionSettings
    from ._config import FlightSettings as FlightSettings
    from ._config import PluginConfig as PluginConfig
    from ._queue import PolicyQueue as PolicyQueue
    from ._queue import QueueStats as QueueStats
    from ._queue import install as install
    from ._scheduler import Scheduler as Scheduler
    from ._scheduler import SyncScheduler as SyncScheduler

# the names each module defines; it is imported on first use of one of them
_LAZY = {
    "_checks": ("PoolChecker",),
    "_config": ("EvictionSettings", "FlightSettings", "PluginConfig"),
    "_queue": ("PolicyQueue", "QueueStats", "install"),
    "_scheduler": ("Scheduler", "SyncScheduler"),
}

# __all__ is the lazy names; it is computed, which mypy cannot read (it would export
# nothing), so type checkers see none of the three and read the re-exports above
if not typing.TYPE_CHECKING:
    __getattr__, __dir__, __all__ = _lazy_attributes(globals(), _LAZY)
