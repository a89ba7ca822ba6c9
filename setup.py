"""Package list for setuptools (everything else is in pyproject.toml).

pyproject.toml's package discovery only finds folders inside raykv/, so this adds
raykv._kernels: the repo's top-level kernels/ folder (mapped in [tool.setuptools.package-dir]),
whose CUDA sources then ship in the wheel and sdist next to raykv.ops, which builds them.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["raykv", "raykv.*"]), "raykv._kernels"])
