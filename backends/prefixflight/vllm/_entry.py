"""The ``vllm.general_plugins`` entry point: the plugin without ``--scheduler-cls``.

vLLM runs every installed general plugin in each of its processes before it builds its
configuration. This one wraps ``EngineArgs.create_engine_config`` so that, once the
configuration exists:

- settings in the environment variable ``PREFIXFLIGHT_VLLM`` (the JSON object that
  ``--additional-config '{"prefixflight": ...}'`` would hold) are used when
  ``--additional-config`` has no ``"prefixflight"`` key;
- the settings are checked at once, before the engine starts or a model loads (a bad key or
  value raises `ConfigError` naming it);
- when there are settings and no ``--scheduler-cls``, the scheduler class becomes
  ``prefixflight.vllm.Scheduler``.

Without settings it changes nothing: stock vLLM runs as it would.
"""

from __future__ import annotations

import json
import os
from typing import Any, Final

from prefixflight.core import ConfigError

from ._config import CONFIG_KEY, PluginConfig

__all__ = ["ENV", "apply", "register"]

ENV: Final = "PREFIXFLIGHT_VLLM"
SCHEDULER: Final = "prefixflight.vllm.Scheduler"


def apply(config: Any) -> PluginConfig | None:
    """Bring the environment's settings into vLLM's ``config``, check them, and name the
    plugin's scheduler unless another one is named. Returns the settings (``None``: none)."""
    additional = config.additional_config
    if not isinstance(additional, dict):
        return None
    if CONFIG_KEY not in additional and os.environ.get(ENV):
        try:
            additional[CONFIG_KEY] = json.loads(os.environ[ENV])
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV} must hold a JSON object: {exc}") from None
    if CONFIG_KEY not in additional:
        return None
    settings = PluginConfig.from_additional_config(additional)
    if config.scheduler_config.scheduler_cls is None:
        config.scheduler_config.scheduler_cls = SCHEDULER
    return settings


def register() -> None:
    """The entry point vLLM calls (once per process; a second call changes nothing)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_prefixflight", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        apply(config)
        return config

    create_engine_config._prefixflight = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
