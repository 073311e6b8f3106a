"""What the engine integrations put in a model's hashing namespace (its salt), shared by them.

A salt must change whenever the K/V a model computes for the same tokens can change (another
config, dtype or set of weights) and stay equal otherwise, whatever path the model was loaded
from. Each integration feeds its own digest (its own personalisation string, so two engines'
blocks never mix) with the same two ingredients:

* the config as JSON with sorted keys, less `CONFIG_KEYS_NOT_SALTED` (where it was loaded from,
  which head classes saved it, its saved dtype, output switches: none changes the K/V, so one
  model built or loaded in several ways shares blocks; each salt adds the dtype the model runs
  in itself);
* per weight tensor, its shape, dtype and `SAMPLED_ELEMENTS` evenly spaced elements
  (`sample_slice` of the flattened tensor): cheap for any model size, and a fine-tune changes
  whole matrices, so it changes the sample.
Standard library only: the transformers adapter samples torch parameters, the vLLM connector
samples the checkpoint's safetensors files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

CONFIG_KEYS_NOT_SALTED = ("_name_or_path", "architectures", "dtype", "output_attentions",
                          "output_hidden_states", "return_dict", "use_cache")
SAMPLED_ELEMENTS = 64  # per tensor, evenly spaced, in the weights' fingerprint


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def config_text(config: dict[str, Any], also_leave_out: Iterable[str] = ()) -> str:
    """`config` as it is salted: sorted JSON without the keys that never change the K/V."""
    left_out = {*CONFIG_KEYS_NOT_SALTED, *also_leave_out}
    return json.dumps({k: v for k, v in config.items() if k not in left_out}, sort_keys=True)


def sample_slice(numel: int) -> slice:
    """The elements of a flattened tensor of `numel` elements that its fingerprint reads."""
    step = max(1, numel // SAMPLED_ELEMENTS)
    return slice(0, step * SAMPLED_ELEMENTS, step)


def add_tensor(digest: Digest, shape: Iterable[int], dtype: str, sample: bytes) -> None:
    """Feed one tensor's shape, dtype and sampled elements (raw bytes) to a fingerprint."""
    digest.update(f"{tuple(shape)}|{dtype}|".encode())
    digest.update(sample)
