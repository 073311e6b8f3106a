"""The engines the transformers tests run: imported, or the test module skipped -- except in CI
(KVD_REQUIRE_ENGINES=1), where a missing engine fails the run instead of skipping it."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


def import_torch() -> ModuleType:
    """torch, with transformers importable and the Hub offline (the tests build their models)."""
    if os.environ.get("KVD_REQUIRE_ENGINES") == "1":
        import torch
        import transformers  # noqa: F401
    else:
        torch = pytest.importorskip(
            "torch", reason="torch is not installed: `pip install -e '.[engines]'` runs this test")
        pytest.importorskip(
            "transformers", reason="transformers is not installed: `pip install -e '.[engines]'`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One thread, as the tests' worker processes run: the tiny models gain nothing from more,
    # and on a shared machine a second thread waiting for a busy core makes a generation 50x
    # slower (a batch of 4 through the tiny Gemma 2: 0.3 s on one thread, 17 s on two).
    torch.set_num_threads(1)
    return torch
