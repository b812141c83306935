"""Adapters that put real engines under prefixflight's conformance machines.

Each declares its semantics (`EngineSemantics` or `PolicySemantics`) and imports its engine
only when one is made, so this package imports without vLLM, SGLang, libCacheSim or Dynamo (and
without Hypothesis). ``prefixflight conform ENGINE`` runs them; so can you::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import PrefixEngineConformance
    from prefixflight.specs.adapters import VLLMAdapter

    run_state_machine_as_test(PrefixEngineConformance.for_adapter(VLLMAdapter))

- `PagePoolAdapter`: prefixflight's own engine path (the `Scheduler`'s page pool);
- `PrefixflightSchedulerAdapter`: prefixflight's `Scheduler` under `SchedulerConformance`;
- `VLLMAdapter`: vLLM's v1 ``KVCacheManager`` (and its ``BlockPool``);
- `VLLMPluginLRU`, `VLLMPluginS3FIFO`: the same with ``prefixflight.vllm``'s free queue in its
  pool, against the reference engine running prefixflight's policy;
- `VLLMSchedulerAdapter`: vLLM's v1 ``Scheduler``, driven without a model;
- `SGLangAdapter`: SGLang's ``RadixCache`` with page size 16 and a simulated allocator;
- `LibCacheSimS3FIFO`, `LibCacheSimLRU`: libCacheSim's policies (run them `isolated`);
- `ReplicaIndexAdapter`: prefixflight's router index (`ReplicaBlockIndex`) under
  `KVIndexConformance`, fed a reference engine's KV events;
- `DynamoIndexAdapter`: NVIDIA Dynamo's KV router index (``dynamo.llm.RadixTree``) likewise.

The adapters take ``impl=`` (``pool_cls=``, ``scheduler_cls=``, ``index_cls=`` for ours,
``tree_cls=`` for Dynamo's): a drop-in replacement for the engine's class, built with exactly
the original's arguments, to check a fork.
"""

from __future__ import annotations

from ._dynamo import DynamoIndexAdapter
from ._kv_index import ReplicaIndexAdapter
from ._libcachesim import LibCacheSimLRU, LibCacheSimS3FIFO, libcachesim_s3fifo_configs
from ._prefixflight import PagePoolAdapter, PrefixflightSchedulerAdapter
from ._sglang import SGLangAdapter, stub_torchvision
from ._vllm import VLLMAdapter, VLLMPluginLRU, VLLMPluginS3FIFO
from ._vllm_scheduler import VLLMSchedulerAdapter

__all__ = [
    "DynamoIndexAdapter",
    "LibCacheSimLRU",
    "LibCacheSimS3FIFO",
    "PagePoolAdapter",
    "PrefixflightSchedulerAdapter",
    "ReplicaIndexAdapter",
    "SGLangAdapter",
    "VLLMAdapter",
    "VLLMPluginLRU",
    "VLLMPluginS3FIFO",
    "VLLMSchedulerAdapter",
    "libcachesim_s3fifo_configs",
    "stub_torchvision",
]
