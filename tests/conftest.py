import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


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
