#!/usr/bin/env python3
"""A small cellmesh game server in Python: wandering NPCs and input-driven player avatars.

It speaks only the local protocol (proto/local.proto) to its sidecar, with protobuf code generated
from that same file, to show that a game server in any language can join a cellmesh world.

Usage: python game.py [--sidecar 127.0.0.1:7100 | unix:/path] [--npcs 8] [--center 1000,1000]
                      [--duration 0]
"""

import argparse
import asyncio
import logging
import math
import os
import random
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto" / "proto"
GENERATED_DIR = HERE / "generated"

PROTOCOL = (1, 0)
TICK_HZ = 20
TICK_SECS = 1.0 / TICK_HZ
MAX_FRAME = 1 << 20  # the sidecar's default frame limit

# The sample games' schema (shared with the Rust arena and the bots).
KIND, HEALTH, INVENTORY, INPUT_ACK = 1, 2, 3, 4
PLAYER_SPEED = 5.0
NPC_SPEED = 2.0
NPC_ROAM_RADIUS = 25.0  # NPCs turn back towards the center beyond this distance
ID_SPARE = 16  # ids kept in reserve so a joining player spawns without waiting a round trip
NPC_NAMES = ["wolf", "boar", "crow", "toad", "moth", "slime", "golem", "sprite"]

log = logging.getLogger("python-game")


def load_protocol(proto_dir=PROTO_DIR, out_dir=GENERATED_DIR):
    """Imports `local_pb2`, (re)generating it from local.proto when missing or older than the proto."""
    source = proto_dir / "local.proto"
    target = out_dir / "local_pb2.py"
    if not target.exists() or target.stat().st_mtime < source.stat().st_mtime:
        from grpc_tools import protoc

        out_dir.mkdir(parents=True, exist_ok=True)
        # Generate beside the target and rename, so concurrent starts never import a half-written file.
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={tmp}", "local.proto"])
            if rc != 0:
                raise SystemExit(f"protoc failed with status {rc} on {source}")
            os.replace(Path(tmp) / "local_pb2.py", target)
    sys.path.insert(0, str(out_dir))
    import local_pb2

    return local_pb2


class ProtocolError(Exception):
    """The sidecar sent something this game cannot read; the connection is dropped."""


class Refused(Exception):
    """The sidecar did not welcome this game (an Error instead of Welcome, or no answer)."""


# ---------------------------------------------------------------- the game (no I/O)


@dataclass
class Entity:
    kind: str  # "npc:<name>" or "player:<account>"
    x: float
    y: float
    account: str = ""  # empty for NPCs
    session_epoch: int = 0
    id: int = 0  # 0 until an id from ReserveIds is free
    vx: float = 0.0
    vy: float = 0.0
    turn_at: float = 0.0
    components: dict = field(default_factory=dict)  # type -> (payload, audience kind)
    dirty: set = field(default_factory=set)  # component types changed since the last tick
    last_seq: int = 0
    inputs_applied: int = 0


def wrap_delta(d, size):
    """Shortest signed distance along one axis of a torus of `size` (no wrap when size is 0)."""
    return (d + size / 2) % size - size / 2 if size > 0 else d


class World:
    """All game state; the caller feeds it sidecar messages and asks it for one frame per tick."""

    def __init__(self, pb, center, npc_count, rng, world_size=(0.0, 0.0)):
        self.pb = pb
        self.center = center
        self.rng = rng
        self.width, self.height = world_size
        self.players = {}  # account -> Entity
        self.npcs = [self._npc(i) for i in range(npc_count)]
        self.free_ids = []
        self.ids_requested = {}  # request_id -> count
        self.next_request_id = 1
        self.despawned = []
        self.tick_no = 0

    def _npc(self, i):
        angle = self.rng.uniform(0, 2 * math.pi)
        r = self.rng.uniform(0, NPC_ROAM_RADIUS / 2)
        npc = Entity(f"npc:{NPC_NAMES[i % len(NPC_NAMES)]}-{i}",
                     self.center[0] + r * math.cos(angle), self.center[1] + r * math.sin(angle))
        public = self.pb.PUBLIC_IN_RANGE
        npc.components = {KIND: (npc.kind.encode(), public), HEALTH: (struct.pack(">II", 100, 100), public)}
        return npc

    def entity_count(self):
        return len(self.npcs) + len(self.players)

    def handle(self, msg):
        body = msg.WhichOneof("body")
        if body == "ids_reserved":
            self.ids_requested.pop(msg.ids_reserved.request_id, None)
            self.free_ids.extend(msg.ids_reserved.ids)
        elif body == "player_join":
            self.join(msg.player_join)
        elif body == "player_leave":
            self.leave(msg.player_leave)
        elif body == "input":
            self.apply_input(msg.input)
        elif body == "error":
            e = msg.error
            log.warning("sidecar error %s%s: %s (entity %d)", self.pb.ErrorCode.Name(e.code),
                        " (fatal)" if e.fatal else "", e.detail, e.entity_id)
        elif body is None:
            raise ProtocolError("sidecar message without a body (expected a SidecarMessage)")
        else:
            log.debug("ignoring %s: this game runs on a single node", body)

    def join(self, join):
        avatar = self.players.get(join.account)
        if avatar is not None:  # re-login: the avatar stays where it is
            avatar.session_epoch = max(avatar.session_epoch, join.session_epoch)
            log.info("player %s rejoined (epoch %d)", join.account, join.session_epoch)
            return
        if join.HasField("last_position"):
            x, y = join.last_position.x, join.last_position.y
        else:
            x, y = self.center[0] + self.rng.uniform(2, 4), self.center[1] + self.rng.uniform(-2, 2)
        avatar = Entity(f"player:{join.account}", x, y, account=join.account,
                        session_epoch=join.session_epoch)
        pb = self.pb
        avatar.components = {
            KIND: (avatar.kind.encode(), pb.PUBLIC_IN_RANGE),
            HEALTH: (struct.pack(">II", 100, 100), pb.OWNER_AND_PARTY),
            INVENTORY: (b"wooden-sword,bread", pb.OWNER_ONLY),
            INPUT_ACK: (struct.pack(">QQ", 0, 0), pb.OWNER_ONLY),
        }
        self.players[join.account] = avatar
        log.info("player %s joined (epoch %d) at %.1f,%.1f", join.account, join.session_epoch, x, y)

    def leave(self, leave):
        avatar = self.players.get(leave.account)
        if avatar is None or leave.session_epoch < avatar.session_epoch:
            return  # a newer session of this account took over; its avatar stays
        del self.players[leave.account]
        if avatar.id:
            self.despawned.append(avatar.id)
        log.info("player %s left (%s)", leave.account, leave.reason or "no reason")

    def apply_input(self, inp):
        avatar = self.players.get(inp.account)
        if avatar is None or inp.session_epoch < avatar.session_epoch:
            return
        if len(inp.payload) != 8:
            log.warning("input from %s: payload of %d bytes, expected 8", inp.account, len(inp.payload))
            return
        dx, dy = struct.unpack(">ff", inp.payload)
        norm = math.hypot(dx, dy)
        if not math.isfinite(norm) or norm < 1e-6:
            avatar.vx = avatar.vy = 0.0
        else:
            avatar.vx, avatar.vy = PLAYER_SPEED * dx / norm, PLAYER_SPEED * dy / norm
        avatar.last_seq = inp.seq
        avatar.inputs_applied += 1
        avatar.components[INPUT_ACK] = (struct.pack(">QQ", avatar.last_seq, avatar.inputs_applied),
                                        self.pb.OWNER_ONLY)
        avatar.dirty.add(INPUT_ACK)

    def _wander(self, npc, now):
        dx = wrap_delta(self.center[0] - npc.x, self.width)
        dy = wrap_delta(self.center[1] - npc.y, self.height)
        if math.hypot(dx, dy) > NPC_ROAM_RADIUS:
            heading = math.atan2(dy, dx)
        elif now >= npc.turn_at:
            heading = self.rng.uniform(0, 2 * math.pi)
            npc.turn_at = now + self.rng.uniform(1.0, 4.0)
        else:
            return
        npc.vx, npc.vy = NPC_SPEED * math.cos(heading), NPC_SPEED * math.sin(heading)

    def _move(self, e, dt):
        if not (e.vx or e.vy):
            return False
        e.x += e.vx * dt
        e.y += e.vy * dt
        if self.width > 0:
            e.x %= self.width
        if self.height > 0:
            e.y %= self.height
        return True

    def _components(self, e, types):
        return [self.pb.Component(type=t, payload=e.components[t][0],
                                  audience=self.pb.Audience(kind=e.components[t][1]))
                for t in sorted(types)]

    def tick(self, dt, now):
        """Advances the world by `dt` seconds; returns this tick's messages, ending with TickEnd."""
        pb = self.pb
        out = [pb.GameMessage(despawn=pb.Despawn(entity_id=i)) for i in self.despawned]
        self.despawned.clear()
        entities = self.npcs + list(self.players.values())
        unspawned = sum(1 for e in entities if not e.id)
        wanted = unspawned + ID_SPARE - len(self.free_ids) - sum(self.ids_requested.values())
        if wanted > 0:
            count = max(wanted, 2 * ID_SPARE)
            self.ids_requested[self.next_request_id] = count
            reserve = pb.ReserveIds(request_id=self.next_request_id, count=count)
            out.append(pb.GameMessage(reserve_ids=reserve))
            self.next_request_id += 1
        for e in entities:
            if not e.account:
                self._wander(e, now)
            moved = self._move(e, dt)
            if not e.id:
                if not self.free_ids:
                    continue
                e.id = self.free_ids.pop(0)
                e.dirty.clear()
                out.append(pb.GameMessage(spawn=pb.Spawn(
                    entity_id=e.id, position=pb.Vec3(x=e.x, y=e.y), owner_account=e.account,
                    is_master=bool(e.account), components=self._components(e, e.components))))
            elif moved or e.dirty:
                update = pb.Update(entity_id=e.id, changed=self._components(e, e.dirty))
                if moved:
                    update.position.CopyFrom(pb.Vec3(x=e.x, y=e.y))
                e.dirty.clear()
                out.append(pb.GameMessage(update=update))
        self.tick_no += 1
        out.append(pb.GameMessage(tick_end=pb.TickEnd(tick=self.tick_no)))
        return out


# ---------------------------------------------------------------- the connection


def encode_frame(pb, messages):
    body = pb.GameFrame(messages=messages).SerializeToString()
    return struct.pack(">I", len(body)) + body


async def read_frame(pb, reader, max_bytes=MAX_FRAME):
    """The next SidecarFrame, or None when the sidecar closed the connection between frames."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("connection closed inside a frame header") from None
        return None
    (length,) = struct.unpack(">I", header)
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"connection closed after {len(e.partial)} of {length} frame bytes") from None
    try:
        frame = pb.SidecarFrame.FromString(body)
    except Exception as e:  # protobuf raises DecodeError, whose import path differs by version
        raise ProtocolError(f"undecodable SidecarFrame: {e}") from None
    if not frame.messages:
        raise ProtocolError("empty frame: expected a SidecarFrame (is this a sidecar's local port?)")
    return frame


async def sleep_unless(stop, secs):
    """Sleeps `secs`, or less if `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), secs)
    except asyncio.TimeoutError:
        pass


async def connect(address, stop):
    """Dials the sidecar, retrying with back-off (it may start after the game); None if stopped."""
    delay = 0.1
    while not stop.is_set():
        try:
            if address.startswith("unix:"):
                return await asyncio.open_unix_connection(address[len("unix:"):])
            host, port = address.rsplit(":", 1)
            return await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError as e:
            log.info("sidecar %s not reachable (%s); retrying in %.1f s", address, e, delay)
            await sleep_unless(stop, delay)
            delay = min(delay * 2, 2.0)
    return None


async def handshake(pb, reader, writer):
    """Sends Hello and returns (Welcome, messages that came after it in the same frame)."""
    hello = pb.Hello(version=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                     tick_rate_hz=TICK_HZ, game="python-game")
    writer.write(encode_frame(pb, [pb.GameMessage(hello=hello)]))
    await writer.drain()
    try:
        frame = await asyncio.wait_for(read_frame(pb, reader), 10.0)
    except asyncio.TimeoutError:
        raise Refused("no answer to Hello within 10 s") from None
    except ProtocolError as e:
        raise Refused(str(e)) from None
    if frame is None:
        raise Refused("the sidecar closed the connection before Welcome")
    first = frame.messages[0]
    body = first.WhichOneof("body")
    if body == "welcome":
        return first.welcome, frame.messages[1:]
    if body == "error":
        raise Refused(f"{pb.ErrorCode.Name(first.error.code)}: {first.error.detail}")
    raise Refused(f"expected Welcome, got {body or 'a message without a body'}")


async def serve(pb, args, reader, writer, stop, rng):
    """Runs one connected session; returns when stopped or when the connection is lost."""
    welcome, rest = await handshake(pb, reader, writer)
    shape = welcome.world
    log.info("joined node %d (protocol %d.%d, world %.0fx%.0f m)", welcome.node_id,
             welcome.version.major, welcome.version.minor, shape.width, shape.height)
    world = World(pb, args.center, args.npcs, rng, (shape.width, shape.height))
    for msg in rest:
        world.handle(msg)

    async def read_loop():
        while (frame := await read_frame(pb, reader)) is not None:
            for msg in frame.messages:
                world.handle(msg)
        log.warning("the sidecar closed the connection")

    reader_task = asyncio.create_task(read_loop())
    stop_task = asyncio.create_task(stop.wait())
    clock = asyncio.get_running_loop().time
    last = next_tick = next_load = clock()
    try:
        while not stop.is_set() and not reader_task.done():
            now = clock()
            started = time.perf_counter()
            messages = world.tick(now - last, now)
            tick_ms = (time.perf_counter() - started) * 1000
            last = now
            if now >= next_load:
                next_load = now + 1.0
                messages.insert(0, pb.GameMessage(load=pb.Load(
                    tick_ms=tick_ms, budget_ms=TICK_SECS * 1000, entity_count=world.entity_count())))
            writer.write(encode_frame(pb, messages))
            await writer.drain()
            next_tick = max(next_tick + TICK_SECS, clock())  # after a stall, resume; never catch up
            await asyncio.wait({reader_task, stop_task}, timeout=max(0.0, next_tick - clock()),
                               return_when=asyncio.FIRST_COMPLETED)
        if reader_task.done():
            reader_task.result()  # re-raises a ProtocolError from the reader
    finally:
        reader_task.cancel()
        stop_task.cancel()
        writer.close()


async def run(pb, args):
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.duration > 0:
        loop.call_later(args.duration, stop.set)
    rng = random.Random()
    while not stop.is_set():
        conn = await connect(args.sidecar, stop)
        if conn is None:
            break
        try:
            await serve(pb, args, *conn, stop, rng)
        except Refused as e:
            log.error("the sidecar refused this game: %s", e)
            return 1
        except ProtocolError as e:
            log.error("dropping the sidecar connection: %s", e)
        except OSError as e:
            log.error("connection to the sidecar lost: %s", e)
        await sleep_unless(stop, 0.5)  # then reconnect; the new session spawns the world afresh
    log.info("stopped")
    return 0


def parse_args(argv=None):
    def center(text):
        try:
            x, y = (float(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected X,Y, got {text!r}") from None
        if not (math.isfinite(x) and math.isfinite(y)):
            raise argparse.ArgumentTypeError(f"center must be finite, got {text!r}")
        return x, y

    def sidecar(text):
        if text.startswith("unix:") and len(text) > len("unix:"):
            return text
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT or unix:/path, got {text!r}")
        return text

    p = argparse.ArgumentParser(description="A small cellmesh game server speaking the local protocol.")
    p.add_argument("--sidecar", type=sidecar, default="127.0.0.1:7100",
                   help="HOST:PORT or unix:/path of the sidecar")
    p.add_argument("--npcs", type=int, default=8, help="number of wandering NPCs")
    p.add_argument("--center", type=center, default=(1000.0, 1000.0), help="X,Y the NPCs roam around")
    p.add_argument("--duration", type=float, default=0, help="seconds to run; 0 = until SIGINT/SIGTERM")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.npcs < 0:
        p.error("--npcs must not be negative")
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="python-game %(levelname)s %(message)s")
    pb = load_protocol()
    return asyncio.run(run(pb, args))


if __name__ == "__main__":
    sys.exit(main())
