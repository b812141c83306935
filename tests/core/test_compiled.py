"""The optional compiled build (mypyc): which variant is loaded, and that the build compiles
the modules the runtime flag checks. The rest of the suite runs unchanged against either
variant (the CI compiled step sets PREFIXFLIGHT_EXPECT_COMPILED=1)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import prefixflight.core.cache as core_cache
from prefixflight.core import LRU, S3FIFO, ConfigError, PrefixCache, UsageError
from prefixflight.core.cache._build import COMPILED_MODULES, compiled_modules

ROOT = Path(__file__).resolve().parents[2]


def test_the_hook_compiles_the_modules_the_flag_checks() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"(?ms)^\[tool\.hatch\.build\.targets\.wheel\.hooks\.custom\]$(.*?)^\[", text)
    assert block is not None
    listed = re.search(r"(?s)compile-modules = \[(.*?)\]", block.group(1))
    assert listed is not None
    assert tuple(re.findall(r'"([^"]+)"', listed.group(1))) == COMPILED_MODULES


def test_the_flag_says_which_variant_is_loaded() -> None:
    loaded = compiled_modules()
    assert set(loaded) == set(COMPILED_MODULES)
    assert core_cache.compiled == all(loaded.values())
    for name, is_ext in loaded.items():
        suffix = Path(sys.modules[name].__file__ or "").suffix
        assert is_ext == (suffix != ".py"), name
    expected = os.environ.get("PREFIXFLIGHT_EXPECT_COMPILED")
    if expected is not None:
        assert core_cache.compiled is (expected == "1"), loaded


@pytest.mark.parametrize("bad", [True, False, 2.0, "3", None])
def test_both_variants_reject_the_same_arguments(bad: Any) -> None:
    # A bool is an int to mypyc: without CheckedInt the compiled build would take True as 1.
    # Any other non-int is rejected by the compiled build at the call (TypeError naming its
    # type) and by the pure build's validation (ConfigError naming the value); both leave
    # the state as it was.
    at_call = core_cache.compiled and not isinstance(bad, bool)
    config_error: type[Exception] = TypeError if at_call else ConfigError
    usage_error: type[Exception] = TypeError if at_call else UsageError
    named = ("None" if bad is None else type(bad).__name__) if at_call else repr(bad)
    for make in (S3FIFO, LRU, lambda v: PrefixCache(LRU(4), v)):
        with pytest.raises(config_error, match=named):
            make(bad)
    with pytest.raises(config_error, match=named):
        S3FIFO(4, max_freq=bad)
    cache = PrefixCache(S3FIFO(4), 2)
    cache.access([7], 2)
    with pytest.raises(usage_error, match=named):
        cache.access([1], bad)
    with pytest.raises(config_error, match=named):
        cache.evict_many(bad)
    assert cache.stats.requests == 1 and list(cache.policy.resident()) == [7]
