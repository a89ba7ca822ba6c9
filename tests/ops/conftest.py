"""Fixtures the ops tests share."""

from __future__ import annotations

import pytest

from raykv.blocks import hashing


@pytest.fixture(scope="module")
def native():
    """The native extension (row sums, the fused copy) must load on a machine with a C++
    compiler (CI has one)."""
    hashing.build_native()
    module = hashing.native_module()
    assert module is not None, hashing.native_status()
    return module
