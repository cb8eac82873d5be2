"""Tiny TCP throughput and latency probe used by ``EmulatedCluster.verify`` (verify.py).

Run one end in each network namespace (``ip netns exec NS python netprobe.py ...``, or
``python -m grace.bench.cluster.netprobe ...``):

    netprobe.py recv  --bind IP --port P --warmup 0.5     # prints "ready", then a JSON result
    netprobe.py send  --host IP --port P --seconds 3
    netprobe.py echo  --bind IP --port P                  # prints "ready", serves one client
    netprobe.py ping  --host IP --port P --count 50       # prints a JSON result (RTTs in seconds)

The receiver measures goodput (application bytes per second) over the window that starts
``--warmup`` seconds after the first byte (slow start and the token bucket's initial burst
are left out) and ends at the last byte.  Only the standard library is used.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

CHUNK = 1 << 20  # 1 MiB per send/recv call
BUF = 16 << 20   # requested socket buffer (the kernel caps it at net.core.[rw]mem_max)


def _listen(bind: str, port: int) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(1)
    print("ready", flush=True)
    return srv


def _connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def recv(args) -> dict:
    srv = _listen(args.bind, args.port)
    srv.settimeout(args.timeout)
    conn, _ = srv.accept()
    conn.settimeout(args.timeout)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    first = None
    mark_t = mark_b = None
    last = None
    while True:
        n = conn.recv_into(view)
        now = time.monotonic()
        if n == 0:
            break
        if first is None:
            first = now
        total += n
        last = now
        if mark_t is None and now - first >= args.warmup:
            mark_t, mark_b = now, total
    conn.close()
    srv.close()
    if first is None:
        raise SystemExit("netprobe recv: no data received")
    if mark_t is None or last - mark_t <= 0:  # shorter than the warm-up: use everything
        mark_t, mark_b = first, 0
    return {"bytes": total, "seconds": last - first,
            "goodput_bps": 8.0 * (total - mark_b) / (last - mark_t),
            "goodput_bps_with_warmup": 8.0 * total / max(last - first, 1e-9),
            "window_seconds": last - mark_t}


def send(args) -> dict:
    sock = _connect(args.host, args.port)
    if args.sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
    payload = memoryview(bytes(CHUNK))
    total = 0
    start = time.monotonic()
    end = start + args.seconds
    while time.monotonic() < end:
        total += sock.send(payload)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the receiver to close: every byte has arrived
    sock.close()
    return {"bytes": total, "seconds": time.monotonic() - start}


def echo(args) -> dict:
    srv = _listen(args.bind, args.port)
    srv.settimeout(args.timeout)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(4096)
        if not data:
            break
        conn.sendall(data)
    conn.close()
    srv.close()
    return {}


def ping(args) -> dict:
    sock = _connect(args.host, args.port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * args.size
    rtts = []
    for i in range(args.count + args.skip):
        t0 = time.perf_counter()
        sock.sendall(msg)
        got = 0
        while got < len(msg):
            chunk = sock.recv(len(msg) - got)
            if not chunk:
                raise SystemExit("netprobe ping: connection closed")
            got += len(chunk)
        if i >= args.skip:
            rtts.append(time.perf_counter() - t0)
        if args.interval:
            time.sleep(args.interval)
    sock.close()
    return {"count": len(rtts), "rtt_min": min(rtts), "rtt_median": statistics.median(rtts),
            "rtt_max": max(rtts)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv"); r.add_argument("--bind", required=True); r.add_argument("--port", type=int, required=True)
    r.add_argument("--warmup", type=float, default=0.5); r.add_argument("--timeout", type=float, default=30)
    s = sub.add_parser("send"); s.add_argument("--host", required=True); s.add_argument("--port", type=int, required=True)
    s.add_argument("--seconds", type=float, default=3.0); s.add_argument("--sndbuf", action="store_true",
                                                                          help="fix SO_SNDBUF (disables autotuning)")
    e = sub.add_parser("echo"); e.add_argument("--bind", required=True); e.add_argument("--port", type=int, required=True)
    e.add_argument("--timeout", type=float, default=30)
    g = sub.add_parser("ping"); g.add_argument("--host", required=True); g.add_argument("--port", type=int, required=True)
    g.add_argument("--count", type=int, default=50); g.add_argument("--skip", type=int, default=5)
    g.add_argument("--size", type=int, default=64); g.add_argument("--interval", type=float, default=0.002)
    args = p.parse_args(argv)
    result = {"recv": recv, "send": send, "echo": echo, "ping": ping}[args.mode](args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
