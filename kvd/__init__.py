"""kvd: a shared KV-cache daemon for LLM inference (and the same core embedded in-process).

Package layout and its layering rules (tests/test_layering.py imports each module in a fresh
interpreter and checks what got loaded):

    kvd/errors.py, kvd/native.py  import nothing of kvd; every layer may use them
    kvd/core/       the pool, prefix tree, page table and policies: pure (see its __init__)
    kvd/protocol/   framing, messages, argument checks: sans I/O, nothing of the core
    kvd/server/     the daemon: startup and recovery, the loop, the service, journal, metrics
    kvd/client.py   the client: the protocol and the segment, never the core or the server
    kvd/segment.py, kvd/hashing.py, kvd/geometry.py, kvd/runtime.py  shared leaves
    kvd/embedded.py, kvd/integrations/, kvd/cli.py, kvd/demo.py, kvd/replay.py  built on the above

The names below are loaded on first use (PEP 562), so `import kvd.protocol` costs neither numpy
nor the pool, and `import kvd` alone costs almost nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Client": "kvd.client", "Sequence": "kvd.client", "connect": "kvd.client",
    "Block": "kvd.embedded", "PagedKVCache": "kvd.embedded",
    "HASH_VERSION": "kvd.hashing", "hash_blocks": "kvd.hashing",
    **{name: "kvd.errors" for name in (
        "ERROR_CLASSES", "BadArgsError", "DeniedError", "DisconnectedError", "InternalError",
        "InUseError", "JournalError", "KvdError", "NoSpaceError", "NotFoundError",
        "ProtocolError", "TooLargeError", "UnknownOpError", "VersionError")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvd.client import Client, Sequence, connect
    from kvd.embedded import Block, PagedKVCache
    from kvd.errors import (
        ERROR_CLASSES, BadArgsError, DeniedError, DisconnectedError, InternalError, InUseError,
        JournalError, KvdError, NoSpaceError, NotFoundError, ProtocolError, TooLargeError,
        UnknownOpError, VersionError,
    )
    from kvd.hashing import HASH_VERSION, hash_blocks


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
