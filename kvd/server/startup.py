"""Startup: build everything the daemon's loop serves, in order, and release it in reverse.

Theory of operation
-------------------
`start(config)` returns a `Started`: every piece the loop (kvd/server/loop.py) serves, each one
built, and one ExitStack that releases them all. Each step pushes its undo as it goes, so that a
failure anywhere unwinds exactly what was made, and a stopping loop unwinds the same way:

    flock       the name's single-instance lock, taken before anything touches the socket path: a
                second daemon of the same name is refused having changed nothing. Released last,
                so the name is free only once everything else is gone; its file is unlinked
                while still locked (take_lock then locks only a file still on disk: see there).
    signals     SIGTERM/SIGINT request the stop and wake the selector (set_wakeup_fd on a
                socketpair). Right after the lock, so that a signal during startup still ends
                in the cleanup: the loop sees the request before it serves anyone.
    selector    the loop's.
    (pidfile)   its removal: under the lock, a pidfile there is ours or a dead daemon's.
    journal     unless --no-journal; opened before the segment, which recovery checks it against
                (several pools: one per pool, PoolJournals; the journals of pools no longer
                configured are deleted).
    segment     re-attached with its journaled blocks restored (--recover: kvd/server/recovery.py)
                or created clean; then the pool over its generation counters, and the Service.
    socket      bound 0600 inside the 0700 runtime directory (kvd/runtime.py); an existing path
                is replaced only if it is a socket nobody answers on (a dead daemon's).
    pidfile     written.
    metrics     --metrics-port: a thread serving the Service's stats on 127.0.0.1; the port
                bound (port 0: one the kernel chose) goes in `service.info["metrics_port"]`.
    (remote)    --remote: a tier per pool, made before the pools, whose seals each taps (its
                pool's observer); their threads start once the Service exists, and stop before
                the journal is released.

What a release keeps is `Stop.keep`. A plain stop and a failed start remove segment and journal.
Both stay as they were, for the next --recover, after `kvd stop --keep`, after a kvd bug escaped
the loop, after a --recover start that failed once it had re-attached the crashed daemon's
segment (a bad flag must not cost the cache), and after a --recover refused because the journal's
stamp could not be read (what could not be read is never deleted). A damaged journal a start gets
past is copied aside first (kvd/server/recovery.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import selectors
import signal
import socket
import stat
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType

import numpy as np

from kvd.core.arena import Arena
from kvd.core.policies import make_policy
from kvd.core.pool import BlockPool
from kvd.errors import BadArgsError, DeniedError, InUseError, JournalError, KvdError
from kvd.geometry import Geometry
from kvd.runtime import SHM_DIR, DaemonPaths, check_ours
from kvd.runtime import state_dir as state_dir_of
from kvd.segment import Segment
from kvd.server.journal import (JOURNAL_FILENAME, Journal, Loaded, PoolJournals, failpoint,
                                pool_journal_filename, remove_journal, set_aside_files)
from kvd.server.metrics import OpStats, serve_metrics
from kvd.server.config import ModelSpec, PoolSpec, check_models, check_pools
from kvd.server.recovery import (attach_pools, attach_recoverable, drop_shared_slabs,
                                 load_journal, read_stamp, reshape, restore, stamp)
from kvd.server.remote import (DEFAULT_TIMEOUT_MS, BlockCodec, RemoteTier, SealTap, SlabBlocks,
                               Tiers, parse_url, require_redis)
from kvd.server.remote.codec import check_block
from kvd.server.service import Limits, Service

log = logging.getLogger("kvd")


@dataclass(frozen=True)
class DaemonConfig:
    """A daemon's flags: what `start` builds from.

    Args:
        policy: eviction policy name, or "default".
        tiers: `--tiers` (e.g. prefill=0.7,decode=0.3): a prefill/decode TieredPolicy.
        metrics_port: serve Prometheus metrics on 127.0.0.1 at this port (None: not at all).
        state_dir: where the journal lives (None: runtime.state_dir(name)).
        recover: re-attach the segment and journal a previous daemon left, if they match.
        journal: keep the crash-recovery journal (off: faster seals, nothing survives).
        pools: several pools (kvd/server/config.py) sharing `budget_nbytes` through an arena
            (kvd/core/arena.py); empty: the one pool of `geometry`, named "default".
        models: models whose sequences span several of the pools (kvd/server/config.py).
        limits: what each session, and all together, may hold (`--max-*`).
        remote: `--remote` URL of the remote tier (docs/remote.md); None: no remote tier.
        remote_timeout_ms: how long a lookup waits for the remote tier.
    """

    paths: DaemonPaths
    geometry: Geometry
    policy: str = "default"
    tiers: str | None = None
    metrics_port: int | None = None
    state_dir: str | None = None
    recover: bool = False
    journal: bool = True
    pools: tuple[PoolSpec, ...] = ()
    budget_nbytes: int = 0
    models: tuple[ModelSpec, ...] = ()
    limits: Limits = Limits()
    remote: str | None = None
    remote_timeout_ms: int = DEFAULT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.remote is not None:
            parse_url(self.remote)  # a typed error before anything starts
            for name, shape in self.pool_shapes:
                check_block(name, shape)
        timeout = self.remote_timeout_ms
        if not (type(timeout) is int and 1 <= timeout <= 60_000):
            raise BadArgsError(f"--remote-timeout-ms must be an int in [1, 60000], "
                               f"got {timeout!r}")
        port = self.metrics_port
        if port is not None and not (type(port) is int and 0 <= port <= 65535):
            raise BadArgsError(f"metrics port must be an int in [0, 65535], got {port!r}")
        if self.pools:
            check_pools(list(self.pools), self.budget_nbytes)
        check_models(list(self.models), list(self.pools))

    @property
    def pool_shapes(self) -> list[tuple[str, Geometry]]:
        """(name, geometry) of every pool: the configured ones, or the one pool `default`."""
        if not self.pools:
            return [("default", self.geometry)]
        return [(spec.name, spec.shape) for spec in self.pools]

    @property
    def journal_dir(self) -> str:
        return self.state_dir or str(state_dir_of(self.paths.name))


class Stop:
    """The request to stop: by SIGTERM/SIGINT, the shutdown op or Server.stop; the loop reads it
    once an iteration, and the release reads `keep` (module docstring)."""

    def __init__(self) -> None:
        self.is_requested = False
        self.keep = False  # keep segment and journal for --recover
        self.signal_name: str | None = None  # the signal that asked, logged by the loop

    def request(self, keep: bool | None = None) -> None:
        if keep is not None:
            self.keep = keep
        self.is_requested = True

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No logging here: a handler runs between two bytecodes of the main thread, perhaps in
        # the middle of its own write to the log's stream, which a write from here re-enters
        # (RuntimeError: reentrant call), and that error escapes the loop as if kvd had failed.
        self.signal_name = signal.Signals(signum).name
        self.is_requested = True

    def on_shutdown(self, keep: bool) -> None:
        """The shutdown op's."""
        self.request(keep)
        log.info("shutdown requested by a client (keep=%s)", keep)


@dataclass(frozen=True, eq=False)
class Started:
    """What `start` built: all of it serving, none of it missing."""

    config: DaemonConfig
    segment: Segment
    journal: Journal | PoolJournals | None  # None: --no-journal
    service: Service  # (with the pool)
    listener: socket.socket
    wakeup: socket.socket  # readable after a signal (the set_wakeup_fd pair's read end)
    selector: selectors.BaseSelector
    stop: Stop
    num_restored: int  # blocks a recovery restored (0: started clean)
    resources: ExitStack  # releases everything above, in the reverse order of building
    remote: Tiers | None = None  # --remote


def take_lock(paths: DaemonPaths) -> int:
    """Take the single-instance flock; returns its fd. Raises DeniedError if a daemon holds it.

    A stopping daemon unlinks the lock file while it still holds the flock (_release_lock). A
    starter that opened the file just before that unlink may then lock the unlinked inode while a
    third process creates and locks a new file at the path: two "owners". So a lock counts only
    if the locked file is still the one at the path (same device and inode); otherwise it is
    dropped and taken again on whatever is there now.
    """
    while True:
        fd = os.open(paths.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DeniedError(f"a kvd daemon named {paths.name!r} is already running "
                              f"{_pid_text(paths)}: stop it (kvd stop --name {paths.name}) or "
                              "choose another --name") from None
        if _is_file_at(fd, paths.lock_path):
            return fd
        os.close(fd)  # we locked a file a stopping daemon had just unlinked


def _is_file_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the file now at `path`."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def is_running(paths: DaemonPaths) -> bool:
    """Whether a daemon holds the name's lock."""
    try:
        fd = os.open(paths.lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def start(config: DaemonConfig) -> Started:
    """Build everything the loop serves (module docstring).

    Raises:
        DeniedError: a daemon of this name is running.
        InUseError: the socket path or the metrics port is taken.
        KvdError: another reason it cannot start; what it had made is released.
    """
    paths = config.paths
    lock_fd = take_lock(paths)
    undo = ExitStack()
    undo.callback(_release_lock, lock_fd, paths.lock_path)
    try:
        stop = Stop()
        wakeup = _install_signals(stop, undo)
        selector = undo.enter_context(selectors.DefaultSelector())
        undo.callback(_unlink_quietly, paths.pid_path)
        journal: Journal | PoolJournals | None = None
        if config.journal:
            journal = _open_pool_journals(config) if config.pools else _open_journal(config)
            undo.callback(_release_journal, journal, stop)
        remote = _remote_tiers(config)
        if remote is not None:
            undo.callback(remote.close)
        if config.pools:
            segment, service, num_restored = _open_pools(
                config, journal if isinstance(journal, PoolJournals) else None, stop, undo,
                remote)
        else:
            assert not isinstance(journal, PoolJournals)
            segment, pool, num_restored = _open_pool(
                config, journal, stop, undo, None if remote is None else remote.tiers["default"])
            service = Service(pool, config.geometry, _block_copier(segment.pool), {}, OpStats(),
                              on_shutdown=stop.on_shutdown, limits=config.limits)
        service.info.update({"segment": segment.name, "segment_uuid": segment.uuid,
                             "daemon_pid": os.getpid(), "name": paths.name})
        if journal is not None:
            service.journal_state = "ok"
        if remote is not None:
            service.serve_remote(remote)
            _start_tiers(remote, segment, config)
        listener = _bind(paths.socket_path)
        undo.callback(_release_listener, listener, paths.socket_path)
        _write_pidfile(paths.pid_path)
        if config.metrics_port is not None:
            service.info["metrics_port"] = _serve_metrics(config.metrics_port, service, undo)
    except BaseException:
        undo.close()
        raise
    stop.keep = False  # started: from now on a plain stop removes what it serves
    return Started(config, segment, journal, service, listener, wakeup, selector, stop,
                   num_restored, undo, remote)


# ---- the pool ------------------------------------------------------------------------------------
def _open_pool(config: DaemonConfig, journal: Journal | None, stop: Stop,
               undo: ExitStack, remote: RemoteTier | None) -> tuple[Segment, BlockPool, int]:
    """Recover the previous segment and index if asked and valid, else start clean: (segment,
    pool, blocks restored); the segment's release goes on `undo` once it is the one served."""
    if config.recover:
        recovered = _recover(config, journal, stop, undo, remote)
        if recovered is not None:
            return recovered
    segment = _create_segment(config, journal)
    undo.callback(_release_segment, segment, stop)
    if journal is not None:
        _reset_journal(journal, segment)
    return segment, _new_pool(config, segment, journal, remote), 0


def _recover(config: DaemonConfig, journal: Journal | None, stop: Stop, undo: ExitStack,
             remote: RemoteTier | None) -> tuple[Segment, BlockPool, int] | None:
    """The previous segment, its journaled blocks restored into a new pool, or None (logged) to
    start clean."""
    if journal is None:
        log.warning("recovery: --recover needs the journal; starting clean")
        return None
    try:
        recovered = attach_recoverable(config.paths.segment_name, config.geometry, journal)
    except JournalError:
        stop.keep = True  # a journal that could not be read is never deleted
        raise
    if recovered is None:
        return None
    segment, loaded = recovered
    # From here a failed start leaves the crashed daemon's segment and journal as it found them,
    # for the next --recover: a bad flag must not cost the cache.
    stop.keep = True
    pool = _new_pool(config, segment, journal, remote)
    journal.on_commit = segment.set_acknowledged_seals
    failpoint("during-recovery")
    try:
        num_restored = restore(pool, segment, journal, loaded)
    except BadArgsError as exc:  # a journal the pool cannot take: never map it, nor delete it
        log.warning("recovery: %s; it is kept as %s; starting clean", exc, journal.set_aside())
        stop.keep = False  # (the old mapping goes with the pool)
        return None
    undo.callback(_release_segment, segment, stop)
    return segment, pool, num_restored


def _open_journal(config: DaemonConfig, filename: str = JOURNAL_FILENAME) -> Journal:
    """The journal. One SQLite cannot open (a damaged file) is a refusal for --recover, which
    keeps it; a plain start forgets its blocks anyway, so it sets the files aside and goes on."""
    try:
        return Journal(config.journal_dir, filename=filename)
    except JournalError as exc:
        if config.recover:
            raise JournalError(f"{exc}: move {config.journal_dir} aside, or start without "
                               "--recover (which keeps a copy)") from None
        aside = set_aside_files(config.journal_dir, filename=filename)
        log.warning("%s; it is kept as %s; starting with a new journal", exc, aside)
        return Journal(config.journal_dir, filename=filename)


def _open_pool_journals(config: DaemonConfig) -> PoolJournals:
    """One journal per configured pool; the journals of pools no longer configured go (their
    blocks do: kvd/server/recovery.py)."""
    names = [spec.name for spec in config.pools]
    journals = PoolJournals(config.journal_dir, {})
    try:
        for name in names:
            journals.journals[name] = _open_journal(config, pool_journal_filename(name))
    except BaseException:
        journals.close()
        raise
    for path in journals.path.glob(pool_journal_filename("*")):
        name = path.name.removeprefix("journal-").removesuffix(".sqlite3")
        if name not in names:
            log.info("removing the journal of pool %s, which is no longer configured", name)
            remove_journal(config.journal_dir, keep_dir=True, filename=path.name)
    return journals


def _new_pool(config: DaemonConfig, segment: Segment, journal: Journal | None,
              remote: RemoteTier | None = None) -> BlockPool:
    num_blocks = config.geometry.num_blocks
    policy = make_policy(config.policy, num_blocks, tiers=config.tiers)
    observer = journal if remote is None else SealTap(journal, remote)
    return BlockPool(num_blocks, policy, segment.generations, observer=observer)


# ---- the remote tier -----------------------------------------------------------------------------
def _remote_tiers(config: DaemonConfig) -> Tiers | None:
    """A tier per pool, its blocks named after the pool (docs/remote.md)."""
    if config.remote is None:
        return None
    require_redis()
    url = parse_url(config.remote)
    return Tiers({name: RemoteTier(url, BlockCodec(name, shape), config.remote_timeout_ms)
                  for name, shape in config.pool_shapes})


def _start_tiers(remote: Tiers, segment: Segment, config: DaemonConfig) -> None:
    """Start each tier's threads over its pool's blocks (uint8 rows of block_nbytes)."""
    if not config.pools:
        remote.tiers["default"].start(
            segment.pool.reshape(segment.geometry.num_blocks, -1).view(np.uint8),
            segment.generations)
        return
    for name, tier in remote.tiers.items():
        layout = segment.pools[name]
        tier.start(SlabBlocks(segment.slabs_of(name), layout.blocks_per_slab),
                   segment.generations_of(name))


def _remove_stale_segment(paths: DaemonPaths) -> None:
    stale = SHM_DIR + paths.segment_name
    # Ours, we hold the lock, so no live daemon uses it; another uid's file or a symlink there
    # is refused rather than followed or (as root) deleted.
    if check_ours(stale, "a kvd segment", "choose another --name"):
        log.warning("removing stale segment %s left by a daemon that crashed or stopped "
                    "with --keep (kvd start --recover keeps it)", paths.segment_name)
        os.unlink(stale)


def _create_segment(config: DaemonConfig, journal: Journal | None) -> Segment:
    paths = config.paths
    _remove_stale_segment(paths)
    segment = Segment.create(paths.segment_name, config.geometry)
    if journal is None and Path(config.journal_dir) == state_dir_of(paths.name):
        # A journal there describes a segment that is gone (say, kept by stop --keep and
        # then started clean with --no-journal): nothing would ever remove it. (Only under
        # the name's own default: the lock held covers nothing else.)
        remove_journal(config.journal_dir)
    return segment


def _open_pools(config: DaemonConfig, journals: PoolJournals | None, stop: Stop,
                undo: ExitStack, remote: Tiers | None) -> tuple[Segment, Service, int]:
    """A layout-2 segment for the configured pools (the previous one with each pool's journaled
    blocks restored, for --recover, where they match: kvd/server/recovery.py), their arena and
    the Service over them; also the blocks restored."""
    specs = list(config.pools)
    shapes = [(spec.name, spec.shape) for spec in specs]
    segment, loaded, is_reshaped = (_recover_pools(config, journals, stop) if config.recover
                                    else (None, {}, False))
    if segment is None:
        arena = Arena(config.budget_nbytes, [spec.block_nbytes for spec in specs])
        _remove_stale_segment(config.paths)
        segment = Segment.create_pools(config.paths.segment_name, shapes, arena.slab_nbytes,
                                       arena.num_slabs)
    else:
        arena = Arena(config.budget_nbytes, [spec.block_nbytes for spec in specs],
                      segment.pools[specs[0].name].slab_nbytes)
    undo.callback(_release_segment, segment, stop)
    service: Service | None = None
    num_restored = 0
    for number, spec in enumerate(specs):
        journal = journals.journals[spec.name] if journals is not None else None
        if journal is not None and spec.name not in loaded:
            _reset_journal(journal, segment, spec.name)
        tier = None if remote is None else remote.tiers[spec.name]
        pool = arena.add_pool(number, make_policy(config.policy, arena.num_ids(number),
                                                  tiers=config.tiers),
                              segment.generations_of(spec.name),
                              observer=journal if tier is None else SealTap(journal, tier))
        if journal is not None and journals is not None:
            journal.on_commit = partial(segment.set_pool_acknowledged_seals, spec.name)
            journals.rows_of[spec.name] = pool.journal_rows
            if spec.name in loaded:
                num_restored += _restore_pool(pool, segment, journal, loaded[spec.name],
                                              spec.name)
                if is_reshaped:  # its journal names the old uuid: the same rows, stamped anew
                    _reset_journal(journal, segment, spec.name)
                    journal.rewrite(pool.journal_rows())
        geometry = segment.pools[spec.name].geometry
        copy_block = _slab_copier(segment.slabs_of(spec.name), pool.blocks_per_slab)
        if service is None:
            service = Service(pool, geometry, copy_block, {}, OpStats(),
                              on_shutdown=stop.on_shutdown, pool_name=spec.name,
                              limits=config.limits)
        else:
            service.add_pool(spec.name, pool, geometry, copy_block)
    if service is None:
        raise BadArgsError("no pool configured")
    for model in config.models:
        service.add_model(model.name, list(model.pools))
    return segment, service, num_restored


def _recover_pools(config: DaemonConfig, journals: PoolJournals | None,
                   stop: Stop) -> tuple[Segment | None, dict[str, Loaded], bool]:
    """The previous segment (reshaped if the pools changed), the journaled blocks of each
    unchanged pool whose journal describes it, and whether it was reshaped (its journals then
    need the new stamp); (None, {}, False) to start every pool clean (logged)."""
    if journals is None:
        log.warning("recovery: --recover needs the journal; starting clean")
        return None, {}, False
    shapes = [(spec.name, spec.shape) for spec in config.pools]
    attached = attach_pools(config.paths.segment_name, shapes, config.budget_nbytes)
    if attached is None:
        return None, {}, False
    segment, kept = attached
    # From here a failed start leaves the segment and journals as it found them (as for one pool)
    stop.keep = True
    loaded = {}
    try:
        for name in kept:
            journal = journals.journals[name]
            each = load_journal(journal, read_stamp(journal), stamp(segment, name),
                                f"pool {name} starts clean")
            if each is not None:
                loaded[name] = each
    except JournalError:
        segment.close()
        raise
    failpoint("during-recovery")
    old_uuid = segment.uuid
    try:
        segment = reshape(segment, shapes)
    except KvdError as exc:
        log.warning("recovery: the segment cannot be reshaped for the pools (%s); starting "
                    "clean", exc)
        stop.keep = False
        return None, {}, False
    return segment, drop_shared_slabs(segment, loaded), segment.uuid != old_uuid


def _restore_pool(pool: BlockPool, segment: Segment, journal: Journal, loaded: Loaded,
                  name: str) -> int:
    """One pool's blocks restored; a journal the pool cannot take starts that pool clean."""
    try:
        return restore(pool, segment, journal, loaded, name)
    except BadArgsError as exc:  # a journal the pool cannot take: never map it, nor delete it
        log.warning("recovery: %s; it is kept as %s; pool %s starts clean", exc,
                    journal.set_aside(), name)
        _reset_journal(journal, segment, name)
        return 0


def _slab_copier(slabs: np.ndarray, blocks_per_slab: int) -> Callable[[int, int], None]:
    def copy_block(src: int, dst: int) -> None:
        slabs[divmod(dst, blocks_per_slab)] = slabs[divmod(src, blocks_per_slab)]
    return copy_block


def _reset_journal(journal: Journal, segment: Segment, pool: str | None = None) -> None:
    """Start the journal over for a new segment (or, of several pools, for pool `pool`)."""
    try:
        journal.reset(stamp(segment, pool))
    except JournalError as exc:  # a damaged file SQLite opened but cannot write
        log.warning("%s; it is kept as %s; starting with a new journal", exc, journal.set_aside())
        journal.reset(stamp(segment, pool))
    if pool is None:
        journal.on_commit = segment.set_acknowledged_seals
    else:
        segment.set_pool_acknowledged_seals(pool, 0)


def _block_copier(blocks: np.ndarray) -> Callable[[int, int], None]:
    def copy_block(src: int, dst: int) -> None:
        blocks[dst] = blocks[src]
    return copy_block


# ---- the socket, the pidfile, signals, metrics ---------------------------------------------------
def _bind(path: str) -> socket.socket:
    """A listening socket at `path` (0600), non-blocking."""
    # The name's lock does not cover a --socket path another name may serve, or a file a typo
    # names: replace only a socket nobody answers on (a dead daemon's).
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise InUseError(f"{path} exists and is not a socket: refusing to replace it "
                             "(choose another --socket)")
        if _is_answered(path):
            raise InUseError(f"another daemon serves {path} (started under another "
                             "--name): stop it or choose another --socket")
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        listener.listen(512)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


def _is_answered(socket_path: str) -> bool:
    """Whether something accepts connections on the Unix socket at `socket_path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def _write_pidfile(pid_path: str) -> None:
    tmp = f"{pid_path}.{os.getpid()}"
    with open(tmp, "w") as file:
        file.write(f"{os.getpid()}\n")
    os.replace(tmp, pid_path)


def _pid_text(paths: DaemonPaths) -> str:
    try:
        with open(paths.pid_path) as file:
            return f"(pid {int(file.read().strip())})"
    except (OSError, ValueError):
        return ""


def _install_signals(stop: Stop, undo: ExitStack) -> socket.socket:
    """SIGTERM and SIGINT request `stop` and wake the selector; returns the socket they wake."""
    wakeup, signal_w = socket.socketpair()
    undo.callback(signal_w.close)
    undo.callback(wakeup.close)
    wakeup.setblocking(False)
    signal_w.setblocking(False)
    signal.set_wakeup_fd(signal_w.fileno(), warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.on_signal)
    return wakeup


def _serve_metrics(port: int, service: Service, undo: ExitStack) -> int:
    """Serve metrics on 127.0.0.1:`port` until `undo`; returns the port bound (`port`, or the
    kernel's pick for 0)."""
    try:
        server = serve_metrics(port, service.stats, service.ops)
        undo.callback(server.server_close)
        undo.callback(server.shutdown)
        bound = int(server.server_address[1])
    except OSError as exc:
        error = InUseError if exc.errno == errno.EADDRINUSE else KvdError
        raise error(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    log.info("serving metrics on 127.0.0.1:%d", bound)
    return bound


# ---- releases (on the ExitStack) -----------------------------------------------------------------
def _release_lock(lock_fd: int, lock_path: str) -> None:
    """Unlink the lock file, then drop the flock: unlinked while still held, so no starter can
    lock it and also pass take_lock's check that the file is still on disk."""
    _unlink_quietly(lock_path)
    os.close(lock_fd)


def _release_listener(listener: socket.socket, path: str) -> None:
    listener.close()
    _unlink_quietly(path)


def _release_segment(segment: Segment, stop: Stop) -> None:
    if not stop.keep:
        segment.unlink()


def _release_journal(journal: Journal | PoolJournals, stop: Stop) -> None:
    """Close it for --recover (the loop has committed what was pending), or remove it."""
    if stop.keep:
        journal.close()
    else:
        journal.remove()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
