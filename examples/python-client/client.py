#!/usr/bin/env python3
"""A minimal cellmesh client: logs in to a geo-edge proxy, plays a few inputs, and leaves.

It speaks the edge protocol (proto/proto/edge.proto) as any client must: TLS to the proxy when it
serves clients over TLS (`--tls-ca`, the CA its certificate chains to), the proxy's `Challenge`
first, then a `ClientHello` with the login token's claim and a proof over the challenge (the token
itself never crosses the wire), then inputs. Every `Batch` the gateway sends back is counted.

    python3 client.py --proxy localhost:7300 --tls-ca ca.pem --token "$(cellmesh token ...)"

Needs `protobuf` and `grpcio-tools` (the edge module is generated from edge.proto at start).
"""

import argparse
import hashlib
import hmac
import os
import socket
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto" / "proto"
GENERATED_DIR = HERE / "generated"
PROTOCOL = (1, 7)
PROOF_LABEL = b"cellmesh-login-proof\0"
MAX_FRAME = 1 << 20


def load_protocol(proto_dir=PROTO_DIR, out_dir=GENERATED_DIR):
    """Imports `edge_pb2`, (re)generating it from edge.proto when missing or older than the proto."""
    source = proto_dir / "edge.proto"
    target = out_dir / "edge_pb2.py"
    if not target.exists() or target.stat().st_mtime < source.stat().st_mtime:
        from grpc_tools import protoc

        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={tmp}", "edge.proto"])
            if rc != 0:
                raise SystemExit(f"protoc failed with status {rc} on {source}")
            os.replace(Path(tmp) / "edge_pb2.py", target)
    sys.path.insert(0, str(out_dir))
    import edge_pb2

    return edge_pb2


def prove(token, nonce):
    """The hello's claim and proof: HMAC-SHA256 keyed by the token's signature over the nonce."""
    claim, _, signature = token.rpartition(".")
    if not claim or len(signature) != 64:
        raise SystemExit("not a cellmesh login token: <account>.<expiry>.<kid>.<64 hex digits>")
    key = bytes.fromhex(signature)
    return claim, hmac.new(key, PROOF_LABEL + nonce, hashlib.sha256).digest()


class Connection:
    def __init__(self, edge, sock):
        self.edge = edge
        self.sock = sock
        self.pending = []

    def send(self, **body):
        frame = self.edge.ClientFrame(messages=[self.edge.ClientMessage(**body)])
        data = frame.SerializeToString()
        self.sock.sendall(struct.pack(">I", len(data)) + data)

    def _read_exactly(self, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the proxy closed the connection")
            buf += chunk
        return bytes(buf)

    def next(self):
        """The next ServerMessage; pings are answered on the way."""
        while True:
            if self.pending:
                m = self.pending.pop(0)
                if m.WhichOneof("body") == "ping":
                    self.send(pong=self.edge.Pong(nonce=m.ping.nonce))
                    continue
                return m
            (length,) = struct.unpack(">I", self._read_exactly(4))
            if length > MAX_FRAME:
                raise ConnectionError(f"frame of {length} bytes from the proxy")
            self.pending.extend(self.edge.ServerFrame.FromString(self._read_exactly(length)).messages)


def connect(edge, proxy, tls_ca, timeout):
    host, _, port = proxy.rpartition(":")
    host = host.strip("[]")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls_ca:
        ctx = ssl.create_default_context(cafile=tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        sock = ctx.wrap_socket(sock, server_hostname=host)
    return Connection(edge, sock)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy", default="127.0.0.1:7300", help="host:port of the proxy")
    ap.add_argument("--token", required=True, help="a login token (`cellmesh token`)")
    ap.add_argument("--tls-ca", help="speak TLS, trusting the CA certificates in this file")
    ap.add_argument("--inputs", type=int, default=5, help="inputs to send (one every 100 ms)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the proxy")
    args = ap.parse_args()

    edge = load_protocol()
    conn = connect(edge, args.proxy, args.tls_ca, args.timeout)
    first = conn.next()
    if first.WhichOneof("body") != "challenge":
        raise SystemExit(f"expected the proxy's Challenge first, got {first.WhichOneof('body')}")
    claim, proof = prove(args.token, first.challenge.nonce)
    version = edge.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1])
    conn.send(hello=edge.ClientHello(version=version, claim=claim, proof=proof))
    while True:
        m = conn.next()
        kind = m.WhichOneof("body")
        if kind == "welcome":
            w = m.welcome
            print(f"welcome {w.account} session {w.session_id} gateway {w.gateway_node}", flush=True)
            break
        if kind == "kick":
            reason = edge.KickReason.Name(m.kick.reason)
            raise SystemExit(f"kicked: {reason}: {m.kick.detail}")

    batches = 0
    deadline = time.monotonic() + args.timeout
    for seq in range(1, args.inputs + 1):
        conn.send(input=edge.ClientInput(seq=seq, payload=f"step {seq}".encode()))
        time.sleep(0.1)
    while batches < args.inputs and time.monotonic() < deadline:
        m = conn.next()
        if m.WhichOneof("body") == "batch":
            batches += 1
        elif m.WhichOneof("body") == "kick":
            raise SystemExit(f"kicked: {edge.KickReason.Name(m.kick.reason)}: {m.kick.detail}")
    print(f"batches {batches}", flush=True)
    conn.send(bye=edge.Bye())
    conn.sock.close()
    return 0 if batches >= args.inputs else 1


if __name__ == "__main__":
    sys.exit(main())
