"""The connector's connection to the daemon, which may be absent: kvd is a cache, never a need.

`DaemonLink.client()` returns a connected `kvd.Client`, or None while no daemon answers. A
missing daemon is logged once per process and daemon (the scheduler's and the worker's links
share the record), and its return once; the link then tries again at most every `retry_s`,
so an engine started before its daemon, or whose daemon went away, keeps serving without the
cache and takes it up when the daemon is back. Every kvd error of an op is turned into a miss
(`call`, `failed`), logged once per kind.

Pins belong to a session. `lookup` returns, with the pinned ids, a token naming the session
that holds them (the client and its reconnect count); `release` with a token of a session that
is gone does nothing, because those pins died with it and the ids may now name other pins.

`check(geometry)` is called on every new connection: a daemon whose pool does not fit the
engine (block size, layers, heads, head size, dtype) is a configuration error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import kvd
from kvd.errors import BadArgsError, DisconnectedError, KvdError, NotFoundError
from kvd.geometry import Geometry

REPLY_TIMEOUT_S = 10.0  # a daemon that hangs this long is dropped, not waited for
RECONNECT_TIMEOUT_S = 1.0  # how long one call waits for a restarting daemon
RETRY_S = 5.0  # how often a missing daemon is looked for
T = TypeVar("T")
# What this process has logged, per daemon: each trouble is told once, whichever link met it.
_logged: dict[str | None, set[str]] = {}


def connect(name: str | None, pool: str | None) -> kvd.Client:
    """`kvd.connect` with the connector's timeouts, on `pool` (None: the daemon's only pool or
    `default`)."""
    return kvd.connect(name, pool=pool, timeout_s=REPLY_TIMEOUT_S,
                       reconnect_timeout_s=RECONNECT_TIMEOUT_S)


def check_fits(wanted: dict[str, Any], geometry: Geometry) -> None:
    """BadArgsError naming the flags to start the daemon with, unless `geometry` has the
    `wanted` block size, layers, KV heads, head size and dtype."""
    wrong = [f"{name} {value} (pool {getattr(geometry, name)})"
             for name, value in wanted.items() if getattr(geometry, name) != value]
    if wrong:
        raise BadArgsError(
            f"the kvd pool does not fit this engine: {', '.join(wrong)}. Start the daemon with "
            f"--layers {wanted['num_layers']} --kv-heads {wanted['num_kv_heads']} --head-dim "
            f"{wanted['head_dim']} --dtype {wanted['dtype']} --block-size {wanted['block_size']}")


class DaemonLink:
    def __init__(self, name: str | None, pool: str | None, check: Callable[[Geometry], None],
                 log: Callable[[str], None], retry_s: float = RETRY_S) -> None:
        self.name, self.pool = name, pool
        self.check, self.log, self.retry_s = check, log, retry_s
        self._client: kvd.Client | None = None
        self._next_try = 0.0
        self._logged = _logged.setdefault(name, set())

    def start(self) -> bool:
        """Connect now; False (logged) if no daemon answers. A misfit raises BadArgsError, a pool
        the daemon does not serve NotFoundError."""
        try:
            client = connect(self.name, self.pool)
        except DisconnectedError as exc:
            self._log_once("absent", f"kvd: no daemon answers at {self.name or 'default'} "
                           f"({exc}); this engine runs without the kvd cache and looks for the "
                           f"daemon again every {self.retry_s:g} s")
            self._next_try = time.monotonic() + self.retry_s
            return False
        try:
            self.check(client.geometry)
        except BaseException:
            client.close()
            raise
        self._client = client
        return True

    def client(self) -> kvd.Client | None:
        if self._client is not None and not self._client.is_closed:
            return self._client
        if self._client is not None:
            self.drop()
        if time.monotonic() < self._next_try:
            return None
        try:
            if not self.start():
                return None
        except (BadArgsError, NotFoundError) as exc:  # (restarted with another config)
            self._log_once("misfit", f"kvd: the daemon does not fit this engine: {exc}")
            self._next_try = time.monotonic() + self.retry_s
            return None
        if "absent" in self._logged or DisconnectedError.__name__ in self._logged:
            self.log(f"kvd: connected to the daemon at {self.name or 'default'}; the kvd "
                     "cache is in use again")
        self._logged.clear()
        return self._client

    def failed(self, what: str, exc: KvdError) -> None:
        """An op failed: log it once per kind of error; the caller treats it as a miss."""
        self._log_once(type(exc).__name__, f"kvd: {what} failed ({type(exc).__name__}: {exc}); "
                       "the engine goes on without those blocks (this is logged once)")
        if isinstance(exc, DisconnectedError):
            self._next_try = time.monotonic() + self.retry_s

    def drop(self) -> None:
        """Forget the client (its session is gone); close it if nothing views its segment."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except KvdError:
                pass  # a view is still alive: its owner drops it, the mapping goes with it

    def session(self) -> object:
        client = self._client
        return None if client is None else (client, client.num_reconnects)

    def call(self, what: str, op: Callable[[kvd.Client], T]) -> tuple[T, object] | None:
        """`op(client)` and the session it ran in; None (logged) without a daemon or on error.

        A daemon that restarted clean fails the first op after it (the client reconnects, but
        the blocks of the old session are gone): an op that holds nothing of the old session
        (a lookup, an alloc) is sent once more, to the new daemon."""
        client = self.client()
        if client is None:
            return None
        for attempt in range(2):
            try:
                return op(client), self.session()
            except DisconnectedError as exc:
                if client.is_closed or attempt:
                    self.failed(what, exc)
            except KvdError as exc:
                self.failed(what, exc)
                return None
        return None

    def lookup(self, hashes: Sequence[bytes]) -> tuple[list[int], object]:
        done = self.call("lookup", lambda client: client.lookup(hashes))
        return done if done is not None else ([], None)

    def release(self, block_ids: Sequence[int], session: object) -> None:
        if not block_ids or session is None or session != self.session():
            return  # that session's pins went with it
        try:
            session[0].release(block_ids)  # type: ignore[index]
        except KvdError as exc:
            self.failed("release", exc)

    def close(self) -> None:
        self.drop()

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self.log(message)
