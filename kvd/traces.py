"""Block-hash request traces (the Mooncake JSONL format of ../shared/traces).

One request per line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}`. `hash_ids` are prefix-chained hashes of 512-token blocks remapped to
integers: equal ids mean equal prefixes up to and including that block, so an id stands for a
block's content key exactly as `kvd.hash_blocks` digests do in the daemon. The last id may cover
a partial block (`len(hash_ids) == ceil(input_length / 512)`).

Decode blocks. The traces list prompt blocks only, but an engine also writes the blocks its
output fills: a request with P = input_length // 512 full prompt blocks writes
(input_length + output_length) // 512 - P more full blocks during decode (the first one starts
with the prompt's partial tail). In a multi-turn conversation the next turn's prompt contains this
turn's output, so those blocks are exactly what the follow-up may reuse. `decode_blocks` gives
them keys:
  * the follow-up's keys, when the request has an unambiguous *follow-up*: its last full prompt
    block first appears in this request (so the prefix is its own, not a shared system prompt or
    document that unrelated requests extend), the first later request extending that prefix has a
    prompt long enough to hold this prompt plus the output, and that request's next block is new
    content (first seen there);
  * otherwise fresh negative ids: written, cached, never reused.
The rule errs toward fewer follow-ups (a turn whose last full block repeats an earlier one is not
matched): on conversation_trace_part1.jsonl 1,035 of its 4,177 decode blocks get a follow-up
key, on synthetic_trace.jsonl 15 of 824.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvd.errors import BadArgsError, NotFoundError

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True, slots=True)
class Request:
    """One traced request: arrival time, prompt and output lengths, prompt block keys."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[Request]:
    """Read a JSONL trace.

    Raises:
        NotFoundError: the file does not exist.
        BadArgsError: a line is not a request record; the message names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise NotFoundError(f"trace {path} does not exist: pass a JSONL file such as "
                            "../shared/traces/synthetic_trace.jsonl")
    with path.open() as lines:
        return [_parse(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]


def _parse(line: str, path: Path, number: int) -> Request:
    try:
        record = json.loads(line)
        hash_ids = tuple(int(key) for key in record["hash_ids"])
        return Request(int(record.get("timestamp", 0)), int(record["input_length"]),
                       int(record.get("output_length", 0)), hash_ids)
    except (ValueError, KeyError, TypeError) as exc:
        raise BadArgsError(f"{path}:{number} is not a trace record with input_length and "
                           f"hash_ids ({exc!r}): is this a Mooncake-format JSONL trace?") from exc


def write_trace(path: str | Path, requests: list[Request]) -> None:
    """Write `requests` in the same JSONL format (used for generated test fixtures)."""
    with Path(path).open("w") as out:
        for request in requests:
            out.write(json.dumps({"timestamp": request.timestamp_ms,
                                  "input_length": request.input_length,
                                  "output_length": request.output_length,
                                  "hash_ids": list(request.hash_ids)}) + "\n")


def decode_blocks(trace: Sequence[Request]) -> list[tuple[int, ...]]:
    """Per request, the keys of the full blocks its decode writes (module docstring), in order."""
    first_seen: dict[int, int] = {}
    requests_of: dict[int, list[int]] = {}
    for number, request in enumerate(trace):
        for key in request.hash_ids:
            first_seen.setdefault(key, number)
            requests_of.setdefault(key, []).append(number)
    fresh = itertools.count(-1, -1)
    result = []
    for number, request in enumerate(trace):
        num_prompt = request.input_length // TRACE_BLOCK_TOKENS
        num_decode = (request.input_length + request.output_length) // TRACE_BLOCK_TOKENS \
            - num_prompt
        follow_up = _follow_up(trace, number, num_prompt, first_seen, requests_of)
        if follow_up is None:
            result.append(tuple(next(fresh) for _ in range(num_decode)))
        else:
            result.append(follow_up.hash_ids[num_prompt: num_prompt + num_decode])
    return result


def _follow_up(trace: Sequence[Request], number: int, num_prompt: int,
               first_seen: dict[int, int], requests_of: dict[int, list[int]]) -> Request | None:
    """The next turn of request `number`, if there is an unambiguous one (module docstring)."""
    request = trace[number]
    if num_prompt == 0 or first_seen[request.hash_ids[num_prompt - 1]] != number:
        return None
    for later in requests_of[request.hash_ids[num_prompt - 1]][1:]:
        candidate = trace[later]
        if len(candidate.hash_ids) > num_prompt:
            is_long_enough = candidate.input_length >= request.input_length + request.output_length
            is_new = first_seen[candidate.hash_ids[num_prompt]] == later
            return candidate if is_long_enough and is_new else None
    return None
