"""A delay line for kernels without sch_netem: hold every packet of an NFQUEUE queue for a fixed
time, then let it go on (to the link's tbf), in arrival order.

    ip netns exec <host> python delay_line.py --queue 0 --delay 2ms
    ip netns exec <host> python -m grace.bench.cluster.delay_line --queue 0 --delay 2ms

The emulated cluster sends a host's outgoing packets to queue 0 of its namespace
(``iptables -t mangle -A POSTROUTING -o eth0 -j NFQUEUE --queue-num 0``) and runs one delay
line per host (shaping.py starts it by this file's path). It talks nfnetlink_queue directly
(linux/netfilter/nfnetlink_queue.h): packets arrive as metadata only (no payload copy), whole
GSO packets (no segmentation), and leave with one batch verdict for every packet that is due.
A packet whose notice was lost (socket buffer full) is released by the next batch verdict, as
the kernel accepts every id up to the given one.

It prints "ready" once bound, and on SIGTERM/SIGINT releases what it holds and exits.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import os
import select
import signal
import socket
import struct
import sys
import time

from grace.bench.cluster.units import parse_time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
SO_RCVBUFFORCE = 33
PR_SET_TIMERSLACK = 29

NLMSG = struct.Struct("=IHHII")   # len, type, flags, seq, pid (host order)
NFGEN = struct.Struct("!BBH")     # family, version, res_id (the queue number, big-endian)


def attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


class Queue:
    """One bound NFQUEUE queue on a netlink socket of the current network namespace."""

    def __init__(self, num: int, maxlen: int = 1 << 16, rcvbuf: int = 32 << 20):
        self.num = num
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
        self.sock.bind((0, 0))
        self.seq = 0
        self.config(attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)))
        self.config(attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self.config(attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))
        self.config(attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                    + attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
        self.sock.setblocking(False)

    def _send(self, msg: int, attrs: bytes, flags: int) -> None:
        self.seq += 1
        body = NFGEN.pack(socket.AF_UNSPEC, 0, self.num) + attrs
        head = NLMSG.pack(NLMSG.size + len(body), NFNL_SUBSYS_QUEUE << 8 | msg, NLM_F_REQUEST | flags, self.seq, 0)
        self.sock.send(head + body)

    def config(self, attrs: bytes) -> None:
        """Send a config message and wait for the kernel's answer (an error raises)."""
        self._send(NFQNL_MSG_CONFIG, attrs, NLM_F_ACK)
        data = self.sock.recv(65536)
        _, kind, _, _, _ = NLMSG.unpack_from(data)
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, NLMSG.size)
            if code:
                raise OSError(-code, f"nfnetlink_queue config of queue {self.num}: {os.strerror(-code)}")

    def accept_through(self, packet_id: int) -> None:
        """Accept every queued packet with an id up to packet_id."""
        self._send(NFQNL_MSG_VERDICT_BATCH, attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)), 0)

    def packet_ids(self):
        """The ids of the packets waiting on the socket now (non-blocking)."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:   # notices lost; the next batch verdict frees them
                    continue
                raise
            yield from packet_ids_in(data)


def packet_ids_in(data: bytes):
    """The packet ids in one datagram of netlink messages (messages other than packet notices skipped)."""
    off = 0
    while off + NLMSG.size <= len(data):
        length, kind, _, _, _ = NLMSG.unpack_from(data, off)
        if kind & 0xff == NFQNL_MSG_PACKET and kind >> 8 == NFNL_SUBSYS_QUEUE:
            packet_id = packet_header_id(data, off + NLMSG.size + NFGEN.size, off + length)
            if packet_id is not None:
                yield packet_id
        off += (length + 3) & ~3


def packet_header_id(data: bytes, start: int, end: int):
    """The id in the NFQA_PACKET_HDR attribute among the attributes in data[start:end]; None without one."""
    a = start
    while a + 4 <= end:
        alen, akind = struct.unpack_from("=HH", data, a)
        if akind & 0x7fff == NFQA_PACKET_HDR:
            return struct.unpack_from("!I", data, a + 4)[0]
        a += (alen + 3) & ~3
    return None


def run(queue_num: int, delay_s: float) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake-ups to the microsecond
    with contextlib.suppress(Exception):
        # ahead of the ranks when they keep every core busy: a packet held longer than its delay
        # would turn CPU load into network latency (it is a wire, not a process)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    queue = Queue(queue_num)
    held: collections.deque = collections.deque()   # (due, id), due in arrival order
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    print("ready", flush=True)
    clock = time.monotonic
    while not stop:
        timeout = max(0.0, held[0][0] - clock()) if held else 1.0
        try:
            readable, _, _ = select.select([queue.sock], [], [], timeout)
        except InterruptedError:
            continue
        now = clock()
        if readable:
            due = now + delay_s
            held.extend((due, pid) for pid in queue.packet_ids())
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            queue.accept_through(last)
    if held:
        queue.accept_through(held[-1][1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queue", type=int, default=0, help="NFQUEUE number (default 0)")
    p.add_argument("--delay", required=True, type=parse_time, help="how long each packet is held: 2ms, 500us, 0.002")
    args = p.parse_args(argv)
    if not 0 <= args.delay <= 10:
        p.error(f"delay {args.delay} s outside [0, 10 s]")
    run(args.queue, args.delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
