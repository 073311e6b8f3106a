"""kvd's compiled modules, behind one switch: the only place that loads them or reads its variables.

Theory of operation
-------------------
Every compiled module is optional. Each is a fast path of Python that stays beside it as the
readable specification and the twin tests' oracle (`functools.lru_cache` and `_functools` are the
model): a module that was not built, or that `KVD_PURE_PYTHON=1` turns off, leaves kvd running the
same logic in Python, slower. One of them is a dependency rather than kvd's own C: msgspec, the
protocol's codec, switched the same way so that the pure-Python run exercises the specification. Nothing else in kvd imports a compiled module or reads these
variables; callers ask `load(name)` once at import and get the module or None.

    KVD_PURE_PYTHON=1   load() returns None for every module (an install without a compiler runs
                        exactly this; CI runs the whole suite so too).
    KVD_REQUIRE_C=1     load() raises ImportError for a module that was not built: an install that
                        silently fell back to Python fails loudly (CI sets it).

`status()` says, per module, whether this process runs it ("native") or the Python ("python"):
`kvd start` prints `summary()` in its ready line and `kvd stats --json` reports `status()` under
"native", so a build that fell back shows.

This module imports nothing of kvd, so every layer may use it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

PURE_PYTHON_ENV = "KVD_PURE_PYTHON"
REQUIRE_C_ENV = "KVD_REQUIRE_C"

# name -> (compiled module, the Python it speeds up)
MODULES: dict[str, tuple[str, str]] = {
    "msgspec": ("msgspec", "kvd/protocol/messages.py: the frame codec (a dependency, not built here)"),
    "checks": ("kvd.protocol._checks", "kvd/protocol/checks.py: the hot ops' argument checks"),
    "journal": ("kvd.server._journal", "kvd/server/journal.py: a commit's records, packed and applied"),
    "copy": ("kvd._copy", "kvd/blockcopy.py: bulk block writes with streaming stores"),
    "pool": ("kvd.core._pool", "kvd/core/pool.py: the per-block loops of a batch"),
    "s3fifo": ("kvd.core.policies._s3fifo", "kvd/core/policies/s3fifo.py: batch events"),
    "remote": ("kvd.server.remote._codec", "kvd/server/remote/codec.py: write packing, CRC-32"),
}


def is_pure_python() -> bool:
    """Whether KVD_PURE_PYTHON=1 turns every compiled module off in this process."""
    return os.environ.get(PURE_PYTHON_ENV) == "1"


def built(name: str) -> ModuleType | None:
    """The compiled module `name` if it was built, whatever KVD_PURE_PYTHON says (twin tests call
    it directly); raises ImportError under KVD_REQUIRE_C=1 if it was not built."""
    module_name = MODULES[name][0]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if os.environ.get(REQUIRE_C_ENV) == "1":
            raise ImportError(f"{REQUIRE_C_ENV}=1 but {module_name} is missing ({exc}): install "
                              "kvd with a C compiler and its dependencies, or unset the "
                              "variable") from exc
        return None


def load(name: str) -> ModuleType | None:
    """The compiled module `name` this process runs, or None where the Python runs instead."""
    module = built(name)
    return None if is_pure_python() else module


def status() -> dict[str, str]:
    """Per module of MODULES: "native" if this process runs it, "python" if it runs the Python."""
    return {name: "python" if load(name) is None else "native" for name in MODULES}


def summary() -> str:
    """The modules this process runs, for the ready line: e.g. "msgspec+checks+journal", or
    "none" where everything runs in Python (a build without a compiler, KVD_PURE_PYTHON=1)."""
    running = [name for name, state in status().items() if state == "native"]
    return "+".join(running) if running else "none"
