"""kvd.geometry: validation, shapes, sizes and the dict round trip."""

import numpy as np
import pytest

from kvd.errors import BadArgsError
from kvd.geometry import DTYPES, Geometry


def test_defaults_and_shapes():
    geometry = Geometry(num_blocks=10)
    assert geometry.block_shape == (8, 2, 16, 8, 128)
    assert geometry.pool_shape == (10, 8, 2, 16, 8, 128)
    assert geometry.numpy_dtype == np.float16


@pytest.mark.parametrize("dtype, itemsize", [("float16", 2), ("float32", 4), ("bfloat16", 2)])
def test_nbytes_follow_dtype(dtype, itemsize):
    geometry = Geometry(num_blocks=3, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                        dtype=dtype)
    assert geometry.block_nbytes == 2 * 2 * 4 * 2 * 8 * itemsize
    assert geometry.pool_nbytes == 3 * geometry.block_nbytes
    assert np.empty(geometry.block_shape, geometry.numpy_dtype).nbytes == geometry.block_nbytes


def test_bfloat16_is_stored_as_two_byte_words():
    assert DTYPES["bfloat16"] == np.dtype("<u2")


@pytest.mark.parametrize("field", ["num_blocks", "num_layers", "block_size", "num_kv_heads",
                                   "head_dim"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None])
def test_non_positive_or_non_int_fields_are_rejected_naming_the_field(field, value):
    kwargs = {"num_blocks": 4, field: value}
    with pytest.raises(BadArgsError, match=field):
        Geometry(**kwargs)


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(BadArgsError, match="float16, float32, bfloat16"):
        Geometry(num_blocks=1, dtype="int8")


def test_dict_round_trip():
    geometry = Geometry(num_blocks=7, num_layers=3, block_size=32, num_kv_heads=4, head_dim=64,
                        dtype="bfloat16")
    assert Geometry.from_dict(geometry.to_dict()) == geometry


@pytest.mark.parametrize("data, match", [
    ([1, 2], "must be a map"),
    ({"num_blocks": 1, "colour": "red"}, "unknown geometry fields"),
    ({"num_layers": 2}, "bad geometry"),
    ({"num_blocks": 0}, "num_blocks"),
])
def test_from_dict_rejects_bad_input(data, match):
    with pytest.raises(BadArgsError, match=match):
        Geometry.from_dict(data)


def test_for_memory_fits_whole_blocks():
    probe = Geometry(num_blocks=1, num_layers=2, head_dim=64)
    geometry = Geometry.for_memory(probe.block_nbytes * 5 + 1, num_layers=2, head_dim=64)
    assert geometry.num_blocks == 5 and geometry.pool_nbytes <= probe.block_nbytes * 5 + 1


def test_for_memory_too_small_says_what_to_do():
    with pytest.raises(BadArgsError, match="raise --memory"):
        Geometry.for_memory(10)


def test_geometry_is_immutable():
    geometry = Geometry(num_blocks=1)
    with pytest.raises(AttributeError):
        geometry.num_blocks = 2


@pytest.mark.parametrize("field, flag", [("num_layers", "--layers"), ("head_dim", "--head-dim"),
                                         ("num_blocks", "--num-blocks")])
@pytest.mark.parametrize("value", [2**62, 2**64 + 1, 2**44])
def test_sizes_past_what_a_process_can_map_are_refused_naming_the_flag(field, flag, value):
    """Regression: --layers 2**62 was a ZeroDivisionError and --head-dim 2**62 an OverflowError
    (np.prod wrapped the block's byte count); now every size is checked in Python ints."""
    kwargs = {"num_blocks": 16, "block_size": 4, "num_layers": 1, "num_kv_heads": 1,
              "head_dim": 8, "dtype": "float32", field: value}
    match = f"exceeds the {2**47} bytes.*lower {flag} \\({value}\\)"
    with pytest.raises(BadArgsError, match=match):
        Geometry(**kwargs)


def test_the_largest_mappable_pool_is_accepted():
    geometry = Geometry(num_blocks=2**47 // 256, num_layers=1, block_size=4, num_kv_heads=1,
                        head_dim=8, dtype="float32")
    assert geometry.pool_nbytes == 2**47
