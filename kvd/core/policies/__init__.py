"""Eviction policies and the registry that maps names (`--policy`) to classes."""

from __future__ import annotations

from collections.abc import Sequence

from kvd.errors import BadArgsError
from kvd.core.policies.adaptive import AdaptiveS3FIFOPolicy
from kvd.core.policies.arc import ARCPolicy
from kvd.core.policies.base import TIER_DECODE, TIER_PREFILL, EvictionPolicy
from kvd.core.policies.lfu import LFUPolicy
from kvd.core.policies.lru import LRUPolicy
from kvd.core.policies.s3fifo import S3FIFOPolicy
from kvd.core.policies.sieve import SIEVEPolicy
from kvd.core.policies.tiered import TIER_NAMES, TierSpec, TieredPolicy, parse_tiers

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy, SIEVEPolicy,
                 AdaptiveS3FIFOPolicy)
}

# What `kvd start` and `PagedKVCache` use when no policy is named.
DEFAULT_POLICY = "kvd"  # adaptive S3-FIFO, kvd/core/policies/adaptive.py; table: bench/hit_ratio.py


def make_policy(name: str, capacity: int,
                tiers: str | Sequence[TierSpec] | None = None) -> EvictionPolicy:
    """Build the registered policy `name` (or `"default"`) for a pool of `capacity` blocks.

    Args:
        tiers: a `--tiers` text or parsed specs: build a TieredPolicy whose tiers run their own
            policy (`name` unless the spec names one), each sized to its share of `capacity`.

    Raises:
        BadArgsError: unknown name or bad tiers; the message lists the choices.
    """
    if tiers is not None:
        specs = parse_tiers(tiers) if isinstance(tiers, str) else list(tiers)
        return TieredPolicy(capacity, [spec.share for spec in specs],
                            [make_policy(spec.policy or name, max(1, round(spec.share * capacity)))
                             for spec in specs])
    if name == "default":
        name = DEFAULT_POLICY
    cls = POLICIES.get(name)
    if cls is None:
        choices = ", ".join(sorted(POLICIES))
        raise BadArgsError(f"unknown eviction policy {name!r}: choose one of {choices} or 'default'")
    return cls(capacity)


__all__ = ["DEFAULT_POLICY", "POLICIES", "TIER_DECODE", "TIER_NAMES", "TIER_PREFILL", "ARCPolicy",
           "AdaptiveS3FIFOPolicy", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "S3FIFOPolicy",
           "SIEVEPolicy", "TierSpec", "TieredPolicy", "make_policy", "parse_tiers"]
