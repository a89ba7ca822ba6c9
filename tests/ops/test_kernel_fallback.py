"""When a CUDA machine cannot use the CUDA kernel, raykv says so once, at WARNING
(``raykv.ops.kernel``), and ``raykv.ops`` copies with its torch reference.

No GPU here: CUDA's presence and the extension build are monkeypatched; each test starts from
an undecided kernel state (what a fresh process has) and monkeypatch restores the real one.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from raykv import ops
from raykv.ops import kernel as ops_kernel

LOGGER = "raykv.ops.kernel"


@pytest.fixture
def fresh_process(monkeypatch):
    """ops as a new process sees it: the kernel not yet built or ruled out."""
    monkeypatch.setattr(ops_kernel, "_module", None)
    monkeypatch.setattr(ops_kernel, "_status", None)
    monkeypatch.delenv("RAYKV_DISABLE_KERNEL", raising=False)
    monkeypatch.delenv("RAYKV_KERNELS_DIR", raising=False)
    monkeypatch.setenv("RAYKV_CACHE_DIR", "/nonexistent-raykv-cache")  # never used unless built


@pytest.fixture
def cuda_machine(monkeypatch, fresh_process, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("RAYKV_CACHE_DIR", str(tmp_path / "cache"))


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def use_the_kernel_a_few_times() -> None:
    """What a process does: asks several times, and copies (falling back to the reference)."""
    for _ in range(3):
        assert not ops.kernel_available()
        assert ops.kernel_status().startswith("torch reference")
    pool = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    rows = torch.empty(2, ops.row_bytes([pool]), dtype=torch.uint8)
    ops.gather_blocks([pool], torch.tensor([3, 1]), rows)
    back = torch.zeros_like(pool)
    ops.scatter_blocks(rows, [back], torch.tensor([3, 1]))
    assert torch.equal(back[[3, 1]], pool[[3, 1]])


def failing_load(**kwargs):
    raise RuntimeError("nvcc fatal: unsupported gpu architecture 'compute_200'")


@pytest.mark.parametrize(
    "breakage, names",
    [
        pytest.param(
            lambda mp, tmp: mp.setattr(cpp_extension, "load", failing_load),
            ["building the CUDA kernel failed", "compute_200", "RAYKV_KERNEL_VERBOSE"],
            id="build-fails",
        ),
        pytest.param(
            lambda mp, tmp: mp.setattr(cpp_extension, "CUDA_HOME", None),
            ["nvcc", "CUDA_HOME"],
            id="no-nvcc",
        ),
        pytest.param(
            lambda mp, tmp: mp.setenv("RAYKV_KERNELS_DIR", str(tmp)),
            ["sources not found", "RAYKV_KERNELS_DIR"],
            id="no-sources",
        ),
    ],
)
def test_cuda_machine_falling_back_warns_once_naming_why(
    cuda_machine, monkeypatch, tmp_path, caplog, breakage, names
):
    breakage(monkeypatch, tmp_path)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    use_the_kernel_a_few_times()
    (record,) = warnings_of(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "torch reference" in message
    for name in names:
        assert name in message
    assert "RAYKV_DISABLE_KERNEL" in message  # how to silence it on purpose


def test_machine_without_cuda_does_not_warn(fresh_process, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    use_the_kernel_a_few_times()
    assert warnings_of(caplog) == []


def test_kernel_disabled_on_purpose_does_not_warn(cuda_machine, monkeypatch, caplog):
    monkeypatch.setenv("RAYKV_DISABLE_KERNEL", "1")
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    use_the_kernel_a_few_times()
    assert warnings_of(caplog) == []


def test_kernel_that_builds_is_used_without_a_warning(cuda_machine, monkeypatch, caplog):
    built = types.ModuleType("raykv_paged_copy")
    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        return built

    monkeypatch.setattr(cpp_extension, "load", load)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for _ in range(3):
        assert ops.kernel_module() is built
    assert len(calls) == 1  # built once per process
    assert all(Path(p).is_file() for p in calls[0]["sources"])
    assert warnings_of(caplog) == []
