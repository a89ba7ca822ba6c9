"""raykv's CUDA extension (``kernels/``): built just in time on first use, loaded once per
process, or ruled out with the reason (``kernel_status``); ``raykv.ops`` falls back to its
torch reference then, which gives the same bytes. A CUDA machine that cannot build it says so
once, at WARNING, with the fix.

The sources: ``$RAYKV_KERNELS_DIR`` when set, else the wheel's copy of the repo's ``kernels/``
folder (``raykv/_kernels``, mapped in ``pyproject.toml``), else the source checkout's. The
build lands in ``$RAYKV_CACHE_DIR`` (default ``~/.cache/raykv``), one folder per torch
version; ``RAYKV_DISABLE_KERNEL=1`` uses the reference on purpose.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# Where the CUDA sources live: the wheel ships the repo's kernels/ folder as raykv/_kernels
# (pyproject.toml maps it); a source checkout or editable install reads kernels/ itself.
_PACKAGED_KERNELS = "_kernels"
_SOURCE_KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_KERNEL_SOURCES = (
    "paged_copy_binding.cpp", "paged_copy.cu", "wire_pipeline.cpp", "peer_memory.cpp"
)  # fmt: skip
_lock = threading.Lock()
_module: ModuleType | None = None
_status: str | None = None  # why the kernel is (not) in use, once decided


def load() -> ModuleType | None:
    """The extension, built (or found built) on first call; None where the reference runs."""
    global _module, _status
    if _status is not None:
        return _module
    with _lock:
        if _status is not None:
            return _module
        module, status, fix = _build()
        if fix:  # a CUDA machine that should run the kernel does not: say so, once per process
            log.warning(
                "raykv paged copy: CUDA is available but the CUDA kernel is not in use, block "
                "copies fall back to the slower torch reference (%s). Fix: %s; or set "
                "RAYKV_DISABLE_KERNEL=1 to use the reference on purpose.",
                status.removeprefix("torch reference: "),
                fix,
            )
        else:
            log.debug("raykv paged copy: %s", status)
        _module, _status = module, status
    return _module


def kernel_sources_dir() -> Path:
    """The folder the CUDA kernel is built from: $RAYKV_KERNELS_DIR when set, else the sources
    installed with the package (raykv/_kernels), else the source checkout's kernels/ folder."""
    override = os.environ.get("RAYKV_KERNELS_DIR", "")
    if override:
        return Path(override)
    packaged = Path(str(importlib.resources.files("raykv") / _PACKAGED_KERNELS))
    if all((packaged / name).is_file() for name in _KERNEL_SOURCES):
        return packaged
    return _SOURCE_KERNELS


def _build() -> tuple[ModuleType | None, str, str]:
    """(module, status, fix): fix is non-empty where CUDA is there but the kernel is not."""
    if os.environ.get("RAYKV_DISABLE_KERNEL", "") not in ("", "0"):
        return None, "torch reference: RAYKV_DISABLE_KERNEL is set", ""
    if not torch.cuda.is_available():
        return None, "torch reference: no CUDA device (or a CPU-only torch build)", ""
    kernel_dir = kernel_sources_dir()
    sources = [kernel_dir / name for name in _KERNEL_SOURCES]
    if not all(p.is_file() for p in sources):
        return (
            None,
            f"torch reference: kernel sources not found under {kernel_dir}",
            "reinstall raykv from a wheel that ships raykv/_kernels, or point "
            "RAYKV_KERNELS_DIR at the kernels/ folder of a raykv checkout",
        )
    try:
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            return (
                None,
                "torch reference: CUDA_HOME/nvcc not found, cannot build the kernel",
                "install the CUDA toolkit (nvcc) matching torch's CUDA and set CUDA_HOME",
            )
        cache = Path(os.environ.get("RAYKV_CACHE_DIR", Path.home() / ".cache" / "raykv"))
        build_dir = cache / "torch_extensions" / f"paged_copy_torch{torch.__version__}"
        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name="raykv_paged_copy",
            sources=[str(p) for p in sources],
            extra_include_paths=[str(kernel_dir)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build_dir),
            verbose=os.environ.get("RAYKV_KERNEL_VERBOSE", "") not in ("", "0"),
        )
    except Exception as exc:  # any build/load failure: the reference still gives right bytes
        return (
            None,
            f"torch reference: building the CUDA kernel failed: {exc!s:.2000}",
            "rerun with RAYKV_KERNEL_VERBOSE=1 for the compiler output",
        )
    return module, f"CUDA kernel raykv_paged_copy built in {build_dir}", ""


def kernel_available() -> bool:
    """True when the CUDA extension is built and loaded (building it on first call)."""
    return load() is not None


def kernel_module() -> ModuleType | None:
    """The loaded extension (paged_copy, mapped_pointer, enable_peer_access, memcpy_loop)."""
    return load()


def kernel_status() -> str:
    """One line saying whether the CUDA kernel or the torch reference runs, and why."""
    load()
    return _status or "undecided"
