"""One kvd.Client shared by threads (issue 30, item 3), against a real daemon.

Threads' requests are in flight on the one connection together; each thread must get its own
replies and errors, a daemon restart must be reconnected once and told to every thread once, and
`close()` or a timeout in one thread must fail the others' calls, never leave them hanging.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import threading
import time

import pytest

import kvd
from conftest import SMALL_GEOMETRY, run_threads, start_daemon_process

pytestmark = pytest.mark.integration

NUM_THREADS = 8


def test_threads_sharing_a_client_each_get_their_own_replies_and_errors(kvd_daemon,
                                                                        fine_switching):
    with kvd_daemon.connect() as client:
        max_in_flight = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal max_in_flight
            while not done.is_set():
                max_in_flight = max(max_in_flight, len(client._pending))
                time.sleep(0)

        watcher = threading.Thread(target=watch)
        watcher.start()

        def work(index: int) -> None:
            rng = random.Random(index)
            for step in range(60):
                block_ids = client.alloc(rng.randint(1, 3))
                keys = [os.urandom(16) for _ in block_ids]
                assert client.seal(block_ids, keys) == [True] * len(keys)
                client.release(block_ids)
                found = client.lookup(keys)
                assert found == block_ids[:len(found)], (found, block_ids)  # (a tail evicted)
                client.release(found)
                missing = kvd.Sequence(1_000_000 + index, [], 4)  # this thread's own error
                with pytest.raises(kvd.NotFoundError, match=f"sequence {missing.seq_id} "):
                    client.commit_sequence(missing)
                assert client.stats()["num_blocks"] == SMALL_GEOMETRY["num_blocks"]

        try:
            run_threads(work, NUM_THREADS)
        finally:
            done.set()
            watcher.join()
        assert max_in_flight > 1  # the threads' requests really were in flight together
        stats = client.stats()
        assert (stats["owned"], stats["sealed"]) == (0, 0)  # every pin taken was dropped


@pytest.mark.parametrize("how", ["close", "timeout"])
def test_close_or_a_timeout_fails_every_thread_waiting_on_a_stalled_daemon(kvd_daemon, how):
    """The daemon is stopped (SIGSTOP), so every call waits: one thread in recv, the others
    asleep or about to send. close() from the main thread, or a reply timeout, must fail them
    all with DisconnectedError at once."""
    client = kvd_daemon.connect(timeout_s=1.0 if how == "timeout" else None)
    errors: list[BaseException] = []
    waiting = threading.Barrier(NUM_THREADS + 1, timeout=30)

    def call(index: int) -> None:
        waiting.wait()
        try:
            client.stats()
        except kvd.DisconnectedError as exc:
            errors.append(exc)

    kvd_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=call, args=(index,), daemon=True)
                   for index in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        waiting.wait()
        time.sleep(0.3)  # all of them sent and wait
        if how == "close":
            client.close()
        started = time.monotonic()
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a thread hung"
        assert time.monotonic() - started < 5
    finally:
        kvd_daemon.proc.send_signal(signal.SIGCONT)
    assert len(errors) == NUM_THREADS and client.is_closed
    expected = "close() was called" if how == "close" else "within timeout_s"
    assert all(expected in str(exc) for exc in errors), [str(exc) for exc in errors]
    with pytest.raises(kvd.DisconnectedError, match="closed"):
        client.stats()
    client.close()


def test_a_restart_is_reconnected_once_and_told_to_every_thread_once(kvd_daemon):
    """SIGKILL and `kvd start --recover` under threads sharing one client. Busy threads look up
    and release their sealed blocks in a loop: lookups are retried and releases satisfied, in
    flight or not, so they see no error. Idle threads hold a block allocated before the restart
    and call nothing during it: their next call, a seal of that block, is the one told of the
    restart ('restarted', never sealing a block of the new session), and only that one."""
    client = kvd_daemon.connect(reconnect_timeout_s=30)
    restarted = threading.Event()
    num_busy = NUM_THREADS // 2
    num_rounds_after = [0] * num_busy
    told: list[int] = []
    try:
        chains = []
        for _ in range(num_busy):
            block_ids = client.alloc(2)
            keys = [os.urandom(16) for _ in block_ids]
            client.seal(block_ids, keys)
            client.release(block_ids)
            chains.append((keys, block_ids))
        start = threading.Barrier(NUM_THREADS + 1, timeout=30)

        def busy(index: int) -> None:
            keys, block_ids = chains[index]
            start.wait()
            while num_rounds_after[index] < 20:
                if restarted.is_set():
                    num_rounds_after[index] += 1
                assert client.lookup(keys) == block_ids  # the same segment: recovered
                client.release(block_ids)

        def idle(index: int) -> None:
            owned = client.alloc(1)  # of the session the restart ends
            start.wait()
            restarted.wait(60)
            with pytest.raises(kvd.DisconnectedError, match="restarted before 'seal'"):
                client.seal(owned, [os.urandom(16)])
            told.append(index)
            fresh = client.alloc(1)
            assert client.seal(fresh, [os.urandom(16)]) == [True]  # told once, not again
            client.release(fresh)

        threads = [threading.Thread(target=busy if index < num_busy else idle, args=(index,),
                                    daemon=True) for index in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        start.wait()
        time.sleep(0.2)
        kvd_daemon.proc.send_signal(signal.SIGKILL)
        kvd_daemon.proc.wait(20)
        kvd_daemon.proc = start_daemon_process(kvd_daemon.name, kvd_daemon.log_path,
                                               ["--recover"], **SMALL_GEOMETRY)
        kvd_daemon.wait_ready()
        restarted.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a thread hung"
        assert sorted(told) == list(range(num_busy, NUM_THREADS))
        assert min(num_rounds_after) == 20  # (a busy thread that failed stopped short)
        assert client.num_reconnects == 1
        stats = client.stats()
        assert (stats["owned"], stats["sealed"]) == (0, 0)  # no pin leaked, none released twice
    finally:
        client.close()


def _voluntary_switches_per_request(clients: list[kvd.Client], num_rounds: int) -> float:
    """4 threads, thread i on clients[i % len(clients)], each num_rounds of alloc → seal →
    release (3 requests): this process's voluntary context switches per request."""
    def work(index: int) -> None:
        client = clients[index % len(clients)]
        for _ in range(num_rounds):
            block_ids = client.alloc(1)
            client.seal(block_ids, [os.urandom(16)])
            client.release(block_ids)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    run_threads(work, 4)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / (4 * num_rounds * 3)


def test_threads_sharing_a_client_on_one_cpu_block_about_as_often_as_with_a_client_each(
        kvd_daemon):
    """A thread handed its reply (or the reading) is woken without the GIL held by its waker
    (kvd.client._Waker). Woken by a Lock released with the GIL held, it would run at once on
    the same CPU, block on the GIL, and the two would trade the CPU several times per request:
    ~5x the voluntary switches of threads with a client each, where the kernel wakes each
    thread in its own recv. That shows with the threads on one CPU and the daemon on another
    (as bench/client_threads.py places them); on the daemon's CPU they interleave with it."""
    saved = os.sched_getaffinity(0)
    if len(saved) < 2:
        pytest.skip("needs 2 CPUs: one for the daemon, one for the client's threads")
    daemon_cpu, client_cpu = sorted(saved)[:2]
    shared = kvd_daemon.connect()
    own = [kvd_daemon.connect() for _ in range(4)]
    try:
        os.sched_setaffinity(kvd_daemon.proc.pid, {daemon_cpu})
        os.sched_setaffinity(0, {client_cpu})  # (the threads started below inherit it)
        per_request: dict[str, list[float]] = {"shared": [], "own": []}
        for _ in range(3):  # in turns, so a busy host weighs on both alike
            per_request["shared"].append(_voluntary_switches_per_request([shared], 100))
            per_request["own"].append(_voluntary_switches_per_request(own, 100))
    finally:
        os.sched_setaffinity(0, saved)
        for client in (shared, *own):
            client.close()
    shared_median, own_median = (sorted(values)[1] for values in per_request.values())
    assert shared_median <= 2 * own_median, per_request


def test_a_wakeup_left_over_only_ends_a_sleep_early(kvd_daemon):
    """A thread's wake-up that came after it had stopped waiting makes its next sleep return at
    once; it looks again and sleeps on, and still gets its own reply."""
    client = kvd_daemon.connect()
    results: dict[str, object] = {}
    try:
        kvd_daemon.proc.send_signal(signal.SIGSTOP)
        try:
            reader = threading.Thread(target=lambda: results.update(reader=client.stats()))
            reader.start()
            deadline = time.monotonic() + 10
            while not client._is_reading:  # the other thread is in recv: we will sleep
                assert time.monotonic() < deadline, "the first thread never started reading"
                time.sleep(0.001)
            kvd.client._waker().wake()  # (as if a wake-up meant for an earlier call came late)
            threading.Timer(0.2, kvd_daemon.proc.send_signal, [signal.SIGCONT]).start()
            results["sleeper"] = client.alloc(1)
            reader.join(10)
        finally:
            kvd_daemon.proc.send_signal(signal.SIGCONT)
        assert results["reader"]["num_blocks"] == SMALL_GEOMETRY["num_blocks"]
        assert len(results["sleeper"]) == 1
    finally:
        client.close()


def test_a_forked_child_wakes_its_own_threads_never_the_parents():
    """Threads sleep on an eventfd of their own; a forked child inherits the parent's, so the
    child must make new ones, or a wake-up in the child would end a sleep in the parent."""
    waker = kvd.client._waker()
    waker.sleep(0)  # (takes a wake-up left over from this thread's earlier calls in the run)
    pid = os.fork()
    if pid == 0:  # the child: wake "this thread's" waker, and leave at once
        try:
            kvd.client._waker().wake()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    started = time.monotonic()
    waker.sleep(0.2)
    assert time.monotonic() - started >= 0.15, "the child's wake-up reached the parent"
