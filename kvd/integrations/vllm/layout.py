"""vLLM's paged KV and kvd's blocks: the layouts and the copies between them.

kvd block (host, shared memory):  (num_layers, 2, block_size, H, D)   2 = K, V
vLLM, per attention layer, a tensor of logical shape (num_blocks, H, block_size, 2 * D) whose
memory each backend reads its own way:

    "cpu"    vLLM's CPU backend (CPU_ATTN): per (block, head) the K rows of the block's
             tokens, then their V rows — it views the layer as (num_blocks, H, 2 * block_size,
             D) and splits it in two; so K = view(nb, H, 2, B, D)[:, :, 0]
    "flash"  FLASH_ATTN on CUDA: K = [..., :D] and V = [..., D:] of the logical tensor,
             whatever its strides

Every other backend is refused at start-up (`backend_layout`). A copy moves n blocks of one
layer at a time: `PagedLayer.gather` copies them out of vLLM's cache on vLLM's device, as
(n, 2, B, H, D), `HostPool.write` puts them in kvd's blocks; `HostPool.read` and
`PagedLayer.scatter` go the other way. On the CPU each direction copies each byte twice, in
one index op each, no per-block loop: whole blocks are gathered (contiguous runs), and the
permutation between the layouts is done by the op that writes the destination. On CUDA the
pool is registered as pinned memory (cudaHostRegister) once, each block's (2, B, H, D) slab of
a layer is one contiguous run, and its copy is issued non-blocking on the current stream; the
caller synchronises that stream before it seals blocks it wrote or releases blocks it read.
"""

from __future__ import annotations

from typing import Any

import torch

from kvd.errors import BadArgsError
from kvd.geometry import Geometry

TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "flash"}


def backend_layout(backend_name: str, device_type: str) -> str:
    """The layout of a vLLM attention backend's KV cache; BadArgsError for unsupported ones."""
    layout = LAYOUTS.get(backend_name)
    if layout is None or (layout == "flash") != (device_type == "cuda"):
        raise BadArgsError(
            f"kvd's vLLM connector supports the CPU backend (CPU_ATTN) and FLASH_ATTN on CUDA; "
            f"this engine runs {backend_name} on {device_type}: choose one of those backends "
            "(on CUDA: --attention-backend FLASH_ATTN)")
    return layout


class PagedLayer:
    """One vLLM attention layer's cache as blocks: a 5-D view in the backend's own order
    (`native`) and the permutation that turns it into kvd's (n, 2, B, H, D)."""

    def __init__(self, cache: torch.Tensor, layout: str, geometry: Geometry) -> None:
        heads, size, dim = geometry.num_kv_heads, geometry.block_size, geometry.head_dim
        expected = (heads, size, 2 * dim)
        if tuple(cache.shape[1:]) != expected or cache.dtype != TORCH_DTYPES[geometry.dtype]:
            raise BadArgsError(
                f"vLLM's KV cache layer has shape {tuple(cache.shape)} and dtype {cache.dtype}; "
                f"the kvd pool's geometry needs (num_blocks, {heads}, {size}, {2 * dim}) of "
                f"{geometry.dtype}: start the daemon with this model's --kv-heads, --head-dim, "
                "--dtype and vLLM's --block-size")
        if layout == "cpu":
            if not cache.is_contiguous():
                raise BadArgsError("vLLM's CPU KV cache layer is not contiguous: this vLLM "
                                   "lays out its CPU cache in a way kvd does not know")
            # (nb, H, 2, B, D): one contiguous run per block, so a gather copies whole blocks
            self.native = cache.view(cache.shape[0], heads, 2, size, dim)
            self.to_kvd = (0, 2, 3, 1, 4)
        else:
            self.native = cache.unflatten(-1, (2, dim))  # (nb, H, B, 2, D), any strides
            self.to_kvd = (0, 3, 2, 1, 4)
        self.from_kvd = tuple(self.to_kvd.index(axis) for axis in range(5))
        self.device = cache.device

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks `block_ids` of this layer as (n, 2, B, H, D): one gather copy; a permuted view
        of it on the CPU (the pool's index_put reads it in place), contiguous on CUDA (each
        block's device-to-host copy is then one run)."""
        blocks = self.native[block_ids].permute(self.to_kvd)
        return blocks if self.device.type == "cpu" else blocks.contiguous()

    def scatter(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write (n, 2, B, H, D) `blocks` into blocks `block_ids` of this layer."""
        self.native[block_ids] = blocks.permute(self.from_kvd)


class HostPool:
    """kvd's pool as a torch tensor over shared memory, pinned for CUDA when the engine is there."""

    def __init__(self, client: Any, device: torch.device) -> None:
        pool = torch.from_numpy(client.pool)
        self.tensor = pool.view(torch.bfloat16) if client.geometry.dtype == "bfloat16" else pool
        self.segment_uuid = client.info["segment_uuid"]
        self.device = device
        self._registered = False
        if device.type == "cuda":
            _check_cuda(torch.cuda.cudart().cudaHostRegister(
                self.tensor.data_ptr(), self.tensor.numel() * self.tensor.element_size(),
                1))  # cudaHostRegisterPortable
            self._registered = True

    def read(self, block_ids: list[int], layer: int) -> torch.Tensor:
        """Layer `layer` of kvd blocks `block_ids` as (n, 2, B, H, D) on the engine's device."""
        if self.device.type == "cpu":
            return self.tensor[torch.tensor(block_ids), layer]
        out = torch.empty((len(block_ids), *self.tensor.shape[2:]), dtype=self.tensor.dtype,
                          device=self.device)
        for i, block_id in enumerate(block_ids):
            out[i].copy_(self.tensor[block_id, layer], non_blocking=True)
        return out

    def write(self, block_ids: list[int], layer: int, blocks: torch.Tensor) -> None:
        """Put (n, 2, B, H, D) `blocks` (on the engine's device) in layer `layer` of kvd's blocks.
        On CUDA, `blocks` must live until the stream is synchronised."""
        if self.device.type == "cpu":
            self.tensor[torch.tensor(block_ids), layer] = blocks
            return
        for i, block_id in enumerate(block_ids):
            self.tensor[block_id, layer].copy_(blocks[i], non_blocking=True)

    def synchronize(self) -> None:
        """Wait for the copies issued on the current stream (CUDA; nothing on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Unregister and drop the tensor, so the client can unmap the segment."""
        if self._registered:
            self.synchronize()
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            self._registered = False
        del self.tensor


def _check_cuda(status: Any) -> None:
    code = int(status)
    if code != 0:
        raise RuntimeError(f"CUDA error {code} while (un)registering kvd's pool as pinned memory")
