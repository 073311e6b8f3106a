"""Hugging Face transformers on kvd: a `Cache` whose K and V live in shared-memory blocks.

Supported: transformers 5.24.0 on torch 2.13.0, pinned by the `engines` extra — the Cache API and
the arguments of `update` change between transformers releases.

Contract
--------
- **Batches.** `KvdCache(client, model, input_ids, attention_mask=mask)` takes what `generate`
  takes: one prompt (shape (n,) or (1, n), or a list of ints) or a batch (b, n) padded on the
  left with its attention mask, as a tokenizer with `padding_side="left"` makes it; pass
  `generate` the same `input_ids` and `attention_mask`. Each row is a kvd sequence of its own
  over the row's real tokens: pads are neither hashed nor stored, so a row reuses the cached
  prefix of its own tokens whatever its padding, and seals its own blocks. Rows do not share
  blocks they compute in the same batch: both compute them, the first row's seal is kept and
  the other's copy freed. A hybrid model (`kvd_model=`) takes batches alike: each row is a
  sequence of the daemon model, its prefix hit served by every pool, and in decode it holds at
  most ceil(W / B) + 1 blocks of the window pool.
  `generate_with_kvd` also takes a list of prompts of different lengths and pads them itself.
- **Beam search** (`num_beams > 1`) is not supported and raises `kvd.BadArgsError`: beams are
  reordered in place every step, while a row's sealed blocks are shared and read-only. Use greedy
  decoding or sampling, or transformers' own DynamicCache for beam search.
  `num_return_sequences=k`: `generate_with_kvd` repeats each prompt k times in the batch (rows
  i*k .. i*k+k-1 are prompt i's, the order generate uses); a `KvdCache` by hand must be opened on
  the repeated batch (`input_ids.repeat_interleave(k, 0)`, and the mask alike).
- **Salts.** The default hashing namespace, `model_salt(model)`, hashes the config (but not where
  the model was loaded from, its head classes, saved dtype or output switches), the model's
  dtype, and a fingerprint of the weights
  (shape, dtype and 64 evenly spaced elements of every parameter). The same weights loaded from
  two paths share blocks; a fine-tune saved with an equal config does not reuse the first
  model's K/V. Pass `salt=` to choose the namespace yourself.
- **A full pool during decode.** When the daemon has no block for the next tokens, the forward
  that needs it raises `kvd.NoSpaceError` out of `generate`, once. Closing the cache (the `with`
  block does it) then seals, per row, every full block the row holds whose K/V were computed,
  sends no token that would need a new block, and adds a note to that NoSpaceError saying how
  many computed tokens were kept in sealed blocks; `cache.rows[i].num_sealed_tokens` says it
  per row. Only a row's last partial block is lost.

Theory of operation
-------------------
A `KvdCache` over a batch of b rows is b kvd sequences, one per row, for a decoder-only model
whose layers are all full attention (Llama, Mistral, Qwen2, ...), or for a hybrid model (Gemma 2:
sliding-window and full-attention layers) with `kvd_model=`, a daemon model whose pool without a
window holds the full-attention layers and whose window pool the sliding ones: each row is then
one sequence spanning both (one block table each). A sliding layer returns the K/V of the
`window - 1` columns before the forward's and of its own, and the mask sizes that say so, as
DynamicSlidingWindowLayer does (transformers builds one sliding mask per forward from the first
sliding layer's sizes, over columns: with left padding a column's distance is its row's token
distance, so the window is per row and the columns are every row's); each row tells the daemon
its tokens whenever a window block falls wholly before the window of the row's token computed
next (a round trip a block), and the window pool releases it, so in decode each row holds at
most ceil(W / B) + 1 window blocks::

    KvdCache(client, model, ids)     open_sequence(row's real tokens) per row: one round trip
                                     hashes the row's full blocks, pins its longest cached prefix
                                     — capped by the daemon at floor((r - 1) / B) blocks, so the
                                     row's last token is always computed (its logits pick the
                                     first new token) — and allocates blocks for the rest
    get_seq_length() == L            every column before L is a pad or a cached token in every
                                     row: `generate` computes only columns [L, n)
    forward pre-hook                 sees the token ids of every forward that uses this cache,
                                     checks them (and a padded batch's mask and positions)
                                     against the prompt, records generated ones, asks the daemon
                                     for a block when a row's next tokens need one
                                     (extend_sequence: a round trip per block, not per token),
                                     and works out where each new column's K/V go
    KvdLayer.update(k, v)            writes the new tokens' K/V in place into the blocks through
                                     a torch view of the pool; returns K/V of every column,
                                     gathered from the blocks
    close()                          per row: seals every full block whose tokens' K/V were
                                     computed — the last generated token was never fed back, so
                                     it has none — closes the sequence; drops every view

Columns and rows. The batch keeps the caller's layout: row i has p_i pads on the left, then its
r_i real tokens, of which the first c_i are cached, so its token t sits in column p_i + t and has
position t (generate derives positions from the attention mask). A rectangular forward computes
the same columns for every row, so with t_i = r_i - c_i tokens left to compute per row, the
cache reports L = n - max t_i: each row's columns before L are pads or cached, and the widest
tail decides the width — the width a batch of the uncached tails alone would have. A row whose
tail is shorter recomputes some of its cached tokens in [L, p_i + c_i); those K/V are not stored
(its blocks are sealed and shared) and attention reads the cached ones. Pads are never stored:
their columns read the row's token 0, finite K/V that the attention mask hides (a NaN there
would leak through a zero weight). In a window pool a row's token 0, and the cached tokens such a
row recomputes, may lie in blocks the pool released (a prefix hit holds only the window before
the hit point): those columns read the row's first token still held, since a released block
may already hold another sequence's K/V, half written. The sliding mask hides them: the row's
computed tokens attend only to tokens at or after c_i - W + 1, which the hit holds.

Memory layout. The pool is (num_blocks, num_layers, 2, B, H, D), so viewed as rows of (H, D)
it is one flat array where token t of a sequence has row block_ids[t // B] * (num_layers * 2 * B)
+ t % B for layer 0's keys, and layer l's keys and values are the same rows of the flat array
shifted by 2l * B and (2l + 1) * B rows. The hook computes, once per forward, the flat rows of
the new columns of every row (of all columns on the first forward); each layer then writes its new K/V with one index_copy_ (a plain
index for one token of one row) and reads K/V of all columns with one index_select into a
contiguous (b, columns, H, D) copy, returned as the (b, H, columns, D) view attention wants.
DynamicCache pays a torch.cat of the same size per layer and step, so the read costs about what
it replaces; between forwards this process keeps no private copy of any K/V. The blocks are the
only copy, so what a second process reads is exactly what the first one wrote.

Guards. The model must fit the pool — layers, KV heads, head dim and dtype (a float32 model on a
float16 pool would silently round every K/V) — or BadArgsError is raised before anything is
allocated. Views are `torch.from_numpy` over the client's `np.frombuffer` pool, so closing the
client while a cache is open raises (InUseError) instead of leaving tensors over unmapped
memory; `close()` drops the views first.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kvd.errors import BadArgsError, KvdError, NoSpaceError
from kvd.geometry import Geometry, num_outside_window
from kvd.integrations.salting import add_tensor, config_text, sample_slice

SUPPORTED_TRANSFORMERS = "5.24.0"
HOLE = -1  # a block-table entry the daemon released: outside a window pool's window
TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}

if transformers.__version__ != SUPPORTED_TRANSFORMERS:
    warnings.warn(f"kvd.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} "
                  f"(its Cache API changes between releases); {transformers.__version__} is "
                  "installed: `pip install -e '.[engines]'` installs the supported one",
                  stacklevel=2)

UNSUPPORTED_BEAM_SEARCH = (
    "beam search (num_beams > 1) is not supported on kvd: beams are reordered in place every "
    "step, while a row's sealed blocks are shared and read-only. Use greedy decoding or "
    "sampling, or transformers' DynamicCache for beam search")


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
    wrong = _misfits(model, geometry, model_kv_shape(model)["num_layers"])
    wrong += [f"layer type {kind!r}" for kind in sorted(set(_layer_types(model))
                                                         - {"full_attention"})]
    if wrong:
        raise BadArgsError(
            f"the model does not fit the kvd pool: {', '.join(wrong)}. Start the daemon with this "
            "model's --layers/--kv-heads/--head-dim/--dtype, or cast it with model.to(dtype); "
            "a model with sliding-window layers needs a daemon model over a full-attention pool "
            "and a window pool (--model NAME:FULL,WINDOW) and KvdCache(..., kvd_model=NAME)")


def _layer_types(model: PreTrainedModel) -> list[str]:
    config = model.config.get_text_config(decoder=True)
    return (getattr(config, "layer_types", None)
            or ["full_attention"] * model_kv_shape(model)["num_layers"])


def _misfits(model: PreTrainedModel, geometry: Geometry, num_layers: int) -> list[str]:
    """What of `model`'s K/V (`num_layers` of its layers) does not fit `geometry`."""
    shape = {**model_kv_shape(model), "num_layers": num_layers}
    wrong = [f"{name} {value} (pool {getattr(geometry, name)})"
             for name, value in shape.items() if value != getattr(geometry, name)]
    if model.dtype != TORCH_DTYPES[geometry.dtype]:
        wrong.append(f"dtype {model.dtype} (pool {geometry.dtype})")
    return wrong


def model_pools(model: PreTrainedModel, client: Any, kvd_model: str
                ) -> list[tuple[str, list[int]]]:
    """Per pool of the daemon model `kvd_model`: its name and the model layers it holds (the
    full-attention layers in its pool without a window, the sliding-window ones in its window
    pool, whose window must be the model's); BadArgsError naming what does not fit."""
    pools = client.info.get("models", {}).get(kvd_model)
    if pools is None:
        raise BadArgsError(f"the daemon has no model {kvd_model!r}: start it with --model "
                           f"{kvd_model}:FULL_POOL,WINDOW_POOL")
    layer_types = _layer_types(model)
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    groups: list[tuple[str, list[int]]] = []
    wrong: list[str] = []
    for pool in pools:
        geometry = client.pools[pool]
        kind = "full_attention" if geometry.window is None else "sliding_attention"
        layers = [index for index, each in enumerate(layer_types) if each == kind]
        wrong += [f"pool {pool}: {each}" for each in _misfits(model, geometry, len(layers))]
        if geometry.window is not None and geometry.window != window:
            wrong.append(f"pool {pool}: window {geometry.window} (the model's {window})")
        groups.append((pool, layers))
    held = sorted(index for _, layers in groups for index in layers)
    if held != list(range(len(layer_types))):
        wrong.append(f"layer types {sorted(set(layer_types))} need one pool each "
                     "(full_attention: no window; sliding_attention: window=sliding_window)")
    if wrong:
        raise BadArgsError(f"the model does not fit kvd model {kvd_model!r}: {', '.join(wrong)}")
    return groups


_Versions = tuple[tuple[int, int], ...]
_fingerprints: weakref.WeakKeyDictionary[torch.nn.Module, tuple[_Versions, bytes]] = (
    weakref.WeakKeyDictionary())


def model_salt(model: PreTrainedModel) -> bytes:
    """The default hashing namespace of `model`: its config, dtype and a fingerprint of its weights.

    The config leaves out the load path and output switches (`kvd.integrations.salting`), so the
    same weights loaded from two paths share blocks; the weights' fingerprint tells apart two
    models with one config (a fine-tune and its base), which must never share K/V.
    """
    config = json.loads(model.config.to_json_string(use_diff=False))
    digest = hashlib.blake2b(digest_size=16, person=b"kvd-hf-salt")
    digest.update(f"{config_text(config)}|{model.dtype}|".encode())
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
        sample = flat[sample_slice(flat.numel())].contiguous().cpu().view(torch.uint8)
        add_tensor(digest, param.shape, str(param.dtype), sample.numpy().tobytes())
    fingerprint = digest.digest()
    if versions is not None:
        _fingerprints[model] = (versions, fingerprint)
    return fingerprint


@dataclass(frozen=True)
class _FlatPool:
    """A pool as rows of (H, D) (see Memory layout): block b's layer-0 keys start at row
    `(b // blocks_per_slab) * slab_rows + (b % blocks_per_slab) * block_rows`."""

    rows: torch.Tensor
    blocks_per_slab: int
    slab_rows: int
    block_rows: int  # num_layers * 2 * block_size

    def base(self, block_id: int) -> int:
        slab, index = divmod(block_id, self.blocks_per_slab)
        return slab * self.slab_rows + index * self.block_rows


def flat_pool(client: Any, pool: str | None = None) -> _FlatPool:
    """The client's pool (or `pool` of a multi-pool daemon) as rows of (H, D) over shared
    memory (no copy)."""
    if pool is None and not client._is_multi_pool:
        slabs, blocks_per_slab = client.pool[None], client.geometry.num_blocks
    else:
        slabs, blocks_per_slab, _ = client._pool_view(client.info["pool"] if pool is None
                                                      else pool)
    geometry = client.geometry if pool is None else client.pools[pool]
    tensor = torch.from_numpy(slabs)
    if geometry.dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    heads, dim = geometry.num_kv_heads, geometry.head_dim
    block_rows = geometry.num_layers * 2 * geometry.block_size
    slab_rows, remainder = divmod(slabs.strides[0], heads * dim * slabs.itemsize)
    if remainder:
        raise BadArgsError(f"a slab of {slabs.strides[0]} bytes is not a whole number of "
                           f"({heads}, {dim}) rows: this pool cannot be viewed as rows")
    num_rows = (slabs.shape[0] - 1) * slab_rows + blocks_per_slab * block_rows
    return _FlatPool(tensor.as_strided((num_rows, heads, dim), (heads * dim, dim, 1)),
                     blocks_per_slab, slab_rows, block_rows)


def _prompt_rows(token_ids: torch.Tensor | Sequence[int],
                 attention_mask: torch.Tensor | None) -> list[tuple[list[int], int]]:
    """Per row of the prompt: its real tokens and its number of left pads."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() not in (1, 2) or token_ids.numel() == 0:
            raise BadArgsError(f"input_ids must have shape (n,) or (batch, n) with n > 0, got "
                               f"{tuple(token_ids.shape)}")
        rows: list[list[int]] = token_ids.reshape(-1, token_ids.shape[-1]).tolist()
    else:
        rows = [[int(t) for t in token_ids]]
    if attention_mask is None:
        masks = [[1] * len(row) for row in rows]
    elif attention_mask.numel() != len(rows) * len(rows[0]):
        raise BadArgsError(f"attention_mask of shape {tuple(attention_mask.shape)} does not fit "
                           f"input_ids of shape ({len(rows)}, {len(rows[0])})")
    else:
        masks = attention_mask.reshape(len(rows), -1).tolist()
    return [_real_tokens(row, mask, index) for index, (row, mask) in enumerate(zip(rows, masks))]


def _real_tokens(row: list[int], mask: list[int], index: int) -> tuple[list[int], int]:
    num_pads = len(mask) - sum(1 for m in mask if m)
    if mask != [0] * num_pads + [1] * (len(mask) - num_pads):
        raise BadArgsError(f"row {index}'s attention mask is not 0s then 1s: pad the batch on the "
                           "left (tokenizer padding_side='left'), as decoder-only generation "
                           "appends on the right")
    if num_pads == len(row):
        raise BadArgsError(f"row {index} of the prompt has no token: every row needs at least one")
    return row[num_pads:], num_pads


class _Row:
    """One batch row's side of its daemon sequence: its real tokens, block table(s), what was
    sent. With `kvd_model`, a sequence spanning the model's pools (one block table each)."""

    def __init__(self, client: Any, token_ids: list[int], salt: bytes, num_pads: int,
                 kvd_model: str | None = None) -> None:
        self.client = client
        self.kvd_model = kvd_model
        self.block_size: int = client.geometry.block_size
        self.seq: Any = (client.open_sequence(token_ids, salt=salt) if kvd_model is None
                         else client.open_model_sequence(kvd_model, token_ids, salt=salt))
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_pads = num_pads  # columns of left padding before the row's token 0
        self.num_sent = len(token_ids)  # tokens the daemon's page table holds
        self.windows = {} if kvd_model is None else {  # window pools → their windows
            pool: client.pools[pool].window for pool in self.seq.block_ids
            if client.pools[pool].window is not None}

    def table(self, pool: str | None = None) -> list[int]:
        """The block table (of `pool`, for a model's sequence: its first pool's by default)."""
        tables = self.seq.block_ids
        if self.kvd_model is None:
            return tables
        return tables[next(iter(tables)) if pool is None else pool]

    @property
    def num_cached(self) -> int:
        return int(self.seq.num_cached_tokens)

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold."""
        return len(self.table()) * self.block_size

    def feed(self, token_ids: list[int], start: int) -> None:
        """Record the tokens at positions [start, start + n), about to be computed."""
        known = self.token_ids[start:start + len(token_ids)]
        if token_ids[:len(known)] != known:
            raise BadArgsError(
                f"the model was fed other tokens than the KvdCache was opened with (positions "
                f"{start}..{start + len(known) - 1}): pass generate the same input_ids")
        self.token_ids.extend(token_ids[len(known):])
        if start + len(token_ids) > self.capacity or self._leaves_window(start):
            self._send(len(self.token_ids), num_computed=start)

    def _leaves_window(self, start: int) -> bool:
        """Whether a block of a window pool is wholly before the window of token `start` but
        not released yet (a round trip a block, which keeps the pool's blocks at the window's)."""
        for pool, window in self.windows.items():
            end = num_outside_window(start, window, self.block_size)
            if end and self.table(pool)[end - 1] != HOLE:
                return True
        return False

    def _send(self, stop: int, num_computed: int) -> None:
        """Append tokens [num_sent, stop) to the daemon's sequence (blocks as they need; a
        window pool releases the blocks before the window of token `num_computed`)."""
        # A sequence seals before it appends, so it can only count tokens it already holds; a
        # model's appends first, so its window pool can release up to the token computed next.
        extend = (self.client.extend_sequence if self.kvd_model is None
                  else self.client.extend_model_sequence)
        extend(self.seq, self.token_ids[self.num_sent:stop],
               num_computed=min(num_computed, self.num_sent if self.kvd_model is None else stop))
        self.num_sent = stop

    def slots(self, start: int, stop: int, flat: _FlatPool, pool: str | None = None
              ) -> list[int]:
        """Flat pool rows of tokens [start, stop) for layer 0's keys.

        A token in a block the window pool released (HOLE) reads the row's first held token
        instead: K/V of the row's own, finite, that the sliding-window mask hides. Only a batch
        reads such columns (a row whose cached prefix is longer than the forward's first
        column recomputes cached tokens, and its pads read token 0), and a released block may
        already hold another sequence's K/V, being written.
        """
        block_ids, block_size, base = self.table(pool), self.block_size, flat.base
        early: list[int] = []
        if start < stop and block_ids[start // block_size] == HOLE:  # (holes lead the table)
            num_holes = bisect.bisect(block_ids, False, key=lambda block: block != HOLE)
            early = [base(block_ids[num_holes])] * (min(stop, num_holes * block_size) - start)
        return early + [base(block_ids[t // block_size]) + t % block_size
                        for t in range(start + len(early), stop)]

    def publish(self, num_computed: int) -> None:
        """Seal every full block below `num_computed` tokens.

        Sends first what the daemon lacks, as far as the blocks already held reach and never
        further: after a failed extension (its tokens needed a block the pool did not have) this
        cannot fail the same way again, and the K/V computed in held blocks are kept.
        """
        num_held = min(len(self.token_ids), self.capacity)
        if self.num_sent < num_held:
            self._send(num_held, num_computed)
        commit = (self.client.commit_sequence if self.kvd_model is None
                  else self.client.commit_model_sequence)
        commit(self.seq, num_computed=num_computed)

    def close(self) -> None:
        if self.kvd_model is None:
            self.client.close_sequence(self.seq)
        else:
            self.client.close_model_sequence(self.seq)


@dataclass(frozen=True)
class KvdRow:
    """One batch row on kvd."""

    num_prompt_tokens: int  # the row's real prompt tokens (pads excluded)
    num_cached_tokens: int  # prompt tokens whose K/V came from kvd: their prefill was skipped
    num_computed_tokens: int  # tokens whose K/V this row computed and stored (tail + decode)
    num_sealed_tokens: int  # tokens in the row's sealed blocks, cached prefix included
    block_ids: list[int]  # the row's block table, cached prefix first


class _Slots:
    """Where the K/V of each column of the batch live: flat pool rows (see Memory layout)."""

    def __init__(self, num_rows: int, num_columns: int) -> None:
        self.read = torch.zeros((num_rows, num_columns), dtype=torch.long)
        self.num_columns = 0  # columns whose read rows are set
        self.read_index = self.read[:, :0].reshape(-1)  # read[:, :num_columns], flattened
        # Rows the running forward stores its new K/V in: an int for one token of one row (a
        # plain index, no index tensor), else a tensor over the tokens `write_mask` selects
        # from the forward's (rows, columns) — None when every one is stored.
        self.write_index: torch.Tensor | int = 0
        self.write_mask: torch.Tensor | None = None

    def set_read(self, start: int, rows: list[list[int]]) -> None:
        """Set the read rows of columns [start, start + len(rows[0])) of every batch row."""
        stop = start + len(rows[0])
        if stop > self.read.shape[1]:  # grow geometrically: decode adds a column per step
            grown = torch.zeros((self.read.shape[0], 2 * stop), dtype=torch.long)
            grown[:, :start] = self.read[:, :start]
            self.read = grown
        self.read[:, start:stop] = torch.tensor(rows, dtype=torch.long)
        self.num_columns = stop
        self.read_index = self.read[:, :stop].reshape(-1)


@dataclass(frozen=True)
class _Group:
    """The layers one pool holds (all of them but in a hybrid model): the pool's rows and
    where each column's K/V live in it."""

    pool: str | None  # None: the session's pool
    flat: _FlatPool
    slots: _Slots


class KvdLayer(CacheLayerMixin):
    """One layer's K and V, kept in the sequences' kvd blocks. A sliding-window layer
    (`window`) returns, like transformers' DynamicSlidingWindowLayer, the K/V of the
    `window - 1` columns before the forward's and of the forward's own."""

    def __init__(self, keys_pool: torch.Tensor, values_pool: torch.Tensor, slots: _Slots,
                 num_rows: int, num_tokens: int, window: int | None = None) -> None:
        super().__init__()
        self._pools: tuple[torch.Tensor, torch.Tensor] | None = (keys_pool, values_pool)
        self._slots = slots
        self.num_rows = num_rows
        self.num_tokens = num_tokens  # columns, pads included
        self.window = window
        self.is_sliding = window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the first K/V against the pool once; the storage itself already exists."""
        pool = self._live_pools()[0]
        expected = (self.num_rows, pool.shape[1], pool.shape[2])
        for states in (key_states, value_states):
            got = (states.shape[0], states.shape[1], states.shape[3])
            if got != expected or states.dtype != pool.dtype or states.device.type != "cpu":
                raise BadArgsError(
                    f"K/V of shape (batch, heads, head_dim) {got}, {states.dtype} on "
                    f"{states.device} do not fit the cache's {expected}, {pool.dtype} on cpu: "
                    "run the batch the KvdCache was opened with, on a model that fits the "
                    "pool, on the CPU")
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V into their blocks; return K/V of every column so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        stop = self.num_tokens + key_states.shape[-2]
        if stop != self._slots.num_columns:
            raise BadArgsError(
                "this forward's K/V came without its token ids: run the model the KvdCache was "
                "opened with (its forward is watched), with input_ids, and after a forward that "
                "failed part-way open a new KvdCache")
        pools = self._live_pools()
        for pool, states in zip(pools, (key_states, value_states), strict=True):
            self._write(pool, states)
        offset = self._offset()
        self.num_tokens = stop
        keys, values = (self._gather(pool, offset, stop) for pool in pools)
        return keys, values

    def _offset(self) -> int:
        """The first column a forward from here reads (the window's, of a sliding layer)."""
        return 0 if self.window is None else max(self.num_tokens - self.window + 1, 0)

    def _write(self, pool: torch.Tensor, states: torch.Tensor) -> None:
        index = self._slots.write_index
        if isinstance(index, int):  # decode of one row: plain indexing, no index tensors
            pool[index] = states[0, :, 0]
            return
        tokens = states.transpose(1, 2)  # (rows, columns, H, D)
        mask = self._slots.write_mask
        pool.index_copy_(0, index, tokens.flatten(0, 1) if mask is None else tokens[mask])

    def _gather(self, pool: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """K or V of columns [start, stop) as (rows, H, columns, D), read from the blocks."""
        index = (self._slots.read_index if start == 0
                 else self._slots.read[:, start:stop].reshape(-1))
        tokens = pool.index_select(0, index)  # (rows * columns, H, D)
        # Column t of row b starts at (b*columns + t)*H*D, head h at h*D: one as_strided
        # instead of view/transpose, which cost ~3 us of Python each per layer and step.
        num_heads, head_dim, columns = tokens.shape[1], tokens.shape[2], stop - start
        return tokens.as_strided((self.num_rows, num_heads, columns, head_dim),
                                 (columns * num_heads * head_dim, head_dim, num_heads * head_dim,
                                  1))

    def _live_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pools is None:
            raise BadArgsError("this KvdCache is closed: open a new one for the next generation")
        return self._pools

    def detach(self) -> None:
        """Drop this layer's views of shared memory (the client's mapping can then close)."""
        self._pools = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        offset = self._offset()  # (what DynamicSlidingWindowLayer says for a sliding layer)
        return self.num_tokens + query_length - offset, offset

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1  # grows a block at a time while the pool has space


class KvdCache(Cache):
    """A transformers Cache over kvd sequences, one per batch row, reusing cached prefixes.

    Use it as a context manager (or call `close()`): closing seals the computed full blocks so
    other processes can reuse them, and releases this process's pins and views.
    """

    def __init__(self, client: Any, model: PreTrainedModel,
                 token_ids: torch.Tensor | Sequence[int], *,
                 attention_mask: torch.Tensor | None = None, salt: bytes | None = None,
                 kvd_model: str | None = None) -> None:
        """Args:
            client: a connected `kvd.Client` whose pool fits `model`.
            model: the model that will run on this cache (its forwards are watched for token ids).
            token_ids: the prompt, shape (n,) or (1, n), or a batch (b, n) padded on the left;
                pass `generate` the same ids.
            attention_mask: for a padded batch, its mask (1: token, 0: pad), shape (b, n); pass
                `generate` the same mask.
            salt: hashing namespace; default `model_salt(model)`.
            kvd_model: a daemon model (`--model NAME:FULL,WINDOW`) whose pools hold this
                model's full-attention and sliding-window layers (a hybrid model, e.g. Gemma 2);
                None: every layer in the session's pool.
        Raises:
            BadArgsError: the model does not fit the pool(s), or a row is empty or not
                left-padded.
            NoSpaceError: the pool cannot hold the uncached blocks of every row.
        """
        if kvd_model is None:
            check_model_fits(model, client.geometry)
            placement: list[tuple[str | None, list[int]]] = [
                (None, list(range(client.geometry.num_layers)))]
        else:
            placement = list(model_pools(model, client, kvd_model))
        prompt = _prompt_rows(token_ids, attention_mask)
        salt = model_salt(model) if salt is None else salt
        self._rows = self._open_rows(client, prompt, salt, kvd_model)
        self.num_prompt_columns = len(prompt[0][0]) + prompt[0][1]
        self._is_padded = any(num_pads for _, num_pads in prompt)
        self._pads = torch.tensor([[row.num_pads] for row in self._rows])
        block_size = client.geometry.block_size
        first_computed = self.num_prompt_columns - max(
            row.num_prompt_tokens - row.num_cached for row in self._rows)
        layers: dict[int, KvdLayer] = {}
        self._groups: list[_Group] = []
        for pool, indices in placement:
            # (after a NoSpaceError opening the rows no view is left in its traceback)
            flat = flat_pool(client, pool)
            slots = _Slots(len(self._rows), self.num_prompt_columns + 8 * block_size)
            self._groups.append(_Group(pool, flat, slots))
            window = (client.geometry if pool is None else client.pools[pool]).window
            for number, index in enumerate(indices):
                layers[index] = KvdLayer(flat.rows[2 * number * block_size:],
                                         flat.rows[(2 * number + 1) * block_size:], slots,
                                         len(self._rows), first_computed, window)
        self._layers = [layers[index] for index in range(len(layers))]
        super().__init__(layers=list(self._layers))
        self._no_space: NoSpaceError | None = None  # raised by a forward: close() notes on it
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.is_closed = False

    @staticmethod
    def _open_rows(client: Any, prompt: list[tuple[list[int], int]], salt: bytes,
                   kvd_model: str | None) -> list[_Row]:
        rows: list[_Row] = []
        try:
            for token_ids, num_pads in prompt:
                rows.append(_Row(client, token_ids, salt, num_pads, kvd_model))
        except BaseException:
            _close_all(rows)
            raise
        return rows

    @property
    def rows(self) -> list[KvdRow]:
        """Per batch row: its counts and block table (final once the cache is closed)."""
        num_columns = self._num_columns_done()
        return [KvdRow(row.num_prompt_tokens, row.num_cached,
                       max(0, num_columns - row.num_pads - row.num_cached),
                       row.seq.num_sealed_blocks * row.block_size, list(row.table()))
                for row in self._rows]

    def _num_columns_done(self) -> int:
        """Columns whose K/V every layer has (a forward that failed part-way left fewer in some)."""
        return min(layer.num_tokens for layer in self._layers)

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("cache", kwargs.get("past_key_values")) is not self:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise BadArgsError("KvdCache hashes token ids: call the model with input_ids, "
                               "not inputs_embeds")
        ids = input_ids.reshape(-1, input_ids.shape[-1]).tolist()
        if len(ids) != len(self._rows):
            raise BadArgsError(
                f"the KvdCache holds {len(self._rows)} rows but the model runs a batch of "
                f"{len(ids)}: generate expands a batch for num_beams > 1 — {UNSUPPORTED_BEAM_SEARCH}"
                f" — and for num_return_sequences > 1: open the KvdCache on each prompt repeated "
                "that many times instead (input_ids.repeat_interleave(k, 0); generate_with_kvd "
                "does it)")
        start = self._num_columns_done()
        stop = start + len(ids[0])
        if self._is_padded:
            self._check_padded_inputs(kwargs, start, stop)
        try:
            for row, row_ids in zip(self._rows, ids, strict=True):
                first = start - row.num_pads  # the token in the forward's first column
                row.feed(row_ids[max(0, -first):], max(0, first))
        except NoSpaceError as exc:
            self._no_space = exc
            raise
        self._locate(start, stop)

    def _check_padded_inputs(self, kwargs: dict, start: int, stop: int) -> None:
        """A padded batch needs the mask it was opened with and positions counting real tokens."""
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (len(self._rows), stop):
            raise BadArgsError(f"a padded batch needs its 2-D attention_mask over all {stop} "
                               "columns: pass generate the mask the KvdCache was opened with")
        if start < self.num_prompt_columns and not torch.equal(
                mask.bool(), torch.arange(stop) >= self._pads):
            raise BadArgsError("the attention_mask is not the one the KvdCache was opened with")
        expected = torch.arange(start, stop) - self._pads  # < 0 in pads
        is_token = expected >= 0
        if (positions is None or positions.shape[-1] != stop - start
                or not torch.equal(positions.expand_as(expected)[is_token], expected[is_token])):
            raise BadArgsError("in a padded batch a token's position is its index among its "
                               "row's real tokens: pass position_ids (generate derives them "
                               "from the attention mask)")

    def _locate(self, start: int, stop: int) -> None:
        """Where columns [start, stop) go, in each pool the layers use."""
        for group in self._groups:
            self._locate_in(group, start, stop)

    def _locate_in(self, group: _Group, start: int, stop: int) -> None:
        """Read rows of every column up to `stop` (from column 0 on the first forward), write
        rows of the row's tokens this forward computes afresh, in one pool."""
        flat, pool, slots = group.flat, group.pool, group.slots
        begin = min(slots.num_columns, start)  # 0 at first; start again after a failed forward
        reads, writes, skips = [], [], []
        for row in self._rows:
            first = begin - row.num_pads
            pads = row.slots(0, 1, flat, pool) * -first if first < 0 else []  # token 0's K/V
            reads.append(pads + row.slots(max(0, first), stop - row.num_pads, flat, pool))
            # Columns before num_pads + num_cached hold pads or cached tokens: not stored.
            skip = min(max(0, row.num_pads + row.num_cached - start), stop - start)
            writes += row.slots(start + skip - row.num_pads, stop - row.num_pads, flat, pool)
            skips.append(skip)
        slots.set_read(begin, reads)
        if len(self._rows) == 1 and len(writes) == 1 and stop - start == 1:
            slots.write_index, slots.write_mask = writes[0], None
            return
        slots.write_index = torch.tensor(writes, dtype=torch.long)
        slots.write_mask = None if not any(skips) else (
            torch.arange(start, stop) >= torch.tensor([[start + skip] for skip in skips]))

    def close(self) -> None:
        """Seal each row's computed full blocks, close the sequences, drop every view of the pool.

        After a NoSpaceError in a forward it seals what fits in the blocks already held and
        adds a note to that error saying how much was kept; it raises nothing of its own then.
        """
        if self.is_closed:
            return
        self.is_closed = True
        self._hook.remove()
        num_columns = self._num_columns_done()
        for layer in self._layers:
            layer.detach()
        self._groups = []  # (their flat views of the pool)
        try:
            for row in self._rows:
                row.publish(max(row.num_cached, num_columns - row.num_pads))
        finally:
            _close_all(self._rows)
        if self._no_space is not None:
            self._note_kept(self._no_space)

    def _note_kept(self, error: NoSpaceError) -> None:
        rows = self.rows
        computed = sum(row.num_computed_tokens for row in rows)
        kept = sum(row.num_sealed_tokens - row.num_cached_tokens for row in rows)
        error.add_note(f"KvdCache.close() kept the K/V of {kept} of the {computed} tokens it "
                       f"computed, in sealed blocks (cache.rows[i].num_sealed_tokens per row); "
                       f"the {computed - kept} in partial blocks are dropped")

    def __enter__(self) -> KvdCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise BadArgsError(f"{UNSUPPORTED_BEAM_SEARCH}; a KvdCache's rows are sealed and shared, "
                           "so reordering, repeating, selecting rows, crop and reset are not "
                           "supported either")

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = reset = _unsupported


def _close_all(rows: list[_Row]) -> None:
    """Close every row's sequence; raise the first error once all were tried."""
    first_error: KvdError | None = None
    for row in rows:
        try:
            row.close()
        except KvdError as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error


@dataclass(frozen=True)
class KvdGeneration:
    """What `generate_with_kvd` did."""

    output: Any  # what model.generate returned
    rows: list[KvdRow]  # per batch row (after num_return_sequences' repeats)

    @property
    def num_prompt_tokens(self) -> int:
        """Real prompt tokens of every row."""
        return sum(row.num_prompt_tokens for row in self.rows)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from kvd: their prefill was skipped."""
        return sum(row.num_cached_tokens for row in self.rows)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V this call computed and stored (prompt tails and decode)."""
        return sum(row.num_computed_tokens for row in self.rows)


def generate_with_kvd(model: PreTrainedModel, client: Any,
                      input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], *,
                      attention_mask: torch.Tensor | None = None, salt: bytes | None = None,
                      kvd_model: str | None = None, **generate_kwargs: Any) -> KvdGeneration:
    """`model.generate` on a KvdCache: reuse each row's cached prefix, seal its new full blocks.

    Args:
        input_ids: one prompt (a list of ints, or shape (n,) or (1, n)), a list of prompts of
            any lengths (padded on the left here), or a left-padded batch (b, n).
        attention_mask: the mask of a padded (b, n) batch.
        salt: hashing namespace; default `model_salt(model)`.
        kvd_model: the daemon model whose pools hold a hybrid model's layers (KvdCache).
        generate_kwargs: for `model.generate`; num_return_sequences=k repeats each prompt k
            times in the batch; num_beams > 1 raises BadArgsError.
    `generate` gets the whole batch; the cache's length makes it compute only the uncached
    tails, with positions and attention mask covering every column.
    """
    if not isinstance(model, GenerationMixin):
        raise BadArgsError(f"{type(model).__name__} cannot generate: pass a model with a "
                           "language-modelling head (e.g. ...ForCausalLM)")
    config = generate_kwargs.get("generation_config") or model.generation_config
    if (generate_kwargs.get("num_beams") or config.num_beams or 1) > 1:
        raise BadArgsError(UNSUPPORTED_BEAM_SEARCH)
    repeats = (generate_kwargs.pop("num_return_sequences", None)
               or config.num_return_sequences or 1)
    ids, mask = _batch(input_ids, attention_mask, model.generation_config.pad_token_id or 0)
    if repeats > 1:
        ids = ids.repeat_interleave(repeats, 0)
        mask = None if mask is None else mask.repeat_interleave(repeats, 0)
    if mask is not None:
        generate_kwargs["attention_mask"] = mask
    with KvdCache(client, model, ids, attention_mask=mask, salt=salt,
                  kvd_model=kvd_model) as cache:
        output = model.generate(ids, cache=cache, num_return_sequences=1, **generate_kwargs)
    return KvdGeneration(output, cache.rows)


def _batch(input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
           attention_mask: torch.Tensor | None, pad_token_id: int
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`input_ids` as a (b, n) tensor and its mask (None: no pads)."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.reshape(-1, input_ids.shape[-1]), attention_mask
    if len(input_ids) and hasattr(input_ids[0], "__len__"):  # a list of prompts
        if attention_mask is not None:
            raise BadArgsError("attention_mask goes with a padded (b, n) tensor; a list of "
                               "prompts is padded here")
        prompts = [[int(t) for t in prompt] for prompt in input_ids]  # type: ignore[union-attr]
        width = max(len(prompt) for prompt in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask if bool((mask == 0).any()) else None
    return torch.tensor([[int(t) for t in input_ids]], dtype=torch.long), attention_mask  # type: ignore[arg-type]
