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


# The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup``: most of its time is
# spent waiting on Ray processes, not computing). Each module stays on one worker (its
# module-scoped cluster is started once); the modules that use this host's own service
# (``raykv up``, ``raykv.connect()`` without an address, the default agent socket, a built
# wheel's ``raykv``) or host-wide settings (network namespaces) take turns on one worker.
HOST_WIDE = {
    "tests/deploy/test_local_cluster.py",
    "tests/deploy/test_wheel.py",
    "tests/integrations/test_bench_routing.py",
    "tests/integrations/test_serve_app.py",
    "tests/integrations/test_vllm_outages.py",
    "tests/integrations/test_vllm_server.py",
    "tests/service/test_cli.py",
    "tests/test_readme.py",
    "tests/transport/test_ucx.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("host" if module in HOST_WIDE else module))
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
