"""The prefill/decode two-tier split (`--tiers prefill=0.7,decode=0.3`).

Theory of operation
-------------------
An engine writes KV in two phases: *prefill* computes the prompt's blocks (shared system prompts,
documents, earlier turns: the blocks other requests reuse), *decode* appends the generated tokens
one at a time (reused only if a follow-up turn sends the answer back as part of its prompt). The
page table knows which is which: a block holding any generated token is a decode block
(kvd/core/page_table.py passes the tier to `BlockPool.seal`, the pool passes it to `inserted`).

`TieredPolicy` is a composite: each tier has its own policy instance (sized to the tier's share
of the pool, so ghost lists scale with it) and a *share*, a target fraction of the pool. The
policy counts each tier's *resident* keys — cached, or pinned again after being cached — from
their first `inserted` to their `victim`/`discard`. The victim comes from the tier furthest over
its share (`resident - share * capacity`, the largest wins) among tiers with an evictable key, so
a burst of one tier can borrow the other's idle space but gives it back first. Shares are soft
targets, not partitions: a tier with nothing evictable never blocks an allocation.

Everything is O(1): two tiers, a dict from key to tier, and the tier policies' own O(1) events.
bench/hit_ratio.py --tiers measures when the split helps (bench/results/POLICIES.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvd.errors import BadArgsError
from kvd.core.policies.base import TIER_PREFILL, EvictionPolicy

TIER_NAMES = ("prefill", "decode")  # index = TIER_PREFILL (0), TIER_DECODE (1)


@dataclass(frozen=True)
class TierSpec:
    """One tier of `--tiers`: its share of the pool and, optionally, its own policy name."""

    share: float
    policy: str | None = None  # None: the pool's --policy


def parse_tiers(text: str) -> list[TierSpec]:
    """Parse `prefill=0.7,decode=0.3` (each may add `:POLICY`, e.g. `decode=0.3:lru`).

    Returns the specs indexed by tier (prefill first). Shares must be in (0, 1) and sum to 1.

    Raises:
        BadArgsError: a malformed item, an unknown or missing tier, or shares that do not sum to 1.
    """
    shares: dict[str, TierSpec] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, _, value = item.partition("=")
        share_text, _, policy = value.partition(":")
        try:
            share = float(share_text)
        except ValueError:
            share = -1.0
        if name not in TIER_NAMES or name in shares or not 0.0 < share < 1.0:
            raise BadArgsError(f"bad --tiers item {item!r}: write prefill=SHARE,decode=SHARE with "
                               "shares in (0, 1), e.g. prefill=0.7,decode=0.3 (optionally "
                               "decode=0.3:lru to give a tier its own policy)")
        shares[name] = TierSpec(share, policy or None)
    if set(shares) != set(TIER_NAMES) or abs(sum(s.share for s in shares.values()) - 1.0) > 1e-6:
        raise BadArgsError(f"--tiers {text!r} must give both prefill and decode shares summing "
                           "to 1, e.g. prefill=0.7,decode=0.3")
    return [shares[name] for name in TIER_NAMES]


class TieredPolicy(EvictionPolicy):
    """One policy per tier; the victim comes from the tier furthest over its share."""

    name = "tiered"

    def __init__(self, capacity: int, shares: Sequence[float],
                 policies: Sequence[EvictionPolicy]) -> None:
        """Args:
            capacity: blocks in the pool.
            shares: per tier (TIER_PREFILL, TIER_DECODE), its target fraction of the pool.
            policies: per tier, the policy that orders that tier's keys.
        """
        super().__init__(capacity)
        if len(shares) != len(TIER_NAMES) or len(policies) != len(TIER_NAMES):
            raise ValueError(f"TieredPolicy needs {len(TIER_NAMES)} shares and policies")
        self.shares = tuple(shares)
        self.policies = tuple(policies)
        self.num_resident = [0] * len(TIER_NAMES)
        self._tier_of: dict[Hashable, int] = {}  # resident keys: cached or pinned after caching

    def describe(self) -> str:
        """E.g. `prefill=0.7:kvd,decode=0.3:kvd` (what `kvd stats` shows)."""
        return ",".join(f"{name}={share:g}:{policy.name}" for name, share, policy
                        in zip(TIER_NAMES, self.shares, self.policies))

    def inserted(self, key: Hashable, tier: int = TIER_PREFILL) -> None:
        known = self._tier_of.get(key)
        if known is None:
            if not 0 <= tier < len(TIER_NAMES):
                raise ValueError(f"tier {tier} is not one of {TIER_NAMES}")
            known = self._tier_of[key] = tier
            self.num_resident[tier] += 1
        self.policies[known].inserted(key, known)

    def accessed(self, key: Hashable) -> None:
        tier = self._tier_of.get(key)
        if tier is not None:
            self.policies[tier].accessed(key)

    def removed(self, key: Hashable) -> None:
        self.policies[self._tier_of[key]].removed(key)

    def hit_evictable(self, key: Hashable) -> None:
        self.policies[self._tier_of[key]].hit_evictable(key)

    def hit_evictable_many(self, keys: Sequence[Hashable]) -> None:
        # Each tier's keys in one call, in order (the tiers' policies are independent).
        by_tier: list[list[Hashable]] = [[] for _ in self.policies]
        tier_of = self._tier_of
        for key in keys:
            by_tier[tier_of[key]].append(key)
        for policy, tier_keys in zip(self.policies, by_tier):
            if tier_keys:
                policy.hit_evictable_many(tier_keys)

    def discard(self, key: Hashable) -> None:
        self.policies[self._forget(key)].discard(key)

    def forgotten(self, key: Hashable) -> None:
        if key in self._tier_of:  # (not if it was sealed and never cached)
            self.policies[self._forget(key)].forgotten(key)

    def _forget(self, key: Hashable) -> int:
        tier = self._tier_of.pop(key)
        self.num_resident[tier] -= 1
        return tier

    def victim(self) -> Hashable | None:
        best_tier, best_excess = -1, 0.0
        for tier, policy in enumerate(self.policies):
            excess = self.num_resident[tier] - self.shares[tier] * self.capacity
            if len(policy) and (best_tier < 0 or excess > best_excess):
                best_tier, best_excess = tier, excess
        if best_tier < 0:
            return None
        key = self.policies[best_tier].victim()
        self._forget(key)
        return key

    def __len__(self) -> int:
        return sum(len(policy) for policy in self.policies)

    def __contains__(self, key: object) -> bool:
        tier = self._tier_of.get(key)
        return tier is not None and key in self.policies[tier]
