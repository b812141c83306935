"""Device and dtype choice: CUDA when present, else CPU; fp32 on CPU, bf16 on CUDA."""

from __future__ import annotations

import torch

from prefixflight.core import ConfigError

__all__ = ["resolve_device", "resolve_dtype"]

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


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``: fp32 on CPU (exact enough for the 1e-4 reuse guarantee), bf16 on CUDA."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype must be a floating point type, got {dtype!r}")
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None
