import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# Ray refuses an object its store spills or falls back to a file for once the host's disk is
# over 95 % full (a CI host's disk full of its own caches): test clusters take up to 99 %
os.environ.setdefault("RAY_local_fs_capacity_threshold", "0.99")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Hypothesis: CI keeps each property test's own small settings; the nightly-sized run
# (`pytest tests/blocks --hypothesis-profile=long`) takes the sizes tests/blocks/helpers.py
# `examples()` gives for "long" (>= 10^5 state-machine steps).
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "long",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
