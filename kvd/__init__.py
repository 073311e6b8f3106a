"""kvd: a shared KV-cache daemon for LLM inference (and the same core embedded in-process)."""

from kvd.client import Client, Sequence, connect
from kvd.embedded import Block, PagedKVCache
from kvd.errors import (
    ERROR_CLASSES, BadArgsError, DeniedError, DisconnectedError, InternalError, InUseError,
    JournalError, KvdError, NoSpaceError, NotFoundError, ProtocolError, TooLargeError,
    UnknownOpError, VersionError,
)
from kvd.hashing import HASH_VERSION, hash_blocks

__version__ = "0.1.0"

__all__ = [
    "ERROR_CLASSES", "HASH_VERSION", "BadArgsError", "Block", "Client", "DeniedError", "DisconnectedError",
    "InUseError", "InternalError", "JournalError", "KvdError", "NoSpaceError", "NotFoundError",
    "PagedKVCache", "ProtocolError", "Sequence", "TooLargeError", "UnknownOpError", "VersionError",
    "connect", "hash_blocks",
]
