"""Block-hash request traces (the Mooncake JSONL format of ../shared/traces).

One request per line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}`. `hash_ids` are prefix-chained hashes of 512-token blocks remapped to
integers: equal ids mean equal prefixes up to and including that block, so an id stands for a
block's content key exactly as `kvd.hash_blocks` digests do in the daemon. The last id may cover
a partial block (`len(hash_ids) == ceil(input_length / 512)`).
"""

from __future__ import annotations

import json
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
