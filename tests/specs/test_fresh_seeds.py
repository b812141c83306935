"""The CI step that runs every machine under fresh seeds reports a failure it can replay."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

_spec = importlib.util.spec_from_file_location(
    "fresh_seeds", Path(__file__).with_name("fresh_seeds.py")
)
assert _spec is not None and _spec.loader is not None
fresh_seeds = importlib.util.module_from_spec(_spec)
sys.modules["fresh_seeds"] = fresh_seeds
_spec.loader.exec_module(fresh_seeds)


class _FailsOnALargeDraw(RuleBasedStateMachine):
    @rule(x=st.integers(0, 1000))
    def draw(self, x: int) -> None:
        assert x < 900, f"drew {x}"


def test_every_shipped_machine_is_in_the_fresh_seed_run() -> None:
    """Every machine that has an implementation of ours to check (FIFO, LFU and SIEVE have
    none: they check users' policies, and tests/specs/test_policy_variants.py checks them)."""
    specs = importlib.import_module("prefixflight.specs")  # mypy sees no computed __all__

    machines = {
        getattr(specs, name)
        for name in specs.__all__
        if name.endswith(("Conformance", "Machine")) and name != "PolicyConformance"
    }
    machines -= {specs.FIFOConformance, specs.LFUConformance, specs.SIEVEConformance}
    assert machines == set(fresh_seeds.MACHINES.values())


def test_a_failure_prints_its_seed_replay_and_blob(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fresh_seeds, "MACHINES", {"broken": _FailsOnALargeDraw})
    ticks = itertools.count()
    assert fresh_seeds.main(["--budget", "100"], clock=lambda: float(next(ticks))) == 1
    out = capsys.readouterr().out
    assert "FAILED broken under seed" in out and "reproduce_failure" in out
    seed = int(out.split("FAILED broken under seed ")[1].split(";")[0])
    # the printed seed replays the same failure
    assert fresh_seeds.main(["--machine", "broken", "--seed", str(seed)]) == 1
    again = capsys.readouterr().out
    assert f"seed {seed}" in again and "AssertionError: drew" in again
