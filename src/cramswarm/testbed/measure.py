"""What processes on the testbed actually see: round-trip time, throughput, UDP loss, and what a cut link does.

Each measurement runs real processes in the hosts' namespaces (``ip netns exec``): a server (``serve``: TCP echo
and sink, UDP echo, on one port) on the far host and a client on the near one, both this module run as
``python -m cramswarm.testbed.measure``. The parent-side functions (:func:`rtt`, :func:`throughput`,
:func:`udp_echo`, :func:`cut_session`) start the client, wait for its one JSON line and return it as a dict.

- RTT: one 64-byte message at a time (TCP_NODELAY), echoed back; the median of ``count`` round trips.
- Throughput: the client sends as fast as TCP lets it for ``seconds``; the server counts what arrives and reports
  the rate over the last 75 % of the transfer (the token bucket's initial burst and slow start left out). It is
  TCP payload (goodput): about 96 % of the link rate, which counts Ethernet, IP and TCP headers too.
- A cut: a connection made while the link is up is used again during the cut; the outcome is "timeout" (nothing
  came back in ``timeout_s``) or what the socket raised ("reset", "refused", "unreachable", "closed").
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time

PORT = 47000
MESSAGE = 64


# -- in the hosts --------------------------------------------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = sock.recv(1)
        if mode == b"E":
            while data := sock.recv(65536):
                sock.sendall(data)
        elif mode == b"S":
            self.sink(sock)

    @staticmethod
    def sink(sock: socket.socket) -> None:
        buf = bytearray(1 << 20)
        samples, total = [], 0
        while n := sock.recv_into(buf):
            total += n
            samples.append((time.monotonic(), total))
        report = {"bytes": total}
        if len(samples) >= 2:
            t0, t1 = samples[0][0], samples[-1][0]
            start = t0 + 0.25 * (t1 - t0)
            first = next(s for s in samples if s[0] >= start)
            window = t1 - first[0]
            report |= {"span_s": t1 - t0, "window_s": window, "window_bytes": total - first[1]}
            report["mbit"] = (total - first[1]) * 8 / window / 1e6 if window > 0 else None
        sock.sendall((json.dumps(report) + "\n").encode())


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def serve(bind: str, port: int) -> None:
    tcp = _Server((bind, port), _Handler)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((bind, port))

    def udp_echo() -> None:
        while True:
            data, addr = udp.recvfrom(65536)
            udp.sendto(data, addr)

    threading.Thread(target=udp_echo, daemon=True).start()
    print(json.dumps({"ready": True, "bind": bind, "port": port}), flush=True)
    tcp.serve_forever()


def outcome(err: BaseException) -> str:
    if isinstance(err, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(err, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(err, ConnectionRefusedError):
        return "refused"
    if isinstance(err, OSError) and err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    return f"error: {err!r}"


def _connect(addr: tuple[str, int], timeout_s: float, mode: bytes) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(mode)
    return sock


def _echo_once(sock: socket.socket) -> float:
    """One round trip of a MESSAGE-byte message; its seconds. Raises on timeout or error; EOFError if closed."""
    msg = b"x" * MESSAGE
    t0 = time.perf_counter()
    sock.sendall(msg)
    got = 0
    while got < MESSAGE:
        data = sock.recv(MESSAGE - got)
        if not data:
            raise EOFError("closed by the peer")
        got += len(data)
    return time.perf_counter() - t0


def client_rtt(addr, count: int, timeout_s: float) -> dict:
    with _connect(addr, timeout_s, b"E") as sock:
        _echo_once(sock)  # the first round trip also pays for the server's thread start
        times = [_echo_once(sock) * 1e3 for _ in range(count)]
    return {"rtt_ms": times, "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def client_throughput(addr, seconds: float, timeout_s: float) -> dict:
    payload = b"\0" * 65536
    with _connect(addr, timeout_s, b"S") as sock:
        sock.settimeout(timeout_s)
        sent, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
            sent += len(payload)
        sock.shutdown(socket.SHUT_WR)
        report = json.loads(sock.makefile().readline())
    return {"sent_bytes": sent, **report}


def client_udp(addr, count: int, interval_s: float, wait_s: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.05)
    sent, back = {}, {}
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                data, _ = sock.recvfrom(2048)
            except (socket.timeout, TimeoutError):
                continue
            k = int.from_bytes(data[:4], "big")
            back.setdefault(k, time.perf_counter() - sent[k])

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    for i in range(count):
        sent[i] = time.perf_counter()
        sock.sendto(i.to_bytes(4, "big") + b"u" * (MESSAGE - 4), addr)
        time.sleep(interval_s)
    time.sleep(wait_s)
    stop.set()
    receiver.join()
    sock.close()
    rtts = [v * 1e3 for v in back.values()]
    return {"sent": count, "received": len(back), "fraction": len(back) / count,
            "median_ms": statistics.median(rtts) if rtts else None}  # fmt: skip


def client_session(addr, timeout_s: float) -> None:
    """A connection made now, used again after the parent says so (a line on stdin): reports each outcome."""
    try:
        sock = _connect(addr, timeout_s, b"E")
        _echo_once(sock)
        print(json.dumps({"phase": "connected", "outcome": "ok"}), flush=True)
    except (OSError, EOFError) as err:
        print(json.dumps({"phase": "connected", "outcome": outcome(err)}), flush=True)
        return
    for line in sys.stdin:
        phase, _, wait = line.strip().partition(" ")
        if phase == "end":
            break
        sock.settimeout(float(wait) if wait else timeout_s)
        t0 = time.perf_counter()
        try:
            _echo_once(sock)
            result = "ok"
        except EOFError:
            result = "closed"
        except OSError as err:
            result = outcome(err)
        print(json.dumps({"phase": phase, "outcome": result, "s": time.perf_counter() - t0}), flush=True)
    sock.close()


def client_connect(addr, timeout_s: float) -> dict:
    """A new connection and one round trip; its outcome."""
    t0 = time.perf_counter()
    try:
        with _connect(addr, timeout_s, b"E") as sock:
            _echo_once(sock)
        result = "ok"
    except EOFError:
        result = "closed"
    except OSError as err:
        result = outcome(err)
    return {"outcome": result, "s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the testbed's measurement server and clients")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--bind", required=True)
    p.add_argument("--port", type=int, default=PORT)
    for name in ("rtt", "throughput", "udp", "session", "connect"):
        p = sub.add_parser(name)
        p.add_argument("--to", required=True, help="ip:port")
        p.add_argument("--timeout-s", type=float, default=10.0)
        p.add_argument("--count", type=int, default=20)
        p.add_argument("--seconds", type=float, default=3.0)
        p.add_argument("--interval-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.what == "serve":
        serve(args.bind, args.port)
        return 0
    host, port = args.to.rsplit(":", 1)
    addr = (host, int(port))
    if args.what == "session":
        client_session(addr, args.timeout_s)
        return 0
    result = {
        "rtt": lambda: client_rtt(addr, args.count, args.timeout_s),
        "throughput": lambda: client_throughput(addr, args.seconds, args.timeout_s),
        "udp": lambda: client_udp(addr, args.count, args.interval_ms / 1e3, args.timeout_s),
        "connect": lambda: client_connect(addr, args.timeout_s),
    }[args.what]()
    print(json.dumps(result), flush=True)
    return 0


# -- the parent's side ---------------------------------------------------------------------------------------


def start_server(testbed, host, port: int = PORT, timeout_s: float = 20.0):
    """Start the measurement server on ``host`` (its own address, ``port``, TCP and UDP); wait until it listens."""
    from cramswarm.testbed.relay import _read_line

    h = testbed.host(host)
    proc = testbed.python(h.name, "cramswarm.testbed.measure", "serve", "--bind", "0.0.0.0", "--port", str(port),
                          stdout=-1, stderr=-1, text=True)  # fmt: skip
    if not _read_line(proc, timeout_s).startswith("{"):
        raise RuntimeError(f"the measurement server on {h.name} did not start")
    return proc


def _client(testbed, src, what: str, addr: tuple[str, int], timeout_s: float, *args: str) -> dict:
    argv = [sys.executable, "-m", "cramswarm.testbed.measure", what, "--to", f"{addr[0]}:{addr[1]}",
            "--timeout-s", str(timeout_s), *args]  # fmt: skip
    proc = testbed.run(src, argv, timeout=timeout_s * 4 + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"measure {what} on {src} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rtt(testbed, src, addr: tuple[str, int], count: int = 20, timeout_s: float = 10.0) -> dict:
    """Round trips of 64 bytes from host ``src`` to a measurement server at ``addr`` (milliseconds)."""
    return _client(testbed, src, "rtt", addr, timeout_s, "--count", str(count))


def throughput(testbed, src, addr: tuple[str, int], seconds: float = 3.0, timeout_s: float = 10.0) -> dict:
    """TCP goodput from host ``src`` to a measurement server at ``addr`` (``mbit``: megabits per second)."""
    return _client(testbed, src, "throughput", addr, timeout_s, "--seconds", str(seconds))


def udp_echo(testbed, src, addr: tuple[str, int], count: int = 200, interval_ms: float = 2.0,
             wait_s: float = 2.0) -> dict:  # fmt: skip
    """``count`` datagrams from ``src`` to the server's UDP echo at ``addr``; the fraction that came back."""
    return _client(testbed, src, "udp", addr, wait_s, "--count", str(count), "--interval-ms", str(interval_ms))


def connect(testbed, src, addr: tuple[str, int], timeout_s: float = 3.0) -> dict:
    """A new TCP connection from ``src`` to ``addr`` and one round trip: ``outcome`` "ok", "timeout", "reset"..."""
    return _client(testbed, src, "connect", addr, timeout_s)


class Session:
    """A TCP connection from ``src`` to ``addr`` kept open across link changes: ``echo()`` -> its outcome."""

    def __init__(self, testbed, src, addr: tuple[str, int], timeout_s: float = 3.0):
        from cramswarm.testbed.relay import _read_line

        self._read_line = _read_line
        self.timeout_s = timeout_s
        argv = [sys.executable, "-m", "cramswarm.testbed.measure", "session", "--to", f"{addr[0]}:{addr[1]}",
                "--timeout-s", str(timeout_s)]  # fmt: skip
        self.proc = testbed.popen(src, argv, stdin=-1, stdout=-1, stderr=-1, text=True)
        self.connected = self._answer()

    def _answer(self) -> dict:
        line = self._read_line(self.proc, self.timeout_s * 2 + 20)
        if not line:
            raise RuntimeError(f"the session client gave no answer: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def echo(self, phase: str = "echo", timeout_s: float | None = None) -> dict:
        """One round trip on the open connection, waiting ``timeout_s`` (default: the session's) for the answer."""
        wait = timeout_s or self.timeout_s
        self.proc.stdin.write(f"{phase} {wait}\n")
        self.proc.stdin.flush()
        line = self._read_line(self.proc, wait * 2 + 20)
        if not line:
            raise RuntimeError(f"the session client gave no answer: {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("end\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()


if __name__ == "__main__":
    sys.exit(main())
