"""Eviction policies and the registry that maps names (`--policy`) to classes."""

from __future__ import annotations

from kvd.errors import BadArgsError
from kvd.policies.adaptive import AdaptiveS3FIFOPolicy
from kvd.policies.arc import ARCPolicy
from kvd.policies.base import EvictionPolicy
from kvd.policies.lfu import LFUPolicy
from kvd.policies.lru import LRUPolicy
from kvd.policies.s3fifo import S3FIFOPolicy
from kvd.policies.sieve import SIEVEPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy, SIEVEPolicy,
                 AdaptiveS3FIFOPolicy)
}

# What `kvd start` and `PagedKVCache` use when no policy is named.
DEFAULT_POLICY = "kvd"  # adaptive S3-FIFO, kvd/policies/adaptive.py; table: bench/hit_ratio.py


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the registered policy `name` (or `"default"`) for a pool of `capacity` blocks.

    Raises:
        BadArgsError: unknown name; the message lists the choices.
    """
    if name == "default":
        name = DEFAULT_POLICY
    cls = POLICIES.get(name)
    if cls is None:
        choices = ", ".join(sorted(POLICIES))
        raise BadArgsError(f"unknown eviction policy {name!r}: choose one of {choices} or 'default'")
    return cls(capacity)


__all__ = ["DEFAULT_POLICY", "POLICIES", "ARCPolicy", "AdaptiveS3FIFOPolicy", "EvictionPolicy",
           "LFUPolicy", "LRUPolicy", "S3FIFOPolicy", "SIEVEPolicy", "make_policy"]
