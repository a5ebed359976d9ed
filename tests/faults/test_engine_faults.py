"""Engine-level faults of issue 15 (cases 3, 4, 5, 7, 10 and the engine part of 11), each shown by a test
that asserts what must hold and fails on the engine as it is (so each is marked ``xfail(strict=True)``
until its fix removes the marker).

Only the public face is used: ``ws.TransferEngine`` (register, connect, write, write_batch, counter,
stats), ``Transfer.wait``/``imm_count`` and ``peer.failed_paths``. Peers live in other processes
(``_procs.EngineProc``); NIC cuts and slow NICs use two network namespaces joined by rate-limited veth
pairs (``_procs.Hosts``). The fix design is in the notes (faults_engine.md).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

import weightsync as ws
from tests.faults._procs import EngineProc, ProcError, digest, random_bytes
from tests.support.netns import TwoHosts, available

KiB, MiB = 1 << 10, 1 << 20


def _case(n: int, why: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"issue 15 case {n}: {why}")


needs_netns = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture()
def procs() -> Iterator[list[EngineProc]]:
    """Engine processes a test starts (append to the list); all are ended afterwards."""
    started: list[EngineProc] = []
    yield started
    for p in started:
        p.close()


@pytest.fixture()
def engines() -> Iterator[list[ws.TransferEngine]]:
    """In-process engines a test makes; all are closed afterwards."""
    made: list[ws.TransferEngine] = []
    yield made
    for e in made:
        e.close()


def _start(procs: list[EngineProc], netns: str | None = None, **engine_kwargs: object) -> EngineProc:
    p = EngineProc(netns=netns)
    procs.append(p)
    p.address = p.call("engine", **engine_kwargs)
    return p


def _close(procs: list[EngineProc], hosts: TwoHosts) -> None:
    """Ends the engine processes, then removes the namespaces they ran in."""
    for p in procs:
        p.close()
    procs.clear()
    hosts.remove()


def _engine(engines: list[ws.TransferEngine], **kwargs: object) -> ws.TransferEngine:
    e = ws.TransferEngine(transport="fabric", **kwargs)
    engines.append(e)
    return e


# --- case 3 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_write_to_live_peer_is_not_held_behind_a_dead_peer(procs, engines) -> None:
    """Two peers on one NIC; one dies. A 24-byte write to the live one, posted right after a write to
    the dead one, must land at once, not after the dead peer's stall timeout (5 s by default)."""
    live = _start(procs)
    dead = _start(procs)
    _live_id, live_desc = live.call("alloc", size=64)
    _dead_id, dead_desc = dead.call("alloc", size=MiB)
    eng = _engine(engines)
    src = eng.register(random_bytes(MiB, seed=3))
    live_peer = eng.connect(live.address)
    dead_peer = eng.connect(dead.address)
    eng.write(src, 0, dead_peer, dead_desc, 0, 8, imm=1).wait(10)  # connected, then gone
    dead.kill()

    eng.write(src, 0, dead_peer, dead_desc, 0, MiB, imm=1)  # never completes: the peer is gone
    start = time.monotonic()
    t = eng.write(src, 0, live_peer, live_desc, 0, 24, imm=2)
    t.wait(20)
    live.call("counter_wait", imm=2, n=t.imm_count, timeout=20)
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"24 bytes to a live peer took {elapsed:.2f} s behind a write to a dead peer"
    assert not any(live_peer.failed_paths)


# --- case 4 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_refused_write_does_not_poison_the_peer(procs, engines) -> None:
    """A write into a region the peer has deregistered is refused by the peer (its provider then drops
    the connection). That write may fail, but the peer is alive: the next write into a valid region
    must land, and no path may stay failed. Today the next write either completes locally while its
    bytes and immediate are lost with the connection, or fails with EPIPE, which fails the path for good
    (only a new connect() would clear it)."""
    rx = _start(procs)
    gone_id, gone_desc = rx.call("alloc", size=4096)
    good_id, good_desc = rx.call("alloc", size=4096)
    eng = _engine(engines, stall_timeout=2.0)
    data = random_bytes(4096, seed=4)
    src = eng.register(data)
    peer = eng.connect(rx.address)
    eng.write(src, 0, peer, good_desc, 0, 4096, imm=1).wait(10)
    rx.call("counter_wait", imm=1, n=1, timeout=10)

    rx.call("deregister", region=gone_id)
    rx.call("poison", region=good_id)  # so that the digest below proves the later writes landed
    failure = ""
    for k in range(3):
        # The refused write, and straight behind it (as in a push) a valid one: it meets the connection
        # the provider is tearing down. Refusing the first is right; the second must land all the same.
        # Today it either fails with EPIPE (the path is then failed for good) or, worse, completes
        # locally while its bytes and immediate are lost with the connection.
        refused = None
        try:
            refused = eng.write(src, 0, peer, gone_desc, 0, 4096, imm=2)
            t = eng.write(src, 0, peer, good_desc, 0, 4096, imm=3)
            t.wait(5)
            rx.call("counter_wait", imm=3, n=t.imm_count, timeout=5)
        except Exception as exc:  # a TransportError here, or the receiver's TimeoutError: both are the bug
            failure = f"round {k}: {type(exc).__name__}: {exc}"
            break
        finally:
            if refused is not None:
                try:
                    refused.wait(5)
                except ws.TransportError:
                    pass
    assert not failure, f"a valid write right after a refused one did not land ({failure})"
    assert rx.call("digest", region=good_id, off=0, size=4096) == digest(data)
    assert peer.failed_paths == [False]


@pytest.mark.timeout(90)
@needs_netns
def test_failed_nic_path_is_restored_after_link_up(procs) -> None:
    """Two NICs; NIC 1's link goes down, a write fails over to NIC 0 (right). Once the link is back up,
    the path must be restored within 20 s: failed_paths clears and new striped writes use NIC 1 again."""
    hosts = TwoHosts(rates_mbit=[400, 400], prefix="wsf", latency_ms=400).create()
    try:
        kwargs = {"nics": hosts.nic_names, "stall_timeout": 1.0, "max_piece": 4 * MiB}
        tx = _start(procs, netns=hosts.a, **kwargs)
        rx = _start(procs, netns=hosts.b, **kwargs)
        size = 8 * MiB
        s_id, _ = tx.call("alloc", size=size, seed=41)
        _d_id, d_desc = rx.call("alloc", size=size)
        peer = tx.call("connect", address=rx.address)
        t, n = tx.call("write", region=s_id, peer=peer, descriptor=d_desc, size=size, imm=1)
        tx.call("wait", transfer=t, timeout=30)
        rx.call("counter_wait", imm=1, n=n, timeout=30)

        hosts.set_link(1, up=False)
        t, n = tx.call("write", region=s_id, peer=peer, descriptor=d_desc, size=size, imm=2)
        tx.call("wait", transfer=t, timeout=30)
        assert tx.call("failed_paths", peer=peer) == [False, True]  # rerouted: as it should be
        hosts.set_link(1, up=True)

        nic1_before = tx.call("stats")[1]["bytes"]
        deadline = time.monotonic() + 20
        restored = False
        while time.monotonic() < deadline and not restored:
            t, n = tx.call("write", region=s_id, peer=peer, descriptor=d_desc, size=size, imm=3)
            tx.call("wait", transfer=t, timeout=30)
            restored = (tx.call("failed_paths", peer=peer) == [False, False]
                        and tx.call("stats")[1]["bytes"] > nic1_before)
            time.sleep(0.5)
        new_bytes = tx.call("stats")[1]["bytes"] - nic1_before
        assert restored, (f"20 s after link-up: failed_paths {tx.call('failed_paths', peer=peer)}, "
                          f"NIC 1 carried {new_bytes} new bytes")
    finally:
        _close(procs, hosts)


# --- case 5 ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_dropping_a_transfer_after_timeout_keeps_its_source_alive(procs, engines) -> None:
    """A 128 MiB write to a receiver that is paused (SIGSTOP) cannot finish; its wait times out and the
    caller drops the transfer, the region and the array. The engine still has every piece in flight, so
    the memory must stay alive until the provider has released them: once the receiver runs again,
    all immediates arrive and the destination holds exactly the bytes that were written."""
    rx = _start(procs)
    size = 128 * MiB
    d_id, d_desc = rx.call("alloc", size=size)
    eng = _engine(engines, stall_timeout=60.0)  # a paused receiver is not a dead path here
    peer = eng.connect(rx.address)
    eng.write(eng.register(np.zeros(8, dtype=np.uint8)), 0, peer, d_desc, 0, 8, imm=9).wait(10)

    def write_then_drop() -> tuple[str, int]:
        buf = random_bytes(size, seed=5)
        want = digest(buf)
        t = eng.write(eng.register(buf), 0, peer, d_desc, 0, size, imm=1)
        with pytest.raises(ws.TimeoutError):
            t.wait(0.3)
        return want, t.imm_count  # the transfer, its region and the array go out of scope here

    rx.stop()
    try:
        want, n = write_then_drop()
        gc.collect()
        reuse = np.full(size, 0x5A, dtype=np.uint8)  # likely the freed pages, with other bytes
    finally:
        rx.cont()
    try:
        rx.call("counter_wait", imm=1, n=n, timeout=20)
    except Exception as exc:
        pytest.fail(f"after dropping a timed-out transfer: {exc}; peer failed_paths {peer.failed_paths}")
    assert rx.call("digest", region=d_id, off=0, size=size) == want, "the destination holds other bytes"
    assert not any(peer.failed_paths)
    del reuse


# --- case 7 ---------------------------------------------------------------------------------------------


class _TwoVersions:
    """A sender and a receiver engine in two network namespaces joined by a fast NIC (400 Mbit/s) and a
    slow one (16 Mbit/s, 400 ms), with a 1 s stall timeout and 4 MiB pieces, so an 8 MiB write puts one
    piece on each NIC; two 8 MiB versions of random bytes at the sender and one poisoned region for them
    at the receiver."""

    size = 8 * MiB

    def __init__(self, procs: list[EngineProc], hosts: TwoHosts, seeds: tuple[int, int],
                 tx_hooks: dict[str, object] | None = None, provider: str | None = None) -> None:
        kwargs: dict[str, object] = {"nics": hosts.nic_names, "stall_timeout": 1.0, "max_piece": 4 * MiB}
        if provider is not None:
            kwargs["provider"] = provider
        self.tx = _start(procs, netns=hosts.a, **kwargs, **(tx_hooks or {}))
        self.rx = _start(procs, netns=hosts.b, **kwargs)
        self.v1, _ = self.tx.call("alloc", size=self.size, seed=seeds[0])
        self.v2, _ = self.tx.call("alloc", size=self.size, seed=seeds[1])
        self.d_id, self.d_desc = self.rx.call("alloc", size=self.size)
        self.peer = self.tx.call("connect", address=self.rx.address)
        self.want_v1 = digest(random_bytes(self.size, seeds[0]))
        self.want_v2 = digest(random_bytes(self.size, seeds[1]))

    def write(self, region: int, imm: int) -> tuple[int, int]:
        """Starts a write of a whole version into the receiver's region: (transfer, imm_count)."""
        return self.tx.call("write", region=region, peer=self.peer, descriptor=self.d_desc, size=self.size,
                            imm=imm)

    def received(self) -> str:
        return self.rx.call("digest", region=self.d_id, off=0, size=self.size)

    def failed_paths(self) -> list[bool]:
        return self.tx.call("failed_paths", peer=self.peer)

    def cut_mid_v1_then_v2(self, hosts: TwoHosts) -> tuple[str, int]:
        """Version 1 written, NIC 1 set down while its piece is partly sent, version 1 must still
        complete (NIC 0 reaches the peer) with NIC 1's path failed; then version 2 written, NIC 1 set up
        again, and time for whatever the old connection still held to land. Returns what the receiver
        held when version 1's counter reached its target, and version 1's imm_count."""
        t, n1 = self.write(self.v1, imm=1)
        time.sleep(0.5)  # NIC 1 has sent about a quarter of its piece
        hosts.set_link(1, up=False)
        try:
            self.tx.call("wait", transfer=t, timeout=30)
        except ProcError as exc:
            pytest.fail(f"version 1 failed although NIC 0 reaches the peer: {exc}")
        self.rx.call("counter_wait", imm=1, n=n1, timeout=30)
        v1_at_target = self.received()
        assert self.failed_paths() == [False, True]

        t, n2 = self.write(self.v2, imm=2)
        self.tx.call("wait", transfer=t, timeout=30)
        self.rx.call("counter_wait", imm=2, n=n2, timeout=30)
        hosts.set_link(1, up=True)
        time.sleep(4.0)  # whatever the old connection still held would have landed by now
        return v1_at_target, n1

    def once_and_never_late(self, v1_at_target: str, n1: int) -> list[str]:
        """What case 7 requires once version 2 completed and the slow NIC had time to drain: version 1's
        counter reached its target only with all its bytes in place, it got exactly imm_count
        immediates, and nothing of it landed over version 2."""
        failures = []
        if v1_at_target != self.want_v1:
            failures.append("version 1's counter reached its target before all its bytes landed")
        if (total := self.rx.call("counter_total", imm=1)) != n1:
            failures.append(f"version 1 delivered {total} immediates, imm_count is {n1}")
        if self.received() != self.want_v2:
            failures.append("bytes of version 1 landed after version 2 had completed")
        return failures


@pytest.mark.timeout(90)
@needs_netns
def test_retried_piece_is_counted_once_and_never_lands_late(procs) -> None:
    """NIC 1 is slow (16 Mbit/s), NIC 0 fast; the stall timeout (1 s) is shorter than NIC 1 needs for its
    4 MiB piece. The engine used to take NIC 1 for failed and re-post the piece on NIC 0 while the
    original was still being sent. What must hold whatever the engine retries: version 1's counter
    reaches its target only once every byte of version 1 landed, it receives exactly imm_count
    immediates, and once version 2 completed no byte of version 1 lands over it."""
    hosts = TwoHosts(rates_mbit=[400, 16], prefix="wsf", latency_ms=400).create()
    try:
        pair = _TwoVersions(procs, hosts, (71, 72))
        t, n1 = pair.write(pair.v1, imm=1)
        pair.rx.call("counter_wait", imm=1, n=n1, timeout=30)
        v1_at_target = pair.received()
        pair.tx.call("wait", transfer=t, timeout=30)

        t, n2 = pair.write(pair.v2, imm=2)
        pair.rx.call("counter_wait", imm=2, n=n2, timeout=30)
        pair.tx.call("wait", transfer=t, timeout=30)
        time.sleep(4.0)  # anything still on the slow NIC has landed by now (4 MiB at 16 Mbit/s: ~2.1 s)

        failures = pair.once_and_never_late(v1_at_target, n1)
        assert not failures, f"{failures}; failed_paths {pair.failed_paths()}"
    finally:
        _close(procs, hosts)


@pytest.mark.timeout(90)
@needs_netns
def test_piece_cut_off_mid_write_is_retried_once_and_never_lands_late(procs) -> None:
    """NIC 1 (slow) goes down while its 4 MiB piece of version 1 is partly sent: the path fails and the
    piece is retried on NIC 0. The original must not be counted too, and what the kernel still held
    for it must not be sent once the link is back (a gracefully closed socket goes on sending): after
    version 2 completed and NIC 1 came back up, the destination holds version 2 and version 1's counter
    got exactly imm_count immediates. NIC 1 is restored afterwards (the peer drops its half-open side)."""
    hosts = TwoHosts(rates_mbit=[400, 16], prefix="wsf", latency_ms=400).create()
    try:
        pair = _TwoVersions(procs, hosts, (73, 74))
        v1_at_target, n1 = pair.cut_mid_v1_then_v2(hosts)
        failures = pair.once_and_never_late(v1_at_target, n1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and pair.failed_paths() != [False, False]:
            t, _ = pair.write(pair.v2, imm=3)
            pair.tx.call("wait", transfer=t, timeout=30)
            time.sleep(0.5)
        if pair.failed_paths() != [False, False]:
            failures.append("NIC 1 not restored 20 s after link-up")
        assert not failures, f"{failures}; failed_paths {pair.failed_paths()}"
    finally:
        _close(procs, hosts)


@pytest.mark.timeout(90)
@needs_netns
@pytest.mark.parametrize("provider", ["tcp", "tcp;ofi_rxm"], ids=["tcp", "rxm"])
def test_piece_unresolved_after_the_drain_time_is_retried_and_never_lands_late(procs, provider: str) -> None:
    """NIC 1 (slow) goes down while its 4 MiB piece of version 1 is partly sent, and its connection is
    not aborted when the path fails (test hook ``no_path_abort``: as where a lane finds no socket of its
    own to abort), so the piece is still in flight, unresolved, when the drain time runs out. That
    piece used to be given up (its transfer failed, never retried: a push lost the destination although
    NIC 0 reached it; the emulated cluster's NIC cut). It must be retried on NIC 0 once its connection is
    closed for good, and then: version 1 completes, counted exactly imm_count times, with all its bytes
    in place; and once version 2 completed and NIC 1 came back up, nothing of version 1 that the old
    connection held lands over it (a graceful close would deliver it after link-up). Both TCP lanes: the
    authenticated MSG lane and rxm (which did not close its connection on its own in time: version 1's
    bytes landed over version 2 until the lane reset the socket first)."""
    hosts = TwoHosts(rates_mbit=[400, 16], prefix="wsf", latency_ms=400).create()
    try:
        pair = _TwoVersions(procs, hosts, (75, 76), tx_hooks={"no_path_abort": True},
                            provider=provider)
        v1_at_target, n1 = pair.cut_mid_v1_then_v2(hosts)
        failures = pair.once_and_never_late(v1_at_target, n1)
        assert not failures, f"{failures}; failed_paths {pair.failed_paths()}"
    finally:
        _close(procs, hosts)


@pytest.mark.timeout(90)
@needs_netns
@pytest.mark.parametrize("landing", [False, True], ids=["rma", "landing"])
def test_piece_whose_ack_is_lost_after_it_landed_is_counted_once(procs, landing: bool) -> None:
    """The window case 7's drain leaves: a piece lands (and is counted at the receiver), then its NIC's
    link dies before the acknowledgement reaches the writer, which takes it for failed and retries it on
    the other NIC. The test hook ``lose_imm_acks`` makes exactly that happen to the first write carrying
    an immediate. Whatever is retried, the receiver's counter must get exactly imm_count immediates and
    reach its target only with every byte in place; into a landing region as into an RMA region. (An RMA
    write of two pieces, one per NIC; into a landing region, whose writes go on one NIC, one piece of
    16 messages: a second piece in flight there would be abandoned when the path fails, which is case
    7's drain, not this window.)"""
    hosts = TwoHosts(rates_mbit=[400, 400], prefix="wsf", latency_ms=200).create()
    try:
        kwargs: dict[str, object] = {"nics": hosts.nic_names, "stall_timeout": 1.0, "max_piece": 4 * MiB}
        rx_kwargs = {**kwargs, **LANDING, "stall_timeout": 1.0} if landing else kwargs
        tx = _start(procs, netns=hosts.a, lose_imm_acks=1, **kwargs)
        rx = _start(procs, netns=hosts.b, **rx_kwargs)
        size = MiB if landing else 8 * MiB
        s_id, _ = tx.call("alloc", size=size, seed=81)
        d_id, d_desc = rx.call("alloc", size=size)
        peer = tx.call("connect", address=rx.address)
        t, n = tx.call("write", region=s_id, peer=peer, descriptor=d_desc, size=size, imm=1)
        rx.call("counter_wait", imm=1, n=n, timeout=30)
        at_target = rx.call("digest", region=d_id, off=0, size=size)
        try:
            tx.call("wait", transfer=t, timeout=30)
        except ProcError as exc:
            # Into a landing region the announce may not move to the other NIC (it would not be behind its
            # bytes there): the writer reports the write failed, although its first announce arrived.
            if not landing or "landing ring" not in exc.message:
                raise
        time.sleep(2.0)  # a second immediate of the retried piece would have arrived by now
        failures = []
        if at_target != digest(random_bytes(size, 81)):
            failures.append("the counter reached its target before every byte landed")
        if (total := rx.call("counter_total", imm=1)) != n:
            failures.append(f"the write delivered {total} immediates, imm_count is {n}")
        retried = sum(s["rerouted"] + s["errors"] for s in tx.call("stats"))
        assert retried >= 1, "the hook did not make the engine retry anything"
        assert not failures, f"{failures}; failed_paths {tx.call('failed_paths', peer=peer)}"
    finally:
        _close(procs, hosts)


@pytest.mark.timeout(90)
def test_aborting_one_engines_path_leaves_another_engines_connection_alone(procs, engines, caplog) -> None:
    """Two engines of one process share a NIC and write to the same peer. One of them fails its path to
    the peer with writes in flight, and aborts that connection so that nothing of it lands later. The
    other engine's connection to the same peer looks alike (same address, same peer) but is not the
    failing engine's: it must stay up, and its writes complete with no error and no retry."""
    rx = _start(procs, nics=["lo"])
    _d1, desc1 = rx.call("alloc", size=64 * MiB)
    _d2, desc2 = rx.call("alloc", size=MiB)
    other = _engine(engines, nics=["lo"])
    p_other = other.connect(rx.address)
    src2 = other.register(random_bytes(MiB, seed=12))
    t = other.write(src2, 0, p_other, desc2, 0, MiB, imm=2)
    t.wait(10)  # its connection is up
    rx.call("counter_wait", imm=2, n=t.imm_count, timeout=10)

    failing = ws.TransferEngine._for_tests(transport="fabric", nics=["lo"], max_piece=MiB, lose_imm_acks=1)
    engines.append(failing)
    p_fail = failing.connect(rx.address)
    src1 = failing.register(random_bytes(64 * MiB, seed=13))
    # 64 pieces; the first one's acknowledgement is lost: the path fails with the others in flight, and
    # its connection is aborted. With no other NIC the write fails.
    with pytest.raises(ws.TransportError):
        failing.write(src1, 0, p_fail, desc1, 0, 64 * MiB, imm=1).wait(30)
    with caplog.at_level(logging.WARNING, logger="weightsync.engine"):
        assert sum(s["failed_paths"] for s in failing.stats()) >= 1  # the call drains the engine's log
    # Why the path failed is kept on the peer and logged, naming the peer and the NIC.
    assert p_fail.last_error.startswith("NIC lo: ") and p_fail.failed_paths == [True]
    assert any(r.getMessage().startswith(f"weightsync: path to {p_fail.label} on NIC lo failed (")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert p_other.last_error == ""

    for _ in range(5):
        t = other.write(src2, 0, p_other, desc2, 0, MiB, imm=3)
        t.wait(10)
    rx.call("counter_wait", imm=3, n=5 * t.imm_count, timeout=10)
    stats = other.stats()
    assert sum(s["errors"] for s in stats) == 0, f"the other engine's connection was reset: {stats}"
    assert sum(s["rerouted"] for s in stats) == 0
    assert not any(p_other.failed_paths)


def _quit_status(p: EngineProc) -> int:
    """Closes the engine in its process and returns the exit status (negative: killed by that signal)."""
    try:
        p.call("quit", answer_within=30)
    except (RuntimeError, TimeoutError, OSError):
        pass  # it died during close: the status says how
    try:
        return p.proc.wait(timeout=30)
    except Exception:
        p.kill()
        return p.proc.returncode


@pytest.mark.timeout(120)
@needs_netns
@pytest.mark.parametrize("landing", [False, True], ids=["rma", "landing"])
@pytest.mark.parametrize("sender", ["killed", "alive"])
def test_receiver_closing_on_a_connection_cut_mid_message_does_not_crash(procs, sender: str,
                                                                           landing: bool) -> None:
    """A link goes down while a large write is halfway through it, so the receiver holds a half-open
    connection stopped mid-message; the sender is then killed (or stays), and the receiver closes its
    engine before the link returns. libfabric 1.17 crashed in fi_close of the endpoint there (SIGSEGV);
    closing must not crash the process, whatever state its connections are in."""
    hosts = TwoHosts(rates_mbit=[16], prefix="wsf", latency_ms=400).create()
    try:
        kwargs = {"nics": hosts.nic_names, "stall_timeout": 1.0}
        tx = _start(procs, netns=hosts.a, **kwargs)
        rx = _start(procs, netns=hosts.b, **({**kwargs, **LANDING, "landing_slot_bytes": 4 * MiB}
                                              if landing else kwargs))
        size = 8 * MiB
        s_id, _ = tx.call("alloc", size=size, seed=14)
        _d_id, d_desc = rx.call("alloc", size=size)
        peer = tx.call("connect", address=rx.address)
        tx.call("write", region=s_id, peer=peer, descriptor=d_desc, size=size, imm=1)
        time.sleep(1.0)  # about a quarter of it is through (16 Mbit/s)
        hosts.set_link(0, up=False)
        time.sleep(0.5)
        if sender == "killed":
            tx.kill()
        status = _quit_status(rx)
        assert status == 0, f"the receiver's close ended its process with status {status}"
        if sender == "alive":
            status = _quit_status(tx)
            assert status == 0, f"the sender's close ended its process with status {status}"
    finally:
        _close(procs, hosts)


# --- case 10 --------------------------------------------------------------------------------------------

LANDING = {"land_host_regions": True, "landing_slots": 4, "landing_slot_bytes": 64 * KiB,
           "stall_timeout": 2.0}


@pytest.mark.timeout(90)
def test_slow_receiver_slows_the_sender_but_costs_no_path(procs, engines) -> None:
    """The receiver stops draining for 3 s (SIGSTOP: its connection stays up) while 96 MiB of messages
    wait for its landing ring. That is a slow peer, not a dead NIC: the writes must finish once it
    resumes, every byte land, and no path be marked failed (there is no other NIC to move to anyway)."""
    rx = _start(procs, **LANDING)
    eng = _engine(engines, stall_timeout=2.0, window_bytes=256 * MiB, window_ops=1024)
    size = 12 * MiB + 3
    data = random_bytes(size, seed=10)
    src = eng.register(data)
    peer = eng.connect(rx.address)
    dsts = [rx.call("alloc", size=size) for _ in range(8)]
    transfers = [eng.write(src, 0, peer, desc, 0, size, imm=40) for _id, desc in dsts]
    time.sleep(0.2)
    rx.stop()
    try:
        time.sleep(3.0)
    finally:
        rx.cont()
    errors = []
    for t in transfers:
        try:
            t.wait(60)
        except ws.WeightSyncError as exc:
            errors.append(str(exc))
    assert not errors, f"{len(errors)} writes failed after a slow receiver; first: {errors[0]}"
    rx.call("counter_wait", imm=40, n=sum(t.imm_count for t in transfers), timeout=60)
    for d_id, _desc in dsts:
        assert rx.call("digest", region=d_id, off=0, size=size) == digest(data)
    assert not any(peer.failed_paths)


@pytest.mark.timeout(60)
def test_dropped_bad_messages_cost_no_path(procs, engines) -> None:
    """Messages the receiver must drop (larger than its landing slots: truncated) are one writer's
    mistake, not a dead NIC: afterwards writes keep landing and no path is marked failed."""
    import zlib

    import msgpack

    rx = _start(procs, **LANDING)
    eng = _engine(engines, stall_timeout=2.0)
    slot = 64 * KiB
    data = random_bytes(4 * slot, seed=11)
    src = eng.register(data)
    peer = eng.connect(rx.address)
    _a_id, a_desc = rx.call("alloc", size=4 * slot)
    b_id, b_desc = rx.call("alloc", size=1000)
    # The same descriptor claiming slots 4x larger than the receiver's (a stale or buggy writer).
    body = msgpack.unpackb(a_desc)[:-1]
    body[9] = 4 * slot
    forged = msgpack.packb([*body, zlib.crc32(msgpack.packb(body, use_bin_type=True))], use_bin_type=True)
    # tcp's MSG endpoints end the connection over a truncated message: each bad write is sent once more,
    # alone on a fresh connection, and then fails at its writer (rxm completes it); the good writes
    # caught on a dropped connection are sent again and land.
    msg_lane = eng.provider == "tcp"
    for rep in range(3):
        bad = [eng.write(src, 0, peer, forged, 0, n, imm=50) for n in (slot + 1, 3 * slot, 4 * slot)]
        good = [eng.write(src, k, peer, b_desc, 0, 1000, imm=51) for k in range(12)]
        for t in good:
            t.wait(10)
        for t in bad:
            if msg_lane:
                with pytest.raises(ws.TransportError, match="dropped the connection"):
                    t.wait(10)
            else:
                t.wait(10)
        rx.call("counter_wait", imm=51, n=12, timeout=10)
        time.sleep(2.5)  # past the stall timeout: a late verdict on the dropped messages would show now
        assert not any(peer.failed_paths), f"round {rep}: a dropped message cost the path"
    assert rx.call("counter_total", imm=50) == 0
    assert rx.call("digest", region=b_id, off=0, size=1000) == digest(data[11:1011])


# --- case 11 (engine part) -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_negative_counter_wait_is_a_weightsync_error(engines) -> None:
    eng = _engine(engines)
    with pytest.raises(ws.WeightSyncError, match=r"-1") as info:
        eng.counter(7).wait(-1, timeout=1)
    assert "7" in str(info.value), f"the error does not name the counter: {info.value}"


@pytest.mark.timeout(30)
def test_source_offset_past_64_bits_is_a_weightsync_error(engines) -> None:
    rx = _engine(engines)
    tx = _engine(engines)
    dst = rx.register(np.zeros(64, dtype=np.uint8))
    src = tx.register(np.zeros(64, dtype=np.uint8))
    peer = tx.connect(rx.address)
    with pytest.raises(ws.WeightSyncError, match=str(2**64)) as info:
        tx.write(src, 2**64, peer, dst.descriptor, 0, 8, imm=1)
    assert "offset" in str(info.value), f"the error does not say which argument: {info.value}"
