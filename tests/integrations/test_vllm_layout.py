"""Copies between vLLM's paged KV and kvd's blocks (kvd/integrations/vllm/layout.py), checked
against how each vLLM backend itself splits a layer's cache into K and V (its kernels' view)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, child_env

torch = pytest.importorskip("torch", reason="torch is not installed: `pip install -e '.[engines]'`")

from kvd.errors import BadArgsError  # noqa: E402
from kvd.geometry import Geometry  # noqa: E402
from kvd.integrations.vllm.layout import HostPool, PagedLayer, backend_layout  # noqa: E402

SHAPE = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
GEOMETRY = Geometry(num_blocks=16, **SHAPE)
NB, H, B, D = 6, 2, 4, 8


def cpu_backend_split(cache):
    """vLLM's CPU_ATTN: view (nb, H, 2B, D), K = first B rows of a (block, head), V the rest."""
    key_cache, value_cache = cache.view(NB, H, 2 * B, D).chunk(2, dim=2)
    return key_cache, value_cache  # (nb, H, B, D): [block, head, token]


def flash_split(cache):
    """FLASH_ATTN: (nb, H, B, 2D) -> K, V of (nb, B, H, D): [block, token, head]."""
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    return key_cache.transpose(1, 2), value_cache.transpose(1, 2)


@pytest.mark.parametrize("layout,split", [("cpu", cpu_backend_split), ("flash", flash_split)])
def test_gather_and_scatter_move_what_the_backend_reads_as_k_and_v(layout, split):
    cache = torch.randn(NB, H, B, 2 * D)
    layer = PagedLayer(cache, layout, GEOMETRY)
    ids = torch.tensor([4, 1])
    blocks = layer.gather(ids)
    assert blocks.shape == (2, 2, B, H, D)
    keys, values = split(cache)
    for i, block in enumerate(ids.tolist()):  # kvd's (2, B, H, D) vs the backend's (H, B, D)
        assert torch.equal(blocks[i, 0], keys[block].transpose(0, 1))
        assert torch.equal(blocks[i, 1], values[block].transpose(0, 1))
    other = torch.zeros_like(cache)
    PagedLayer(other, layout, GEOMETRY).scatter(torch.tensor([0, 5]), blocks)
    new_keys, new_values = split(other)
    assert torch.equal(new_keys[0], keys[4]) and torch.equal(new_values[5], values[1])
    assert not new_keys[1:5].any() and not new_values[1:5].any()  # nothing else written


def test_a_cache_that_does_not_fit_the_pool_is_refused_naming_the_flags():
    with pytest.raises(BadArgsError, match="--kv-heads, --head-dim, --dtype and vLLM's --block"):
        PagedLayer(torch.zeros(NB, H, 2 * B, 2 * D), "cpu", GEOMETRY)
    with pytest.raises(BadArgsError, match="dtype torch.float16"):
        PagedLayer(torch.zeros(NB, H, B, 2 * D, dtype=torch.float16), "cpu", GEOMETRY)


@pytest.mark.parametrize("backend,device", [("TRITON_ATTN", "cuda"), ("FLASH_ATTN", "cpu"),
                                             ("CPU_ATTN", "cuda"), ("FLASHINFER", "cuda")])
def test_backends_other_than_cpu_attn_and_flash_attn_on_cuda_are_refused(backend, device):
    with pytest.raises(BadArgsError, match=f"runs {backend} on {device}"):
        backend_layout(backend, device)
    assert backend_layout("CPU_ATTN", "cpu") == "cpu"
    assert backend_layout("FLASH_ATTN", "cuda") == "flash"


def test_host_pool_writes_and_reads_one_layer_of_kvd_blocks_in_place(daemon_factory):
    daemon = daemon_factory(num_blocks=16, layers=2, block_size=4, kv_heads=2, head_dim=8,
                            dtype="float32")
    with daemon.connect() as client:
        host = HostPool(client, torch.device("cpu"))
        block_ids = client.alloc(3)
        blocks = torch.randn(3, 2, B, H, D)
        host.write(block_ids, 1, blocks)
        for i, block_id in enumerate(block_ids):
            view = client.view(block_id)
            assert (view[1] == blocks[i].numpy()).all() and not view[0].any()
            del view
        assert torch.equal(host.read(block_ids[::-1], 1), blocks.flip(0))
        host.synchronize()  # nothing to wait for on the CPU
        host.close()
        client.release(block_ids)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the bench itself")
def test_the_cuda_copy_bench_refuses_clearly_without_cuda():
    done = subprocess.run([sys.executable, "-m", "bench.vllm_cuda_copy"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr
