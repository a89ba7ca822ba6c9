"""The built wheel (what `pip install .`, the Dockerfile and the cluster config install) carries
the CUDA kernel sources, and an installed (non-editable) raykv builds its kernel from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "kernels"
KERNEL_SUFFIXES = (".cu", ".cpp", ".h")
pytest.importorskip("setuptools", minversion="68")


def kernel_sources() -> dict[str, bytes]:
    found = {p.name: p.read_bytes() for p in KERNELS.iterdir() if p.suffix in KERNEL_SUFFIXES}
    assert {Path(n).suffix for n in found} == set(KERNEL_SUFFIXES), found.keys()
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and *.egg-info)."""
    src = tmp_path_factory.mktemp("src")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    for name in ("raykv", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("raykv-*.whl")
    return built


def test_wheel_ships_every_kernel_source_inside_the_package(wheel):
    expected = kernel_sources()
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        shipped = {n: zf.read(n) for n in names if n.endswith(KERNEL_SUFFIXES)}
    # each source once, inside the raykv package (never a top-level `kernels` in site-packages)
    assert sorted(Path(n).name for n in shipped) == sorted(expected)
    assert all(n.startswith("raykv/") for n in shipped), sorted(shipped)
    assert not any(n.startswith("kernels/") for n in names)
    for name, data in shipped.items():
        assert data == expected[Path(name).name], f"{name} differs from kernels/"


PROBE = """
import json, sys
import torch
from torch.utils import cpp_extension
import raykv, raykv.ops as ops

seen = {}
def load(**kwargs):
    seen.update(kwargs)
    raise RuntimeError("probe: stop before compiling")

torch.cuda.is_available = lambda: True      # pretend a CUDA machine: ops resolves its sources
cpp_extension.CUDA_HOME = "/usr/local/cuda"
cpp_extension.load = load
ops.kernel_available()
print(json.dumps({"package": raykv.__file__, "sources": seen.get("sources", []),
                  "includes": seen.get("extra_include_paths", []), "status": ops.kernel_status()}))
"""


def test_installed_wheel_builds_the_kernel_from_its_own_sources(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The installed copy first on the path (ahead of this checkout's editable install); run from
    # an empty folder so neither the checkout's raykv/ nor its kernels/ can be picked up.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYKV_")}
    env["PYTHONPATH"] = str(target)
    env["RAYKV_CACHE_DIR"] = str(tmp_path / "cache")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    package = Path(probe["package"]).resolve().parent
    assert package.is_relative_to(target.resolve()), probe  # the installed copy, not the checkout
    assert probe["sources"], probe["status"]  # it got as far as building: sources were found
    expected = kernel_sources()
    for source in map(Path, probe["sources"] + probe["includes"]):
        assert source.resolve().is_relative_to(package), (source, package)
    for source in map(Path, probe["sources"]):
        assert source.read_bytes() == expected[source.name]
    (include,) = map(Path, probe["includes"])
    assert {p.name for p in include.iterdir() if p.suffix in KERNEL_SUFFIXES} == set(expected)
