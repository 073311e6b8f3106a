"""The vLLM connector's copies on CUDA: vLLM's paged KV on the GPU <-> kvd's pool, pinned.

    python -m bench.vllm_cuda_copy [--blocks 256] [--layers 32] [--kv-heads 8] [--head-dim 128]
                                   [--block-size 16] [--dtype bfloat16] [--repeats 5]

One command, offline, on a GPU host with torch built for CUDA (vLLM itself is not needed: these
are the connector's own copies, kvd/integrations/vllm/layout.py). It starts a daemon with the
given geometry, registers its pool as pinned host memory (cudaHostRegister, as the connector's
worker does), and times, per direction, moving `--blocks` blocks of every layer:

    save   per layer: PagedLayer.gather (a GPU gather of the blocks from a FLASH_ATTN-layout
           cache) then HostPool.write (one non-blocking device-to-host copy per block)
    load   per layer: HostPool.read (one non-blocking host-to-device copy per block) then
           PagedLayer.scatter into the cache
    floor  one copy_ of the same number of bytes between the GPU and a torch pinned tensor

and prints blocks/s and GB/s of each (best of --repeats, the stream synchronised). Without CUDA
it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from bench.common import Daemon, GeometryFlags, markdown_table

NO_CUDA = 2


def best_seconds(run: Callable[[], object], synchronize: Callable[[], None],
                 repeats: int) -> float:
    run()
    synchronize()  # warm-up: first-touch and allocator costs are not the copy's
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def no_cuda(reason: str) -> int:
    print("bench.vllm_cuda_copy needs a CUDA GPU and torch built for CUDA; "
          f"{reason} here: run it on a GPU host", file=sys.stderr)
    return NO_CUDA


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        return no_cuda("torch is not installed")
    if not torch.cuda.is_available():
        return no_cuda("torch sees no CUDA device")
    from kvd.geometry import Geometry
    from kvd.integrations.vllm.layout import TORCH_DTYPES, HostPool, PagedLayer

    shape: GeometryFlags = {"layers": args.layers, "kv_heads": args.kv_heads,
                            "head_dim": args.head_dim, "block_size": args.block_size,
                            "dtype": args.dtype}
    geometry = Geometry(num_blocks=args.blocks, num_layers=args.layers,
                        block_size=args.block_size, num_kv_heads=args.kv_heads,
                        head_dim=args.head_dim, dtype=args.dtype)
    device = torch.device("cuda")
    dtype = TORCH_DTYPES[args.dtype]
    nbytes = args.blocks * geometry.block_nbytes
    with Daemon(num_blocks=args.blocks, **shape) as daemon, daemon.connect() as client:
        kvd_ids = client.alloc(args.blocks)
        host = HostPool(client, device)
        caches = [torch.randn(args.blocks * 2, args.kv_heads, args.block_size,
                              2 * args.head_dim, device=device).to(dtype)
                  for _ in range(args.layers)]
        layers = [PagedLayer(cache, "flash", geometry) for cache in caches]
        vllm_ids = torch.randperm(args.blocks * 2, device=device)[:args.blocks]
        kept: list[object] = []

        def save() -> None:
            kept.clear()
            for index, layer in enumerate(layers):
                blocks = layer.gather(vllm_ids)
                host.write(kvd_ids, index, blocks)
                kept.append(blocks)  # alive until the stream is synchronised

        def load() -> None:
            for index, layer in enumerate(layers):
                layer.scatter(vllm_ids, host.read(kvd_ids, index))

        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        sync = host.synchronize
        rows = []
        for name, run in (("save: GPU -> kvd", save),
                          ("floor: GPU -> pinned", lambda: pinned.copy_(on_gpu,
                                                                        non_blocking=True)),
                          ("load: kvd -> GPU", load),
                          ("floor: pinned -> GPU", lambda: on_gpu.copy_(pinned,
                                                                        non_blocking=True))):
            seconds = best_seconds(run, sync, args.repeats)
            rows.append([name, f"{args.blocks / seconds:,.0f}", f"{nbytes / seconds / 1e9:.2f}"])
        kept.clear()
        del pinned, on_gpu
        host.close()
        client.release(kvd_ids)
    print(f"{args.blocks} blocks of {geometry.block_nbytes} bytes ({args.layers} layers); "
          f"{torch.cuda.get_device_name()}\n")
    print(markdown_table(["copy", "blocks/s", "GB/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
