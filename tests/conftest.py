"""Hypothesis profiles: Hypothesis' automatic ``ci`` profile in CI (derandomised, no
deadline), defaults in development, ``soak`` when HYPOTHESIS_PROFILE=soak."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "soak",
    max_examples=2000,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None)
_profile = os.environ.get("HYPOTHESIS_PROFILE")
if _profile:
    settings.load_profile(_profile)
elif not os.environ.get("CI"):
    settings.load_profile("dev")
