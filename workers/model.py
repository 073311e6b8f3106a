"""A small decoder-only transformer in NumPy whose KV cache is a pluggable store.

Theory of operation
-------------------
The model is a Llama-shaped decoder: token embedding → `num_layers` × (RMSNorm → grouped-query
attention with RoPE → residual, RMSNorm → SwiGLU MLP → residual) → RMSNorm → LM head (tied to the
embedding by default). Weights are random, drawn from a fixed seed, so every process that builds
the same `ModelConfig` holds bit-identical weights — that is what lets one worker reuse another's
K/V.

The math never knows where K/V lives. `DecoderLM.forward(token_ids, start_pos, kv)` computes the
queries, keys and values of tokens [start_pos, start_pos + T), hands K/V to `kv.write`, then reads
the keys and values of every position [0, start_pos + T) back through `kv.read` and attends over
them. Reading back what was written (rather than using the fresh float32 K/V) keeps a token's
attention identical whether its own K/V was computed now or cached earlier, also for float16
stores. Two stores implement that protocol:

* `ContiguousKV` — one growing array per layer: the reference (test oracle).
* `PagedKV` — a block table over a pool array of shape
  `(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`, the kvd layout. K and V
  move in contiguous runs: a block's B tokens of one layer's K (or V) are one `(B, H, D)` run in
  the pool. A write of T tokens is at most three assignments per part — a partial first block,
  every full block in one scatter of runs (kvd/blockcopy.py: with streaming stores when the
  write is large, 1.45-1.5x faster at 16 MiB), a partial last block — after checking every
  block id it touches; a gather is one
  `np.take` of whole runs per part into a buffer the PagedKV keeps, already in token order, and
  the model's `read` keeps such a copy per layer and takes only the blocks written (or
  re-tabled) since, so a decode step copies one block per layer. Those buffers start on a page
  boundary, as the pool does (kvd/blockcopy.py's `page_aligned_empty`: a gather took 1.8x as
  long into an `np.empty` buffer, `python -m bench.data_plane`). With the
  geometry of bench/data_plane.py, the per-token scatter this replaced (T runs of H*D values)
  wrote 1.4-1.6x slower, and gathering K and V together into a fresh array, then untangling them
  with a transposing copy, read float32 about 3x slower (mostly faulting in the fresh
  pages). Positions below `num_frozen_tokens` belong to cached (sealed, shared, read-only)
  blocks: writes there are dropped, because the bytes are already the K/V this model would
  compute.

One `forward` serves prefill (T tokens, a batched matmul with a causal mask offset by
`start_pos`) and decode (T = 1, no mask needed). Compute is float32 whatever the storage dtype;
float16 and bfloat16 stores round on write (bfloat16 is stored as uint16 words, as in kvd).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvd.blockcopy import STREAMING_MIN_NBYTES, page_aligned_empty, scatter_rows
from kvd.errors import BadArgsError

K, V = 0, 1


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the model; `num_heads` must be a multiple of `num_kv_heads` (GQA)."""

    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_heads: int = 4
    vocab_size: int = 512
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False   # tied heads make a random model repeat its input token
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise BadArgsError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                               f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise BadArgsError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def model_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class KVStore(Protocol):
    """Where a sequence's K/V lives: `write` then `read` per layer, positions in tokens."""

    def write(self, layer: int, start_pos: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store K/V (T, num_kv_heads, head_dim) for positions [start_pos, start_pos + T)."""

    def read(self, layer: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, num_tokens) as float32 (num_tokens, num_kv_heads, head_dim).

        They may be views of the store's own memory: use them before the next `write` or `read`.
        """


def to_storage(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float32 `x` to a store's dtype; uint16 means bfloat16 words (round to nearest even)."""
    if dtype != np.uint16:
        return x.astype(dtype, copy=False)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def from_storage(x: np.ndarray) -> np.ndarray:
    """A store's values as float32 (bfloat16 words are shifted into the high half)."""
    if x.dtype != np.uint16:
        return x.astype(np.float32, copy=False)
    return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)


class ContiguousKV:
    """The reference store: per layer, one array of `capacity` positions."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: npt.DTypeLike = np.float32):
        shape = (config.num_layers, 2, capacity, config.num_kv_heads, config.head_dim)
        self.cache = np.zeros(shape, dtype=dtype)

    def write(self, layer: int, start_pos: int, keys: np.ndarray, values: np.ndarray) -> None:
        end = start_pos + len(keys)
        self.cache[layer, K, start_pos:end] = to_storage(keys, self.cache.dtype)
        self.cache[layer, V, start_pos:end] = to_storage(values, self.cache.dtype)

    def read(self, layer: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        kv = from_storage(self.cache[layer, :, :num_tokens])
        return kv[K], kv[V]


class PagedKV:
    """A sequence's K/V in fixed-size blocks of a shared pool, addressed through a block table.

    Args:
        pool: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim) array.
        block_ids: the block table, block i holding positions [i*B, (i+1)*B). The list is kept by
            reference: a caller that grows it in place (kvd's `Sequence.block_ids`) is seen here.
        num_frozen_tokens: positions below this are in cached read-only blocks; writes skip them.
        streaming_min_nbytes: a write of at least this many bytes (K and V together) goes to
            the pool with streaming stores (kvd/blockcopy.py); the default is where they pay.
    """

    def __init__(self, pool: np.ndarray, block_ids: list[int], num_frozen_tokens: int = 0,
                 streaming_min_nbytes: float = STREAMING_MIN_NBYTES):
        if pool.ndim != 6 or pool.shape[2] != 2 or not pool.flags.c_contiguous:
            raise BadArgsError(f"pool must be a C-contiguous array of shape (num_blocks, "
                               f"num_layers, 2, block_size, num_kv_heads, head_dim), got "
                               f"{pool.shape}")
        self.pool = pool
        self.block_ids = block_ids
        self.block_size = pool.shape[3]
        self.num_frozen_tokens = num_frozen_tokens
        self.streaming_min_nbytes = streaming_min_nbytes
        # The pool as rows of one block's K or V of one layer: row (block * L + layer) * 2 + part.
        self._runs = pool.reshape(-1, math.prod(pool.shape[3:]))
        self._gathered = page_aligned_empty((2, 0, self._runs.shape[1]), pool.dtype)
        # `read`'s float32 copy of each layer, the block table it was copied from, and how many
        # of its leading blocks no write has touched since.
        num_layers = pool.shape[1]
        self._copies = [page_aligned_empty((2, 0, self._runs.shape[1]), "float32")] * num_layers
        self._copied_ids: list[list[int]] = [[] for _ in range(num_layers)]
        self._num_clean = [0] * num_layers

    def check_config(self, config: ModelConfig) -> None:
        """Raise BadArgsError unless the pool's block shape fits `config`."""
        expected = (config.num_layers, config.num_kv_heads, config.head_dim)
        actual = (self.pool.shape[1], self.pool.shape[4], self.pool.shape[5])
        if actual != expected:
            raise BadArgsError(f"pool holds (layers, kv heads, head dim) = {actual} but the model "
                               f"needs {expected}: start kvd with matching --layers/--kv-heads/"
                               "--head-dim")

    def write(self, layer: int, start_pos: int, keys: np.ndarray, values: np.ndarray) -> None:
        skip = max(0, self.num_frozen_tokens - start_pos)
        start, end = start_pos + skip, start_pos + len(keys)
        if start >= end:
            return
        self._check_length(end)
        block_size = self.block_size
        table = self.block_ids
        first_block = start // block_size
        head_end = min(end, -(-start // block_size) * block_size)  # partial first block
        tail_start = max(head_end, end // block_size * block_size)  # partial last block
        # Every block id is checked before anything is written: the partial ends alone (a
        # decode step's one-token write is all edge), then the full blocks.
        self._check_ids(layer, table[first_block:-(-head_end // block_size)]
                        + table[tail_start // block_size:-(-end // block_size)])
        if tail_start > head_end:
            full_rows = self._checked_rows(layer, table[head_end // block_size:
                                                        tail_start // block_size])
            # The whole write, K and V, decides the stores (kvd/blockcopy.py).
            streaming = (2 * (end - start) * self._runs.strides[0] // block_size
                         >= self.streaming_min_nbytes)
        self._num_clean[layer] = min(self._num_clean[layer], first_block)
        for part, data in ((K, keys[skip:]), (V, values[skip:])):
            data = to_storage(data, self.pool.dtype)
            if head_end > start:
                offset = start % block_size
                self.pool[table[first_block], layer, part,
                          offset:offset + head_end - start] = data[:head_end - start]
            if tail_start > head_end:
                runs = data[head_end - start:tail_start - start].reshape(len(full_rows), -1)
                scatter_rows(self._runs, full_rows + part, runs, streaming)
            if end > tail_start:
                self.pool[table[tail_start // block_size], layer, part,
                          :end - tail_start] = data[tail_start - start:]

    def gather(self, layer: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, num_tokens) in the pool's dtype, (num_tokens, H, D) each.

        Both are views of a buffer this PagedKV reuses: they hold until its next `gather`. A
        fresh output per call had glibc map and fault in new pages every time, which cost 5-6x
        the copy itself (bench/data_plane.py). Every call copies every block (the data plane's
        measure); `read` copies only what changed.
        """
        self._check_length(num_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        self._gathered = self._copy_blocks(self._gathered, layer, self.block_ids[:num_blocks], 0)
        tokens = self._gathered[:, :num_blocks].reshape(2, -1, *self.pool.shape[4:])
        return tokens[K, :num_tokens], tokens[V, :num_tokens]

    def _copy_blocks(self, buffer: np.ndarray, layer: int, table: list[int],
                     start: int) -> np.ndarray:
        """Copy the K and V runs of `table[start:]` at `layer` into `buffer` after its first
        `start` blocks, converted to the buffer's dtype (the pool's, or float32); returns the
        buffer, grown geometrically if it was too small (decode adds a token a step), with those
        first blocks kept."""
        num_blocks = len(table)
        if buffer.shape[1] < num_blocks:
            grown = page_aligned_empty(
                (2, max(num_blocks, 2 * buffer.shape[1]), self._runs.shape[1]), buffer.dtype)
            grown[:, :start] = buffer[:, :start]
            buffer = grown
        rows = self._checked_rows(layer, table[start:])
        for part in (K, V):
            if buffer.dtype == self.pool.dtype:
                # mode="clip" copies straight into `out` ("raise" stages through a temporary);
                # _checked_rows has done the bounds check.
                np.take(self._runs, rows + part, axis=0, out=buffer[part, start:num_blocks],
                        mode="clip")
            else:  # a half-precision pool: only these blocks are converted
                buffer[part, start:num_blocks] = from_storage(self._runs[rows + part])
        return buffer

    def _check_length(self, num_tokens: int) -> None:
        """BadArgsError unless the block table covers positions [0, num_tokens) (a slice of it
        would quietly give fewer tokens than asked for)."""
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > len(self.block_ids):
            raise BadArgsError(f"positions [0, {num_tokens}) need {num_blocks} blocks of "
                               f"{self.block_size} tokens but the block table holds "
                               f"{len(self.block_ids)}")

    def _checked_rows(self, layer: int, block_ids: list[int]) -> np.ndarray:
        """Rows of `self._runs` holding the K of `block_ids` at `layer` (V is the next row)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        num_blocks, num_layers = self.pool.shape[:2]
        if not 0 <= layer < num_layers or (
                ids.size and not 0 <= ids.min() <= ids.max() < num_blocks):
            raise self._outside(layer)
        return (ids * num_layers + layer) * 2

    def _check_ids(self, layer: int, block_ids: list[int]) -> None:
        """`_checked_rows`'s check for the one or two ids of a write's partial blocks, in Python
        (NumPy's min and max cost ~1 us each, whatever the size; Python's grow with it)."""
        num_blocks, num_layers = self.pool.shape[:2]
        if not 0 <= layer < num_layers or not all(0 <= i < num_blocks for i in block_ids):
            raise self._outside(layer)

    def _outside(self, layer: int) -> BadArgsError:
        num_blocks, num_layers = self.pool.shape[:2]
        return BadArgsError(f"layer {layer} or a block id in the table is outside the pool "
                            f"({num_layers} layers, {num_blocks} blocks)")

    def read(self, layer: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions [0, num_tokens) as float32, (num_tokens, H, D) each, for the model.

        Decode reads every layer once per generated token, and since a layer's last read only
        the block its write touched has changed: sealed blocks are immutable and the sequence's
        pins keep every block of the table its own. So each layer keeps a copy of its own, and a
        read copies only the blocks from the first one written (or whose table entry changed)
        since, one block per decode step instead of the whole context (a kvd worker's decode
        spent 16 % of its time re-gathering, bench/e2e.py under py-spy). The cost is one
        layer's copy per layer instead of one buffer: a private K/V of the sequence, as
        ContiguousKV holds. The copies are float32 whatever the pool's dtype, so a half-precision
        pool's blocks are converted once too, not the whole context every step (converting it on
        each read took a float16 decode step 23.5 ms per layer at 4k tokens, now 0.2 ms:
        bench/data_plane.py). The views hold until this layer's next `read`.
        """
        self._check_length(num_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        table = self.block_ids[:num_blocks]
        clean = min(self._num_clean[layer], num_blocks)
        if self._copied_ids[layer][:clean] != table[:clean]:  # re-tabled (never in decode)
            clean = 0
        self._copies[layer] = copy = self._copy_blocks(self._copies[layer], layer, table, clean)
        self._copied_ids[layer], self._num_clean[layer] = table, num_blocks
        tokens = copy[:, :num_blocks].reshape(2, -1, *self.pool.shape[4:])
        return tokens[K, :num_tokens], tokens[V, :num_tokens]


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray   # (model_dim,)
    wq: np.ndarray          # (model_dim, num_heads * head_dim)
    wk: np.ndarray          # (model_dim, num_kv_heads * head_dim)
    wv: np.ndarray          # (model_dim, num_kv_heads * head_dim)
    wo: np.ndarray          # (num_heads * head_dim, model_dim)
    mlp_norm: np.ndarray    # (model_dim,)
    w_gate: np.ndarray      # (model_dim, ffn_dim)
    w_up: np.ndarray        # (model_dim, ffn_dim)
    w_down: np.ndarray      # (ffn_dim, model_dim)


def _dense(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    # 1/sqrt(fan_in) keeps activations O(1) through the stack, so logits are not degenerate.
    return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)


def _norm_gain(rng: np.random.Generator, dim: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)


def _layer_weights(rng: np.random.Generator, c: ModelConfig) -> LayerWeights:
    kv_dim = c.num_kv_heads * c.head_dim
    return LayerWeights(
        attn_norm=_norm_gain(rng, c.model_dim), wq=_dense(rng, c.model_dim, c.model_dim),
        wk=_dense(rng, c.model_dim, kv_dim), wv=_dense(rng, c.model_dim, kv_dim),
        wo=_dense(rng, c.model_dim, c.model_dim), mlp_norm=_norm_gain(rng, c.model_dim),
        w_gate=_dense(rng, c.model_dim, c.ffn_dim), w_up=_dense(rng, c.model_dim, c.ffn_dim),
        w_down=_dense(rng, c.ffn_dim, c.model_dim),
    )


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class DecoderLM:
    """The transformer; `forward` runs prefill (T > 1) or decode (T == 1) against any KVStore."""

    def __init__(self, config: ModelConfig):
        self.config = config
        rng = np.random.default_rng(config.seed)
        embedding = rng.standard_normal((config.vocab_size, config.model_dim))
        self.embedding = embedding.astype(np.float32)
        self.layers = [_layer_weights(rng, config) for _ in range(config.num_layers)]
        self.final_norm = _norm_gain(rng, config.model_dim)
        self.lm_head = (self.embedding.T / np.sqrt(config.model_dim) if config.tie_embeddings
                        else _dense(rng, config.model_dim, config.vocab_size))
        half = config.head_dim // 2
        self.inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)

    def forward(self, token_ids: np.ndarray, start_pos: int, kv: KVStore) -> np.ndarray:
        """Logits (T, vocab_size) of tokens at positions [start_pos, start_pos + T).

        K/V of positions below `start_pos` must already be in `kv`; this call writes the rest.
        """
        token_ids = np.asarray(token_ids)
        if token_ids.ndim != 1 or token_ids.size == 0:
            raise BadArgsError(f"token_ids must be a non-empty 1-D array, got shape "
                               f"{token_ids.shape}")
        c = self.config
        x = self.embedding[token_ids]
        cos, sin = self._rope(start_pos, len(token_ids))
        mask = self._causal_mask(start_pos, len(token_ids))
        for layer, w in enumerate(self.layers):
            x = x + self._attention(layer, w, rms_norm(x, w.attn_norm, c.rms_eps),
                                    start_pos, kv, cos, sin, mask)
            h = rms_norm(x, w.mlp_norm, c.rms_eps)
            x = x + (silu(h @ w.w_gate) * (h @ w.w_up)) @ w.w_down
        return rms_norm(x, self.final_norm, c.rms_eps) @ self.lm_head

    def _rope(self, start_pos: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        angles = np.arange(start_pos, start_pos + num_tokens)[:, None] * self.inv_freq
        # (T, 1, D/2): broadcast over heads.
        return (np.cos(angles).astype(np.float32)[:, None, :],
                np.sin(angles).astype(np.float32)[:, None, :])

    @staticmethod
    def _causal_mask(start_pos: int, num_tokens: int) -> np.ndarray | None:
        """Additive (T, start_pos + T) mask: query t sees keys at positions <= start_pos + t."""
        if num_tokens == 1:
            return None
        keys = np.arange(start_pos + num_tokens)
        queries = np.arange(start_pos, start_pos + num_tokens)
        return np.where(keys[None, :] > queries[:, None], -np.inf, 0.0).astype(np.float32)

    @staticmethod
    def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def _attention(self, layer: int, w: LayerWeights, h: np.ndarray, start_pos: int,
                   kv: KVStore, cos: np.ndarray, sin: np.ndarray,
                   mask: np.ndarray | None) -> np.ndarray:
        c = self.config
        num_tokens = len(h)
        q = self._apply_rope((h @ w.wq).reshape(num_tokens, c.num_heads, c.head_dim), cos, sin)
        k = self._apply_rope((h @ w.wk).reshape(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = (h @ w.wv).reshape(num_tokens, c.num_kv_heads, c.head_dim)
        kv.write(layer, start_pos, k, v)
        keys, values = kv.read(layer, start_pos + num_tokens)           # (S, Hkv, D)
        # GQA: query head j uses KV head j // group_size; group the queries instead of
        # repeating K/V, so the matmul batches over KV heads: (Hkv, G*T, D) @ (Hkv, D, S).
        q = q.reshape(num_tokens, c.num_kv_heads, c.group_size, c.head_dim)
        q = q.transpose(1, 2, 0, 3).reshape(c.num_kv_heads, c.group_size * num_tokens, c.head_dim)
        scores = q @ keys.transpose(1, 2, 0) * np.float32(1.0 / np.sqrt(c.head_dim))
        if mask is not None:
            scores = scores.reshape(c.num_kv_heads, c.group_size, num_tokens, -1) + mask
            scores = scores.reshape(c.num_kv_heads, c.group_size * num_tokens, -1)
        out = softmax(scores) @ values.transpose(1, 0, 2)                # (Hkv, G*T, D)
        out = out.reshape(c.num_kv_heads, c.group_size, num_tokens, c.head_dim)
        return out.transpose(2, 0, 1, 3).reshape(num_tokens, c.model_dim) @ w.wo

    def generate(self, prompt: np.ndarray, num_new_tokens: int, kv: KVStore,
                 num_cached_tokens: int = 0) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decoding: returns `num_new_tokens` new tokens and the logits that chose each."""
        logits = self.prefill(prompt, num_cached_tokens, kv)
        return self.decode(logits, len(prompt), num_new_tokens, kv)

    def decode(self, logits: np.ndarray, start_pos: int, num_new_tokens: int, kv: KVStore,
               append: Callable[[int], None] | None = None) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decode from the logits of position `start_pos - 1`.

        `append(token_id)` is called before each new token's K/V is computed (kvd grows the
        sequence's block table there); the last token is returned but never fed back.
        """
        step_logits = [logits]
        tokens = [int(np.argmax(logits))]
        for pos in range(start_pos, start_pos + num_new_tokens - 1):
            if append is not None:
                append(tokens[-1])
            step_logits.append(self.forward(np.array(tokens[-1:]), pos, kv)[0])
            tokens.append(int(np.argmax(step_logits[-1])))
        return tokens, step_logits

    def prefill(self, prompt: np.ndarray, num_cached_tokens: int, kv: KVStore,
                chunk_tokens: int = 512) -> np.ndarray:
        """Logits of the prompt's last token, computing K/V only past the cached prefix.

        Chunked prefill: at most `chunk_tokens` queries per forward bounds the (T, S) score
        matrices of a long prompt. A fully cached prompt still needs its last token's query, so
        that token is recomputed (its K/V write lands in a frozen block and PagedKV drops it).
        """
        if chunk_tokens <= 0:
            raise BadArgsError(f"chunk_tokens must be positive, got {chunk_tokens}")
        prompt = np.asarray(prompt)
        start = min(num_cached_tokens, len(prompt) - 1)
        for chunk_start in range(start, len(prompt), chunk_tokens):
            logits = self.forward(prompt[chunk_start:chunk_start + chunk_tokens], chunk_start, kv)
        return logits[-1]
