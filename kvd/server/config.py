"""Pool configuration: several named pools of different geometry sharing one memory budget.

Theory of operation
-------------------
A daemon serves one or more pools. Each has a name (its own hash namespace: lookups never cross
pools), and a block shape: layers, parts (2 = K and V, 1 = a latent), block size in tokens, KV
heads, head dim, dtype, and an optional sliding window in tokens. The pools share `--memory`:
kvd/core/arena.py cuts the budget into slabs that move between pools with the demand, so no
pool has a size of its own.

Two spellings, the same keys (the flags' names without the dashes in front):

    kvd start --memory 8G --pool target:layers=32,kv-heads=8,head-dim=128,dtype=bfloat16 \\
              --pool draft:layers=4,kv-heads=4,head-dim=64,dtype=float32

    kvd start --config kvd.toml          # read with the standard library's tomllib
        memory = "8G"                    # optional; --memory wins
        policy = "default"               # optional; --policy wins
        [pools.target]
        layers = 32
        kv-heads = 8
        ...

A *model* is a set of pools of one block size that one sequence spans (e.g. a hybrid model's
full-attention layers in one pool and its sliding-window layers in another, with `window`):

    kvd start ... --model gemma:gemma-full,gemma-window
        [models.gemma]
        pools = ["gemma-full", "gemma-window"]

The remote tier (docs/remote.md) has a table of its own, each key a flag's (which wins):

        [remote]
        url = "redis-cluster://10.0.0.5:6379,10.0.0.6:6379"   # --remote
        timeout_ms = 50                                        # --remote-timeout-ms

A key left out takes the single-pool flags' default (block-size 16, layers 8, kv-heads 8,
head-dim 128, dtype float16, parts 2, no window). The single-pool flags alone make one pool
named `default`. Every mistake is a BadArgsError that names the fix: an unknown key (the valid
ones listed), a duplicate or malformed name, a bad value, a budget that does not hold a slab
per pool.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.core.arena import Arena
from kvd.errors import BadArgsError, NotFoundError
from kvd.geometry import Geometry

DEFAULT_POOL = "default"
MAX_POOLS = 16  # the segment header's pool table holds this many
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
# a pool's key → the Geometry field it sets
POOL_KEYS: dict[str, str] = {
    "layers": "num_layers", "kv-heads": "num_kv_heads", "head-dim": "head_dim",
    "dtype": "dtype", "block-size": "block_size", "parts": "parts", "window": "window"}
TOP_KEYS = ("memory", "policy", "pools", "models", "remote")
# [remote]'s keys → (the flag each stands for, its type)
REMOTE_KEYS: dict[str, tuple[str, type]] = {"url": ("--remote", str),
                                            "timeout_ms": ("--remote-timeout-ms", int)}


@dataclass(frozen=True)
class PoolSpec:
    """One pool: its name and the shape of its blocks (`shape.num_blocks` is 1: the arena, not
    the config, decides how many blocks a pool holds)."""

    name: str
    shape: Geometry

    @property
    def block_nbytes(self) -> int:
        return self.shape.block_nbytes


@dataclass(frozen=True)
class ModelSpec:
    """A model: its name and the pools one of its sequences spans."""

    name: str
    pools: tuple[str, ...]


def check_pool_name(name: Any, kind: str = "pool") -> str:
    if type(name) is not str or not _NAME_RE.fullmatch(name):
        raise BadArgsError(f"{kind} name must be 1 to 32 letters, digits, '_' or '-', "
                           f"got {name!r}")
    return name


def parse_model_flag(text: str) -> ModelSpec:
    """`NAME:POOL,POOL,...` of `--model`."""
    name, colon, rest = text.partition(":")
    if not colon or not rest:
        raise BadArgsError(f"--model {text!r}: write NAME:POOL[,POOL...]")
    return ModelSpec(check_pool_name(name, "model"), tuple(rest.split(",")))


def _model_table(path: Path, name: Any, values: Any) -> ModelSpec:
    pools = values.get("pools") if isinstance(values, dict) else None
    if (set(values) != {"pools"} or not isinstance(pools, list)
            or not all(isinstance(pool, str) for pool in pools)):
        raise BadArgsError(f"config file {path}: write model {name!r} as [models.{name}] with "
                           "one key, pools = [\"POOL\", ...]")
    return ModelSpec(check_pool_name(name, "model"), tuple(pools))


def check_models(models: list[ModelSpec], pools: list[PoolSpec]) -> list[ModelSpec]:
    """Models over configured pools: distinct names, none a pool's (OP@NAME names either), each
    pool once, at least one, all of one block size (one hash chain serves them all)."""
    if models and not pools:
        raise BadArgsError("a model spans pools: configure them with --pool NAME:... or "
                           "[pools.NAME] in --config")
    shapes = {spec.name: spec.shape for spec in pools}
    seen: set[str] = set()
    for model in models:
        if model.name in seen or model.name in shapes:
            raise BadArgsError(f"model {model.name!r} is configured twice or shares a pool's "
                               "name: give each model a name no pool or other model has")
        seen.add(model.name)
        unknown = [name for name in model.pools if name not in shapes]
        if unknown or not model.pools or len(set(model.pools)) != len(model.pools):
            raise BadArgsError(f"model {model.name!r}: pools {list(model.pools)} must be distinct "
                               f"configured pools ({', '.join(shapes)}); unknown: {unknown}")
        sizes = {shapes[name].block_size for name in model.pools}
        if len(sizes) > 1:
            raise BadArgsError(f"model {model.name!r}: its pools have block sizes "
                               f"{sorted(sizes)}; give them one block-size")
    return models


def pool_spec(name: Any, values: dict[str, Any]) -> PoolSpec:
    """A PoolSpec from its keys (module docstring); BadArgsError naming the key at fault."""
    name = check_pool_name(name)
    unknown = sorted(set(values) - set(POOL_KEYS))
    if unknown:
        raise BadArgsError(f"pool {name!r}: unknown keys {unknown}; valid: {', '.join(POOL_KEYS)}")
    try:
        shape = Geometry(num_blocks=1, **{POOL_KEYS[key]: value for key, value in values.items()})
    except BadArgsError as exc:
        raise BadArgsError(f"pool {name!r}: {exc}") from None
    return PoolSpec(name, shape)


def parse_pool_flag(text: str) -> PoolSpec:
    """`NAME:key=value,...` of `--pool` (values are ints but for dtype)."""
    name, colon, rest = text.partition(":")
    if not colon:
        raise BadArgsError(f"--pool {text!r}: write NAME:layers=L,kv-heads=H,head-dim=D,"
                           "dtype=T,block-size=B[,parts=1][,window=W]")
    values: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, equals, value = item.partition("=")
        if not equals:
            raise BadArgsError(f"--pool {name}: {item!r} is not key=value")
        if key in values:
            raise BadArgsError(f"--pool {name}: {key} given twice")
        values[key] = value if key == "dtype" else _int(name, key, value)
    return pool_spec(name, values)


def _int(name: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise BadArgsError(f"--pool {name}: {key}={value!r} is not an integer") from None


def read_config(path: str | Path) -> dict[str, Any]:
    """A `--config` TOML file as {"memory": ..., "policy": ..., "pools": [PoolSpec, ...],
    "models": [ModelSpec, ...], "remote": {"url": ..., "timeout_ms": ...}} (memory, policy and
    each remote key None where the file leaves them out)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(f"config file {path} does not exist: pass the path of a TOML file"
                            ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BadArgsError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise BadArgsError(f"config file {path}: unknown keys {unknown}; valid: "
                           f"{', '.join(TOP_KEYS)} (pools go under [pools.NAME])")
    pools = data.get("pools", {})
    if not isinstance(pools, dict) or not all(isinstance(v, dict) for v in pools.values()):
        raise BadArgsError(f"config file {path}: write each pool as a table [pools.NAME]")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise BadArgsError(f"config file {path}: write each model as a table [models.NAME]")
    return {"memory": data.get("memory"), "policy": data.get("policy"),
            "pools": [pool_spec(name, values) for name, values in pools.items()],
            "models": [_model_table(path, name, values) for name, values in models.items()],
            "remote": _remote_table(path, data.get("remote", {}))}


def _remote_table(path: Path, values: Any) -> dict[str, Any]:
    """[remote]'s keys (module docstring), each None where left out."""
    if not isinstance(values, dict):
        raise BadArgsError(f"config file {path}: write the remote tier as a table [remote]")
    unknown = sorted(set(values) - set(REMOTE_KEYS))
    if unknown:
        raise BadArgsError(f"config file {path}: [remote] has unknown keys {unknown}; valid: "
                           f"{', '.join(REMOTE_KEYS)}")
    for key, (flag, kind) in REMOTE_KEYS.items():
        if key in values and type(values[key]) is not kind:
            raise BadArgsError(f"config file {path}: [remote] {key} (as {flag}) must be a "
                               f"{kind.__name__}, got {values[key]!r}")
    return {key: values.get(key) for key in REMOTE_KEYS}


def check_pools(pools: list[PoolSpec], budget_nbytes: int) -> list[PoolSpec]:
    """The pools of one daemon: distinct names, at most MAX_POOLS, and a budget that holds a slab
    for each (BadArgsError naming the fix otherwise)."""
    if not pools:
        raise BadArgsError("no pool configured: give --pool NAME:... or [pools.NAME] in --config")
    if len(pools) > MAX_POOLS:
        raise BadArgsError(f"{len(pools)} pools configured, a daemon serves at most {MAX_POOLS}")
    seen: set[str] = set()
    for spec in pools:
        if spec.name in seen:
            raise BadArgsError(f"pool {spec.name!r} is configured twice: give each pool a "
                               "distinct name")
        seen.add(spec.name)
    try:  # (the arena's own check, with the slab size it would choose)
        Arena(budget_nbytes, [spec.block_nbytes for spec in pools])
    except BadArgsError:
        largest = max(pools, key=lambda spec: spec.block_nbytes)
        raise BadArgsError(
            f"--memory {budget_nbytes} bytes does not hold one block of each of the "
            f"{len(pools)} pools (pool {largest.name!r} has {largest.block_nbytes}-byte blocks): "
            "raise --memory or shrink that pool's blocks") from None
    return pools
