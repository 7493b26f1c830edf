"""Where each of kvflow's packages lives: everything it installs is importable under one name,
``kvflow.``, while the folders stay at the top of the tree (services/ is ``kvflow.services``,
shared/ ``kvflow.shared``, kernels/ ``kvflow.kernels``, benchmarks/ ``kvflow.benchmarks``).
Installing kvflow adds no other top-level name (tests/unit/suite/test_source_layout.py checks it).
The rest of the packaging is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = {
    "kvflow": "kvflow",
    "kvflow.services": "services",
    "kvflow.shared": "shared",
    "kvflow.kernels": "kernels",
    "kvflow.benchmarks": "benchmarks",
}

packages = []
for name, folder in FOLDERS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]
packages = sorted(set(packages))

setup(packages=packages, package_dir=FOLDERS)
