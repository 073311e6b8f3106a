"""A decode worker: the NumPy transformer of workers/model.py with its KV cache in kvd.

Theory of operation
-------------------
For each request the worker

1. opens a kvd sequence from the prompt's token ids (`client.open_sequence`, one round trip):
   the daemon hashes the full blocks, pins the longest cached prefix and allocates the rest;
2. prefills only tokens [num_cached_tokens, num_tokens) — the cached prefix's K/V is already in
   shared memory, written by whichever process computed it first — writing K/V in place into the
   sequence's blocks of `client.pool` (a `PagedKV` over the block table; no KV byte crosses the
   socket);
3. decodes greedily, appending each new token before computing its K/V; only a token whose
   position is past the block table goes to the daemon (`client.extend_sequence`, once every
   block_size tokens, with the tokens held since), which grows the table and seals the blocks
   those tokens filled, so a block becomes shareable when the next one is needed;
4. commits the rest and closes the sequence; its sealed blocks stay cached for the next request
   (a later turn of the same conversation, or another worker with the same system prompt).

The model's KV geometry (layers, KV heads, head dim) is taken from `client.geometry`; the query
heads are `heads_per_kv` times the KV heads. Every worker builds the same weights from the same
seed, and the sequences are salted with a digest of the model config so two different models
never share blocks.

The synthetic workload (`conversations`) is multi-turn chat: a few system prompts shared by all
workers, each conversation re-sending its whole history plus a new user turn, so both the system
prompt and the history are prefix hits. `python -m workers.attention --name NAME` runs one worker
process and prints its stats (one JSON line with --json); `kvd demo` runs several.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

import kvd
from workers.model import DecoderLM, ModelConfig, PagedKV


def config_for_geometry(geometry: kvd.geometry.Geometry, heads_per_kv: int = 2,
                        vocab_size: int = 512, seed: int = 0) -> ModelConfig:
    """The model whose KV fits one block of `geometry` exactly."""
    return ModelConfig(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
                       head_dim=geometry.head_dim, num_heads=heads_per_kv * geometry.num_kv_heads,
                       vocab_size=vocab_size, ffn_dim=4 * heads_per_kv * geometry.num_kv_heads
                       * geometry.head_dim // 2, seed=seed)


def model_salt(config: ModelConfig) -> bytes:
    """Hash namespace of a model: equal tokens under different weights must not share K/V."""
    return hashlib.blake2b(repr(config).encode(), digest_size=16).digest()


@dataclass
class RequestStats:
    prompt_tokens: int
    cached_tokens: int      # prefill skipped: K/V found in kvd
    new_tokens: int
    prefill_s: float        # from open_sequence (a round trip) to the first token's logits
    decode_s: float         # the other tokens, commit and close


@dataclass
class WorkerStats:
    """Totals over a worker's requests."""

    worker_id: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, r: RequestStats) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.new_tokens += r.new_tokens
        self.prefill_s += r.prefill_s
        self.decode_s += r.decode_s

    @property
    def prefix_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the worker's busy time (prefill + decode)."""
        busy_s = self.prefill_s + self.decode_s
        return self.new_tokens / busy_s if busy_s else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "prefix_hit_ratio": self.prefix_hit_ratio,
                "tokens_per_s": self.tokens_per_s}


class KvdDecoder:
    """Runs `DecoderLM` requests with their K/V in a kvd pool; keeps per-request stats."""

    def __init__(self, client: kvd.Client, model: DecoderLM, worker_id: int = 0):
        self.client = client
        self.model = model
        self.totals = WorkerStats(worker_id)
        self.last_request: RequestStats | None = None
        PagedKV(client.pool, []).check_config(model.config)  # the daemon's geometry fits the model
        self.salt = model_salt(model.config)

    def generate(self, prompt: np.ndarray, num_new_tokens: int
                 ) -> tuple[list[int], list[np.ndarray]]:
        """Greedy-decode `num_new_tokens` after `prompt`: new tokens and each step's logits.

        Same contract as `DecoderLM.generate`; the request's stats go to `last_request` and
        `totals`.
        """
        started = time.perf_counter()
        seq = self.client.open_sequence(prompt, salt=self.salt)
        try:
            # client.pool, not one kept from __init__: after a daemon's clean restart it is a
            # view of the new segment (the kept one would write into the old, unlinked memory).
            kv = PagedKV(self.client.pool, seq.block_ids, num_frozen_tokens=seq.num_cached_tokens)
            logits = self.model.prefill(prompt, seq.num_cached_tokens, kv)
            prefilled = time.perf_counter()
            append, flush = self._appender(seq)
            tokens, step_logits = self.model.decode(logits, len(prompt), num_new_tokens, kv,
                                                    append=append)
            flush()
            self.client.commit_sequence(seq)
        finally:
            self.client.close_sequence(seq)
        self.last_request = RequestStats(len(prompt), seq.num_cached_tokens, len(tokens),
                                         prefilled - started, time.perf_counter() - prefilled)
        self.totals.add(self.last_request)
        return tokens, step_logits

    def _appender(self, seq: kvd.Sequence) -> tuple[Callable[[int], None], Callable[[], None]]:
        """`append(token)` for the decode loop and `flush()` for after it.

        A generated token needs the daemon only when its position is past the block table
        (every block_size tokens): then the tokens held so far go in one `extend_sequence`,
        which grows the table in place (PagedKV holds the same list) and seals the blocks the
        earlier tokens filled. One request per token instead cost the decode loop about a
        fifth of its time (bench/e2e.py under py-spy). A filled block is thus published when the
        next block is needed or at the commit, not one token after it filled.
        """
        pending: list[int] = []
        block_size = self.client.geometry.block_size

        def flush() -> None:
            if pending:
                self.client.extend_sequence(seq, pending)
                pending.clear()

        def append(token_id: int) -> None:
            pending.append(token_id)
            if seq.num_tokens + len(pending) > len(seq.block_ids) * block_size:
                flush()
        return append, flush


@dataclass(frozen=True)
class Conversation:
    system_id: int
    system_prompt: np.ndarray
    user_turns: list[np.ndarray] = field(default_factory=list)


def conversations(worker_id: int, num_workers: int, num_conversations: int, num_turns: int,
                  num_system_prompts: int = 3, system_tokens: int = 256, user_tokens: int = 32,
                  vocab_size: int = 512, seed: int = 0) -> list[Conversation]:
    """This worker's share of a deterministic multi-turn chat workload.

    System prompt s is the same token ids in every process (seeded by s alone); conversation c of
    worker w uses system prompt (w + c * num_workers) % num_system_prompts, so every system prompt
    is used by several workers.
    """
    systems = [np.random.default_rng([seed, 0, s]).integers(0, vocab_size, system_tokens)
               for s in range(num_system_prompts)]
    result = []
    for c in range(num_conversations):
        system_id = (worker_id + c * num_workers) % num_system_prompts
        rng = np.random.default_rng([seed, 1, worker_id, c])
        turns = [rng.integers(0, vocab_size, user_tokens) for _ in range(num_turns)]
        result.append(Conversation(system_id, systems[system_id], turns))
    return result


GenerateFn = Callable[[np.ndarray, int], tuple[list[int], list[np.ndarray]]]


def run_conversation(generate: GenerateFn, conversation: Conversation, num_new_tokens: int
                     ) -> Iterator[list[np.ndarray]]:
    """Each turn re-sends the history (system prompt, earlier turns and replies) plus a new turn.

    Yields each turn's step logits; `generate(prompt, n) -> (tokens, step_logits)`.
    """
    history = conversation.system_prompt
    for user_turn in conversation.user_turns:
        prompt = np.concatenate([history, user_turn])
        tokens, step_logits = generate(prompt, num_new_tokens)
        history = np.concatenate([prompt, np.asarray(tokens, dtype=prompt.dtype)])
        yield step_logits


def run_worker(args: argparse.Namespace) -> tuple[WorkerStats, list[np.ndarray]]:
    """Connect, run this worker's conversations, return its stats and every request's logits."""
    with kvd.connect(args.name) as client:
        # The decoder holds views of the segment: it must be gone before the client unmaps it,
        # so it lives only inside _serve.
        try:
            return _serve(client, args)
        except BaseException as exc:
            drop_frames(exc)
            raise


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of the frames in `exc`'s traceback.

    They hold views of the segment (the decoder's pool); while they live, the client's close()
    cannot unmap it and raises InUseError, hiding `exc` — say NoSpaceError — behind it. (A
    frame also keeps its function alive, so no closure here may capture the decoder.)
    """
    traceback.clear_frames(exc.__traceback__)


def _serve(client: kvd.Client, args: argparse.Namespace) -> tuple[WorkerStats, list[np.ndarray]]:
    config = config_for_geometry(client.geometry, args.heads_per_kv, args.vocab_size, args.seed)
    decoder = KvdDecoder(client, DecoderLM(config), args.worker_id)
    all_logits: list[np.ndarray] = []
    for conversation in conversations(
            args.worker_id, args.num_workers, args.conversations, args.turns,
            args.system_prompts, args.system_tokens, args.user_tokens, args.vocab_size, args.seed):
        for step_logits in run_conversation(decoder.generate, conversation, args.new_tokens):
            all_logits.append(np.stack(step_logits))
    return decoder.totals, all_logits


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by a worker and `kvd demo` (the demo passes them through)."""
    parser.add_argument("--system-prompts", type=int, default=3, help="distinct system prompts")
    parser.add_argument("--system-tokens", type=int, default=256, help="tokens per system prompt")
    parser.add_argument("--conversations", type=int, default=2, help="conversations per worker")
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    parser.add_argument("--user-tokens", type=int, default=32, help="tokens per user turn")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--heads-per-kv", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="weights and workload seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.attention", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("--name", default=None, help="kvd daemon name or socket path")
    parser.add_argument("--worker-id", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=1, help="workers sharing the workload")
    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print stats as one JSON line")
    parser.add_argument("--save-logits", metavar="PATH",
                        help="save every request's step logits as .npy, shape "
                        "(requests, new_tokens, vocab)")
    return parser


def format_stats(stats: WorkerStats) -> str:
    return (f"worker {stats.worker_id}: {stats.requests} requests, {stats.new_tokens} tokens "
            f"at {stats.tokens_per_s:.0f} tokens/s, prefix hit ratio {stats.prefix_hit_ratio:.1%} "
            f"({stats.cached_tokens} of {stats.prompt_tokens} prompt tokens' prefill skipped)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stats, all_logits = run_worker(args)
    except kvd.KvdError as exc:
        print(f"worker {args.worker_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.save_logits:
        np.save(args.save_logits, np.stack(all_logits))
    print(json.dumps(stats.to_dict()) if args.json else format_stats(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
