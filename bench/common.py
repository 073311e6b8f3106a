"""What every bench shares: a real daemon, the echo floor, placement, timing and result files.

Every bench in `python -m bench` measures kvd next to a floor or an alternative in the same run
(the machines are noisy, so only ratios taken side by side mean anything). The pieces:

* `Daemon`: `kvd start` exactly as a user runs it (a subprocess with its own runtime directory,
  stopped with SIGTERM, leaving nothing in /dev/shm), or with `--recover` and stopped `--keep`.
* The floor, `EchoServer` / `EchoClient`: a minimal msgpack server on the same kind of Unix socket
  with kvd's framing (4-byte big-endian length + msgpack body), one `selectors` loop that decodes
  each request and answers `[id, True, None]`. Whatever kvd costs above it is the daemon's and the
  client library's own work. `python -m bench.common --echo-server SOCKET` runs it.
* Placement: `pinned` holds processes on given CPUs with `os.sched_setaffinity`, so kvd and its
  floor always meet the same conditions; free-running, a small VM's scheduler puts a server
  beside its client or on another vCPU, and not alike for the two
  (`python -m bench.diagnostics.placement` shows it).
* Timing and results: `percentiles`, `cpu_ns` (a process's CPU time), `write_json`,
  `markdown_table`, `save_plot` (small PNGs), `bench_main` (a bench's command line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

import msgpack

import kvd
from kvd.geometry import Geometry

ROOT = Path(__file__).resolve().parents[1]
# The Mooncake traces (bench/hit_ratio.py): ../shared/traces beside the checkout, or $KVD_TRACES.
SHARED_TRACES = Path(os.environ.get("KVD_TRACES") or ROOT.parent / "shared" / "traces")
PLOT_DPI = 100
OWNER = 1  # the session id a bench gives a bare BlockPool's calls


class GeometryFlags(TypedDict):
    """`kvd start`'s geometry flags, as `Daemon`'s keywords and `geometry_of` take them."""
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


# Small blocks keep the segment tiny where only metadata is measured (control plane, scaling).
TINY_GEOMETRY: GeometryFlags = {"layers": 1, "kv_heads": 1, "head_dim": 8, "block_size": 16,
                                "dtype": "float16"}
_STARTED = time.monotonic()
_LENGTH = struct.Struct(">I")


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays for tables), with the seconds since start."""
    print(f"[bench +{time.monotonic() - _STARTED:.0f} s] {message}", file=sys.stderr, flush=True)


def digests(start: int, count: int) -> list[bytes]:
    """Distinct 16-byte content hashes (the size kvd.hash_blocks makes)."""
    return [i.to_bytes(16, "little") for i in range(start, start + count)]


def geometry_of(num_blocks: int, geometry: GeometryFlags = TINY_GEOMETRY) -> Geometry:
    """The Geometry `kvd start` builds from these flags (`Daemon`'s keyword arguments)."""
    return Geometry(num_blocks=num_blocks, num_layers=geometry["layers"],
                    block_size=geometry["block_size"], num_kv_heads=geometry["kv_heads"],
                    head_dim=geometry["head_dim"], dtype=geometry["dtype"])


def child_env(runtime_dir: str | None = None) -> dict[str, str]:
    """This checkout importable, one BLAS thread; a private runtime dir when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    if runtime_dir is not None:
        env["XDG_RUNTIME_DIR"] = runtime_dir
    return env


# ---- a daemon as a user runs it ---------------------------------------------------------------
class Daemon:
    """`kvd start` in a subprocess; a context manager.

    Each has a runtime dir of its own unless `runtime_dir` is given (with `name`: a daemon an
    earlier one of that name left for `--recover`). `socket_path` is what `kvd.connect` takes,
    also from other processes. `ready_s`: from exec to the first successful connect. `flags`:
    more `kvd start` flags.
    """

    def __init__(self, num_blocks: int, journal: bool = False, policy: str = "default",
                 recover: bool = False, name: str | None = None, runtime_dir: str | None = None,
                 flags: Sequence[str] = (), **geometry: int | str) -> None:
        self.owns_runtime_dir = runtime_dir is None
        self.runtime_dir = runtime_dir or tempfile.mkdtemp(prefix="kvdb-", dir="/tmp")
        self.name = name or f"bench-{uuid.uuid4().hex[:8]}"
        self.socket_path = os.path.join(self.runtime_dir, "kvd", f"{self.name}.sock")
        self.log_path = os.path.join(self.runtime_dir, f"{self.name}.log")
        command = [sys.executable, "-m", "kvd.cli", "start", "--name", self.name,
                   "--num-blocks", str(num_blocks), "--policy", policy, "--log-level", "WARNING"]
        for key, value in {**TINY_GEOMETRY, **geometry}.items():
            command += [f"--{key.replace('_', '-')}", str(value)]
        command += [] if journal else ["--no-journal"]
        command += ["--recover"] if recover else []
        command += flags
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=child_env(self.runtime_dir), cwd=ROOT,
                                         stdout=log, stderr=log)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - started

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd start exited with {self.proc.returncode}: {self.log()}")
            try:
                kvd.connect(self.socket_path, reconnect_timeout_s=0).close()
                return
            except kvd.KvdError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvd start not ready in {timeout_s} s: {self.log()}")
                time.sleep(0.005)

    def connect(self) -> kvd.Client:
        return kvd.connect(self.socket_path, reconnect_timeout_s=0)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as file:
            return file.read()[-2000:]

    def stop(self, keep: bool = False) -> None:
        """Stop the daemon: SIGTERM, or with `keep` a shutdown that keeps segment and journal
        for the next `--recover`. Raise if a plain stop left its segment behind."""
        if self.proc.poll() is None:
            if keep:
                with self.connect() as client:
                    client.shutdown(keep=True)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.owns_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        segment = f"/dev/shm/kvd-{os.getuid()}-{self.name}"
        if not keep and os.path.exists(segment):
            os.unlink(segment)
            raise RuntimeError(f"daemon {self.name} left its segment behind")

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


# ---- the floor: a msgpack echo server -----------------------------------------------------------
def echo_replies(buffer: bytearray) -> bytes:
    """Answer every complete frame in `buffer` with `[id, True, None]`; consume those frames."""
    replies, offset = [], 0
    while len(buffer) - offset >= 4:
        (nbytes,) = _LENGTH.unpack_from(buffer, offset)
        end = offset + 4 + nbytes
        if end > len(buffer):
            break
        request = msgpack.unpackb(buffer[offset + 4:end])
        body = msgpack.packb([request[0], True, None])
        replies.append(_LENGTH.pack(len(body)) + body)
        offset = end
    del buffer[:offset]
    return b"".join(replies)


def serve_echo(socket_path: str) -> None:
    """Answer every frame with `[id, True, None]` until SIGTERM; one selectors loop."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(512)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    buffers: dict[socket.socket, bytearray] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        for key, _ in selector.select():
            if key.data is None:
                sock, _ = listener.accept()
                sock.setblocking(False)
                buffers[sock] = bytearray()
                selector.register(sock, selectors.EVENT_READ, sock)
                continue
            sock = key.data
            data = sock.recv(65536)  # not 256 KiB: malloc would mmap and munmap it every call
            if not data:
                selector.unregister(sock)
                del buffers[sock]
                sock.close()
                continue
            buffers[sock] += data
            sock.sendall(echo_replies(buffers[sock]))


class _EchoProtocol(asyncio.Protocol):
    """The same echo as an asyncio Protocol (not streams): what kvd would run on asyncio."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.transport.write(echo_replies(self.buffer))


def serve_echo_asyncio(socket_path: str) -> None:
    """`serve_echo` on asyncio's event loop, until SIGTERM."""
    async def serve() -> None:
        server = await asyncio.get_running_loop().create_unix_server(_EchoProtocol, socket_path)
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(serve())


class EchoClient:
    """The floor's client: pack, send, read one reply; nothing else."""

    def __init__(self, socket_path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self._next_id = 1

    def call(self, op: str, args: dict[str, Any]) -> Any:
        request_id = self._next_id
        self._next_id += 1
        body = msgpack.packb([request_id, op, args])
        self.sock.sendall(_LENGTH.pack(len(body)) + body)
        data = self.sock.recv(65536)
        while len(data) < 4 or len(data) < 4 + _LENGTH.unpack_from(data)[0]:
            data += self.sock.recv(65536)
        return msgpack.unpackb(data[4:])[2]

    def close(self) -> None:
        self.sock.close()


class ServerProcess:
    """A server in a subprocess with a temp directory of its own, ready once `is_ready()` says
    so; stopped (SIGTERM) and its directory removed on `stop()`. A context manager."""

    def __init__(self, command: list[str], directory: str, is_ready: Callable[[], bool],
                 env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not is_ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{command[0]} {' '.join(command[1:3])} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class EchoServer(ServerProcess):
    """The echo server in its own interpreter, as the daemon has. `loop`: "selectors" (the
    floor) or "asyncio"."""

    def __init__(self, loop: str = "selectors") -> None:
        directory = tempfile.mkdtemp(prefix="kvde-", dir="/tmp")
        self.socket_path = os.path.join(directory, "echo.sock")
        super().__init__([sys.executable, "-m", "bench.common", "--echo-server",
                          self.socket_path, "--loop", loop], directory, self._answers,
                         child_env())

    def _answers(self) -> bool:
        try:
            EchoClient(self.socket_path).close()
            return True
        except OSError:
            return False


# ---- placement ----------------------------------------------------------------------------------
@contextlib.contextmanager
def pinned(cpu_of: dict[int, int]) -> Iterator[None]:
    """Pin each process (its main thread) to its CPU for the block, then restore their CPU sets."""
    saved = {pid: os.sched_getaffinity(pid) for pid in cpu_of}
    try:
        for pid, cpu in cpu_of.items():
            os.sched_setaffinity(pid, {cpu})
        yield
    finally:
        for pid, cpus in saved.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, cpus)


def placements(client_pids: Sequence[int],
               server_pids: Sequence[int]) -> dict[str, dict[int, int]]:
    """The placements a cross-process bench measures, each the same for every server: all on one
    CPU, and (given two CPUs) the clients on one and the servers on another, so that every round
    trip crosses CPUs for kvd and its floor alike."""
    cpus = sorted(os.sched_getaffinity(os.getpid()))
    chosen = {"one CPU": {pid: cpus[0] for pid in (*client_pids, *server_pids)}}
    if len(cpus) >= 2:
        chosen["client apart"] = {**{pid: cpus[0] for pid in client_pids},
                                  **{pid: cpus[1] for pid in server_pids}}
    return chosen


# ---- timing -------------------------------------------------------------------------------------
def percentiles(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50 and p99 of samples in ns, returned in microseconds."""
    ordered = sorted(samples_ns)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "n": len(ordered)}


def best_seconds(func: Callable[[], Any], repeats: int, min_time_s: float = 0.0) -> float:
    """Best wall time of `func` over at least `repeats` calls (and `min_time_s` spent)."""
    best, spent, count = float("inf"), 0.0, 0
    while count < repeats or spent < min_time_s:
        start = time.perf_counter()
        func()
        elapsed = time.perf_counter() - start
        best, spent, count = min(best, elapsed), spent + elapsed, count + 1
    return best


def cpu_ns(pid: int) -> int:
    """Nanoseconds every live thread of process `pid` has run: /proc/PID/task/*/schedstat
    (exact), else, where a kernel or sandbox has none (gVisor's), user + system time from
    /proc/PID/stat in clock ticks (10 ms each: a few % of a one-second turn's server time)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # (the thread ended meanwhile)
                with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                    total += int(file.read().split()[0])
        return total
    except FileNotFoundError:
        with open(f"/proc/{pid}/stat") as file:  # fields after the ")" closing the command name
            fields = file.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")


# ---- results ------------------------------------------------------------------------------------
def write_json(out: Path, name: str, results: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    return plt


def save_plot(figure: Any, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=PLOT_DPI)
    pyplot().close(figure)
    return path


def report(out: Path, name: str, results: Any, markdown: Callable[[Any], str],
           plot: Callable[[Any, Path], Path] | None = None) -> str:
    """Write `results` as out/NAME.json (and their plot), return their markdown section."""
    write_json(out, name, results)
    if plot is not None:
        plot(results, out)
    return markdown(results)


def bench_main(doc: str, run_bench: Callable[[bool, Path], str],
               argv: list[str] | None = None) -> int:
    """`python -m bench.<name> [--quick] [--out DIR]`: run one bench, print its section."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny sizes)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    print(run_bench(args.quick, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.common --echo-server SOCKET [--loop asyncio]`: EchoServer's child."""
    parser = argparse.ArgumentParser(description="the echo floor, for EchoServer")
    parser.add_argument("--echo-server", metavar="SOCKET", required=True)
    parser.add_argument("--loop", choices=("selectors", "asyncio"), default="selectors")
    args = parser.parse_args(argv)
    (serve_echo_asyncio if args.loop == "asyncio" else serve_echo)(args.echo_server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
