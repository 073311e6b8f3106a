"""The connector's scheduler side, without vLLM: which blocks each step loads from kvd and saves.

Per request the planner keeps the chained kvd hashes of its full blocks (extended as tokens
arrive), the kvd blocks its lookup pinned, the vLLM block table, and how many of its leading
blocks kvd already holds (`num_saved`):

    matched_tokens(request, num_local)   hash every full block of the known tokens; look up the
                                         longest cached prefix, capped one token short of the
                                         end (the last token's logits must be computed); pin it;
                                         keep pins only past the local hit `num_local` (vLLM's
                                         own prefix cache), return how many tokens kvd adds.
                                         vLLM may ask again for a request it could not
                                         schedule: the earlier pins are released first
    allocated(request, n_external)       vLLM took those tokens: the load is planned for the
                                         request's next step; pins it will not load are dropped
    step(scheduler_output) -> StepPlan   per scheduled request: its planned load (vLLM block ids
                                         and kvd hashes), and the save of every full block whose
                                         tokens are all known and computed by the end of this
                                         step and that kvd does not hold yet
    finished(request)                    release the request's pins (when it finishes)

The worker looks the hashes up again before it copies (its own pins), so a block evicted or a
daemon restarted between this lookup and that load is a load error, never wrong K/V.
`num_saved` never passes the tokens vLLM counts as computed: when vLLM rolls a request back (a
failed load, a preemption) the blocks past that point are saved again once recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvd.hashing import hash_blocks


@dataclass
class LoadSpec:
    """Copy kvd's blocks with these hashes into these vLLM blocks (one request)."""

    req_id: str
    block_ids: list[int]  # vLLM's
    hashes: list[bytes]


@dataclass
class SaveSpec:
    """Copy these vLLM blocks into new kvd blocks and seal them under these hashes."""

    req_id: str
    block_ids: list[int]  # vLLM's
    hashes: list[bytes]
    parents: list[bytes | None]  # each block's parent in its chain (None: the chain's head)


@dataclass
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class Pins(Protocol):
    """What the planner needs of the daemon: pinned lookups, and releases of one session's pins."""

    def lookup(self, hashes: Sequence[bytes]) -> tuple[list[int], object]:
        """Block ids of the longest cached prefix, pinned, and a token naming the session."""

    def release(self, block_ids: Sequence[int], session: object) -> None:
        """Drop pins taken in `session` (nothing if that session is gone: its pins went too)."""


class _Request:
    def __init__(self, request: Any) -> None:
        self.request = request  # vLLM's Request: its all_token_ids grow as tokens are sampled
        self.hashes: list[bytes] = []
        self.pinned: list[int] = []
        self.session: object = None
        self.first_pinned = 0  # block index of pinned[0]
        self.load: tuple[int, int] | None = None  # block range to load at the next step
        self.block_ids: list[int] = []
        self.num_saved = 0


class Planner:
    def __init__(self, block_size: int, salt: bytes, pins: Pins) -> None:
        self.block_size = block_size
        self.salt = salt
        self.pins = pins
        self._requests: dict[str, _Request] = {}

    def matched_tokens(self, request: Any, num_local: int) -> int:
        """Tokens past `num_local` (block-aligned) whose K/V kvd holds; pins them."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request)
        self._drop_pins(state)
        tokens = request.all_token_ids
        loadable = self._hashes(state, len(tokens))[:(len(tokens) - 1) // self.block_size]
        first = num_local // self.block_size
        block_ids, session = self.pins.lookup(loadable) if loadable else ([], None)
        # Blocks past kvd's hit are saved once computed, those of vLLM's local hit included.
        state.num_saved = len(block_ids)
        state.pinned, state.session, state.first_pinned = block_ids, session, 0
        self._keep_pins(state, first, len(block_ids))
        return max(0, len(block_ids) - first) * self.block_size

    def allocated(self, request: Any, num_external: int) -> None:
        """vLLM allocated blocks for `num_external` tokens from kvd (0: it loads none)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        first = state.first_pinned
        last = first + num_external // self.block_size
        if num_external % self.block_size or last > first + len(state.pinned):
            raise AssertionError(f"vLLM took {num_external} tokens from kvd, which offered "
                                 f"{len(state.pinned)} blocks of {self.block_size}")
        state.load = (first, last) if last > first else None
        self._keep_pins(state, first, last)

    def step(self, output: Any) -> StepPlan:
        """The loads and saves of the step vLLM scheduled (`SchedulerOutput`)."""
        plan = StepPlan()
        computed: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids += new_ids[0]
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, num_computed in computed.items():
            state = self._requests[req_id]
            self._plan_load(state, plan)
            self._plan_save(state, num_computed,
                            num_computed + output.num_scheduled_tokens.get(req_id, 0), plan)
        return plan

    def finished(self, request: Any) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._drop_pins(state)

    def _plan_load(self, state: _Request, plan: StepPlan) -> None:
        if state.load is None:
            return
        first, last = state.load
        state.load = None
        plan.loads.append(LoadSpec(state.request.request_id, state.block_ids[first:last],
                                   state.hashes[first:last]))

    def _plan_save(self, state: _Request, computed_before: int, computed_after: int,
                   plan: StepPlan) -> None:
        size = self.block_size
        state.num_saved = min(state.num_saved, computed_before // size)
        known = min(computed_after, len(state.request.all_token_ids))
        full = min(known // size, len(state.block_ids))
        if full <= state.num_saved:
            return
        hashes = self._hashes(state, full * size)
        first = state.num_saved
        plan.saves.append(SaveSpec(state.request.request_id, state.block_ids[first:full],
                                   hashes[first:full],
                                   [hashes[i - 1] if i else None for i in range(first, full)]))
        state.num_saved = full

    def _hashes(self, state: _Request, num_tokens: int) -> list[bytes]:
        """The request's chained hashes, extended to cover its first `num_tokens` tokens."""
        size, hashes = self.block_size, state.hashes
        if num_tokens // size > len(hashes):
            tokens = state.request.all_token_ids[len(hashes) * size:num_tokens // size * size]
            hashes += hash_blocks(list(tokens), size, parent=hashes[-1] if hashes else None,
                                  salt=self.salt)
        return hashes

    def _keep_pins(self, state: _Request, first: int, last: int) -> None:
        """Keep the pins on blocks [first, last) of the request; release the others."""
        offset = state.first_pinned
        pinned = state.pinned
        keep = pinned[first - offset:last - offset]
        drop = pinned[:max(0, first - offset)] + pinned[max(0, last - offset):]
        state.pinned, state.first_pinned = keep, first
        self._release(drop, state.session)

    def _drop_pins(self, state: _Request) -> None:
        pinned, state.pinned, state.load = state.pinned, [], None
        self._release(pinned, state.session)

    def _release(self, block_ids: Iterable[int], session: object) -> None:
        block_ids = list(block_ids)
        if block_ids:
            self.pins.release(block_ids, session)
