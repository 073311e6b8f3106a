"""Where a named daemon lives: runtime directory, socket, lock, pidfile, segment and state names.

Every path derives from the daemon's *name* so `kvd start --name x`, `kvd stop --name x` and
`kvd.connect("x")` agree without configuration. The runtime directory is private (0700) and must
be owned by us: the socket and lock inside it are then reachable by our user only.

    $XDG_RUNTIME_DIR/kvd/  (else /tmp/kvd-<uid>/)
        <name>.sock   Unix socket (0600)
        <name>.lock   flock held by the live daemon: the single-instance guard, taken before the
                      socket path is touched
        <name>.pid    pid of the live daemon
    /dev/shm/kvd-<uid>-<name>             the segment
    /dev/shm/kvd-<uid>-<name>.journal/    the journal (crash recovery; `--state-dir` moves it)

The journal sits beside the segment, in memory, because it is worth exactly as long as the
segment is: it maps content to the segment's blocks, so it survives what the segment survives
(the daemon crashing or being stopped with --keep) and is useless after what wipes the segment (a
reboot; the stamp check then starts clean anyway). On tmpfs, SQLite's WAL writes and
checkpoints never wait for a disk: at batch 16, commit + upkeep take 29-31 us of mean wall time
there against 46-57 us on the bench machine's ext4, and the longest stall (a checkpoint's fsync)
5 ms against 16-24 ms (`python -m bench.journal_commit`, TMPDIR on each).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvd.errors import BadArgsError, DeniedError

DEFAULT_NAME = "default"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory: the segment's tmpfs
JOURNAL_SUFFIX = ".journal"  # the default journal directory: the segment's name + this
MAX_SOCKET_PATH_NBYTES = 107  # sun_path is 108 bytes including the terminating NUL


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BadArgsError(f"daemon name {name!r} must be 1-64 characters of letters, digits, "
                           "'_', '.', '-', starting with a letter or digit")
    if name.endswith(JOURNAL_SUFFIX):  # its segment would be daemon X's journal directory
        raise BadArgsError(f"daemon name {name!r} must not end in {JOURNAL_SUFFIX!r}: "
                           f"/dev/shm/kvd-UID-X{JOURNAL_SUFFIX} is daemon X's journal")
    return name


def runtime_dir() -> Path:
    """The private runtime directory, created 0700 if missing; refused if others can use it."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return private_dir(Path(base) / "kvd" if base else Path(f"/tmp/kvd-{os.getuid()}"),
                       "set XDG_RUNTIME_DIR to a private directory")


def state_dir(name: str) -> Path:
    """The default journal directory of daemon `name` (module docstring: why in memory)."""
    return Path(f"{SHM_DIR}/kvd-{os.getuid()}-{check_name(name)}{JOURNAL_SUFFIX}")


def private_dir(path: Path, remedy: str = "choose another directory") -> Path:
    """`path` as a directory only we can use: created 0700 if missing; refused if it is not a
    directory we own (a world-writable parent such as /tmp or /dev/shm lets others plant one);
    group and other permissions dropped."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # something else is there, a dangling symlink say: lstat names it
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise squatter(path, info, "a directory", remedy)
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def squatter(path: Path | str, info: os.stat_result, wanted: str, remedy: str) -> DeniedError:
    """The error for `path` (lstat `info`) found where we need `wanted` of our own: in a
    world-writable directory (/tmp, /dev/shm) another local user can plant it first."""
    kind = ("a symlink" if stat.S_ISLNK(info.st_mode) else "a directory"
            if stat.S_ISDIR(info.st_mode) else "a file")
    return DeniedError(f"{path} is {kind} owned by uid {info.st_uid}, not {wanted} of uid "
                       f"{os.getuid()} (another user may have planted it): remove it (its owner "
                       f"or root can) or {remedy}")


def check_ours(path: str, wanted: str, remedy: str) -> bool:
    """Whether `path` exists as a regular file of ours, not following a symlink; a symlink or
    another uid's file there is a DeniedError (`squatter`)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise squatter(path, info, wanted, remedy)
    return True


@dataclass(frozen=True)
class DaemonPaths:
    name: str
    socket_path: str
    lock_path: str
    pid_path: str
    segment_name: str

    @classmethod
    def for_name(cls, name: str = DEFAULT_NAME, socket_path: str | None = None) -> DaemonPaths:
        check_name(name)
        directory = runtime_dir()
        socket_path = socket_path or str(directory / f"{name}.sock")
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_NBYTES:
            raise BadArgsError(f"socket path {socket_path!r} is longer than "
                               f"{MAX_SOCKET_PATH_NBYTES} bytes (the Unix limit): use a shorter "
                               "--name, --socket or XDG_RUNTIME_DIR")
        return cls(name=name, socket_path=socket_path,
                   lock_path=str(directory / f"{name}.lock"),
                   pid_path=str(directory / f"{name}.pid"),
                   segment_name=f"/kvd-{os.getuid()}-{name}")


def resolve_socket(name_or_socket_path: str | None) -> str:
    """`kvd.connect`'s argument → a socket path: a path (contains '/') or a daemon name."""
    if name_or_socket_path is None:
        name_or_socket_path = os.environ.get("KVD_NAME", DEFAULT_NAME)
    if not isinstance(name_or_socket_path, str):
        raise BadArgsError("kvd.connect() takes a daemon name or a socket path (str), got "
                           f"{name_or_socket_path!r}")
    if "/" in name_or_socket_path:
        return name_or_socket_path
    return DaemonPaths.for_name(name_or_socket_path).socket_path
