"""One vLLM engine in its own process, driven over stdin/stdout (the vLLM tests, bench/vllm_*).

    python bench/vllm_engine.py --model DIR [--kvd NAME] [--connector MODULE] [--prefix-caching]

Prints `@@kvd {"ready": ...}` once the engine is up, then answers each JSON line it reads
(`{"prompts": [[token ids], ...], "max_tokens": N}`) with one line `@@kvd {JSON}` (vLLM logs
to stdout too): per prompt its greedy output token ids, its prompt length, `num_cached_tokens`
(tokens vLLM did not prefill: its own prefix cache's and kvd's) and its time to first token.
EOF on stdin ends it. Without --kvd the engine runs with no connector. `EngineProcess` starts
and drives one from another process. `make_model(DIR)` writes the tiny random Llama they use
(with `save_pretrained`, so vLLM loads it as it loads any checkpoint; no hub).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from vllm import LLM

# The engine lives in this process: one process per engine, and the tests start two of them.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class LlamaShape(TypedDict):
    """A random Llama's shape: `LlamaConfig`'s keywords."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


MODEL_SHAPE: LlamaShape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 2, "num_attention_heads": 2,
                           "num_key_value_heads": 2, "max_position_embeddings": 1024}
# head_dim 32: the CPU attention backend's smallest head size. Block size 32: a multiple of 32,
# as its kernels want, and small enough for a 300-token prompt to fill 9 blocks.
BLOCK_SIZE = 32
MARKER = "@@kvd "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvd_shape(model_shape: LlamaShape) -> dict[str, Any]:
    """The `kvd start` geometry flags (as keywords) for a model of `model_shape`."""
    return {"layers": model_shape["num_hidden_layers"],
            "kv_heads": model_shape["num_key_value_heads"],
            "head_dim": model_shape["hidden_size"] // model_shape["num_attention_heads"],
            "block_size": BLOCK_SIZE, "dtype": "float32"}


KVD_SHAPE = kvd_shape(MODEL_SHAPE)


def make_model(path: str, seed: int = 0, shape: LlamaShape = MODEL_SHAPE) -> str:
    """Write a random Llama (float32) to `path` unless it is there; return `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    # A wide initialisation makes greedy outputs depend on the whole context (a narrow one
    # repeats one token whatever the K/V), so corrupted K/V shows in the output.
    model = LlamaForCausalLM(LlamaConfig(**shape, initializer_range=0.3))
    model.save_pretrained(path)
    return path


def make_llm(model: str, kvd_name: str | None, connector: str, prefix_caching: bool) -> LLM:
    from vllm import LLM
    kwargs: dict[str, Any] = {}
    if kvd_name is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvdConnector", "kv_connector_module_path": connector,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvd_name": kvd_name}}
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               block_size=BLOCK_SIZE, max_model_len=1024, max_num_seqs=8, seed=0,
               enable_prefix_caching=prefix_caching, disable_log_stats=False, **kwargs)


def answer(llm: LLM, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in command["prompts"]], params,
                           use_tqdm=False)
    return {"seconds": time.perf_counter() - started, "outputs": [{
        "tokens": list(out.outputs[0].token_ids), "prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens or 0,
        "ttft_s": out.metrics.first_token_latency if out.metrics is not None else None,
    } for out in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kvd", default=None, help="daemon name; none: no connector")
    parser.add_argument("--connector", default="kvd.integrations.vllm")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="vLLM's own prefix cache (off: every hit is kvd's)")
    args = parser.parse_args()
    started = time.perf_counter()
    llm = make_llm(make_model(args.model), args.kvd, args.connector, args.prefix_caching)
    reply({"ready": time.perf_counter() - started})
    for line in sys.stdin:
        reply(answer(llm, json.loads(line)))


def reply(value: dict) -> None:
    print(f"\n{MARKER}{json.dumps(value)}", flush=True)





if __name__ == "__main__":
    main()


class EngineProcess:
    """`python bench/vllm_engine.py ...` as a child process; vLLM's own log lines are kept."""

    def __init__(self, model: str, kvd_name: str | None = None,
                 connector: str = "kvd.integrations.vllm", prefix_caching: bool = False,
                 env: dict[str, str] | None = None) -> None:
        command = [sys.executable, __file__, "--model", model, "--connector", connector]
        command += ["--kvd", kvd_name] if kvd_name is not None else []
        command += ["--prefix-caching"] if prefix_caching else []
        if env is None:  # this checkout's kvd, whatever the venv has installed
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.log: list[str] = []
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
            self.log.append(line)
        raise EOFError(f"the engine exited ({self.proc.wait()}):\n{''.join(self.log[-40:])}")

    def wait_ready(self) -> float:
        """Seconds the engine took to start."""
        return self._reply()["ready"]

    def submit(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Send a batch; `result()` reads its answer (so several engines can work at once)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        return self._reply()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        self.submit(prompts, max_tokens)
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
