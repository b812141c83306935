"""The eviction policies by name: one registry that the commands, the engine settings and the
specs read."""

from __future__ import annotations

import pytest

from prefixflight.core import LRU, S3FIFO, ConfigError, ReplayConfig
from prefixflight.core.cache import POLICIES, make_policy


def test_the_registry_names_the_core_policies_replay_default_first() -> None:
    assert dict(POLICIES) == {"s3fifo": S3FIFO, "lru": LRU}
    assert next(iter(POLICIES)) == ReplayConfig(cache_capacity_blocks=1).policy


def test_make_policy_passes_each_policy_only_its_own_settings() -> None:
    settings = {"small_ratio": 0.5, "max_freq": 2, "ghost_admit_freq": 1}
    s3 = make_policy("S3FIFO", 10, **settings)
    assert isinstance(s3, S3FIFO) and s3.capacity == 10
    assert repr(s3) == "S3FIFO(capacity=10, small_ratio=0.5, max_freq=2, ghost_admit_freq=1)"
    lru = make_policy("lru", 7, **settings)  # S3FIFO's settings are not LRU's
    assert isinstance(lru, LRU) and lru.capacity == 7


@pytest.mark.parametrize("bad", ["fifo", "", 3, ["lru"]])
def test_an_unknown_policy_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"policy must be 's3fifo' or 'lru' \(any case\), got"):
        make_policy(bad, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=repr(bad).replace("[", r"\[").replace("]", r"\]")):
        ReplayConfig(policy=bad, cache_capacity_blocks=4)
