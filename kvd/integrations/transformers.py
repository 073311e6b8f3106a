"""Hugging Face transformers on kvd: a `Cache` whose K and V live in shared-memory blocks.

Supported: transformers 5.24.0 on torch 2.13.0, pinned by the `engines` extra — the Cache API and
the arguments of `update` change between transformers releases.

Theory of operation
-------------------
One `KvdCache` holds one sequence (batch size 1) of a decoder-only model whose layers are all full
attention (Llama, Mistral, Qwen2, ...); it is a kvd sequence on the daemon side::

    KvdCache(client, model, prompt)   open_sequence(prompt): one round trip hashes the prompt's
                                      full blocks, pins the longest cached prefix — capped by the
                                      daemon at floor((n - 1) / B) blocks, so the last prompt token
                                      is always computed (its logits pick the first new token) —
                                      and allocates blocks for the rest
    get_seq_length() == num_cached   the prefix is "pre-filled" by pointing at its blocks (no
                                      copy); `generate`, given the whole prompt, slices it past
                                      the cache length and runs only the uncached tail
    forward pre-hook                  sees the token ids of every forward that uses this cache,
                                      checks them against the prompt, records generated ones and,
                                      when the next tokens need a block, asks the daemon for one
                                      (extend_sequence: a round trip per block, not per token)
    KvdLayer.update(k, v)             writes the new tokens' K/V in place into the blocks through
                                      a torch view of the pool; returns K/V of every token,
                                      gathered from the blocks in block-table order
    close()                           seals every full block whose tokens' K/V were computed —
                                      the last generated token was never fed back, so it has
                                      none — closes the sequence, drops every view of the pool

Memory layout. The pool is (num_blocks, num_layers, 2, B, H, D); attention wants (1, H, tokens,
D). Layer l's keys are the strided view pool[:, l, 0] of shape (num_blocks, B, H, D): a write is
an index_put at (block_table[t // B], t % B); a read is one index_select of the sequence's blocks
(a contiguous copy), a free reshape to (tokens, H, D) and a transpose view. DynamicCache pays a
torch.cat of the same size per layer and step, so the read costs about what it replaces; between
forwards this process keeps no private copy of any K/V. The blocks are the only copy, so what a
second process reads is exactly what the first one wrote.

Guards. The model must fit the pool — layers, KV heads, head dim and dtype (a float32 model on a
float16 pool would silently round every K/V) — or BadArgsError is raised before anything is
allocated. Views are `torch.from_numpy` over the client's `np.frombuffer` pool, so closing the
client while a cache is open raises (InUseError) instead of leaving tensors over unmapped
memory; `close()` drops the views first.
"""

from __future__ import annotations

import hashlib
import json
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kvd.errors import BadArgsError
from kvd.geometry import Geometry

SUPPORTED_TRANSFORMERS = "5.24.0"
TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}

if transformers.__version__ != SUPPORTED_TRANSFORMERS:
    warnings.warn(f"kvd.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} "
                  f"(its Cache API changes between releases); {transformers.__version__} is "
                  "installed: `pip install -e '.[engines]'` installs the supported one",
                  stacklevel=2)


def model_kv_shape(model: PreTrainedModel) -> dict[str, int]:
    """The model's KV geometry in kvd's names: num_layers, num_kv_heads, head_dim."""
    config = model.config.get_text_config(decoder=True)
    num_heads = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // num_heads,
    }


def check_model_fits(model: PreTrainedModel, geometry: Geometry) -> None:
    """Raise BadArgsError unless `model`'s K/V have the pool's shape and dtype."""
    wrong = [f"{name} {value} (pool {getattr(geometry, name)})"
             for name, value in model_kv_shape(model).items() if value != getattr(geometry, name)]
    if model.dtype != TORCH_DTYPES[geometry.dtype]:
        wrong.append(f"dtype {model.dtype} (pool {geometry.dtype})")
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    wrong += [f"layer type {kind!r}" for kind in sorted(set(layer_types) - {"full_attention"})]
    if wrong:
        raise BadArgsError(
            f"the model does not fit the kvd pool: {', '.join(wrong)}. Start the daemon with this "
            "model's --layers/--kv-heads/--head-dim/--dtype, or cast it with model.to(dtype); "
            "only full-attention layers are supported")


# Config keys that say where a model was loaded from, which head classes saved it, what a
# forward returns or the dtype it was saved in (None for a model built in-process; the salt
# takes the dtype from the model itself) — never which K/V it computes — so one model built
# or loaded in several ways shares blocks.
_CONFIG_KEYS_NOT_SALTED = ("_name_or_path", "architectures", "dtype", "output_attentions",
                           "output_hidden_states", "return_dict", "use_cache")
_SAMPLED_ELEMENTS = 64  # per parameter, evenly spaced, in the weights' fingerprint
_Versions = tuple[tuple[int, int], ...]
_fingerprints: weakref.WeakKeyDictionary[torch.nn.Module, tuple[_Versions, bytes]] = (
    weakref.WeakKeyDictionary())


def model_salt(model: PreTrainedModel) -> bytes:
    """The default hashing namespace of `model`: its config, dtype and a fingerprint of its weights.

    The config leaves out the load path and output switches (`_CONFIG_KEYS_NOT_SALTED`), so the
    same weights loaded from two paths share blocks; the weights' fingerprint tells apart two
    models with one config (a fine-tune and its base), which must never share K/V.
    """
    config = json.loads(model.config.to_json_string(use_diff=False))
    for key in _CONFIG_KEYS_NOT_SALTED:
        config.pop(key, None)
    digest = hashlib.blake2b(digest_size=16, person=b"kvd-hf-salt")
    digest.update(f"{json.dumps(config, sort_keys=True)}|{model.dtype}|".encode())
    digest.update(weights_fingerprint(model))
    return digest.digest()


def weights_fingerprint(model: torch.nn.Module) -> bytes:
    """A digest of every parameter's shape, dtype and 64 evenly spaced elements.

    It reads 64 elements per parameter whatever the model's size, and is remembered per model
    until a parameter is replaced or changed in place (torch's version counter), so a training
    step between two generations changes the salt. A change confined to elements between the
    sampled ones goes unseen; a fine-tune changes whole matrices.
    """
    params = list(model.parameters())
    try:
        versions: _Versions | None = tuple((p.data_ptr(), p._version) for p in params)
    except RuntimeError:  # parameters made under inference_mode have no version counter
        versions = None
    remembered = _fingerprints.get(model)
    if versions is not None and remembered is not None and remembered[0] == versions:
        return remembered[1]
    digest = hashlib.blake2b(digest_size=16, person=b"kvd-hf-weights")
    for param in params:
        flat = param.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // _SAMPLED_ELEMENTS)][:_SAMPLED_ELEMENTS]
        digest.update(f"{tuple(param.shape)}|{param.dtype}|".encode())
        digest.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    fingerprint = digest.digest()
    if versions is not None:
        _fingerprints[model] = (versions, fingerprint)
    return fingerprint


def pool_tensor(client: Any) -> torch.Tensor:
    """The client's whole pool as a torch tensor over shared memory (no copy)."""
    pool = torch.from_numpy(client.pool)
    return pool.view(torch.bfloat16) if client.geometry.dtype == "bfloat16" else pool


def _token_list(token_ids: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] != 1:
            raise BadArgsError(f"KvdCache holds one sequence; got a batch of {token_ids.shape[0]}")
        token_ids = token_ids.reshape(-1).tolist()
    ids = [int(t) for t in token_ids]
    if not ids:
        raise BadArgsError("the prompt needs at least one token")
    return ids


class _SequenceBinding:
    """This cache's side of its daemon sequence: the token ids, the block table, what was sent."""

    def __init__(self, client: Any, token_ids: list[int], salt: bytes) -> None:
        self.client = client
        self.block_size = client.geometry.block_size
        self.seq = client.open_sequence(token_ids, salt=salt)
        self.token_ids = token_ids
        self.num_sent = len(token_ids)  # tokens the daemon's page table holds
        self.block_table = torch.tensor(self.seq.block_ids, dtype=torch.long)

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold."""
        return len(self.seq.block_ids) * self.block_size

    def feed(self, token_ids: list[int], start: int) -> None:
        """Record the tokens at positions [start, start + n), about to be computed."""
        known = self.token_ids[start:start + len(token_ids)]
        if token_ids[:len(known)] != known:
            raise BadArgsError(
                f"the model was fed other tokens than the KvdCache was opened with (positions "
                f"{start}..{start + len(known) - 1}): pass generate the same input_ids")
        self.token_ids.extend(token_ids[len(known):])
        if start + len(token_ids) > self.capacity:
            self._send(num_computed=start)

    def _send(self, num_computed: int) -> None:
        # The daemon seals before it appends, so it can only count tokens it already holds.
        self.client.extend_sequence(self.seq, self.token_ids[self.num_sent:],
                                    num_computed=min(num_computed, self.num_sent))
        self.num_sent = len(self.token_ids)
        self.block_table = torch.tensor(self.seq.block_ids, dtype=torch.long)

    def commit(self, num_computed: int) -> None:
        """Seal every full block below `num_computed` tokens."""
        if self.num_sent < len(self.token_ids):
            self._send(num_computed)
        self.client.commit_sequence(self.seq, num_computed=num_computed)

    def close(self) -> None:
        self.client.close_sequence(self.seq)


class KvdLayer(CacheLayerMixin):
    """One layer's K and V, kept in the sequence's kvd blocks."""

    is_sliding = False

    def __init__(self, keys_pool: torch.Tensor, values_pool: torch.Tensor,
                 binding: _SequenceBinding, num_tokens: int) -> None:
        super().__init__()
        self._pools: tuple[torch.Tensor, torch.Tensor] | None = (keys_pool, values_pool)
        self._binding = binding
        self.num_tokens = num_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the first K/V against the pool once; the storage itself already exists."""
        pool = self._live_pools()[0]
        expected = (1, pool.shape[2], pool.shape[3])
        for states in (key_states, value_states):
            got = (states.shape[0], states.shape[1], states.shape[3])
            if got != expected or states.dtype != pool.dtype or states.device.type != "cpu":
                raise BadArgsError(
                    f"K/V of shape (batch, heads, head_dim) {got}, {states.dtype} on "
                    f"{states.device} do not fit the pool's {expected}, {pool.dtype} on cpu: "
                    "KvdCache holds one sequence of a model that fits the pool, on the CPU")
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V into their blocks; return K/V of every token so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop = self.num_tokens, self.num_tokens + key_states.shape[-2]
        pools = self._live_pools()
        for pool, states in zip(pools, (key_states, value_states), strict=True):
            self._write(pool, states, start, stop)
        self.num_tokens = stop
        keys, values = (self._gather(pool, stop) for pool in pools)
        return keys, values

    def _write(self, pool: torch.Tensor, states: torch.Tensor, start: int, stop: int) -> None:
        block_size = self._binding.block_size
        if stop - start == 1:  # decode: plain indexing, no index tensors
            block, offset = divmod(start, block_size)
            pool[self._binding.seq.block_ids[block], offset] = states[0, :, 0]
            return
        positions = torch.arange(start, stop)
        table = self._binding.block_table
        pool[table[positions // block_size], positions % block_size] = states[0].transpose(0, 1)

    def _gather(self, pool: torch.Tensor, stop: int) -> torch.Tensor:
        """K or V of tokens [0, stop) as (1, H, stop, D), read from the blocks in table order."""
        num_blocks = -(-stop // self._binding.block_size)
        blocks = pool.index_select(0, self._binding.block_table[:num_blocks])  # (n, B, H, D)
        # Token t of the contiguous copy starts at t*H*D, head h at h*D: one as_strided instead
        # of flatten/slice/transpose/unsqueeze, which cost ~3 us of Python each per layer and step.
        num_heads, head_dim = blocks.shape[2], blocks.shape[3]
        return blocks.as_strided((1, num_heads, stop, head_dim),
                                 (blocks.numel(), head_dim, num_heads * head_dim, 1))

    def _live_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pools is None:
            raise BadArgsError("this KvdCache is closed: open a new one for the next generation")
        return self._pools

    def detach(self) -> None:
        """Drop this layer's views of shared memory (the client's mapping can then close)."""
        self._pools = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1  # grows a block at a time while the pool has space


class KvdCache(Cache):
    """A transformers Cache over one kvd sequence, reusing any cached prefix of the prompt.

    Use it as a context manager (or call `close()`): closing seals the computed full blocks so
    other processes can reuse them, and releases this process's pins and views.
    """

    def __init__(self, client: Any, model: PreTrainedModel,
                 token_ids: torch.Tensor | Sequence[int], *, salt: bytes | None = None) -> None:
        """Args:
            client: a connected `kvd.Client` whose pool fits `model`.
            model: the model that will run on this cache (its forwards are watched for token ids).
            token_ids: the prompt, shape (n,) or (1, n); pass `generate` the same ids.
            salt: hashing namespace; default `model_salt(model)`.
        Raises:
            BadArgsError: the model does not fit the pool, or the prompt is empty or batched.
            NoSpaceError: the pool cannot hold the prompt's uncached blocks.
        """
        check_model_fits(model, client.geometry)
        prompt = _token_list(token_ids)
        pool = pool_tensor(client)
        salt = model_salt(model) if salt is None else salt
        self._binding = _SequenceBinding(client, prompt, salt)
        self.num_prompt_tokens = len(prompt)
        self.num_cached_tokens = self._binding.seq.num_cached_tokens
        super().__init__(layers=[
            KvdLayer(pool[:, layer, 0], pool[:, layer, 1], self._binding, self.num_cached_tokens)
            for layer in range(client.geometry.num_layers)])
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.is_closed = False

    @property
    def block_ids(self) -> list[int]:
        """The sequence's block table (cached prefix first)."""
        return list(self._binding.seq.block_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V every layer has written (prompt and generated)."""
        return min(layer.num_tokens for layer in self.layers)

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("cache", kwargs.get("past_key_values")) is not self:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise BadArgsError("KvdCache hashes token ids: call the model with input_ids, "
                               "not inputs_embeds")
        self._binding.feed(_token_list(input_ids), self.num_computed_tokens)

    def close(self) -> None:
        """Seal the computed full blocks, close the sequence, drop every view of the pool."""
        if self.is_closed:
            return
        self.is_closed = True
        self._hook.remove()
        num_computed = self.num_computed_tokens
        for layer in self.layers:
            layer.detach()
        try:
            self._binding.commit(num_computed)
        finally:
            self._binding.close()

    def __enter__(self) -> KvdCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise BadArgsError("KvdCache holds one sequence whose sealed blocks are shared: beam "
                           "search, batch expansion, crop and reset are not supported")

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = reset = _unsupported


@dataclass(frozen=True)
class KvdGeneration:
    """What `generate_with_kvd` did."""

    output: Any  # what model.generate returned
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V came from kvd: their prefill was skipped
    num_computed_tokens: int  # tokens this call ran through the model (prompt tail + decode)
    block_ids: list[int]  # the sequence's block table, cached prefix first


def generate_with_kvd(model: PreTrainedModel, client: Any,
                      input_ids: torch.Tensor | Sequence[int], *, salt: bytes | None = None,
                      **generate_kwargs: Any) -> KvdGeneration:
    """`model.generate` on a KvdCache: reuse the cached prefix, seal the new full blocks.

    `generate` gets the whole prompt; the cache's length makes it compute only the uncached
    tail, with positions and attention mask covering the whole sequence.
    """
    prompt = torch.tensor([_token_list(input_ids)], dtype=torch.long)
    with KvdCache(client, model, prompt, salt=salt) as cache:
        output = model.generate(prompt, cache=cache, **generate_kwargs)
        return KvdGeneration(output, cache.num_prompt_tokens, cache.num_cached_tokens,
                             cache.num_computed_tokens - cache.num_cached_tokens, cache.block_ids)
