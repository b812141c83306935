"""The plugin's settings: what ``--additional-config '{"prefixflight": {...}}'`` may say.

Parsed and checked before anything in vLLM's pool changes; a bad key or value raises
`ConfigError` naming it. No vLLM import here: the settings are tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, final

import attrs

from prefixflight.core import ConfigError, EvictionPolicy, ReleasePolicy
from prefixflight.core.cache import POLICIES, make_policy
from prefixflight.core.validate import check_int, check_number, check_ratio

__all__ = ["EvictionSettings", "FlightSettings", "PluginConfig"]

CONFIG_KEY: Final = "prefixflight"
"""The key of vLLM's ``--additional-config`` that holds the plugin's settings."""

_TOP_KEYS: Final = ("eviction", "single_flight", "checked")
_EVICTION_KEYS: Final = {name: ("policy", *cls.SETTINGS) for name, cls in POLICIES.items()}
_FLIGHT_KEYS: Final = ("release", "max_wait_s", "min_shared_blocks")


def _unknown(where: str, got: Mapping[str, object], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(got) - set(allowed))
    if extra:
        raise ConfigError(f"unknown key {extra[0]!r} in {where} (allowed: {', '.join(allowed)})")


def _mapping(where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where} must be a JSON object, got {value!r}")
    return value


@final
@attrs.frozen(kw_only=True)
class EvictionSettings:
    """Which prefixflight policy orders vLLM's cached free blocks.

    ``"lru"`` evicts the block released longest ago (stock vLLM's order); ``"s3fifo"`` is
    prefixflight's S3-FIFO, with its parameters.
    """

    policy: Literal["lru", "s3fifo"] = "lru"
    small_ratio: float = 0.1
    max_freq: int = 3
    ghost_admit_freq: int = 0

    def build(self, capacity: int) -> EvictionPolicy:
        """The policy over ``capacity`` cacheable blocks."""
        return make_policy(
            self.policy,
            capacity,
            small_ratio=self.small_ratio,
            max_freq=self.max_freq,
            ghost_admit_freq=self.ghost_admit_freq,
        )

    @property
    def refresh_on_free(self) -> bool:
        """Whether a block's release counts as a use: LRU's recency is the release (as in
        stock vLLM); S3-FIFO's frequency counts hits only."""
        return self.policy == "lru"

    def describe(self) -> str:
        if self.policy == "lru":
            return "lru"
        return (
            f"s3fifo(small_ratio={self.small_ratio}, max_freq={self.max_freq}, "
            f"ghost_admit_freq={self.ghost_admit_freq})"
        )

    @classmethod
    def parse(cls, value: object) -> EvictionSettings:
        if isinstance(value, str):
            value = {"policy": value}
        raw = _mapping("prefixflight.eviction", value)
        policy = raw.get("policy", "lru")
        if policy not in _EVICTION_KEYS:
            names = " or ".join(repr(n) for n in sorted(POLICIES))
            raise ConfigError(f"prefixflight.eviction.policy must be {names}, got {policy!r}")
        _unknown(f"prefixflight.eviction ({policy})", raw, _EVICTION_KEYS[policy])
        if policy == "lru":
            return cls(policy="lru")
        small_ratio = check_ratio("prefixflight.eviction.small_ratio", raw.get("small_ratio", 0.1))
        max_freq = check_int("prefixflight.eviction.max_freq", raw.get("max_freq", 3), minimum=0)
        admit = check_int(
            "prefixflight.eviction.ghost_admit_freq", raw.get("ghost_admit_freq", 0), minimum=0
        )
        if admit > max_freq:
            raise ConfigError(
                f"prefixflight.eviction.ghost_admit_freq must be <= max_freq ({max_freq}), "
                f"got {admit!r}"
            )
        return cls(
            policy="s3fifo", small_ratio=small_ratio, max_freq=max_freq, ghost_admit_freq=admit
        )


@final
@attrs.frozen(kw_only=True)
class FlightSettings:
    """Single flight inside vLLM's scheduler: a waiting request whose prompt shares at
    least ``min_shared_blocks`` leading blocks with a request still prefilling them waits
    for those blocks (at most ``max_wait_s``) instead of computing them again.

    ``release``: ``"after_prefill"`` lets followers in once the shared blocks are computed;
    ``"on_completion"`` once the leader's whole request has ended.
    """

    release: ReleasePolicy = ReleasePolicy.AFTER_PREFILL
    max_wait_s: float = 30.0
    min_shared_blocks: int = 1

    def describe(self) -> str:
        return (
            f"{self.release.value}(max_wait_s={self.max_wait_s}, "
            f"min_shared_blocks={self.min_shared_blocks})"
        )

    @classmethod
    def parse(cls, value: object) -> FlightSettings | None:
        if value is False or value is None or value == "off":
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            value = {"release": value}
        raw = _mapping("prefixflight.single_flight", value)
        _unknown("prefixflight.single_flight", raw, _FLIGHT_KEYS)
        release = raw.get("release", "after_prefill")
        choices = {p.value: p for p in ReleasePolicy if p is not ReleasePolicy.INDEPENDENT}
        if release not in choices:
            raise ConfigError(
                "prefixflight.single_flight.release must be 'after_prefill' or "
                f"'on_completion', got {release!r}"
            )
        max_wait = check_number(
            "prefixflight.single_flight.max_wait_s",
            raw.get("max_wait_s", 30.0),
            minimum=0.0,
            finite=True,
        )
        shared = check_int(
            "prefixflight.single_flight.min_shared_blocks",
            raw.get("min_shared_blocks", 1),
            minimum=1,
        )
        return cls(release=choices[str(release)], max_wait_s=max_wait, min_shared_blocks=shared)


@final
@attrs.frozen(kw_only=True)
class PluginConfig:
    """Everything the plugin does, from ``additional_config["prefixflight"]``.

    ``eviction``: the policy (default ``"lru"``, stock vLLM's order); ``single_flight``:
    `FlightSettings` or ``None`` (off, the default); ``checked``: check the live pool and
    scheduler against the specs' invariants after every step (default off).
    """

    eviction: EvictionSettings = EvictionSettings()
    single_flight: FlightSettings | None = None
    checked: bool = False

    @classmethod
    def from_additional_config(cls, additional: object) -> PluginConfig:
        """The settings under ``"prefixflight"`` of vLLM's ``additional_config`` (all
        defaults when the key is absent)."""
        if additional is None:
            return cls()
        outer = _mapping("--additional-config", additional)
        if CONFIG_KEY not in outer:
            return cls()
        raw = _mapping(CONFIG_KEY, outer[CONFIG_KEY])
        _unknown(CONFIG_KEY, raw, _TOP_KEYS)
        checked = raw.get("checked", False)
        if not isinstance(checked, bool):
            raise ConfigError(f"prefixflight.checked must be true or false, got {checked!r}")
        return cls(
            eviction=EvictionSettings.parse(raw.get("eviction", "lru")),
            single_flight=FlightSettings.parse(raw.get("single_flight")),
            checked=checked,
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        flight = "off" if self.single_flight is None else self.single_flight.describe()
        return (
            f"prefixflight: eviction={self.eviction.describe()}, single_flight={flight}, "
            f"checked={'on' if self.checked else 'off'}"
        )
