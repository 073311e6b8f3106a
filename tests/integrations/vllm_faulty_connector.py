"""KvdConnector with faults injected between the scheduler's lookup and the worker's load.

For tests/integrations/test_vllm_engines.py only: the test writes an action into the file
$KVD_TEST_FAULT; the next lookup that finds blocks carries it out right after the lookup, in the
same engine step, before the worker loads those blocks:

    evict   drop the request's pins (as a daemon restart would) and fill the pool, so every
            block not pinned by someone else is evicted
    stop    shut the daemon down

Every non-empty set of load errors reported to vLLM is appended to $KVD_TEST_FAULT.errors as a
JSON line, so the test sees what vLLM was told to recompute.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from kvd.errors import NoSpaceError
from kvd.integrations.vllm.connector import KvdConnector as _KvdConnector
from kvd.runtime import resolve_socket


class KvdConnector(_KvdConnector):
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        matched, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        path = os.environ["KVD_TEST_FAULT"]
        if matched and os.path.exists(path):
            with open(path) as file:
                action = file.read().strip()
            os.unlink(path)
            client = self.link.client()
            assert client is not None
            if action == "evict":
                state = self.planner._requests[request.request_id]
                self.link.release(state.pinned, state.session)
                state.session = None  # its pins are gone: the planner releases nothing more
                _fill(client)
            elif action == "stop":
                socket_path = resolve_socket(self.link.name)
                client.shutdown()
                while os.path.exists(socket_path):
                    time.sleep(0.01)
            else:
                raise ValueError(f"unknown fault {action!r}")
        return matched, load_async

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            with open(os.environ["KVD_TEST_FAULT"] + ".errors", "a") as file:
                file.write(json.dumps(sorted(errors)) + "\n")
        return errors


def _fill(client: Any) -> None:
    """Allocate until the pool is full (evicting every unpinned block), then free it all."""
    taken: list[int] = []
    for chunk in (8, 1):
        try:
            while True:
                taken += client.alloc(chunk)
        except NoSpaceError:
            pass
    for start in range(0, len(taken), 256):
        client.release(taken[start:start + 256])
