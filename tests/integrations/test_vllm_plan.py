"""The vLLM connector's scheduler side (kvd/integrations/vllm/plan.py) without vLLM: what it
looks up, pins and releases, and which loads and saves it plans per step."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

import kvd
from kvd.integrations.vllm.plan import Planner

B = 4
SALT = b"model"


class FakePins:
    """The daemon's prefix index: `cached` hashes -> block ids; pins counted per block."""

    def __init__(self, cached: Sequence[bytes] = ()) -> None:
        self.ids = {h: 100 + i for i, h in enumerate(cached)}
        self.pins: dict[int, int] = {}
        self.session = object()

    def lookup(self, hashes: Sequence[bytes]) -> tuple[list[int], object]:
        found = []
        for h in hashes:
            if h not in self.ids:
                break
            found.append(self.ids[h])
            self.pins[self.ids[h]] = self.pins.get(self.ids[h], 0) + 1
        return found, self.session

    def release(self, block_ids: Sequence[int], session: object) -> None:
        assert session is self.session
        for block_id in block_ids:
            assert self.pins[block_id] > 0, f"block {block_id} released more than pinned"
            self.pins[block_id] -= 1

    def pinned(self) -> list[int]:
        return sorted(b for b, n in self.pins.items() if n)


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens)


def new_step(req: SimpleNamespace, block_ids: list[int], computed: int, scheduled: int):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,),
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: scheduled})


def cached_step(req: SimpleNamespace, new_block_ids: list[int] | None, computed: int,
                scheduled: int, resumed: bool = False):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req.request_id], resumed_req_ids={req.request_id} if resumed else set(),
            new_block_ids=[None if new_block_ids is None else (new_block_ids,)],
            num_computed_tokens=[computed]),
        num_scheduled_tokens={req.request_id: scheduled})


def test_a_hit_is_capped_one_token_short_pinned_loaded_and_released_when_finished():
    tokens = list(range(1, 18))  # 17 tokens: 4 full blocks
    hashes = kvd.hash_blocks(tokens, B, salt=SALT)
    pins = FakePins(hashes)  # kvd holds all 4 blocks
    planner = Planner(B, SALT, pins)
    req = request("r", tokens)
    assert planner.matched_tokens(req, 0) == 16  # 4 blocks: token 16 is left to compute
    tokens_short = tokens[:16]
    assert Planner(B, SALT, FakePins(hashes)).matched_tokens(request("s", tokens_short), 0) == 12
    planner.allocated(req, 16)
    plan = planner.step(new_step(req, [7, 8, 9, 10, 11], computed=16, scheduled=1))
    (load,) = plan.loads
    assert (load.block_ids, load.hashes) == ([7, 8, 9, 10], hashes)
    assert plan.saves == []  # kvd holds every full block already
    assert pins.pinned() == [100, 101, 102, 103]
    planner.finished(req)
    assert pins.pinned() == []


def test_pins_below_the_local_hit_or_past_what_vllm_takes_are_dropped_at_once():
    tokens = list(range(1, 26))
    hashes = kvd.hash_blocks(tokens, B, salt=SALT)
    pins = FakePins(hashes)
    planner = Planner(B, SALT, pins)
    req = request("r", tokens)
    assert planner.matched_tokens(req, 8) == 16  # vLLM's own cache has 2 blocks; kvd 6
    assert pins.pinned() == [102, 103, 104, 105]
    planner.allocated(req, 8)  # vLLM takes 2 of the 4
    assert pins.pinned() == [102, 103]
    plan = planner.step(new_step(req, list(range(7)), computed=16, scheduled=9))
    assert [(s.block_ids, s.hashes) for s in plan.loads] == [([2, 3], hashes[2:4])]
    planner.finished(req)
    assert pins.pinned() == []


def test_asking_again_releases_the_first_lookups_pins():
    tokens = list(range(1, 10))
    pins = FakePins(kvd.hash_blocks(tokens, B, salt=SALT))
    planner = Planner(B, SALT, pins)
    req = request("r", tokens)
    assert planner.matched_tokens(req, 0) == 8
    assert planner.matched_tokens(req, 0) == 8  # vLLM could not schedule it the first time
    assert pins.pinned() == [100, 101]
    planner.allocated(req, 0)  # then scheduled it with no kvd tokens after all
    assert pins.pinned() == []
    assert planner.step(new_step(req, [0, 1, 2], computed=0, scheduled=9)).loads == []


def test_full_blocks_are_saved_once_computed_and_known_with_chained_hashes_and_parents():
    prompt = list(range(1, 11))  # 10 tokens
    planner = Planner(B, SALT, FakePins())
    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 0
    planner.allocated(req, 0)
    # Chunked prefill: 6 tokens, then 4: block 0 is full after the first chunk, block 1 after.
    (save,) = planner.step(new_step(req, [5, 6, 7], computed=0, scheduled=6)).saves
    assert save.block_ids == [5]
    (save,) = planner.step(cached_step(req, None, computed=6, scheduled=4)).saves
    assert save.block_ids == [6]
    # Decode: block 2 (tokens 9..12) is saved in the step that computes token 12's K/V.
    req.all_token_ids.append(11)
    assert planner.step(cached_step(req, None, computed=10, scheduled=1)).saves == []
    req.all_token_ids.append(12)
    (save,) = planner.step(cached_step(req, [8], computed=11, scheduled=1)).saves
    hashes = kvd.hash_blocks(req.all_token_ids, B, salt=SALT)
    assert (save.block_ids, save.hashes, save.parents) == ([7], [hashes[2]], [hashes[1]])
    assert planner.step(cached_step(req, None, computed=12, scheduled=1)).saves == []


def test_a_rolled_back_request_saves_its_recomputed_blocks_again():
    tokens = list(range(1, 14))
    hashes = kvd.hash_blocks(tokens, B, salt=SALT)
    planner = Planner(B, SALT, FakePins(hashes[:2]))
    req = request("r", tokens)
    assert planner.matched_tokens(req, 0) == 8
    planner.allocated(req, 8)
    (save,) = planner.step(new_step(req, [0, 1, 2, 3], computed=8, scheduled=5)).saves
    assert save.block_ids == [2]
    # The load failed: vLLM rolled the request back to token 0 and recomputes everything; the
    # blocks it recomputes are saved (the first save was dropped, its step having failed).
    (save,) = planner.step(cached_step(req, None, computed=0, scheduled=13)).saves
    assert (save.block_ids, save.parents[0]) == ([0, 1, 2], None)
    # Preempted and resumed with a new block table: saved from the table it has now.
    (save,) = planner.step(cached_step(req, [9, 8, 7, 6], computed=0, scheduled=13,
                                       resumed=True)).saves
    assert save.block_ids == [9, 8, 7]


def test_vllm_taking_more_than_offered_is_a_bug_that_raises():
    tokens = list(range(1, 10))
    planner = Planner(B, SALT, FakePins(kvd.hash_blocks(tokens, B, salt=SALT)[:1]))
    req = request("r", tokens)
    assert planner.matched_tokens(req, 0) == 4
    with pytest.raises(AssertionError, match="offered 1 blocks"):
        planner.allocated(req, 8)
