#!/usr/bin/env python3
"""Holds every packet of a netfilter queue for a fixed time, then lets it go on.

The lab's stand-in for `tc netem` on a kernel built without it (CONFIG_NET_SCH_NETEM unset):
scripts/lab.sh sends the packets the host routes between two geos' networks to an NFQUEUE
(iptables ... -j NFQUEUE --queue-num N --queue-bypass) and runs this on the host:

    delay.py --queue N --delay-ms 45

Each packet gets its verdict (accept, unchanged) --delay-ms after it was queued. The kernel keeps
the packet meanwhile; only its metadata crosses to this process (copy mode "meta"), so the cost
is one netlink message each way per packet. Verdicts are given by packet id in any order, so
packets leave in the order they came, each delayed the same. With --queue-bypass a packet passes
undelayed while no process listens on the queue (before this starts, after it stops).

Uses libnetfilter_queue (Debian: libnetfilter-queue1) through ctypes: no compiler, no package
from outside the distribution. Stops on SIGTERM or SIGINT, letting every held packet go first.
"""

import argparse
import ctypes
import ctypes.util
import heapq
import os
import select
import signal
import socket
import sys
import time

NF_ACCEPT = 1
NFQNL_COPY_META = 1


class PacketHeader(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("packet_id", ctypes.c_uint32), ("hw_protocol", ctypes.c_uint16), ("hook", ctypes.c_uint8)]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE number")
    parser.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    args = parser.parse_args()
    delay_s = args.delay_ms / 1000.0

    name = ctypes.util.find_library("netfilter_queue") or "libnetfilter_queue.so.1"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.nfq_open.restype = ctypes.c_void_p
    lib.nfq_create_queue.restype = ctypes.c_void_p
    lib.nfq_create_queue.argtypes = [ctypes.c_void_p, ctypes.c_uint16, CALLBACK, ctypes.c_void_p]
    lib.nfq_get_msg_packet_hdr.restype = ctypes.POINTER(PacketHeader)
    lib.nfq_get_msg_packet_hdr.argtypes = [ctypes.c_void_p]
    for f in ("nfq_fd", "nfq_unbind_pf", "nfq_bind_pf", "nfq_close"):
        getattr(lib, f).argtypes = [ctypes.c_void_p] + ([ctypes.c_uint16] if "bind" in f else [])
    lib.nfq_set_mode.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_uint32]
    lib.nfq_set_queue_maxlen.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.nfq_set_verdict.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p]
    lib.nfq_handle_packet.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.nfq_destroy_queue.argtypes = [ctypes.c_void_p]

    handle = lib.nfq_open()
    if not handle:
        sys.exit("nfq_open failed (root, and a kernel with NETFILTER_NETLINK_QUEUE, are needed)")
    lib.nfq_unbind_pf(handle, socket.AF_INET)
    if lib.nfq_bind_pf(handle, socket.AF_INET) < 0:
        sys.exit("nfq_bind_pf failed")

    held = []  # (due, packet id), earliest first

    @CALLBACK
    def on_packet(_qh, _nfmsg, nfad, _data):
        header = lib.nfq_get_msg_packet_hdr(nfad)
        if header:
            heapq.heappush(held, (time.monotonic() + delay_s, socket.ntohl(header.contents.packet_id)))
        return 0

    queue = lib.nfq_create_queue(handle, args.queue, on_packet, None)
    if not queue:
        sys.exit(f"nfq_create_queue {args.queue} failed (is another process bound to it?)")
    lib.nfq_set_mode(queue, NFQNL_COPY_META, 0)
    lib.nfq_set_queue_maxlen(queue, 65536)
    fd = lib.nfq_fd(handle)
    sock = socket.socket(fileno=os.dup(fd))
    # A large receive buffer: a burst queued at once must not overflow the netlink socket.
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    buf = ctypes.create_string_buffer(65536)

    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))

    def release(until):
        while held and held[0][0] <= until:
            _, packet_id = heapq.heappop(held)
            lib.nfq_set_verdict(queue, packet_id, NF_ACCEPT, 0, None)

    print(f"delaying queue {args.queue} by {args.delay_ms} ms", flush=True)
    while not stopping:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([sock], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            # Every message waiting, then the verdicts that fell due.
            while True:
                try:
                    n = sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break  # ENOBUFS: the kernel dropped messages; their packets are dropped too
                lib.nfq_handle_packet(handle, buf, n)
        release(time.monotonic())
    release(float("inf"))
    lib.nfq_destroy_queue(queue)
    lib.nfq_close(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
