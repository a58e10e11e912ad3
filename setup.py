"""Packages: fedq's own, plus the repository's top-level ``migrations/`` folder shipped
inside the wheel as ``fedq._migrations`` (pyproject.toml cannot map a folder that sits
outside the package while also finding packages). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["fedq", "fedq.*"])
    + ["fedq._migrations", "fedq._migrations.versions"],
    package_dir={"fedq._migrations": "migrations"},
)
