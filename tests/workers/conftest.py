"""Fixtures for worker tests: the environment of worker processes (daemons: tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Children import kvd and workers from this checkout, one BLAS thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def source_root() -> Path:
    return ROOT
