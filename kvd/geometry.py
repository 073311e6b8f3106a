"""Geometry: the shape of one pool's blocks, a per-pool value from the start.

One block holds K and V for `block_size` tokens of every layer::

    block shape = (num_layers, parts, block_size, num_kv_heads, head_dim)  # parts 2 = K, V
    pool shape  = (num_blocks, *block shape)

`parts` is 2 (K and V) unless the model keeps one latent vector per token and layer (multi-head
latent attention: `parts=1`, `num_kv_heads=1`, `head_dim` the latent width). `window` is the
sliding-window length in tokens of a pool holding sliding-window layers (None: full attention);
it is the pool's contract with its users, the pool itself stores blocks the same way: the token
at position p attends to itself and the `window - 1` tokens before it, so once `n` tokens are
computed the first `num_outside_window(n, ...)` blocks are never read again (the daemon releases
them, kvd/core/page_table.py).

NumPy has no bfloat16: a bfloat16 pool is stored as 2-byte words (uint16) and viewed in torch
with `torch.from_numpy(view).view(torch.bfloat16)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvd.errors import BadArgsError

DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}
# The most one process can map: x86-64 and 4-level aarch64 give user space 2**47 bytes (128 TiB).
# Sizes are checked against it in Python ints, before any NumPy call could wrap them.
MAX_POOL_NBYTES = 1 << 47
FLAGS = {"num_blocks": "--num-blocks", "num_layers": "--layers", "block_size": "--block-size",
         "num_kv_heads": "--kv-heads", "head_dim": "--head-dim"}


@dataclass(frozen=True)
class Geometry:
    num_blocks: int
    num_layers: int = 8
    block_size: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    parts: int = 2
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadArgsError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise BadArgsError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.parts not in (1, 2) or isinstance(self.parts, bool):
            raise BadArgsError(f"parts must be 2 (K and V) or 1 (a latent), got {self.parts!r}")
        if self.window is not None and (not isinstance(self.window, int)
                                        or isinstance(self.window, bool) or self.window <= 0):
            raise BadArgsError(f"window must be a positive token count or None, "
                               f"got {self.window!r}")
        self._check_size()

    def _check_size(self) -> None:
        """Refuse a block or pool larger than a process can map (the largest flag is named)."""
        for what, nbytes, names in (("a block", self.block_nbytes, tuple(FLAGS)[1:]),
                                    ("the pool", self.pool_nbytes, tuple(FLAGS))):
            if nbytes > MAX_POOL_NBYTES:
                largest = max(names, key=lambda name: getattr(self, name))
                raise BadArgsError(
                    f"{what} of {nbytes} bytes exceeds the {MAX_POOL_NBYTES} bytes a process can "
                    f"map: lower {FLAGS[largest]} ({getattr(self, largest)}) or the other sizes")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.parts, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.block_shape)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The storage dtype (uint16 words for bfloat16)."""
        return DTYPES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.numpy_dtype.itemsize  # no int64 wrap

    @property
    def pool_nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    def to_dict(self) -> dict[str, Any]:
        """The fields, less `parts` and `window` at their defaults (so a K/V full-attention
        geometry reads as it did before they existed: journal stamps, hello replies)."""
        data = asdict(self)
        if data["parts"] == 2:
            del data["parts"]
        if data["window"] is None:
            del data["window"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Geometry:
        """Build from a dict (e.g. off the wire); unknown or missing keys are a BadArgsError."""
        if not isinstance(data, dict):
            raise BadArgsError(f"geometry must be a map, got {type(data).__name__}")
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise BadArgsError(f"unknown geometry fields {sorted(unknown)}; valid: {sorted(fields)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise BadArgsError(f"bad geometry {data!r}: {exc}") from None

    @classmethod
    def for_memory(cls, nbytes: int, **shape: Any) -> Geometry:
        """The geometry with as many blocks as fit in `nbytes` (at least one)."""
        probe = cls(num_blocks=1, **shape)
        num_blocks = nbytes // probe.block_nbytes
        if num_blocks < 1:
            raise BadArgsError(f"{nbytes} bytes hold no block of {probe.block_nbytes} bytes: "
                               "raise --memory or shrink the block")
        return cls(num_blocks=int(num_blocks), **shape)


def num_outside_window(num_computed: int, window: int, block_size: int) -> int:
    """How many leading blocks lie wholly before the window of the token at `num_computed`."""
    return max(num_computed - window + 1, 0) // block_size
