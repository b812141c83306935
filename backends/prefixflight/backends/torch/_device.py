"""Device and dtype choice: CUDA when present, else CPU; bf16 where the hardware has it.

The default dtype is bf16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or
AMX on x86: oneDNN runs bf16 matrix products there at 2-4x the fp32 rate, and the KV pool
is half the size), fp32 on other CPUs (bf16 would be emulated there, and slower than fp32).
"""

from __future__ import annotations

import functools

import torch

from prefixflight.core import ConfigError

__all__ = ["native_bf16", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` or ``"auto"``: ``cuda`` if available, else ``cpu``. Rejects unusable devices."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}"
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    return dev


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX) and oneDNN can use it."""
    cpu: object = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    has = any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
    mkldnn: object = torch.ops.mkldnn
    try:
        usable = bool(mkldnn._is_mkldnn_bf16_supported())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        usable = False
    return has and usable and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``: bf16 on CUDA and on CPUs with native bf16 (`native_bf16`), else fp32."""
    if dtype is None:
        if device.type == "cpu" and not native_bf16():
            return torch.float32
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype must be a floating point type, got {dtype!r}")
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None
