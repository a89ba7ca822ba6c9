"""An engine's connection to its node agent: the agent serves a connection's requests in
order and releases what it held when it closes; the engine's side fails fast while the agent
is gone (the breaker) and reconnects by itself; only the agent's own user gets in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from types import SimpleNamespace

import pytest

from raykv.engine.agent import AgentUnavailable, NodeAgent
from raykv.errors import InvalidInput
from raykv.service.node import agent_protocol as p
from raykv.service.node.agent import AgentServer


class FakeTier:
    """What ``AgentServer`` uses of a ``CpuTierActor``."""

    def __init__(self) -> None:
        self.node_id, self.tiers = "ab" * 28, {"m": None}
        self.released: list = []
        self.applied: list = []
        self.metrics = SimpleNamespace(engine_counts=lambda *a: self.applied.append(a))

    async def release_holder(self, holder) -> int:
        self.released.append(holder)
        return 0

    async def apply(self, model, ops, wait_publish=True) -> int:
        await asyncio.sleep(0.01 * (len(self.applied) % 3))  # answers would reorder
        self.applied.append(ops)
        return len(ops)

    async def arena(self, model):
        raise InvalidInput(f"the CPU tier holds no model {model!r}")

    async def reserve(self, model, keys, members, writers=1, holder=None, tenant=None):
        return ("reserve", keys, tenant)

    async def lease_groups(self, model, keys, holder=None, tenant=None):
        return ("lease", keys, tenant)

    async def pull(self, model, keys, tenant=None):
        if keys == [b"never"]:  # a call still pending when the agent goes
            await asyncio.Event().wait()
        return ("pull", keys, tenant)


class Agent:
    """An ``AgentServer`` on its own event loop thread, started and stopped at will."""

    def __init__(self, tier: FakeTier) -> None:
        self.tier, self.loop = tier, asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server: AgentServer | None = None

    def start(self) -> AgentServer:
        self.server = AgentServer(self.tier, "raykv-test")
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self.server

    def stop(self) -> None:
        async def stop() -> None:
            self.server._server.close()
            for task in asyncio.all_tasks():  # the connections' handlers
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        with contextlib.suppress(FileNotFoundError):
            self.server.path.unlink()


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv(p.AGENT_DIR_ENV, str(tmp_path / "agents"))
    a = Agent(FakeTier())
    a.start()
    yield a
    with contextlib.suppress(Exception):
        a.stop()


def test_requests_are_answered_in_order_and_a_closed_connection_releases_its_holds(agent):
    client = NodeAgent(agent.server.path, reprobe_s=0.1)
    assert client.connect() and client.welcome.node_id == agent.tier.node_id
    sent = [client.send(p.Apply("m", [("op", i)])) for i in range(6)]
    assert [f.result(5) for f in sent] == [1] * 6
    assert agent.tier.applied == [[("op", i)] for i in range(6)]  # in the order sent
    with pytest.raises(InvalidInput, match="no model 'x'"):  # the agent's own error, as is
        client.call(p.Arena("x"))
    client.close()
    deadline = time.monotonic() + 5
    while not agent.tier.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(agent.tier.released) == 1 and agent.tier.released[0].pid == os.getpid()


def test_stores_leases_and_pulls_carry_their_tenant_to_the_tier(agent):
    """The tier charges a store's, a promotion's and a pull's entries to the request's
    tenant (its quota, invariant 13); a request without one is untenanted."""
    client = NodeAgent(agent.server.path, reprobe_s=0.1)
    assert client.connect()
    t = b"\x01" * 32
    assert client.call(p.Reserve("m", (b"k",), None, t)) == ("reserve", (b"k",), t)
    assert client.call(p.Reserve("m", (b"k",), None)) == ("reserve", (b"k",), None)
    assert client.call(p.LeaseGroups("m", [[b"k"]], t)) == ("lease", [[b"k"]], t)
    assert client.call(p.Pull("m", [b"k"], t)) == ("pull", [b"k"], t)
    client.close()


def test_while_the_agent_is_gone_calls_fail_at_once_and_it_reconnects_by_itself(agent):
    client = NodeAgent(agent.server.path, reprobe_s=0.1)
    assert client.connect()
    agent.stop()
    deadline = time.monotonic() + 5
    while client.up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client.up and client.trips == 1
    for _ in range(20):
        t0 = time.perf_counter()
        with pytest.raises(AgentUnavailable, match="is not reachable"):
            client.call(p.Arena("m"))
        assert time.perf_counter() - t0 < 0.1  # a miss, never a wait
    agent.start()
    deadline = time.monotonic() + 5
    while not client.up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.up and client.call(p.Apply("m", [("op", 9)])) == 1
    client.close()


def test_a_call_the_breaker_fails_finds_it_open_and_the_trip_counted(agent):
    """The breaker opens and counts its trip as one step: a pending call failed by the trip,
    or a reader polling ``up``, never sees it open with no trip counted (CI once did)."""
    client = NodeAgent(agent.server.path, reprobe_s=10)
    assert client.connect()
    seen: list[tuple[bool, int]] = []
    pending = client.send(p.Pull("m", [b"never"]))
    pending.add_done_callback(lambda _: seen.append((client.up, client.trips)))
    agent.stop()
    with pytest.raises(AgentUnavailable):
        pending.result(5)
    deadline = time.monotonic() + 5  # callbacks run just after the result is set
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [(False, 1)]
    client.close()


def test_with_no_agent_at_all_the_engine_side_answers_misses(tmp_path):
    from raykv.engine import NodeKV

    node = NodeKV.open(path=tmp_path / "nobody.sock")
    assert not node.up
    t0 = time.perf_counter()
    assert node.lookup(list(range(1000))).hit_tokens == 0
    assert time.perf_counter() - t0 < 0.1
    node.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as another user")
def test_another_user_cannot_talk_to_the_agent(agent):
    import socket

    pid = os.fork()
    if pid == 0:  # the child: another user
        code = 1
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            try:
                s.connect(str(agent.server.path))
                s.sendall(p.frame((1, p.Hello(os.getpid()))))
                code = 0 if s.recv(1) == b"" else 1  # refused: closed unanswered
            except PermissionError:
                code = 0  # the socket's folder and file are the agent user's alone
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
