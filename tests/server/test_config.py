"""kvd.server.config: pools from --pool flags and TOML files, every mistake a typed error."""

from __future__ import annotations

import pytest

from kvd.errors import BadArgsError, NotFoundError
from kvd.server.config import (
    ModelSpec, check_models, check_pools, parse_model_flag, parse_pool_flag, read_config,
)

TARGET = "target:layers=32,kv-heads=8,head-dim=128,dtype=bfloat16,block-size=16"


def test_a_pool_flag_sets_every_key():
    spec = parse_pool_flag("latent:layers=27,kv-heads=1,head-dim=576,dtype=bfloat16,"
                           "block-size=64,parts=1,window=4096")
    shape = spec.shape
    assert (spec.name, shape.num_layers, shape.parts, shape.block_size, shape.head_dim,
            shape.window) == ("latent", 27, 1, 64, 576, 4096)
    assert spec.block_nbytes == 27 * 64 * 576 * 2


@pytest.mark.parametrize("text, match", [
    ("target", "NAME:layers="),
    ("target:layers=32,heads=8", "unknown keys \\['heads'\\]; valid: layers, kv-heads"),
    ("target:layers=x", "layers='x' is not an integer"),
    ("target:layers=4,layers=8", "layers given twice"),
    ("tar get:layers=4", "pool name"),
    ("target:parts=3", "parts must be 2"),
    ("target:dtype=int8", "dtype must be one of"),
    ("target:window=0", "window must be a positive"),
])
def test_bad_pool_flags_name_the_fix(text, match):
    with pytest.raises(BadArgsError, match=match):
        parse_pool_flag(text)


def test_a_toml_file_gives_memory_policy_and_pools(tmp_path):
    path = tmp_path / "kvd.toml"
    path.write_text('memory = "8G"\npolicy = "lru"\n[pools.target]\nlayers = 32\n'
                    'dtype = "bfloat16"\n[pools.draft]\nlayers = 4\nhead-dim = 64\n')
    config = read_config(path)
    assert config["memory"] == "8G" and config["policy"] == "lru"
    assert [spec.name for spec in config["pools"]] == ["target", "draft"]
    assert config["pools"][1].shape.head_dim == 64


@pytest.mark.parametrize("text, error, match", [
    ("memroy = 1\n", BadArgsError, "unknown keys \\['memroy'\\]"),
    ("[pools.a]\nlayer = 2\n", BadArgsError, "pool 'a': unknown keys \\['layer'\\]"),
    ("pools = 3\n", BadArgsError, "\\[pools.NAME\\]"),
    ("[pools.a\n", BadArgsError, "not valid TOML"),
])
def test_bad_toml_names_the_fix(tmp_path, text, error, match):
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    with pytest.raises(error, match=match):
        read_config(path)


def test_a_missing_config_file_is_not_found(tmp_path):
    with pytest.raises(NotFoundError, match="does not exist"):
        read_config(tmp_path / "nope.toml")


def test_duplicate_names_and_budgets_too_small_are_refused():
    target = parse_pool_flag(TARGET)
    with pytest.raises(BadArgsError, match="configured twice"):
        check_pools([target, target], 1 << 30)
    with pytest.raises(BadArgsError, match="raise --memory or shrink that pool's blocks"):
        check_pools([target, parse_pool_flag("draft:layers=4")], 3 << 20)
    with pytest.raises(BadArgsError, match="no pool configured"):
        check_pools([], 1 << 30)
    assert check_pools([target], 1 << 30) == [target]


FULL = "full:layers=2,kv-heads=2,head-dim=8,block-size=16"
WINDOW = "window:layers=2,kv-heads=2,head-dim=8,block-size=16,window=512"


def test_models_from_flags_and_toml(tmp_path):
    pools = [parse_pool_flag(FULL), parse_pool_flag(WINDOW)]
    model = parse_model_flag("gemma:full,window")
    assert check_models([model], pools) == [ModelSpec("gemma", ("full", "window"))]
    path = tmp_path / "kvd.toml"
    path.write_text('[pools.full]\nlayers = 2\n[pools.window]\nwindow = 64\n'
                    '[models.gemma]\npools = ["full", "window"]\n')
    assert read_config(path)["models"] == [model]


@pytest.mark.parametrize("models, match", [
    (["gemma"], "NAME:POOL"),
    (["gemma:full,nope"], "unknown: \\['nope'\\]"),
    (["gemma:full,full"], "must be distinct"),
    (["full:full,window"], "shares a pool's name"),
    (["gemma:full", "gemma:window"], "configured twice"),
    (["gemma:full,other"], "block sizes \\[4, 16\\]; give them one block-size"),
    (["ge mma:full"], "model name"),
])
def test_bad_models_name_the_fix(models, match):
    pools = [parse_pool_flag(FULL), parse_pool_flag(WINDOW),
             parse_pool_flag("other:layers=1,block-size=4")]
    with pytest.raises(BadArgsError, match=match):
        check_models([parse_model_flag(text) for text in models], pools)


def test_a_bad_model_table_names_the_fix(tmp_path):
    path = tmp_path / "kvd.toml"
    path.write_text('[pools.full]\nlayers = 2\n[models.gemma]\npool = ["full"]\n')
    with pytest.raises(BadArgsError, match="pools = "):
        read_config(path)
