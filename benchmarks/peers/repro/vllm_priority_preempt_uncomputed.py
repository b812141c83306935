"""vLLM: under priority scheduling, a request preempted after it was scheduled in the same
``schedule()`` call leaves the blocks it registered for that step in the prefix cache, though
their KV is never computed; a later prefix hit (the preempted request itself, when it
resumes) reads that KV.

Reproduces on vLLM alone (checked with vllm 0.33.0, CPU, no model: the scheduler is driven
the way the engine core drives it, with the model runner's outputs faked):

    python vllm_priority_preempt_uncomputed.py    # exit 1: reproduced; exit 0: fixed

With ``--plugin`` the scheduler is ``prefixflight.vllm``'s (over vLLM's sync one, ``"lru"``
eviction, checked mode), which uncaches the blocks of a request preempted in the step that
scheduled it: not reproduced (exit 0). With ``--plugin-checks-only`` it keeps vLLM's own
preemption, and checked mode logs the uncomputed block as an invariant violation.

``--scheduling-policy priority --long-prefill-token-threshold 4``, block size 4, a pool of
5 blocks, a budget of 6 tokens, 2 sequences. Request A (13 tokens, priority 1) computes
positions 0-5; request B, the same prompt at priority 0, arrives. Step 2: A computes 6-9
(capped at the threshold), B hits A's two full blocks and computes 8-9. Step 3: A is
scheduled first (it is first in ``running``) for 10-12: ``allocate_slots`` takes the last
free block and registers A's third block (positions 8-11) in the prefix cache,
``cache_blocks(request, num_computed + num_new)``, before the forward pass. Then B needs a
block for position 12; there is none, so the priority policy preempts the lowest-priority
running request, A -- already scheduled in this step. ``schedule()`` takes A out of this
step's output and frees its blocks, but A's third block keeps its hash: it is cached with
positions 10-11 never computed. When A resumes, its prefix lookup hits that block (12
tokens) and it computes only position 12, attending to KV nobody wrote.

Under FCFS the victim is ``running[-1]``, never a request already scheduled in the step,
and without the threshold a request scheduled before another is never cut short with budget
left, so neither configuration reaches this. Expected: a request taken out of a step before
it runs leaves no registration of blocks that step would have computed.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

logging.disable(logging.WARNING)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK, BLOCKS = 4, 5


class NoModelForCausalLM(nn.Module):
    """Lets ModelConfig validate without a model; the scheduler never runs it."""

    def __init__(self, *, vllm_config: object = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


ModelRegistry.register_model("NoModelForCausalLM", NoModelForCausalLM)
folder = Path(tempfile.mkdtemp())
(folder / "config.json").write_text(
    json.dumps(
        {
            "architectures": ["NoModelForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "vocab_size": 1024,
            "max_position_embeddings": 512,
        }
    )
)
vllm_config = VllmConfig(
    model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=512),
    scheduler_config=SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=6,
        max_model_len=512,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy="priority",
        long_prefill_token_threshold=4,
    ),
    cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
    device_config=DeviceConfig("cpu"),
)
vllm_config.cache_config.num_gpu_blocks = BLOCKS + 1
spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
kv_cache_config = KVCacheConfig(
    num_blocks=BLOCKS + 1,  # + the null block
    kv_cache_tensors=[],
    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], spec)],
)
scheduler_cls: type[Scheduler] = Scheduler
if {"--plugin", "--plugin-checks-only"} & set(sys.argv[1:]):
    from prefixflight.vllm import SyncScheduler

    vllm_config.additional_config = {"prefixflight": {"eviction": "lru", "checked": True}}
    scheduler_cls = SyncScheduler
    if "--plugin-checks-only" in sys.argv[1:]:

        class ChecksOnly(SyncScheduler):
            _preempt_request = Scheduler._preempt_request

        scheduler_cls = ChecksOnly
scheduler = scheduler_cls(
    vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK
)
hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(hash_fn)
hasher = get_request_block_hasher(BLOCK, hash_fn)
pool = scheduler.kv_cache_manager.block_pool

computed: set[tuple[int, int]] = set()  # (block id, slot) whose KV a step computed
tables: dict[str, list[int]] = {}  # the model runner's block tables


def step() -> dict[str, tuple[int, int]]:
    """One step, as the engine core runs it; returns each request's scheduled positions."""
    out = scheduler.schedule()
    for new in out.scheduled_new_reqs:
        tables[new.req_id] = list(new.block_ids[0])
    c = out.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        ids = c.new_block_ids[i]
        if rid in c.resumed_req_ids:
            tables[rid] = list(ids[0])
        elif ids is not None:
            tables[rid].extend(ids[0])
    spans = {}
    for rid, n in out.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        start = req.num_computed_tokens - n  # schedule() has already advanced it
        spans[rid] = (start, start + n)
        computed.update((tables[rid][p // BLOCK], p % BLOCK) for p in range(start, start + n))
    ids = list(out.num_scheduled_tokens)
    reqs = scheduler.requests
    done = {rid: reqs[rid].num_computed_tokens >= reqs[rid].num_tokens for rid in ids}
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] if done[rid] else [] for rid in ids],
        ),
    )
    return spans


prompt = list(range(100, 113))  # 13 tokens: 3 full blocks and 1 token
a = Request("A", prompt, SamplingParams(max_tokens=1), None, priority=1, block_hasher=hasher)
scheduler.add_request(a)
print("step 1:", step())
b = Request("B", prompt, SamplingParams(max_tokens=1), None, priority=0, block_hasher=hasher)
scheduler.add_request(b)
print("step 2:", step())
third = a.block_hashes[2]  # A's block for positions 8-11
print("step 3:", spans := step(), f"(A preempted: {a.status.name})")
block = pool.get_cached_block(third, [0])
if "A" in spans or block is None:
    print("not reproduced: A ran in step 3, or its third block is not cached")
    sys.exit(0)
(blk,) = block
missing = [8 + s for s in range(BLOCK) if (blk.block_id, s) not in computed]
print(f"A's third block (positions 8-11) is cached as block {blk.block_id}; "
      f"positions {missing} of it were never computed")  # fmt: skip
while scheduler.has_unfinished_requests() and "A" not in (spans := step()):
    pass
print(f"A resumes with {a.num_computed_tokens - (spans['A'][1] - spans['A'][0])} cached "
      f"tokens and computes positions {spans['A']}")  # fmt: skip
if missing:
    print(
        f"REPRODUCED: block {blk.block_id} was registered in the prefix cache for a step that "
        f"did not run; positions {missing} were never computed; a hit reads them"
    )
    sys.exit(1)
print("not reproduced: every position of the cached block was computed")
sys.exit(0)
