"""vLLM on kvd: `KvdConnector`, a KV connector that vLLM loads by module path.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvd_name": "default"}})

Engines pointed at one daemon share prefixes: a prompt's full blocks computed by one engine are
loaded, not recomputed, by the others. docs/vllm.md has the details; the modules:

    connector.py  KvdConnector (imports vLLM)      plan.py    the scheduler side's bookkeeping
    layout.py     vLLM's paged KV <-> kvd blocks   link.py    the (optional) daemon connection
    salt.py       the hashing namespace of a checkpoint

`import kvd.integrations.vllm` imports no vLLM: `KvdConnector` loads its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("KvdConnector", "KvdMetadata"):
        return getattr(importlib.import_module("kvd.integrations.vllm.connector"), name)
    raise AttributeError(f"module 'kvd.integrations.vllm' has no attribute {name!r}")
