"""The `kvd` command: start, stop, status, stats, demo, replay."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvd import native
from kvd.core.policies import DEFAULT_POLICY, POLICIES, TIER_NAMES, parse_tiers
from kvd.errors import BadArgsError, DisconnectedError, KvdError
from kvd.geometry import DTYPES, Geometry
from kvd.protocol import codec
from kvd.runtime import DEFAULT_NAME, SHM_DIR, DaemonPaths, runtime_dir

if TYPE_CHECKING:  # (the daemon's modules load only for `kvd start`)
    from kvd.client import Client
    from kvd.server.config import ModelSpec, PoolSpec
    from kvd.server.startup import DaemonConfig, Started

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_nbytes(text: str) -> int:
    """'512M', '1GiB', '2g', '4096' → bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512M, 8GiB or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return port


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=os.environ.get("KVD_NAME", DEFAULT_NAME),
                        help="daemon name (default: $KVD_NAME or %(default)s)")
    parser.add_argument("--socket", help="socket path (default: derived from --name)")


def _add_start(subparsers: Any) -> None:
    parser = subparsers.add_parser("start", help="run a daemon (foreground unless --detach)")
    _add_selection(parser)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="blocks in the pool")
    size.add_argument("--memory", type=parse_nbytes, help="pool size, e.g. 2G (default 512M)")
    parser.add_argument("--config", metavar="KVD_TOML",
                        help="pools (and memory, policy, [remote]) from a TOML file: see "
                             "docs/pools.md")
    parser.add_argument("--pool", action="append", default=[], metavar="NAME:KEY=V,...",
                        help="a pool: NAME:layers=L,kv-heads=H,head-dim=D,dtype=T,block-size=B"
                             "[,parts=1][,window=W]; repeat for several sharing --memory")
    parser.add_argument("--model", action="append", default=[], metavar="NAME:POOL,POOL",
                        help="a model whose sequences span these pools (one block size), e.g. "
                             "full-attention and sliding-window layers; see docs/pools.md")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--policy", default="default",
                        help=f"eviction policy: {', '.join(sorted(POLICIES))} or default "
                             f"({DEFAULT_POLICY})")
    parser.add_argument("--tiers", metavar="prefill=S,decode=S",
                        help="split the pool into prefill and decode tiers with these shares, "
                             "e.g. prefill=0.7,decode=0.3 (add :POLICY to give a tier its own)")
    parser.add_argument("--state-dir", help="journal directory for crash recovery (default: "
                        "/dev/shm/kvd-UID-NAME.journal, in memory beside the segment)")
    parser.add_argument("--no-journal", action="store_true",
                        help="no crash-recovery journal (seals are cheaper; nothing survives)")
    parser.add_argument("--recover", action="store_true",
                        help="re-attach the segment and journal a crashed daemon left")
    parser.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on 127.0.0.1")
    parser.add_argument("--remote", metavar="URL",
                        help="remote tier (docs/remote.md): redis://HOST:PORT[/DB] or "
                             "redis-cluster://HOST:PORT[,HOST:PORT...]")
    parser.add_argument("--remote-timeout-ms", type=int,
                        help="how long a lookup waits for the remote tier (default 100)")
    parser.add_argument("--detach", action="store_true", help="daemonise (log to the runtime dir)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    _add_limits(parser)
    parser.set_defaults(func=cmd_start)


# (flag, parser, help) per field of kvd.server.service.Limits; the defaults are its own.
_LIMIT_FLAGS = (
    ("--max-sequences", int, "open sequences per session"),
    ("--max-forks", int, "open forked sequences per session"),
    ("--max-pins", int, "block pins one session's sequences may hold"),
    ("--max-output-nbytes", parse_nbytes, "unread replies per connection before it is closed"),
    ("--max-total-output-nbytes", parse_nbytes,
     "unread replies of all connections together (the largest are closed first)"),
)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("limits (a request past one gets TOO_LARGE)")
    for flag, parse, text in _LIMIT_FLAGS:
        limits.add_argument(flag, type=parse, help=f"{text} (default: {_default_limit(flag)})")


def _limit_field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _default_limit(flag: str) -> int:
    from kvd.server.daemon import Limits

    return int(getattr(Limits(), _limit_field(flag)))


def _limits(args: argparse.Namespace) -> Any:
    from kvd.server.daemon import Limits

    given = {_limit_field(flag): getattr(args, _limit_field(flag)) for flag, _, _ in _LIMIT_FLAGS}
    return Limits(**{name: value for name, value in given.items() if value is not None})


def _geometry(args: argparse.Namespace) -> Geometry:
    shape = {"num_layers": args.layers, "block_size": args.block_size,
             "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}
    if args.num_blocks is not None:
        return Geometry(num_blocks=args.num_blocks, **shape)
    return Geometry.for_memory(512 << 20 if args.memory is None else args.memory, **shape)


def cmd_start(args: argparse.Namespace) -> int:
    from kvd.server.daemon import DaemonConfig, launch

    _check_policy("--policy", args.policy)
    if args.tiers:  # a typed error before anything starts
        for name, spec in zip(TIER_NAMES, parse_tiers(args.tiers)):
            if spec.policy is not None:
                _check_policy(f"--tiers {name}=...:POLICY", spec.policy)
    paths = DaemonPaths.for_name(args.name, args.socket)
    pools, memory, policy, models, remote = _pools(args)
    geometry = pools[0].shape if pools else _geometry(args)
    _raise_fd_limit()
    config = DaemonConfig(paths, geometry, policy, tiers=args.tiers,
                          metrics_port=args.metrics_port, state_dir=args.state_dir,
                          recover=args.recover, journal=not args.no_journal,
                          pools=tuple(pools), budget_nbytes=memory, models=tuple(models),
                          limits=_limits(args), **remote)
    if args.detach:
        return _detach(config, args.log_level)
    _setup_logging(args.log_level, sys.stderr)
    server = launch(config)
    print(_ready_line(server.started), flush=True)
    server.serve_forever()
    return 0


def _remote(args: argparse.Namespace, file: dict[str, Any]) -> dict[str, Any]:
    """DaemonConfig's remote and remote_timeout_ms from the flags, else the config's [remote]
    (DaemonConfig has the default timeout)."""
    url = args.remote if args.remote is not None else file["url"]
    timeout_ms = (args.remote_timeout_ms if args.remote_timeout_ms is not None
                  else file["timeout_ms"])
    if timeout_ms is None:
        return {"remote": url}
    if url is None:
        raise BadArgsError("--remote-timeout-ms (or [remote] timeout_ms) needs --remote (or "
                           "[remote] url in --config)")
    return {"remote": url, "remote_timeout_ms": timeout_ms}


def _pools(args: argparse.Namespace
           ) -> tuple[list[PoolSpec], int, str, list[ModelSpec], dict[str, Any]]:
    """`--config`, `--pool`, `--model` and the remote tier's flags: (pools, budget, policy,
    models, DaemonConfig's remote settings); no pools for the single-pool flags."""
    from kvd.server.config import parse_model_flag, parse_pool_flag, read_config

    file = read_config(args.config) if args.config else {
        "pools": [], "memory": None, "policy": None, "models": [],
        "remote": {"url": None, "timeout_ms": None}}
    pools = [*file["pools"], *(parse_pool_flag(text) for text in args.pool)]
    models = [*file["models"], *(parse_model_flag(text) for text in args.model)]
    if pools and args.num_blocks is not None:
        raise BadArgsError("--num-blocks sizes the single pool; several pools share --memory: "
                           "give --memory instead")
    memory = args.memory
    if memory is None and file["memory"] is not None:
        memory = file["memory"] if type(file["memory"]) is int else parse_nbytes(
            str(file["memory"]))
    policy = args.policy if args.policy != "default" or not file["policy"] else file["policy"]
    _check_policy("policy", policy)
    return (pools, 512 << 20 if memory is None else memory, policy, models,
            _remote(args, file["remote"]))


def _check_policy(flag: str, name: str) -> None:
    if name not in POLICIES and name != "default":
        raise BadArgsError(f"unknown {flag} {name!r}: choose one of "
                           f"{', '.join(sorted(POLICIES))} or default")


def _raise_fd_limit() -> None:
    """Every session takes two fds (its socket and a pidfd): the usual soft limit of 1024 would
    stop the daemon near 500 workers, so take what the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _ready_line(started: Started) -> str:
    g, paths = started.config.geometry, started.config.paths
    metrics_port = started.service.info.get("metrics_port")
    metrics = "" if metrics_port is None else f" metrics=127.0.0.1:{metrics_port}"
    served = started.service.served
    blocks = (f"blocks={g.num_blocks} block_nbytes={g.block_nbytes}" if not started.config.pools
              else f"memory={started.config.budget_nbytes} pools=" + ",".join(
                  f"{name}:{each.geometry.block_nbytes}" for name, each in served.items()))
    return (f"kvd: serving name={paths.name} socket={paths.socket_path} "
            f"segment={started.segment.name} {blocks} policy={started.service.pool.policy.name} "
            f"codec={codec()} native={native.summary()}{metrics} pid={os.getpid()}")


def _setup_logging(level: str, stream: Any) -> None:
    logging.basicConfig(level=level, stream=stream,
                        format="%(asctime)s kvd[%(process)d] %(levelname)s %(message)s")


def _detach(config: DaemonConfig, log_level: str) -> int:
    """Double-fork; the parent prints the daemon's ready line (or its error) and returns."""
    read_fd, write_fd = os.pipe()
    if os.fork():
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            message = pipe.read().strip()
        print(message or "kvd: the daemon exited before it was ready (see its log)",
              file=sys.stdout if message.startswith("kvd: serving") else sys.stderr)
        return 0 if message.startswith("kvd: serving") else 1
    os.close(read_fd)
    os.setsid()
    if os.fork():
        os._exit(0)
    log_path = os.path.join(runtime_dir(), f"{config.paths.name}.log")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    _setup_logging(log_level, sys.stderr)
    from kvd.server.daemon import launch

    try:
        server = launch(config)
    except KvdError as exc:
        os.write(write_fd, f"kvd: {exc}\n".encode())
        os._exit(1)
    os.write(write_fd, f"{_ready_line(server.started)} log={log_path}\n".encode())
    os.close(write_fd)
    server.serve_forever()
    os._exit(0)


def _socket_of(args: argparse.Namespace) -> str:
    return args.socket or DaemonPaths.for_name(args.name).socket_path


def _control_client(args: argparse.Namespace) -> Client:
    """A session that maps no segment: status and stop must work when it was deleted."""
    from kvd.client import Client

    return Client(_socket_of(args), timeout_s=args.timeout, reconnect_timeout_s=0,
                  map_segment=False)


def cmd_stop(args: argparse.Namespace) -> int:
    from kvd.server.startup import is_running

    if not args.timeout > 0:
        raise BadArgsError(f"--timeout must be > 0 seconds, got {args.timeout}")
    paths = DaemonPaths.for_name(args.name, args.socket)
    deadline = time.monotonic() + args.timeout
    try:
        with _control_client(args) as client:
            client.shutdown(keep=args.keep)
    except DisconnectedError:
        if not is_running(paths):
            print(f"kvd: no daemon named {args.name!r} is running", file=sys.stderr)
            return 1
        print(f"kvd: daemon {args.name!r} holds its name but did not answer within "
              f"{args.timeout} s (stopped or hung?)", file=sys.stderr)
        return 1
    while is_running(paths):
        if time.monotonic() > deadline:
            print(f"kvd: daemon {args.name!r} did not stop within {args.timeout} s",
                  file=sys.stderr)
            return 1
        time.sleep(0.02)
    print(f"kvd: stopped {args.name}{' (segment kept)' if args.keep else ''}")
    return 0


# `kvd status` / `kvd stats` exit codes, as LSB init scripts report them.
EXIT_NOT_RUNNING = 3
EXIT_NOT_RESPONDING = 4  # "status unknown": the name is held, the daemon does not answer


def _daemon_stats(args: argparse.Namespace) -> tuple[dict[str, Any] | None, int, str]:
    """`(stats, 0, "")`, or `(None, exit code, why)` when the daemon cannot say. The stats carry
    `segment`, the name of the segment the daemon serves (from its hello)."""
    from kvd.server.startup import is_running

    if not args.timeout > 0:
        raise BadArgsError(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        with _control_client(args) as client:
            return {**client.stats(), "segment": client.info["segment"]}, 0, ""
    except DisconnectedError:
        if is_running(DaemonPaths.for_name(args.name, args.socket)):
            return (None, EXIT_NOT_RESPONDING,
                    f"running but not responding (no reply within {args.timeout:g} s)")
        return None, EXIT_NOT_RUNNING, "not running"


def cmd_status(args: argparse.Namespace) -> int:
    stats, code, why = _daemon_stats(args)
    if stats is None:
        print(f"kvd {args.name}: {why}")
        return code
    g = stats["geometry"]
    print(f"kvd {args.name}: up {stats['uptime_s']:.0f} s, pid {stats['daemon_pid']}, "
          f"{stats['sessions']} sessions, {stats['sequences']} sequences, policy {stats['policy']}")
    print(f"  geometry: {g['num_blocks']} blocks × (layers {g['num_layers']}, 2, block_size "
          f"{g['block_size']}, kv_heads {g['num_kv_heads']}, head_dim {g['head_dim']}) "
          f"{g['dtype']}")
    if "remote" in stats:
        print(f"  remote: {_remote_summary(stats['remote'])}")
    if not os.path.exists(SHM_DIR + stats["segment"]):
        print(f"  segment {stats['segment']} is MISSING (deleted under the running daemon): "
              "no client can attach; `kvd stop` it and start again")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats, code, why = _daemon_stats(args)
    if stats is None:
        print(f"kvd {args.name}: {why}", file=sys.stderr)
        return code
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(format_stats(stats))
    return 0


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table of the numbers the Prometheus endpoint serves."""
    pools = stats.get("pools", {})
    rows = [
        *(_block_rows(stats, "") if len(pools) < 2 else
          [row for name, each in pools.items() for row in _block_rows(each, f"pool {name}: ")]),
        *_arena_rows(stats),
        ("prompt tokens / served from cache",
         f"{stats['prompt_tokens']} / {stats['cached_tokens']}"),
        ("sessions now / opened / closed",
         f"{stats['sessions']} / {stats['sessions_opened']} / {stats['sessions_closed']}"),
        ("sequences open", stats["sequences"]), ("policy", stats["policy"]),
        *_tier_rows(stats),
        *_remote_rows(stats),
        ("uptime", f"{stats['uptime_s']:.1f} s"),
        ("requests", ", ".join(f"{op} {n}" for op, n in sorted(stats["requests"].items()))),
        ("errors", ", ".join(f"{code} {n}" for code, n in sorted(stats["errors"].items()))
         or "none"),
        ("native modules", ", ".join(f"{name} {state}" for name, state in stats["native"].items())),
        ("metrics", "off" if stats.get("metrics_port") is None
         else f"http://127.0.0.1:{stats['metrics_port']}/metrics"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _remote_summary(remote: dict[str, Any]) -> str:
    error = f", last error: {remote['last_error']}" if remote["last_error"] else ""
    return (f"{remote['url']} {remote['state']}, {remote['queue_depth']} of "
            f"{remote['queue_capacity']} writes queued{error}")


def _remote_rows(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    """With --remote: the tier's state, queue, hits and errors (kvd_remote_* in metrics)."""
    remote = stats.get("remote")
    if remote is None:
        return []
    pools = stats.get("pools") or {"default": stats}
    each_pool = [(f"pool {name}: remote hit blocks", _hits_of(each["remote"], each))
                 for name, each in pools.items() if len(pools) > 1 and "remote" in each]
    return [
        ("remote tier", _remote_summary(remote)),
        ("remote hit blocks (of prefix hits)", _hits_of(remote, {"hit_blocks": sum(
            each["hit_blocks"] for each in pools.values())})),
        *each_pool,
        ("remote fetches / declined / timeouts",
         f"{remote['fetches']} / {remote['declined']} / {remote['timeouts']}"),
        ("remote blocks fetched / missed / corrupt",
         f"{remote['fetched']} / {remote['missed']} / {remote['corrupt']}"),
        ("remote blocks written / dropped / stale",
         f"{remote['written']} / {remote['dropped']} / {remote['stale']}"),
        ("remote bytes written / fetched",
         f"{remote['written_bytes']} / {remote['fetched_bytes']}"),
        ("remote errors (fetch / write blocks)",
         f"{remote['fetch_errors']} / {remote['write_errors']}"),
    ]


def _hits_of(remote: dict[str, Any], pool: dict[str, Any]) -> str:
    hit_blocks = remote["hit_blocks"]
    return f"{hit_blocks} of {pool['hit_blocks']} (local {pool['hit_blocks'] - hit_blocks})"


def _block_rows(stats: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """One pool's block counts, counters and prefix hits (`stats` or one of stats["pools"])."""
    lookups = stats["lookup_blocks"]
    return [
        (prefix + "blocks free / owned / sealed / cached",
         f"{stats['free']} / {stats['owned']} / {stats['sealed']} / {stats['cached']} "
         f"of {stats['num_blocks']}"),
        (prefix + "allocations", stats["allocations"]), (prefix + "evictions", stats["evictions"]),
        (prefix + "seals", stats["seals"]), (prefix + "lookups", stats["lookups"]),
        (prefix + "prefix hit blocks", f"{stats['hit_blocks']} of {lookups} asked "
                                       f"({stats['hit_blocks'] / lookups:.1%})" if lookups
         else "0"),
    ]


def _arena_rows(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    """With several pools: the slabs they share."""
    arena = stats.get("arena")
    if arena is None:
        return []
    return [("slabs unowned / all, moves",
             f"{arena['unowned_slabs']} / {arena['num_slabs']} of {arena['slab_nbytes']} bytes, "
             f"{arena['slab_moves']} moved")]


def _tier_rows(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    """With --tiers: the split (share:policy per tier) and each tier's resident blocks."""
    if "tiers" not in stats:
        return []
    counts = stats["tier_blocks"]
    return [("tiers", stats["tiers"]),
            ("tier blocks " + " / ".join(counts), " / ".join(str(n) for n in counts.values()))]


def _add_module_command(subparsers: Any, name: str, help_text: str, module: Any) -> None:
    """A subcommand whose module provides `add_arguments(parser)` and `run(args) -> int`."""
    parser = subparsers.add_parser(name, help=help_text)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="A shared KV-cache daemon for LLM "
                                     "inference on one host.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_start(subparsers)
    for name, func, help_text in (("stop", cmd_stop, "stop a daemon"),
                                  ("status", cmd_status, "is the daemon up; its geometry"),
                                  ("stats", cmd_stats, "the daemon's counters")):
        sub = subparsers.add_parser(name, help=help_text)
        _add_selection(sub)
        sub.set_defaults(func=func)
        sub.add_argument("--timeout", type=float, default=30.0 if name == "stop" else 10.0,
                         help="seconds to wait for the daemon (default %(default)g)")
        if name == "stop":
            sub.add_argument("--keep", action="store_true",
                             help="keep the segment and journal for a restart (--recover)")
        if name == "stats":
            sub.add_argument("--json", action="store_true")
    from kvd import demo, replay

    _add_module_command(subparsers, "demo", "a daemon + worker processes doing paged attention",
                        demo)
    _add_module_command(subparsers, "replay", "replay a block-hash trace against the policies",
                        replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KvdError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
