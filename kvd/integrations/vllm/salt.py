"""The vLLM connector's hashing namespace: a model's checkpoint, read without loading it.

The scheduler side hashes prompts before (and apart from) the worker that holds the weights, so
the salt comes from the checkpoint on disk: `config.json` and the `*.safetensors` files that
vLLM loads. Per tensor, the fingerprint reads its shape, dtype and 64 evenly spaced elements
straight from the file through a read-only memory map (the safetensors header gives each
tensor's offsets), so it costs a few pages per tensor whatever the model's size. The rules are
the transformers adapter's (`kvd.integrations.salting`); the personalisation strings differ, so
vLLM and transformers never share blocks (their kernels round K/V differently).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from kvd.errors import BadArgsError
from kvd.integrations.salting import add_tensor, config_text, sample_slice

# config.json keys a checkpoint file carries beyond a loaded config's, none of which changes K/V.
_FILE_ONLY_KEYS = ("transformers_version", "torch_dtype")
_ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADER_MAX_NBYTES = 100 << 20  # the safetensors format's own cap


def checkpoint_salt(model_dir: str | os.PathLike[str], kv_dtype: str) -> bytes:
    """The hashing namespace of the checkpoint in `model_dir` whose K/V are kept as `kv_dtype`."""
    directory = Path(model_dir)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BadArgsError(f"cannot read {directory / 'config.json'} ({exc}) for the kvd salt: "
                           "point vLLM at a local checkpoint directory, or name the hashing "
                           "namespace yourself with kv_connector_extra_config {'salt': ...}"
                           ) from None
    digest = hashlib.blake2b(digest_size=16, person=b"kvd-vllm-salt")
    digest.update(f"{config_text(config, _FILE_ONLY_KEYS)}|{kv_dtype}|".encode())
    digest.update(weights_fingerprint(directory))
    return digest.digest()


def named_salt(name: str) -> bytes:
    """The hashing namespace a user named (kv_connector_extra_config's `salt`)."""
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"kvd-vllm-named").digest()


def weights_fingerprint(directory: Path) -> bytes:
    """Shape, dtype and 64 sampled elements of every tensor of the checkpoint's safetensors."""
    files = _weight_files(directory)
    digest = hashlib.blake2b(digest_size=16, person=b"kvd-vllm-weights")
    for path in files:
        for name, shape, dtype, sample in _sampled_tensors(path):
            digest.update(name.encode())
            add_tensor(digest, shape, dtype, sample)
    return digest.digest()


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / name for name in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BadArgsError(f"no *.safetensors weights in {directory} to fingerprint for the kvd "
                           "salt: convert the checkpoint to safetensors, or name the hashing "
                           "namespace yourself with kv_connector_extra_config {'salt': ...}")
    return files


def _sampled_tensors(path: Path) -> list[tuple[str, list[int], str, bytes]]:
    """(name, shape, dtype, sampled elements' bytes) of each tensor in one safetensors file."""
    with open(path, "rb") as file:
        (header_nbytes,) = struct.unpack("<Q", file.read(8))
        if header_nbytes > _HEADER_MAX_NBYTES:
            raise BadArgsError(f"{path} is not a safetensors file (header of {header_nbytes} "
                               "bytes)")
        header = json.loads(file.read(header_nbytes))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_nbytes)
    tensors = []
    for name in sorted(key for key in header if key != "__metadata__"):
        entry = header[name]
        numel, itemsize = math.prod(entry["shape"]), _ITEMSIZES.get(entry["dtype"], 1)
        begin, end = entry["data_offsets"]
        if end - begin != numel * itemsize:  # a dtype this table lacks: sample its raw bytes
            numel, itemsize = end - begin, 1
        elements = data[begin:end].reshape(numel, itemsize)
        tensors.append((name, entry["shape"], entry["dtype"],
                        elements[sample_slice(numel)].tobytes()))
    del data
    return tensors
