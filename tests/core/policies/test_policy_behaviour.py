"""What makes each policy itself: ARC's ghost adaptation, S3-FIFO's quick demotion, SIEVE's
hand, kvd's adaptive split, LRU/LFU order."""

from __future__ import annotations

from kvd.core.policies import (AdaptiveS3FIFOPolicy, ARCPolicy, LFUPolicy, LRUPolicy, S3FIFOPolicy,
                          SIEVEPolicy)


def fill(policy, keys) -> None:
    for key in keys:
        policy.inserted(key)


def test_lru_evicts_least_recent() -> None:
    policy = LRUPolicy(3)
    fill(policy, "abc")
    policy.accessed("a")
    assert [policy.victim() for _ in range(3)] == ["b", "c", "a"]


def test_lfu_evicts_least_frequent_then_oldest() -> None:
    policy = LFUPolicy(4)
    fill(policy, "abcd")
    for key in "aaab":
        policy.accessed(key)
    assert [policy.victim() for _ in range(4)] == ["c", "d", "b", "a"]


def test_lfu_ages_out_a_formerly_hot_key() -> None:
    """LFU-DA's aging: a key hit often, then never again, outlives keys hit less than it for a
    while but is evicted once the inflation value climbs past its priority (plain LFU would keep
    it forever, each newcomer evicted in its place)."""
    policy = LFUPolicy(4)
    fill(policy, "hxyz")
    for _ in range(10):
        policy.accessed("h")  # frequency 11
    victims = []
    for newcomer in range(40):  # each newcomer is hit once (frequency 2), then left alone
        victims.append(policy.victim())
        policy.inserted(newcomer)
        policy.accessed(newcomer)
    assert victims[:3] == ["x", "y", "z"]
    assert "h" in victims, "a formerly hot key was never evicted: no aging"
    assert victims.index("h") >= 10  # not at once: it earned a longer stay than the newcomers
    assert victims.index("h") < 20  # ~10 turnovers (its 10 extra hits), not MAX_FREQUENCY


def test_arc_hit_moves_key_to_frequency_list() -> None:
    policy = ARCPolicy(4)
    fill(policy, "abc")
    policy.accessed("a")  # a: T1 → T2, so the T1 keys go first while T1 is above p = 0
    assert [policy.victim() for _ in range(3)] == ["b", "c", "a"]


def test_arc_ghost_hit_in_b1_grows_recency_target() -> None:
    policy = ARCPolicy(4)
    fill(policy, "abcd")
    assert policy.victim() == "a"  # a becomes a B1 ghost
    policy.inserted("a")  # a miss on a B1 ghost: T1 was too small
    assert policy.target_t1 == 1.0
    assert "a" in policy


def test_arc_ghost_hit_in_b2_shrinks_recency_target() -> None:
    policy = ARCPolicy(4)
    fill(policy, "ab")
    policy.accessed("a")
    assert policy.victim() == "b"  # from T1 (p = 0) → B1
    policy.inserted("b")  # B1 ghost: p up to 1, b into T2
    assert policy.target_t1 == 1.0
    assert policy.victim() == "a"  # T1 empty: T2's LRU → B2
    policy.inserted("a")  # B2 ghost: p back down
    assert policy.target_t1 == 0.0


def test_s3fifo_quick_demotion_of_one_hit_wonders() -> None:
    policy = S3FIFOPolicy(10)  # S holds 1 block
    fill(policy, range(10))
    policy.accessed(0)
    # S is over its share: unhit keys leave at once, the hit key 0 is promoted to M.
    assert [policy.victim() for _ in range(3)] == [1, 2, 3]
    assert 0 in policy


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy = S3FIFOPolicy(10)
    fill(policy, range(3))
    assert policy.victim() == 0  # demoted to the ghost queue
    policy.inserted(0)  # comes back: admitted to M, not S
    assert [policy.victim() for _ in range(2)] == [1, 2]  # S first while it is over its share
    assert policy.victim() == 0


def test_s3fifo_main_gives_hit_keys_another_lap() -> None:
    policy = S3FIFOPolicy(10)
    fill(policy, "ab")
    policy.accessed("a")
    policy.accessed("b")
    policy.victim()  # promotes a and b to M (counters cleared), then M evicts a
    assert "b" in policy


def test_sieve_hand_skips_visited_and_keeps_position() -> None:
    policy = SIEVEPolicy(3)
    fill(policy, "abc")
    policy.accessed("a")
    assert policy.victim() == "b"  # a's bit is cleared, the hand stops after b
    policy.inserted("d")
    assert policy.victim() == "c"  # the hand resumes at c, not at the tail
    policy.accessed("d")
    policy.inserted("e")
    assert policy.victim() == "e"  # d is visited; a was cleared but the hand has passed it
    assert policy.victim() == "a"  # wrapped to the tail


def test_kvd_grows_small_queue_on_small_ghost_hits() -> None:
    policy = AdaptiveS3FIFOPolicy(10)
    start = policy.small_target
    fill(policy, range(3))
    assert policy.victim() == 0  # quick demotion → S's ghost
    policy.inserted(0)
    assert policy.small_target > start


def test_kvd_shrinks_small_queue_on_main_ghost_hits() -> None:
    policy = AdaptiveS3FIFOPolicy(10)
    fill(policy, range(3))
    policy.victim()  # 0 → S's ghost
    policy.inserted(0)  # 0 → M, S grows
    grown = policy.small_target
    while policy.victim() != 0:
        pass  # drain S, then M evicts 0 → M's ghost
    policy.inserted(0)
    assert policy.small_target < grown


def test_kvd_far_small_ghost_hit_admits_without_growing() -> None:
    """ARC's bound: only an S ghost an S of at most the pool could have kept moves the split."""
    policy = AdaptiveS3FIFOPolicy(10)
    fill(policy, range(11))
    assert [policy.victim() for _ in range(10)] == list(range(10))  # S = [10], ghosts 0..9
    start = policy.small_target
    policy.inserted(0)  # |S| + 9 later S evictions = 10: beyond the bound
    assert policy.small_target == start and 0 in policy
    policy.inserted(9)  # |S| + 0: within it
    assert policy.small_target > start


def test_kvd_main_is_lru_not_clock() -> None:
    """A hit in M moves the key to M's tail and earns no extra lap (S3-FIFO's counter would)."""
    policy = AdaptiveS3FIFOPolicy(10)  # S's target: 2 blocks
    fill(policy, "abcde")
    for key in "abc":
        policy.accessed(key)  # hits in S: counters that earn promotion
    assert policy.victim() == "d"  # a, b, c promoted to M with counters cleared; S = [e]
    for key in "bbba":
        policy.accessed(key)  # M = [c, b, a] by recency; no counters
    assert [policy.victim() for _ in range(4)] == ["c", "b", "a", "e"]
