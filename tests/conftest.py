"""Shared test setup: Hypothesis profiles and the multi-process worker pool.

Profiles: `ci` (the default; derandomized so CI is reproducible, modest example
counts to keep the suite under ~15 minutes on 2 cores) and `thorough`
(`pytest --hypothesis-profile=thorough`: many more, random examples).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
