"""The vLLM connector's hashing namespace (kvd/integrations/vllm/salt.py): one per checkpoint's
config, weights and KV dtype, wherever the checkpoint lies, read without loading it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvd.errors import BadArgsError
from kvd.integrations.salting import sample_slice
from kvd.integrations.vllm.salt import _sampled_tensors, checkpoint_salt, named_salt

torch = pytest.importorskip("torch", reason="torch is not installed: `pip install -e '.[engines]'`")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
          "_name_or_path": "/somewhere", "transformers_version": "5.19.0"}


def checkpoint(path, config=CONFIG, seed=0, shards=1):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {"a.weight": torch.randn(300, 7, generator=generator),
               "b.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
               "c.steps": torch.arange(1000, dtype=torch.int64)}
    if shards == 1:
        safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for i, name in enumerate(names):
            safetensors_torch.save_file({name: tensors[name]}, str(path / f"part-{i}.safetensors"))
            weight_map[name] = f"part-{i}.safetensors"
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_a_copy_elsewhere_shares_the_salt_and_a_change_of_kv_dtype_does_not(tmp_path):
    first = checkpoint(tmp_path / "first")
    shutil.copytree(first, tmp_path / "copy")
    moved = dict(CONFIG, _name_or_path="/elsewhere", transformers_version="5.24.0")
    (tmp_path / "copy" / "config.json").write_text(json.dumps(moved))
    salt = checkpoint_salt(first, "float32")
    assert checkpoint_salt(tmp_path / "copy", "float32") == salt
    assert checkpoint_salt(first, "bfloat16") != salt
    assert named_salt("mine") not in (salt, named_salt("yours"))


def test_other_weights_or_another_config_change_the_salt(tmp_path):
    salt = checkpoint_salt(checkpoint(tmp_path / "base"), "float32")
    assert checkpoint_salt(checkpoint(tmp_path / "tuned", seed=1), "float32") != salt
    deeper = dict(CONFIG, num_hidden_layers=3)
    assert checkpoint_salt(checkpoint(tmp_path / "deeper", deeper), "float32") != salt


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    sharded = checkpoint(tmp_path / "sharded", shards=3)
    (sharded / "stray.safetensors").write_bytes(b"not listed in the index: never read")
    assert checkpoint_salt(sharded, "float32") == checkpoint_salt(sharded, "float32")


def test_the_sample_is_the_tensors_evenly_spaced_elements(tmp_path):
    path = checkpoint(tmp_path / "model") / "model.safetensors"
    loaded = safetensors_torch.load_file(str(path))
    for name, shape, dtype, sample in _sampled_tensors(path):
        flat = loaded[name].reshape(-1)
        assert list(loaded[name].shape) == shape
        expected = flat[sample_slice(flat.numel())].contiguous().view(torch.uint8).numpy()
        assert np.frombuffer(sample, np.uint8).tobytes() == expected.tobytes(), (name, dtype)


def test_a_checkpoint_kvd_cannot_fingerprint_is_refused_naming_the_way_out(tmp_path):
    with pytest.raises(BadArgsError, match="config.json.*kv_connector_extra_config"):
        checkpoint_salt(tmp_path, "float32")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(BadArgsError, match="no \\*.safetensors.*'salt'"):
        checkpoint_salt(tmp_path, "float32")
