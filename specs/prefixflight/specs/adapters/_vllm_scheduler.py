"""vLLM's v1 `Scheduler` under `SchedulerConformance`, driven without a model.

Runs in an environment with vLLM (``benchmarks/peers/setup.sh`` builds one; vLLM 0.33.0 was
checked); vLLM is imported when an adapter is made, never when this module is. The
scheduler is vLLM's own class, built the way its engine core builds it (``Scheduler(
vllm_config, kv_cache_config, structured_output_manager, block_size=...)``) from a real
`VllmConfig`: a `ModelConfig` over a local one-layer Llama ``config.json`` whose
architecture is a registered stub (nothing is loaded or run), one full-attention KV cache
group, prefix caching on, chunked prefill on, no KV connector. Requests are
``vllm.v1.request.Request`` objects hashed with vLLM's sha256 block hasher; aborts are
``finish_requests(..., FINISHED_ABORTED)``, as the engine core does them.

The adapter is the model runner: it keeps each request's tokens and block table from the
`SchedulerOutput` alone, as vLLM's GPU model runner does (new requests bring their block
ids; running ones append ``new_block_ids``; a request resumed after preemption replaces its
table), and turns the machine's samples into a `ModelRunnerOutput` (an empty list for a
row that does not reach the end of its tokens, as the runner discards partial prefills).
Pages are vLLM's block ids minus one (block 0 is vLLM's null block).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from importlib import import_module
from typing import Any, Literal

import attrs

from .._declare import SchedulerSemantics
from .._sched_adapter import Delivery, ScheduledRow, SchedulerLimits, SchedulerPages

__all__ = ["VLLMSchedulerAdapter"]

_MAX_MODEL_LEN = 512
_ARCH = "PrefixflightNoModelForCausalLM"


@functools.cache
def _vllm() -> dict[str, Any]:
    """vLLM's pieces, imported once, and the model folder its `ModelConfig` reads."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    torch = import_module("torch")
    nn = import_module("torch.nn")
    vllm = import_module("vllm")
    hashing = import_module("vllm.utils.hashing")
    utils = import_module("vllm.v1.core.kv_cache_utils")

    class PrefixflightNoModelForCausalLM(nn.Module):  # type: ignore[misc,name-defined]
        """A model class vLLM's registry accepts; the scheduler never runs it."""

        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError

        def forward(self, input_ids: Any, positions: Any) -> Any:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError

    vllm.ModelRegistry.register_model(_ARCH, PrefixflightNoModelForCausalLM)
    folder = tempfile.mkdtemp(prefix="prefixflight-vllm-scheduler-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": [_ARCH],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "num_key_value_heads": 1,
                "vocab_size": 1024,
                "max_position_embeddings": _MAX_MODEL_LEN,
            },
            f,
        )
    hash_fn = hashing.get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    utils.init_none_hash(hash_fn)
    config = import_module("vllm.config")
    return {
        "torch": torch,
        "folder": folder,
        "config": config,
        "iface": import_module("vllm.v1.kv_cache_interface"),
        "Scheduler": import_module("vllm.v1.core.sched.scheduler").Scheduler,
        "StructuredOutputManager": import_module(
            "vllm.v1.structured_output"
        ).StructuredOutputManager,
        "Request": import_module("vllm.v1.request").Request,
        "RequestStatus": import_module("vllm.v1.request").RequestStatus,
        "SamplingParams": import_module("vllm.sampling_params").SamplingParams,
        "ModelRunnerOutput": import_module("vllm.v1.outputs").ModelRunnerOutput,
        "FinishReason": import_module("vllm.v1.engine").FinishReason,
        "hash_fn": hash_fn,
        "hasher": functools.cache(lambda bs: utils.get_request_block_hasher(bs, hash_fn)),
        "block_hash": utils.get_block_hash,
    }


@attrs.define
class _RunnerState:
    """One request as the model runner holds it."""

    tokens: list[int]  # prompt, then every token it sampled
    prompt_len: int
    table: list[int]  # vLLM block ids
    computed: int = 0


_Reason = Literal["stop", "length"]


class VLLMSchedulerAdapter:
    """vLLM's v1 `Scheduler` over ``limits.pages`` blocks (plus vLLM's null block).

    ``impl`` replaces vLLM's `Scheduler` class, built with exactly vLLM's arguments (a
    subclass: how ``prefixflight conform vllm --impl`` checks a fork).
    ``long_prefill_token_threshold`` is vLLM's option of that name (0: off): a prefill
    chunk is at most that many tokens while other requests wait, so a prompt is cut with
    budget left (declare ``chunking="any"`` with it).
    """

    semantics = SchedulerSemantics(same_step_reads="any", preemption="recompute")

    def __init__(
        self,
        limits: SchedulerLimits,
        *,
        impl: type[Any] | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        v = _vllm()
        cfg, iface, bs = v["config"], v["iface"], limits.block_size
        model = cfg.ModelConfig(
            model=v["folder"],
            skip_tokenizer_init=True,
            max_model_len=_MAX_MODEL_LEN,
            dtype="float32",
        )
        sched = cfg.SchedulerConfig(
            max_num_seqs=limits.max_running,
            max_num_batched_tokens=limits.max_batch_tokens,
            max_model_len=_MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            policy=limits.policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        cache = cfg.CacheConfig(block_size=bs, enable_prefix_caching=True)
        cache.num_gpu_blocks = limits.pages + 1
        vllm_config = cfg.VllmConfig(
            model_config=model,
            scheduler_config=sched,
            cache_config=cache,
            device_config=cfg.DeviceConfig("cpu"),
        )
        spec = iface.FullAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=32, dtype=v["torch"].float32
        )
        kv_cache_config = iface.KVCacheConfig(
            num_blocks=limits.pages + 1,
            kv_cache_tensors=[],
            kv_cache_groups=[iface.KVCacheGroupSpec(["model.layers.0.self_attn"], spec)],
        )
        cls = impl if impl is not None else v["Scheduler"]
        self.scheduler = cls(
            vllm_config, kv_cache_config, v["StructuredOutputManager"](vllm_config), block_size=bs
        )
        self._bs = bs
        self._hasher = v["hasher"](bs)
        self._requests: dict[str, Any] = {}  # every Request made, also after it ends
        self._keys: dict[Any, tuple[int, ...]] = {}  # vLLM block hash -> key
        self._known: dict[str, int] = {}  # request -> block hashes already in _keys
        self._runner: dict[str, _RunnerState] = {}
        self._out: Any = None
        self._arrival = 0.0

    # -- requests ------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        priority: int,
    ) -> None:
        v = _vllm()
        self._arrival += 1.0
        params = v["SamplingParams"](max_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids))
        req = v["Request"](
            request_id,
            list(prompt),
            params,
            None,
            arrival_time=self._arrival,
            priority=priority,
            block_hasher=self._hasher,
        )
        self._requests[request_id] = req
        self.scheduler.add_request(req)
        self._learn()

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, _vllm()["RequestStatus"].FINISHED_ABORTED)

    def _learn(self) -> None:
        """Map the block hashes vLLM computed (as tokens were appended) to keys."""
        bs = self._bs
        for rid, req in self._requests.items():
            done = self._known.get(rid, 0)
            hashes = req.block_hashes
            if len(hashes) == done:
                continue
            tokens = req.all_token_ids
            for i in range(done, len(hashes)):
                self._keys[hashes[i]] = tuple(tokens[: (i + 1) * bs])
            self._known[rid] = len(hashes)

    # -- steps, as the model runner sees them --------------------------------------------
    def schedule(self) -> list[ScheduledRow]:
        out = self.scheduler.schedule()
        self._learn()
        runner = self._runner
        for rid in out.finished_req_ids:
            runner.pop(rid, None)
        for new in out.scheduled_new_reqs:  # (the V2 runner also gets resumed ones here)
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else None
            tokens = list(tokens if tokens is not None else new.prompt_token_ids)
            prompt_len = len(new.prompt_token_ids)
            runner[new.req_id] = _RunnerState(
                tokens, prompt_len, list(new.block_ids[0]), new.num_computed_tokens
            )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = runner.get(rid)
            assert state is not None, f"vLLM sent {rid} as a cached request the runner never had"
            state.computed = cached.num_computed_tokens[i]
            outputs = cached.num_output_tokens[i]
            del state.tokens[state.prompt_len + outputs :]  # rejected tokens (none here)
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                assert new_ids is not None, f"vLLM resumed {rid} without a block table"
                state.table = list(new_ids[0])
            elif new_ids is not None:
                state.table.extend(new_ids[0])
        self._out = out
        rows = []
        for rid, n in out.num_scheduled_tokens.items():
            state = runner[rid]
            start = state.computed
            assert start + n <= len(state.tokens), (
                f"vLLM scheduled {n} tokens of {rid} from position {start}; it has "
                f"{len(state.tokens)}"
            )
            rows.append(
                ScheduledRow(
                    request_id=rid,
                    start=start,
                    token_ids=tuple(state.tokens[start : start + n]),
                    pages=tuple(b - 1 for b in state.table),
                    sample=start + n == len(state.tokens),
                )
            )
        return rows

    def complete(self, sampled: Mapping[str, int]) -> list[Delivery]:
        v = _vllm()
        out, self._out = self._out, None
        assert out is not None, "complete() without a step"
        ids = list(out.num_scheduled_tokens)
        for rid, tok in sampled.items():
            self._runner[rid].tokens.append(tok)
        result = v["ModelRunnerOutput"](
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in ids],
        )
        engine_outputs = self.scheduler.update_from_output(out, result)
        self._learn()
        reasons: dict[Any, _Reason] = {
            v["FinishReason"].STOP: "stop",
            v["FinishReason"].LENGTH: "length",
        }
        deliveries = []
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                why = o.finish_reason
                assert why is None or why in reasons, f"{o.request_id} finished with {why!r}"
                deliveries.append(
                    Delivery(
                        request_id=o.request_id,
                        token_ids=tuple(o.new_token_ids),
                        finished=None if why is None else reasons[why],
                    )
                )
        return deliveries

    # -- pages ---------------------------------------------------------------------------
    def pages(self) -> SchedulerPages:
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        get_hash = _vllm()["block_hash"]
        cached = {}
        for b in pool.blocks[1:]:  # block 0 is vLLM's null block
            if b.block_hash is not None:
                key = self._keys.get(get_hash(b.block_hash))
                assert key is not None, f"block {b.block_id} caches a hash no request has"
                cached[b.block_id - 1] = key
        free = frozenset(b.block_id - 1 for b in pool.free_block_queue.get_all_free_blocks())
        (group,) = manager.coordinator.single_type_managers
        held = {
            rid: tuple(b.block_id - 1 for b in blocks)
            for rid, blocks in group.req_to_blocks.items()
            if blocks
        }
        refs = {b.block_id - 1: b.ref_cnt for b in pool.blocks[1:]}
        return SchedulerPages(free=free, cached=cached, held=held, refs=refs)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())
