"""The plugin's settings (prefixflight.vllm.PluginConfig), without vLLM: every bad key or
value is refused with a message naming it, and the defaults are stock vLLM's behaviour."""

from __future__ import annotations

from typing import Any

import pytest

from prefixflight.core import LRU, S3FIFO, ConfigError, ReleasePolicy
from prefixflight.vllm import EvictionSettings, FlightSettings, PluginConfig


def parse(settings: Any) -> PluginConfig:
    return PluginConfig.from_additional_config({"prefixflight": settings})


def test_without_the_key_everything_is_stock() -> None:
    for additional in (None, {}, {"other_plugin": {"x": 1}}):
        config = PluginConfig.from_additional_config(additional)
        assert config == PluginConfig()
        assert config.eviction.policy == "lru" and config.single_flight is None
        assert not config.checked


def test_a_full_setting_parses_to_what_it_says() -> None:
    config = parse(
        {
            "eviction": {"policy": "s3fifo", "small_ratio": 0.2, "max_freq": 2},
            "single_flight": {"release": "on_completion", "max_wait_s": 5, "min_shared_blocks": 4},
            "checked": True,
        }
    )
    assert config.eviction == EvictionSettings(policy="s3fifo", small_ratio=0.2, max_freq=2)
    assert config.single_flight == FlightSettings(
        release=ReleasePolicy.ON_COMPLETION, max_wait_s=5.0, min_shared_blocks=4
    )
    assert config.checked
    policy = config.eviction.build(100)
    assert isinstance(policy, S3FIFO) and policy.small_capacity == 20 and policy.max_freq == 2
    assert isinstance(parse({"eviction": "lru"}).eviction.build(10), LRU)
    line = config.describe()
    assert line.startswith("prefixflight: eviction=s3fifo(small_ratio=0.2")
    assert "single_flight=on_completion(max_wait_s=5.0" in line and line.endswith("checked=on")


def test_short_forms() -> None:
    assert parse({"eviction": "s3fifo"}).eviction.policy == "s3fifo"
    assert parse({"single_flight": True}).single_flight == FlightSettings()
    assert parse({"single_flight": "on_completion"}).single_flight == FlightSettings(
        release=ReleasePolicy.ON_COMPLETION
    )
    assert parse({"single_flight": False}).single_flight is None
    assert parse({"single_flight": "off"}).single_flight is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"evicton": "lru"}, "unknown key 'evicton' in prefixflight"),
        ({"eviction": "arc"}, "prefixflight.eviction.policy must be 'lru' or 's3fifo', got 'arc'"),
        ({"eviction": {"policy": "lru", "max_freq": 2}}, "unknown key 'max_freq'"),
        (
            {"eviction": {"policy": "s3fifo", "small_ratio": 2}},
            "small_ratio must be in [0, 1], got 2",
        ),
        ({"eviction": {"policy": "s3fifo", "max_freq": -1}}, "max_freq must be >= 0, got -1"),
        (
            {"eviction": {"policy": "s3fifo", "max_freq": 1, "ghost_admit_freq": 2}},
            "ghost_admit_freq must be <= max_freq (1), got 2",
        ),
        ({"single_flight": {"release": "independent"}}, "got 'independent'"),
        (
            {"single_flight": {"max_wait_s": -1}},
            "max_wait_s must be a finite number >= 0.0, got -1",
        ),
        ({"single_flight": {"max_wait_s": float("inf")}}, "got inf"),
        ({"single_flight": {"min_shared_blocks": 0}}, "min_shared_blocks must be >= 1, got 0"),
        ({"single_flight": {"wait": 1}}, "unknown key 'wait' in prefixflight.single_flight"),
        ({"checked": "yes"}, "prefixflight.checked must be true or false, got 'yes'"),
        ([1, 2], "prefixflight must be a JSON object, got [1, 2]"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(settings: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(settings)
    assert message in str(caught.value)
