"""The paged runner's own forward pass for Llama-family models, with fused projections.

transformers' modules are written for any cache and any attention; on a 135M-parameter model
on a CPU their per-call overhead and separate projections cost as much as the arithmetic of
a decode step. `FusedForward` runs the same computation from the same weights, read once
from a loaded transformers model:

- the query, key and value projections are one matrix product (their weights concatenated),
  and so are the MLP's gate and up projections (the ``silu(gate) * up`` halves of one
  output), as in vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``;
- on a CPU, every weight is reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the weight prepacking that inductor's
  freezing pass and vLLM's CPU ``onednn_mm`` do): a decode step's small matrix products then
  skip the reorder each call would otherwise make, 1.5-2x faster in bf16;
- the pass runs over the step's tokens flattened (no padding in any projection), the
  rotary embedding is applied to queries and keys in one operation, the final norm and the
  output head only to each row's last token, and attention is `PagedStep.attend`.

The norms, rotary embedding and activation follow transformers' Llama code operation for
operation (fp32 norm statistics, the product with the weight in the model's dtype), so in
fp32 the logits match the model's own forward to rounding (tested against the gather path).
Supported: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (and models with their structure:
RMS norms, rotary embeddings, SiLU-gated MLP, no sliding window); others run the model's own
modules with paged attention (`unsupported` says why).

The weights are copied at construction: later changes to the model's parameters do not
reach a runner built before them. The input embedding is the model's own module (called
with the step's tokens flattened, ``[T]``), so hooks registered on it run; the layers'
modules are not called.
"""

from __future__ import annotations

from typing import Any, final

import torch
import torch.nn.functional as F

from ._paged import PagedStep

__all__ = ["FusedForward", "unsupported"]

_FAMILIES = ("llama", "qwen2")


def unsupported(model: Any) -> str | None:
    """Why `FusedForward` cannot run ``model`` (None: it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _FAMILIES:
        return f"model type {kind!r} is not one of {_FAMILIES}"
    assert config is not None
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed):
        return "not the Llama module layout (model.model.embed_tokens/layers/norm/rotary_emb)"
    if not hasattr(model, "lm_head"):
        return "no lm_head"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = (
            (attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (mlp, ("gate_proj", "up_proj", "down_proj")),
        )
        if any(m is None or not all(hasattr(m, n) for n in names) for m, names in parts):
            return "not the Llama layer layout (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj)"
    return None


@final
class _Linear:
    """``x @ weight.T + bias``, with the weight prepacked for oneDNN on a CPU when possible."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight: torch.Tensor | None = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
                self(torch.zeros((1, weight.shape[1]), dtype=weight.dtype))  # usable?
            except (RuntimeError, AttributeError):
                self.packed = None
            else:
                self.weight = None  # the packed copy is all that is needed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


def _cat_bias(*linears: Any) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
            for m, b in zip(linears, biases, strict=True)
        ]
    )


@final
class _Layer:
    __slots__ = ("down", "eps1", "eps2", "gate_up", "norm1", "norm2", "o", "qkv")

    def __init__(self, layer: Any, q_scale: float) -> None:
        a, m = layer.self_attn, layer.mlp
        with torch.no_grad():
            # the attention's 1/sqrt(head_dim) folded into the query rows (rotary embedding
            # is linear, so scaling before it is scaling after; exact for a power of two)
            bias = _cat_bias(a.q_proj, a.k_proj, a.v_proj)
            rows = a.q_proj.weight.shape[0]
            if bias is not None:
                bias[:rows] *= q_scale
            self.qkv = _Linear(
                torch.cat([a.q_proj.weight * q_scale, a.k_proj.weight, a.v_proj.weight]), bias
            )
            self.o = _Linear(a.o_proj.weight, a.o_proj.bias)
            self.gate_up = _Linear(
                torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                _cat_bias(m.gate_proj, m.up_proj),
            )
            self.down = _Linear(m.down_proj.weight, m.down_proj.bias)
        self.norm1 = layer.input_layernorm.weight.detach()
        self.norm2 = layer.post_attention_layernorm.weight.detach()
        self.eps1 = float(layer.input_layernorm.variance_epsilon)
        self.eps2 = float(layer.post_attention_layernorm.variance_epsilon)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: the statistics and the normalisation in fp32, rounded to
    the model's dtype, then the product with the weight in that dtype (one fused operation in
    fp32). Rounding once instead (``F.rms_norm`` in bf16, weight included) is as accurate per
    call, but the model was trained with this order, and on a CPU with native bf16 its
    greedy answers drifted: SmolLM2 answered "L'Étoile, la Marseillaise" to "What is the
    capital of France?" where transformers answers "Paris"."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@final
class FusedForward:
    """A Llama-family model's forward pass over a `PagedStep` (see the module docstring)."""

    __slots__ = (
        "embed",
        "eps",
        "head",
        "head_dim",
        "heads",
        "intermediate",
        "kv_heads",
        "layers",
        "norm",
        "rotary",
        "scale",
    )

    def __init__(self, model: Any) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"FusedForward cannot run this model: {why}")
        config = model.config
        inner = model.model
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.intermediate = int(config.intermediate_size)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.layers = [_Layer(layer, self.scale) for layer in inner.layers]
        self.embed = inner.embed_tokens  # the module itself: hooks on the input embeddings run
        self.norm = inner.norm.weight.detach()
        self.eps = float(inner.norm.variance_epsilon)
        with torch.no_grad():
            self.head = _Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None))
        self.rotary = inner.rotary_emb

    def __call__(self, ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits ``[rows, vocab]`` at each row's last token of the step (``ids``: ``[T]``)."""
        h, g, d = self.heads, self.kv_heads, self.head_dim
        t = ids.shape[0]
        x = self.embed(ids)
        cos, sin = self.rotary(x, step.positions.unsqueeze(0))
        half = d // 2
        # rotate_half(x) * sin == flip(x's halves) * sin with its first half negated
        cos = cos[0].unsqueeze(1)  # [T, 1, D]
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).unsqueeze(1)
        qk_width = (h + g) * d
        inter = self.intermediate
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms_norm(x, layer.norm1, layer.eps1))
            qk = qkv[:, :qk_width].view(t, h + g, d)
            flipped = qk.view(t, h + g, 2, half).flip(2).view(t, h + g, d)
            qk = torch.addcmul(qk * cos, flipped, sin)
            query = qk[:, :h]
            key = qk[:, h:]
            value = qkv[:, qk_width:].view(t, g, d)
            out = step.attend(i, query, key, value, 1.0).reshape(t, h * d)
            x = x + layer.o(out)
            gate_up = layer.gate_up(_rms_norm(x, layer.norm2, layer.eps2))
            x = x + layer.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        last = x.index_select(0, step.last)
        return self.head(_rms_norm(last, self.norm, self.eps))
