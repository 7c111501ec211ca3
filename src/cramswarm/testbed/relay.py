"""Latency, jitter and loss without netem: a user-space relay in the testbed's switch namespace.

This kernel has no ``netem`` qdisc, so delay is added by a relay that sits on the path: an asyncio process in the
switch namespace that listens on host B's *relay address* (``10.77.1.<i+1>``, see :mod:`cramswarm.testbed.netns`)
and the ports declared for B, and forwards to B's own address and the same port. A process on host A reaches
B through the relay by connecting to ``relay.address("B", port)`` instead of ``(B.ip, port)``; both paths exist,
so a test or a benchmark picks which one its processes use. The traffic still crosses A's and B's shaped links
(A -> switch is A's upload, switch -> B is B's download).

TCP: every chunk read from one side is written to the other ``latency_ms ± jitter_ms`` (uniform) later, and
never before the chunk read before it (order-preserving; jitter only spreads the delays). The delay is one-way,
in each direction, so a request/response round trip gains twice ``latency_ms``. Loss cannot be emulated for
TCP above the kernel (TCP would hide it by retransmission; it does when a link is cut, see ``cut``). A half-close
is forwarded as a half-close; a reset (or a refused connection to B) is forwarded as a reset (SO_LINGER 0).

UDP: each datagram, in each direction, is dropped with probability ``loss`` or sent ``latency_ms ± jitter_ms``
later (datagrams may overtake each other, as on a real path). Replies go back from the relay address.

Not emulated: connection set-up is not delayed (A's connect completes when the relay accepts, before the relay
has reached B; a connection to a cut host through the relay is accepted and then hangs, it is not refused), and
delay does not grow with queueing beyond what the shaped links add.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import select
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field

CHUNK_BYTES = 65536
MAX_CHUNKS = 256  # per direction: at most 16 MiB on its way inside the relay (16 MiB / 20 ms: 6.7 Gb/s)
BEHIND_S = 0.002  # the relay stops reading when the next chunk to deliver is this overdue (the receiver is slower)


class Delay:
    """One-way delays ``latency ± jitter`` (uniform, seconds), and drops with probability ``loss``."""

    def __init__(self, latency_ms: float, jitter_ms: float, loss: float, seed: int):
        if latency_ms < 0 or jitter_ms < 0 or not 0 <= loss < 1:
            raise ValueError(f"need latency_ms >= 0, jitter_ms >= 0, 0 <= loss < 1: {latency_ms}, {jitter_ms}, {loss}")
        self.latency, self.jitter, self.loss = latency_ms / 1e3, jitter_ms / 1e3, loss
        self.rng = random.Random(seed)

    def sample(self) -> float:
        return max(0.0, self.latency + self.rng.uniform(-self.jitter, self.jitter))

    def drop(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0) instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _direction(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> str:
    """Forward one direction chunk by chunk, each delayed, in order; return how it ended: "eof" or "reset".

    The relay holds what is on its way (at most MAX_CHUNKS chunks) and stops reading while the receiving side
    falls behind (the next chunk is overdue by BEHIND_S): then the sender's TCP window closes, as it would
    before a slow link, instead of a queue growing inside the relay.
    """
    loop = asyncio.get_running_loop()
    chunks: deque = deque()
    arrived, progressed = asyncio.Event(), asyncio.Event()

    async def read() -> None:
        last = 0.0
        while True:
            while len(chunks) >= MAX_CHUNKS or (chunks and chunks[0][0] < loop.time() - BEHIND_S):
                progressed.clear()
                await progressed.wait()
            try:
                data = await reader.read(CHUNK_BYTES)
            except (ConnectionError, OSError):
                data = None
            last = max(loop.time() + delay.sample(), last)  # never before the chunk read before it
            chunks.append((last, data))
            arrived.set()
            if not data:
                return

    reading = asyncio.create_task(read())
    try:
        while True:
            while not chunks:
                arrived.clear()
                await arrived.wait()
            due, data = chunks.popleft()
            progressed.set()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                return "reset"
            if not data:
                if writer.can_write_eof() and not writer.is_closing():
                    writer.write_eof()
                return "eof"
            writer.write(data)
            try:
                await writer.drain()
            except (ConnectionError, OSError):
                return "reset"
    finally:
        reading.cancel()


@dataclass
class TcpRoute:
    listen: tuple[str, int]
    target: tuple[str, int]
    delay: Delay
    tasks: set = field(default_factory=set)

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            await asyncio.sleep(self.delay.sample())
            _reset(c_writer)  # the target refused (or is unreachable): the client sees a reset
            return
        for sock_writer in (c_writer, t_writer):
            sock = sock_writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = asyncio.create_task(_direction(c_reader, t_writer, self.delay))
        down = asyncio.create_task(_direction(t_reader, c_writer, self.delay))
        pending = {up: t_writer, down: c_writer}
        other = {up: c_writer, down: t_writer}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del pending[task]
                if task.result() == "reset":  # one side reset: reset the other side as well, stop both ways
                    _reset(other[task])
                    for rest in pending:
                        rest.cancel()
                    pending.clear()
                    break
        for w in (c_writer, t_writer):
            if not w.is_closing():
                w.close()


class UdpRoute(asyncio.DatagramProtocol):
    """Datagrams to ``listen`` go to ``target`` from one socket per client; replies come back from ``listen``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: Delay):
        self.listen, self.target, self.delay = listen, target, delay
        self.transport: asyncio.DatagramTransport | None = None
        self.clients: dict[tuple, asyncio.DatagramTransport | list] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport

    def _later(self, send, data: bytes) -> None:
        if not self.delay.drop():
            asyncio.get_running_loop().call_later(self.delay.sample(), send, data)

    def datagram_received(self, data: bytes, addr) -> None:
        client = self.clients.get(addr)
        if client is None:
            self.clients[addr] = [data]  # datagrams that arrive before the client's socket is ready
            asyncio.get_running_loop().create_task(self._open(addr))
        elif isinstance(client, list):
            client.append(data)
        else:
            self._later(client.sendto, data)

    async def _open(self, addr) -> None:
        loop = asyncio.get_running_loop()
        route = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, _src) -> None:
                route._later(lambda d: route.transport.sendto(d, addr), data)

        transport, _ = await loop.create_datagram_endpoint(Back, remote_addr=self.target)
        waiting = self.clients[addr]
        self.clients[addr] = transport
        for data in waiting:
            self._later(transport.sendto, data)


async def serve(config: dict) -> None:
    delay = Delay(config["latency_ms"], config["jitter_ms"], config["loss"], config["seed"])
    loop = asyncio.get_running_loop()
    servers = []
    for listen, target in config["tcp"]:
        route = TcpRoute(tuple(listen), tuple(target), delay)
        servers.append(await asyncio.start_server(route.handle, *listen, reuse_address=True))
    for listen, target in config["udp"]:
        await loop.create_datagram_endpoint(lambda lt=listen, tg=target: UdpRoute(tuple(lt), tuple(tg), delay),
                                            local_addr=tuple(listen))  # fmt: skip
    print(json.dumps({"ready": True, "tcp": len(config["tcp"]), "udp": len(config["udp"])}), flush=True)
    await asyncio.Event().wait()  # until killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the testbed's delaying TCP/UDP relay (run in the switch namespace)")
    parser.add_argument("config", type=json.loads, help="JSON: tcp, udp ([[listen ip, port], [target ip, port]]), "
                        "latency_ms, jitter_ms, loss, seed")  # fmt: skip
    asyncio.run(serve(parser.parse_args(argv).config))
    return 0


# -- the parent's side ---------------------------------------------------------------------------------------


@dataclass
class Relay:
    """A running relay: ``address(host, port)`` is where a process on another host reaches ``host:port`` delayed."""

    proc: object
    routes: dict  # (protocol, host name, port) -> (relay ip, port)
    latency_ms: float
    jitter_ms: float
    loss: float

    def address(self, host: str, port: int, protocol: str = "tcp") -> tuple[str, int]:
        try:
            return self.routes[protocol, host, port]
        except KeyError:
            raise KeyError(f"the relay has no {protocol} route to {host}:{port}") from None


def start(
    testbed,
    tcp: list[tuple[str, int]] = (),
    udp: list[tuple[str, int]] = (),
    latency_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss: float = 0.0,
    seed: int = 0,
    timeout_s: float = 20.0,
) -> Relay:
    """Start a relay in ``testbed``'s switch namespace for these (host, port) pairs; wait until it listens."""
    Delay(latency_ms, jitter_ms, loss, seed)  # validate here, not in the child
    routes, config = {}, {"tcp": [], "udp": [], "latency_ms": latency_ms, "jitter_ms": jitter_ms, "loss": loss,
                          "seed": seed}  # fmt: skip
    for protocol, pairs in (("tcp", tcp), ("udp", udp)):
        for name, port in pairs:
            h = testbed.host(name)
            config[protocol].append([[h.relay_ip, port], [h.ip, port]])
            routes[protocol, h.name, port] = (h.relay_ip, port)
    proc = testbed.python("switch", "cramswarm.testbed.relay", json.dumps(config), stdout=-1, stderr=-1, text=True)
    line = _read_line(proc, timeout_s)
    if not line.startswith("{"):
        raise RuntimeError(f"the relay did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")
    return Relay(proc, routes, latency_ms, jitter_ms, loss)


def _read_line(proc, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return ""
    return ""


if __name__ == "__main__":
    sys.exit(main())
