"""Two vLLM engines sharing prefixes through one kvd daemon, next to two engines without kvd.

    python -m bench.vllm_workload [--quick] [--out DIR]     (in the venv .ci/vllm builds)

The workload: 3 system prompts, 10 conversations (conversation i uses system prompt i % 3), each
a first turn (system prompt + a user message); then 6 of them ask a follow-up (system prompt +
first message + the answer + a second message): 16 requests. Conversation i's first turn runs on
engine i % 2 and its follow-up on the other engine. The first turns run engine by engine (engine
0's batch, then engine 1's, as when a replica joins a warm one), then the follow-ups on both at
once; so engine 1 finds the system prompts, and every follow-up its whole first turn, computed
by the other engine. Each setup has two engines with vLLM's own prefix cache on: without kvd an
engine recomputes what the other one computed, with kvd it loads it. The four engines run at
once and the setups take turns, 3 rounds of new prompts (1 with --quick), the setup going first
alternating. Reported side by side: prefill tokens computed (prompt tokens less those vLLM did
not prefill), time to first token (vLLM's `first_token_latency`: a wave's requests run as one
batch, so it includes waiting for the batch's prefill), and whether every greedy output is the
same token for token. The model is random: 4 layers, hidden size 512 (the tests' tiny one with
--quick, whose prefill is nearly free).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Daemon, bench_main, markdown_table, write_json
from bench.vllm_engine import MODEL_SHAPE, EngineProcess, LlamaShape, kvd_shape, make_model

# The full run's model: small, but with prefill that costs something on a CPU (13M parameters;
# the tests' model has 0.1M), so TTFT weighs the prefill kvd saves against what kvd costs.
BENCH_SHAPE: LlamaShape = {**MODEL_SHAPE, "hidden_size": 512, "intermediate_size": 1408,
                           "num_hidden_layers": 4, "num_attention_heads": 8,
                           "num_key_value_heads": 8}


@dataclass
class Workload:
    systems: list[list[int]]
    first: list[list[int]]  # per conversation: its first user message
    second: list[list[int]]  # per following-up conversation: its second user message
    max_tokens: int


def make_workload(seed: int = 0, system_tokens: int = 200, user_tokens: int = 24,
                  num_conversations: int = 10, num_follow_ups: int = 6,
                  max_tokens: int = 16) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]
    return Workload([tokens(system_tokens) for _ in range(3)],
                    [tokens(user_tokens) for _ in range(num_conversations)],
                    [tokens(user_tokens) for _ in range(num_follow_ups)], max_tokens)


def run_workload(engines: Sequence[EngineProcess], work: Workload) -> list[dict[str, Any]]:
    """The workload on `engines`; one record per request, in a fixed order."""
    n = len(engines)
    first = [work.systems[i % 3] + user for i, user in enumerate(work.first)]
    records = []
    for engine in range(n):
        records += _wave(engines, [(engine, f"c{i}.1", prompt) for i, prompt in enumerate(first)
                                   if i % n == engine], work.max_tokens)
    answers = {r["request"]: r["tokens"] for r in records}
    follow = [((i + 1) % n, f"c{i}.2", first[i] + answers[f"c{i}.1"] + user)
              for i, user in enumerate(work.second)]
    return sorted(records + _wave(engines, follow, work.max_tokens),
                  key=lambda r: r["request"])


def _wave(engines: Sequence[EngineProcess], requests: list[tuple[int, str, list[int]]],
          max_tokens: int) -> list[dict[str, Any]]:
    batches = [[(name, prompt) for e, name, prompt in requests if e == index]
               for index in range(len(engines))]
    for engine, batch in zip(engines, batches):
        if batch:
            engine.submit([prompt for _, prompt in batch], max_tokens)
    records = []
    for index, (engine, batch) in enumerate(zip(engines, batches)):
        if batch:
            outputs = engine.result()["outputs"]
            records += [{"request": name, "engine": index, **output}
                        for (name, _), output in zip(batch, outputs)]
    return sorted(records, key=lambda r: r["request"])


# The parts of the workload that kvd treats differently: engine 0's first turns find nothing
# (with kvd they save), engine 1's find the system prompts, the follow-ups their first turn.
PARTS = (("first turns, engine 0", lambda r: r["request"].endswith(".1") and r["engine"] == 0),
         ("first turns, engine 1", lambda r: r["request"].endswith(".1") and r["engine"] == 1),
         ("follow-ups", lambda r: r["request"].endswith(".2")))


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in records]
    return {"requests": len(records), "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "prefill_tokens": sum(r["prompt_tokens"] - r["num_cached_tokens"] for r in records),
            "ttft_mean_ms": 1e3 * statistics.mean(ttfts),
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_max_ms": 1e3 * max(ttfts)}


def start_engines(model: str, kvd_name: str | None, count: int = 2) -> list[EngineProcess]:
    return [EngineProcess(model, kvd_name, prefix_caching=True) for _ in range(count)]


def run_bench(quick: bool, out: Path) -> str:
    """Both setups' engines start together and take turns, round by round (new prompts each
    round, the setup going first alternating), so both meet the same machine load."""
    shape = MODEL_SHAPE if quick else BENCH_SHAPE
    rounds = 1 if quick else 3
    results: dict[str, list[dict[str, Any]]] = {"vLLM alone": [], "vLLM + kvd": []}
    with tempfile.TemporaryDirectory(prefix="kvd-vllm-model-") as model_dir, \
            Daemon(num_blocks=2048, **kvd_shape(shape)) as daemon:
        model = make_model(model_dir, shape=shape)
        setups = {"vLLM alone": start_engines(model, None),
                  "vLLM + kvd": start_engines(model, daemon.socket_path)}
        try:
            for engine in [e for engines in setups.values() for e in engines]:
                engine.wait_ready()
            for round_ in range(rounds):
                work = make_workload(seed=round_, system_tokens=96 if quick else 480,
                                     max_tokens=8 if quick else 16)
                order = list(setups) if round_ % 2 == 0 else list(setups)[::-1]
                for setup in order:
                    results[setup] += run_workload(setups[setup], work)
        finally:
            for engine in [e for engines in setups.values() for e in engines]:
                engine.close()
    alone, shared = results["vLLM alone"], results["vLLM + kvd"]
    same = [a["tokens"] == b["tokens"] for a, b in zip(alone, shared)]
    rows = []
    for setup, records in results.items():
        for part, chosen in (("all", records), *[(name, [r for r in records if pick(r)])
                                                 for name, pick in PARTS]):
            s = summary(chosen)
            rows.append([setup, part, s["requests"], s["prompt_tokens"], s["prefill_tokens"],
                         f"{s['ttft_mean_ms']:.1f}", f"{s['ttft_p50_ms']:.1f}",
                         f"{s['ttft_max_ms']:.1f}"])
    write_json(out, "vllm_workload", {"shape": shape, "rounds": rounds, "records": results,
                                      "identical": same})
    return (f"## vLLM: two engines sharing prefixes through kvd (bench/vllm_workload.py)\n\n"
            f"{rounds} round(s) of 16 requests; model {shape['num_hidden_layers']} layers, "
            f"hidden size {shape['hidden_size']}.\n\n"
            + markdown_table(["setup", "part", "requests", "prompt tokens",
                              "prefill tokens computed", "TTFT mean ms", "TTFT p50 ms",
                              "TTFT max ms"], rows)
            + f"\n\nGreedy outputs identical: {sum(same)} of {len(same)} requests.\n")


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run_bench))
