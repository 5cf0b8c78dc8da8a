#!/usr/bin/env python3
"""A small cellmesh game server in Python: wandering NPCs and input-driven player avatars.

It speaks only the local protocol (proto/local.proto) to its sidecar, with protobuf code generated
from that same file, to show that a game server in any language can join a cellmesh world. It honours
the handoff contract (Freeze, Thaw, Evict, Adopt), so its entities cross into neighbouring nodes' areas,
and its snapshots use the JSON format the Rust arena shares, so either game adopts the other's entities.
Its players fight the nearest NPC with entity commands, wherever that NPC is simulated, in the arena's
convention, so the two games fight across a border too.

Usage: python game.py [--sidecar 127.0.0.1:7100 | unix:/path] [--npcs 8] [--center 1000,1000]
                      [--duration 0]
"""

import argparse
import asyncio
import collections
import itertools
import json
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

PROTOCOL = (1, 4)  # 1.4: entity commands
TICK_HZ = 20
TICK_SECS = 1.0 / TICK_HZ
MAX_FRAME = 1 << 20  # the sidecar's default frame limit

# The sample games' schema (shared with the Rust arena and the bots).
KIND, HEALTH, INVENTORY, INPUT_ACK = 1, 2, 3, 4
PLAYER_SPEED = 5.0
NPC_SPEED = 2.0
NPC_ROAM_RADIUS = 25.0  # NPCs turn back towards their home beyond this distance
RELEASE_BACKOFF_TICKS = 20  # a released NPC the sidecar kept is not released again before this
NPC_TURN_TICKS = (20, 80)  # an NPC keeps a heading for this many ticks (1 to 4 s)
ID_SPARE = 16  # ids kept in reserve so a joining player spawns without waiting a round trip
NPC_NAMES = ["wolf", "boar", "crow", "toad", "moth", "slime", "golem", "sprite"]

# Entity commands, in the Rust arena's convention (its combat.rs): the payload is u32 BE amount, u64 BE
# id of the attack or reward, unique in a run (cellmesh never reads it).
CMD_ATTACK, CMD_XP = 1, 2
DAMAGE = 10  # of one attack
KILL_XP = 100  # a kill shares this among its attackers, by damage dealt
REACH_M = 30.0  # how far a player reaches with an attack
ATTACK_EVERY_TICKS = 10
APPLIED_KEPT = 10_000  # payload ids of applied commands remembered, to spot one applied twice
# The command figures a World counts, in the order its summary line gives them.
COMMAND_FIGURES = ("sent", "attacks_sent", "attacks_across_border", "xp_sent", "results_ok",
                   "results_refused", "results_entity_gone", "results_timeout", "results_not_delivered",
                   "results_unexpected", "applied", "applied_from_other_nodes", "refused", "twice", "kills",
                   "xp_gained", "xp_from_other_nodes")

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
    z: float = 0.0  # carried along untouched
    account: str = ""  # empty for NPCs
    session_epoch: int = 0
    id: int = 0  # 0 until an id from ReserveIds is free
    vx: float = 0.0
    vy: float = 0.0
    home: tuple = (0.0, 0.0)  # the point an NPC roams around
    turn_in: int = 0  # ticks until an NPC picks a new heading
    components: dict = field(default_factory=dict)  # type -> (payload, audience kind)
    dirty: set = field(default_factory=set)  # component types changed since the last tick
    last_seq: int = 0
    inputs_applied: int = 0
    frozen: bool = False  # being handed to another node: neither moved nor written
    released: bool = False  # frozen by this game's own Release (not by the sidecar's Freeze)
    release_after: int = 0  # not released again before this tick (a release that was kept)
    epoch: int = 1  # the entity epoch it is written under (a checkpoint names it)
    leaving: bool = False  # its player left while it was frozen: despawned if it is thawed
    damage: dict = field(default_factory=dict)  # an NPC's attackers: account -> [avatar, damage]
    xp: int = 0  # a player's experience from kills


@dataclass
class Ghost:
    """A read-only copy of an entity simulated on another node, as the sidecar reports it."""

    x: float
    y: float
    components: dict  # type -> payload


def wrap_coord(v, size):
    """`v` on an axis of a torus of `size`, in [0, size) (unchanged when size is 0)."""
    if size <= 0:
        return v
    v %= size
    return 0.0 if v >= size else v  # a tiny negative v rounds up to size itself


class OwnedArea:
    """The area this game's node owns (Welcome, then PartitionChanged), and the rule the sidecar hands
    entities over by: one is due for a Release once it stands more than `margin` whole chunks past
    the area's edge, on a world that wraps around."""

    def __init__(self, world_size=(0.0, 0.0), chunk_size=0.0, rects=(), margin=0):
        self.width, self.height = world_size
        self.chunk = chunk_size
        self.rects = list(rects)  # (x, y, width, height) in metres
        self.margin = margin

    def chunks_outside(self, x, y):
        """Whole chunks from the chunk holding (x, y) to the nearest chunk of the area (0 inside, 1 in
        the first chunk past the edge); None without a world shape or an area."""
        c = self.chunk
        if c <= 0 or self.width <= 0 or self.height <= 0 or not self.rects:
            return None
        nx, ny = max(1, round(self.width / c)), max(1, round(self.height / c))
        cx, cy = math.floor(x / c) % nx, math.floor(y / c) % ny

        def axis(a0, a1, b, n):
            k = (a0 - b) // n
            return min(max(0, b + j * n - a1 + 1, a0 - b - j * n) for j in range(k - 1, k + 3))

        return min(max(axis(round(rx / c), round((rx + rw) / c), cx, nx),
                       axis(round(ry / c), round((ry + rh) / c), cy, ny))
                   for rx, ry, rw, rh in self.rects)

    def release_due(self, x, y):
        d = self.chunks_outside(x, y)
        return d is not None and d > self.margin


def next_tick_at(now_unix, origin_unix_ms, rate_hz):
    """(tick, its start in Unix seconds): the first tick of the world's common clock (tick k starts at
    origin + k / rate) that starts at or after `now_unix`."""
    origin = origin_unix_ms / 1000.0
    k = max(0, math.ceil((now_unix - origin) * rate_hz - 1e-9))
    return k, origin + k / rate_hz


def wrap_delta(d, size):
    """Shortest signed distance along one axis of a torus of `size` (no wrap when size is 0)."""
    return d - round(d / size) * size if size > 0 else d


# ---------------------------------------------------------------- the entity snapshot format

# Shared with the Rust arena, so either game adopts what the other froze: UTF-8 JSON, unknown fields
# ignored, every one of these present ("damage" and "xp" too, but older snapshots lack them).
SNAPSHOT_VERSION = 1
SNAPSHOT_FIELDS = frozenset({"v", "kind", "name", "pos", "dir", "health", "inventory", "session_epoch",
                             "last_seq", "applied", "turn_in"})
U32_MAX, U64_MAX = (1 << 32) - 1, (1 << 64) - 1


class SnapshotError(ValueError):
    """A snapshot this game cannot adopt; the message says which field is wrong."""


def encode_snapshot(e):
    """The complete state of `e` in the shared snapshot format."""
    speed = PLAYER_SPEED if e.account else NPC_SPEED
    current, maximum = struct.unpack(">II", e.components[HEALTH][0])
    return json.dumps({
        "v": SNAPSHOT_VERSION,
        "kind": "player" if e.account else "npc",
        "name": e.kind.split(":", 1)[1],
        "pos": [float(e.x), float(e.y), float(e.z)],
        "dir": [e.vx / speed, e.vy / speed],
        "health": [current, maximum],
        "inventory": e.components[INVENTORY][0].decode() if INVENTORY in e.components else "",
        "session_epoch": e.session_epoch,
        "last_seq": e.last_seq,
        "applied": e.inputs_applied,
        "turn_in": 0 if e.account else e.turn_in,
        "damage": [[account, avatar, d] for account, (avatar, d) in sorted(e.damage.items())],
        "xp": e.xp,
    }).encode()


def _uint(value, what, limit):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise SnapshotError(f"{what} must be an integer in 0..={limit}, got {value!r}")
    return value


def _finite_numbers(value, what, count):
    if (not isinstance(value, list) or len(value) != count
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in value)):
        raise SnapshotError(f"{what} must be a list of {count} finite numbers, got {value!r}")
    return [float(v) for v in value]


def decode_snapshot(state):
    """The fields of a snapshot in the shared format, checked; SnapshotError when it is not one."""
    try:
        s = json.loads(state.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        raise SnapshotError(f"not UTF-8 JSON: {e}") from None
    if not isinstance(s, dict):
        raise SnapshotError(f"expected a JSON object, got {type(s).__name__}")
    missing = SNAPSHOT_FIELDS - s.keys()
    if missing:
        raise SnapshotError(f"missing field(s) {', '.join(sorted(missing))}")
    if _uint(s["v"], "v", U32_MAX) != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot format version {s['v']}, this game reads {SNAPSHOT_VERSION}")
    if s["kind"] not in ("player", "npc"):
        raise SnapshotError(f"kind must be \"player\" or \"npc\", got {s['kind']!r}")
    if not isinstance(s["name"], str) or not s["name"]:
        raise SnapshotError(f"name must be a non-empty string, got {s['name']!r}")
    if not isinstance(s["inventory"], str):
        raise SnapshotError(f"inventory must be a string, got {s['inventory']!r}")
    health = s["health"]
    if not isinstance(health, list) or len(health) != 2:
        raise SnapshotError(f"health must be [current, max], got {health!r}")
    damage = s.get("damage", [])
    if not isinstance(damage, list) or not all(
            isinstance(d, list) and len(d) == 3 and isinstance(d[0], str) for d in damage):
        raise SnapshotError(f"damage must be a list of [account, avatar, damage], got {damage!r}")
    return {
        "kind": s["kind"],
        "name": s["name"],
        "pos": _finite_numbers(s["pos"], "pos", 3),
        "dir": _finite_numbers(s["dir"], "dir", 2),
        "health": [_uint(h, "health", U32_MAX) for h in health],
        "inventory": s["inventory"],
        "session_epoch": _uint(s["session_epoch"], "session_epoch", U64_MAX),
        "last_seq": _uint(s["last_seq"], "last_seq", U64_MAX),
        "applied": _uint(s["applied"], "applied", U64_MAX),
        "turn_in": _uint(s["turn_in"], "turn_in", U32_MAX),
        "damage": {a: [_uint(avatar, "damage avatar", U64_MAX), _uint(d, "damage", U32_MAX)]
                   for a, avatar, d in damage},
        "xp": _uint(s.get("xp", 0), "xp", U64_MAX),
    }


# ---------------------------------------------------------------- combat (the arena's convention)


def encode_command(amount, key):
    """A CMD_ATTACK or CMD_XP payload: the damage or XP, and the attack's or reward's id."""
    return struct.pack(">IQ", amount, key)


def decode_command(payload):
    """(amount, id) of a CMD_ATTACK or CMD_XP payload, or None if it is not one."""
    return struct.unpack(">IQ", payload) if len(payload) == 12 else None


def share_out(damage, xp):
    """A kill's XP for each attacker as [(account, avatar, xp)], by damage dealt, as the arena shares it
    (everyone who hit gets at least 1); `damage` (account -> [avatar, damage]) is emptied."""
    total = sum(d for _, d in damage.values())
    shares = sorted(damage.items())
    damage.clear()
    return [(account, avatar, max(1, xp * d // total)) for account, (avatar, d) in shares] if total else []


# ---------------------------------------------------------------- the world


class World:
    """All game state; the caller feeds it sidecar messages and asks it for one frame per tick."""

    def __init__(self, pb, center, npc_count, rng, world_size=(0.0, 0.0), area=None, release=True,
                 node_id=0):
        self.pb = pb
        self.rng = rng
        self.node_id = node_id  # this game's node (Welcome): commands from any other crossed a border
        self.area = area or OwnedArea()
        self.release = release  # NPCs that walk out of the area are released in that tick
        self.width, self.height = world_size
        self.center = self.wrap(*center)
        self.players = {}  # account -> Entity
        self.npcs = [self._npc(i) for i in range(npc_count)]
        self.ghosts = {}  # entity id -> Ghost
        self.free_ids = []
        self.ids_requested = {}  # request_id -> count
        self.next_request_id = 1
        self.outbox = []  # Despawn, Snapshot and Adopted messages for the next frame
        self.tick_no = 0
        self.inputs_duplicate = 0  # seq not above the last applied one: already applied
        self.inputs_while_frozen = 0  # the sidecar holds these during a handoff; any that slip by
        self.released = 0  # NPCs handed over with Release...
        self.releases_kept = 0  # ...and of those, how many the sidecar kept (thawed)
        self.commands_waiting = {}  # request_id -> (type, acting entity): sent, until their one result
        self.next_command_id = 1  # never reused on this connection, so never one still waiting
        self.attacking = set()  # avatars with an attack on its way (one at a time each)
        self.applied_keys = {}  # (type, payload id) of the commands applied lately, oldest first
        self.command_stats = collections.Counter()  # see COMMAND_FIGURES

    def wrap(self, x, y):
        """(x, y) on the torus, normalised as the sidecar reports positions."""
        return wrap_coord(x, self.width), wrap_coord(y, self.height)

    def _npc(self, i):
        angle = self.rng.uniform(0, 2 * math.pi)
        r = self.rng.uniform(0, NPC_ROAM_RADIUS / 2)
        x, y = self.wrap(self.center[0] + r * math.cos(angle), self.center[1] + r * math.sin(angle))
        npc = Entity(f"npc:{NPC_NAMES[i % len(NPC_NAMES)]}-{i}", x, y, home=self.center)
        npc.components = self._npc_components(npc.kind, (100, 100))
        return npc

    # The samples' schema: which components an entity has, and who may see each.
    def _npc_components(self, kind, health):
        public = self.pb.PUBLIC_IN_RANGE
        return {KIND: (kind.encode(), public), HEALTH: (struct.pack(">II", *health), public)}

    def _player_components(self, kind, health, inventory, last_seq, applied):
        pb = self.pb
        return {
            KIND: (kind.encode(), pb.PUBLIC_IN_RANGE),
            HEALTH: (struct.pack(">II", *health), pb.OWNER_AND_PARTY),
            INVENTORY: (inventory.encode(), pb.OWNER_ONLY),
            INPUT_ACK: (struct.pack(">QQ", last_seq, applied), pb.OWNER_ONLY),
        }

    def entity_count(self):
        return len(self.npcs) + len(self.players)

    def entity(self, entity_id):
        """The entity with this id that this game simulates (its real), or None."""
        if entity_id:
            for e in itertools.chain(self.npcs, self.players.values()):
                if e.id == entity_id:
                    return e
        return None

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
        elif body == "freeze":
            self.freeze(msg.freeze)
        elif body == "checkpoint":
            self.checkpoint(msg.checkpoint)
        elif body == "thaw":
            self.thaw(msg.thaw)
        elif body == "evict":
            self.evict(msg.evict)
        elif body == "adopt":
            self.adopt(msg.adopt)
        elif body in ("ghost_enter", "ghost_update", "ghost_leave"):
            self.ghost(body, getattr(msg, body))
        elif body == "command_in":
            self.command_in(msg.command_in)
        elif body == "command_result":
            self.command_result(msg.command_result)
        elif body == "partition_changed":
            self.area.rects = [(r.x, r.y, r.width, r.height) for r in msg.partition_changed.owned_area]
            log.info("partition epoch %d: this node now owns %d area(s)",
                     msg.partition_changed.partition_epoch, len(msg.partition_changed.owned_area))
        elif body == "error":
            e = msg.error
            log.warning("sidecar error %s%s: %s (entity %d)", self.pb.ErrorCode.Name(e.code),
                        " (fatal)" if e.fatal else "", e.detail, e.entity_id)
        elif body is None:
            raise ProtocolError("sidecar message without a body (expected a SidecarMessage)")
        else:
            log.debug("ignoring %s", body)

    def join(self, join):
        avatar = self.players.get(join.account)
        if avatar is not None:  # re-login: the avatar stays where it is
            avatar.session_epoch = max(avatar.session_epoch, join.session_epoch)
            log.info("player %s rejoined (epoch %d)", join.account, join.session_epoch)
            return
        if join.HasField("last_position"):
            p = join.last_position
            x, y, z = *self.wrap(p.x, p.y), p.z
        else:
            x, y = self.wrap(self.center[0] + self.rng.uniform(2, 4),
                             self.center[1] + self.rng.uniform(-2, 2))
            z = 0.0
        avatar = Entity(f"player:{join.account}", x, y, z, account=join.account,
                        session_epoch=join.session_epoch)
        avatar.components = self._player_components(avatar.kind, (100, 100), "wooden-sword,bread", 0, 0)
        self.players[join.account] = avatar
        log.info("player %s joined (epoch %d) at %.1f,%.1f", join.account, join.session_epoch, x, y)

    def leave(self, leave):
        avatar = self.players.get(leave.account)
        if avatar is None or leave.session_epoch < avatar.session_epoch:
            return  # simulated on another node now, or a newer session of this account took over
        if avatar.frozen:  # no Despawn while it is handed over; if the handoff is refused, then
            avatar.leaving = True
            return
        self._despawn_player(avatar, leave.reason or "no reason")

    def _despawn_player(self, avatar, reason):
        del self.players[avatar.account]
        if avatar.id:
            self.outbox.append(self.pb.GameMessage(despawn=self.pb.Despawn(entity_id=avatar.id)))
        log.info("player %s left (%s)", avatar.account, reason)

    def apply_input(self, inp):
        avatar = self.players.get(inp.account)
        if avatar is None or inp.session_epoch < avatar.session_epoch:
            return
        if avatar.frozen:  # its next owner applies it: the sidecar forwards what the snapshot lacks
            self.inputs_while_frozen += 1
            return
        if inp.seq <= avatar.last_seq:
            self.inputs_duplicate += 1
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

    # ------------------------------------------------ handoff: the entity's real moves between nodes

    def freeze(self, freeze):
        """Stops simulating the entity and answers its complete state in the next frame."""
        e = self.entity(freeze.entity_id)
        if e is None:
            log.warning("Freeze of entity %d, which this game does not simulate", freeze.entity_id)
            return
        e.frozen = True
        self.outbox.append(self.pb.GameMessage(snapshot=self.pb.Snapshot(
            entity_id=e.id, entity_epoch=freeze.entity_epoch, state=encode_snapshot(e))))
        log.info("froze %s (entity %d, epoch %d) for a handoff", e.kind, e.id, freeze.entity_epoch)

    def checkpoint(self, checkpoint):
        """Answers the complete state of each entity asked for, without freezing it: the sidecar keeps
        it, so a crash of this game loses at most a checkpoint interval."""
        for entity_id in checkpoint.entity_ids:
            e = self.entity(entity_id)
            if e is None:
                continue
            self.outbox.append(self.pb.GameMessage(checkpoint_state=self.pb.CheckpointState(
                entity_id=e.id, entity_epoch=e.epoch, state=encode_snapshot(e))))

    def thaw(self, thaw):
        """The handoff was refused: the entity is this game's again."""
        e = self.entity(thaw.entity_id)
        if e is None or not e.frozen:
            log.warning("Thaw of entity %d, which this game does not hold frozen", thaw.entity_id)
            return
        log.info("thawed %s (entity %d): %s", e.kind, e.id, thaw.reason or "no reason")
        if e.released:
            # Kept: no node could take it yet, or it is within the margin. The sidecar's own Freeze
            # hands it over once one can; releasing it again at every tick would only churn.
            e.released = False
            e.release_after = self.tick_no + RELEASE_BACKOFF_TICKS
            self.releases_kept += 1
        self._resume(e)

    def _resume(self, e):
        e.frozen = False
        if e.leaving:
            e.leaving = False
            self._despawn_player(e, "left during a refused handoff")

    def evict(self, evict):
        """The entity lives on another node now: forget it without a Despawn (it stays visible there)."""
        e = self.entity(evict.entity_id)
        if e is None:
            log.warning("Evict of entity %d, which this game does not simulate", evict.entity_id)
            return
        if e.account:
            del self.players[e.account]  # its inputs and leave now go to the other node's game
        else:
            self.npcs = [n for n in self.npcs if n is not e]
        log.info("handed %s (entity %d) to another node", e.kind, e.id)

    def adopt(self, adopt):
        """Takes over an entity (with what moves along with it) that another node handed here."""
        try:
            entities = [self._adoptee(a) for a in (adopt, *adopt.attachments)]
        except SnapshotError as e:
            # Unanswered, the handoff stays in doubt: better than an entity without its state.
            log.error("cannot adopt entity %d: %s", adopt.entity_id, e)
            return
        for e, a in zip(entities, (adopt, *adopt.attachments)):
            e.epoch = a.entity_epoch
            self.ghosts.pop(e.id, None)
            if self.entity(e.id) is e:
                self._resume(e)
            elif e.account:
                self.players[e.account] = e
            else:
                self.npcs.append(e)
        self.outbox.append(self.pb.GameMessage(adopted=self.pb.Adopted(
            entity_id=adopt.entity_id, entity_epoch=adopt.entity_epoch)))
        log.info("adopted %s (entity %d, epoch %d)", entities[0].kind, adopt.entity_id, adopt.entity_epoch)

    def _adoptee(self, adopt):
        """The entity an Adopt hands over, built from its snapshot (not yet held); SnapshotError if it
        cannot be."""
        held = self.entity(adopt.entity_id)
        if held is not None:
            # A replayed Adopt, or the area of a frozen entity's failed target came back here: one
            # copy either way, and it is this game's.
            return held
        s = decode_snapshot(adopt.state)
        player = s["kind"] == "player"
        if player and adopt.owner_account and adopt.owner_account != s["name"]:
            raise SnapshotError(f"snapshot of player {s['name']!r} adopted for account "
                                f"{adopt.owner_account!r}")
        if player and s["name"] in self.players:
            raise SnapshotError(f"player {s['name']!r} already has an avatar here "
                                f"(entity {self.players[s['name']].id})")
        p = adopt.position if adopt.HasField("position") else self.pb.Vec3(
            x=s["pos"][0], y=s["pos"][1], z=s["pos"][2])
        if not all(map(math.isfinite, (p.x, p.y, p.z))):
            raise SnapshotError(f"position {p.x},{p.y},{p.z} is not finite")
        x, y = self.wrap(p.x, p.y)
        kind = f"{s['kind']}:{s['name']}"
        speed = PLAYER_SPEED if player else NPC_SPEED
        e = Entity(kind, x, y, p.z, id=adopt.entity_id, vx=speed * s["dir"][0], vy=speed * s["dir"][1],
                   home=(x, y), turn_in=s["turn_in"], damage=s["damage"], xp=s["xp"])
        if player:
            e.account, e.session_epoch = s["name"], s["session_epoch"]
            e.last_seq, e.inputs_applied = s["last_seq"], s["applied"]
            e.components = self._player_components(kind, s["health"], s["inventory"], e.last_seq,
                                                   e.inputs_applied)
            # The sidecar has the components as last written, which can lag the snapshot by the
            # acknowledgement of an input applied just before the Freeze: send the snapshot's.
            e.dirty.add(INPUT_ACK)
        else:
            e.components = self._npc_components(kind, s["health"])
        return e

    def ghost(self, kind, msg):
        """Keeps the read-only copies of other nodes' entities near this node's area up to date."""
        if kind == "ghost_leave":
            self.ghosts.pop(msg.entity_id, None)
        elif kind == "ghost_enter":
            if self.entity(msg.entity_id) is not None:
                log.warning("GhostEnter of entity %d, which this game simulates: ignored", msg.entity_id)
                return
            self.ghosts[msg.entity_id] = Ghost(msg.position.x, msg.position.y,
                                               {c.type: c.payload for c in msg.components})
        elif (g := self.ghosts.get(msg.entity_id)) is not None:
            if msg.HasField("position"):
                g.x, g.y = msg.position.x, msg.position.y
            g.components.update((c.type, c.payload) for c in msg.changed)
            for t in msg.removed_types:
                g.components.pop(t, None)

    # ------------------------------------------------ entity commands: combat across borders

    def distance(self, e, x, y):
        """From `e` to (x, y), the short way round."""
        return math.hypot(wrap_delta(x - e.x, self.width), wrap_delta(y - e.y, self.height))

    def _command(self, target, kind, payload, from_entity):
        """A Command with a fresh request id, waiting for its one result from now on."""
        request_id = self.next_command_id
        self.next_command_id += 1
        self.commands_waiting[request_id] = (kind, from_entity)
        self.command_stats["sent"] += 1
        return self.pb.GameMessage(command=self.pb.Command(
            target_entity=target, type=kind, payload=payload, request_id=request_id, from_entity=from_entity))

    def _command_key(self):
        # Random rather than counted, so a restarted game does not repeat its predecessor's ids.
        return self.rng.getrandbits(64)

    def attack(self):
        """Each avatar with no attack on its way hits the nearest NPC in reach, this game's or a ghost of
        another node's alike; returns the Commands."""
        npcs = [(n.id, n.x, n.y, False) for n in self.npcs if n.id and not n.frozen]
        npcs += [(i, g.x, g.y, True) for i, g in self.ghosts.items()
                 if g.components.get(KIND, b"").startswith(b"npc:")]
        out = []
        for avatar in self.players.values():
            if not avatar.id or avatar.frozen or avatar.id in self.attacking:
                continue
            in_reach = [(d, i, ghost) for i, x, y, ghost in npcs
                        if (d := self.distance(avatar, x, y)) <= REACH_M]
            if not in_reach:
                continue
            _, target, ghost = min(in_reach)  # the nearest; the lowest id of those as near
            payload = encode_command(DAMAGE, self._command_key())
            out.append(self._command(target, CMD_ATTACK, payload, avatar.id))
            self.attacking.add(avatar.id)
            self.command_stats["attacks_sent"] += 1
            self.command_stats["attacks_across_border"] += ghost
        return out

    def command_in(self, c):
        """A command to an entity this game writes: applied at once, and answered exactly once when it
        carries a request id."""
        apply = {CMD_ATTACK: self._attacked, CMD_XP: self._rewarded}.get(c.type)
        refusal = apply(c) if apply else f"unknown command type {c.type}"
        if refusal:
            self.command_stats["refused"] += 1
            log.info("refused command type %d to entity %d from node %d: %s", c.type, c.target, c.from_node,
                     refusal)
        if c.request_id:
            self.outbox.append(self.pb.GameMessage(command_reply=self.pb.CommandReply(
                request_id=c.request_id, refused=bool(refusal), detail=refusal or "")))

    def _command_target(self, c, player):
        """(the entity `c` may act on, None) or (None, why not)."""
        e = self.entity(c.target)
        if e is None:
            return None, "no such entity here"
        if e.frozen:  # its state is the snapshot's now
            return None, "frozen"
        if bool(e.account) != player:
            return None, "only players gain XP" if player else "only NPCs are attacked"
        return e, None

    def _applied_before(self, kind, key):
        """Whether a command with this payload id was applied here already (the mesh applies each at most
        once: counted, and not applied again); remembers it otherwise."""
        if (kind, key) in self.applied_keys:
            self.command_stats["twice"] += 1
            log.warning("command type %d with id %d came twice: not applied again", kind, key)
            return True
        self.applied_keys[(kind, key)] = None
        if len(self.applied_keys) > APPLIED_KEPT:
            del self.applied_keys[next(iter(self.applied_keys))]
        return False

    def _count_applied(self, c):
        self.command_stats["applied"] += 1
        self.command_stats["applied_from_other_nodes"] += c.from_node != self.node_id

    def _attacked(self, c):
        """An attack on one of this game's NPCs: its damage table grows; a kill shares out XP to every
        attacker's avatar, wherever it is simulated, and the NPC rises again at full health. Returns why it
        was refused, or None."""
        hit = decode_command(c.payload)
        if hit is None:
            return "unreadable attack"
        npc, refusal = self._command_target(c, player=False)
        if refusal or self._applied_before(CMD_ATTACK, hit[1]):
            return refusal
        self._count_applied(c)
        entry = npc.damage.setdefault(c.from_account, [c.from_entity, 0])
        entry[0] = c.from_entity  # the attacker's latest avatar gets the XP
        entry[1] += hit[0]
        current, maximum = struct.unpack(">II", npc.components[HEALTH][0])
        current = max(0, current - hit[0])
        if current == 0:
            rewards = share_out(npc.damage, KILL_XP)
            current = maximum
            self.command_stats["kills"] += 1
            log.info("%s (entity %d) killed; XP to %s", npc.kind, npc.id,
                     ", ".join(f"{a or '?'} {xp}" for a, _, xp in rewards))
            for _, avatar, xp in rewards:
                if avatar:  # 0: an attack without an actor
                    self.outbox.append(self._command(avatar, CMD_XP, encode_command(xp, self._command_key()),
                                                     npc.id))
                    self.command_stats["xp_sent"] += 1
        npc.components[HEALTH] = (struct.pack(">II", current, maximum), self.pb.PUBLIC_IN_RANGE)
        npc.dirty.add(HEALTH)
        return None

    def _rewarded(self, c):
        """XP for a kill, to one of this game's avatars. Returns why it was refused, or None."""
        reward = decode_command(c.payload)
        if reward is None:
            return "unreadable reward"
        avatar, refusal = self._command_target(c, player=True)
        if refusal or self._applied_before(CMD_XP, reward[1]):
            return refusal
        self._count_applied(c)
        avatar.xp += reward[0]
        self.command_stats["xp_gained"] += reward[0]
        self.command_stats["xp_from_other_nodes"] += c.from_node != self.node_id
        log.info("%s gained %d XP for a kill on node %d (%d in all)", avatar.kind, reward[0], c.from_node,
                 avatar.xp)
        return None

    def command_result(self, r):
        """The one result of a command this game sent."""
        waiting = self.commands_waiting.pop(r.request_id, None)
        if waiting is None:  # a second result, or one for a command never sent: the mesh broke a promise
            self.command_stats["results_unexpected"] += 1
            log.warning("a result for request %d, which waits for none", r.request_id)
            return
        kind, actor = waiting
        if kind == CMD_ATTACK:
            self.attacking.discard(actor)
        error = r.error if r.error in self.pb.CommandError.values() else self.pb.NOT_DELIVERED
        name = "ok" if error == self.pb.COMMAND_OK else self.pb.CommandError.Name(error).lower()
        self.command_stats[f"results_{name}"] += 1
        if name != "ok":
            log.info("command type %d to entity %d: %s%s", kind, r.target, name.upper(),
                     f" ({r.detail})" if r.detail else "")

    def command_summary(self):
        """The command figures as `name=count` words, with the requests still waiting."""
        figures = [(name, self.command_stats[name]) for name in COMMAND_FIGURES]
        return " ".join(f"{k}={v}" for k, v in [*figures, ("waiting", len(self.commands_waiting))])

    # ------------------------------------------------ simulation

    def _wander(self, npc):
        npc.turn_in = max(0, npc.turn_in - 1)
        dx = wrap_delta(npc.home[0] - npc.x, self.width)
        dy = wrap_delta(npc.home[1] - npc.y, self.height)
        if math.hypot(dx, dy) > NPC_ROAM_RADIUS:
            heading = math.atan2(dy, dx)
        elif npc.turn_in == 0:
            heading = self.rng.uniform(0, 2 * math.pi)
            npc.turn_in = self.rng.randint(*NPC_TURN_TICKS)
        else:
            return
        npc.vx, npc.vy = NPC_SPEED * math.cos(heading), NPC_SPEED * math.sin(heading)

    def _move(self, e, dt):
        if not (e.vx or e.vy):
            return False
        e.x, e.y = self.wrap(e.x + e.vx * dt, e.y + e.vy * dt)
        return True

    def _components(self, e, types):
        return [self.pb.Component(type=t, payload=e.components[t][0],
                                  audience=self.pb.Audience(kind=e.components[t][1]))
                for t in sorted(types)]

    def tick(self, dt):
        """Advances the world by `dt` seconds; returns this tick's messages, ending with TickEnd."""
        pb = self.pb
        out, self.outbox = self.outbox, []
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
            if e.frozen:
                continue  # its state is the snapshot's until Thaw or Evict
            if not e.account:
                self._wander(e)
            moved = self._move(e, dt)
            if not e.id:
                if not self.free_ids:
                    continue
                e.id = self.free_ids.pop(0)
                e.dirty.clear()
                out.append(pb.GameMessage(spawn=pb.Spawn(
                    entity_id=e.id, position=pb.Vec3(x=e.x, y=e.y, z=e.z), owner_account=e.account,
                    is_master=bool(e.account), components=self._components(e, e.components))))
            elif moved or e.dirty:
                update = pb.Update(entity_id=e.id, changed=self._components(e, e.dirty))
                if moved:
                    update.position.CopyFrom(pb.Vec3(x=e.x, y=e.y, z=e.z))
                e.dirty.clear()
                out.append(pb.GameMessage(update=update))
            # An NPC that walked out of the area is handed over with this tick's state, so its next
            # owner simulates it in its very next tick. Not a player's avatar: inputs on their way
            # here would reach it frozen; the sidecar's Freeze holds them back.
            if (self.release and e.id and not e.account and moved and self.tick_no >= e.release_after
                    and self.area.release_due(e.x, e.y)):
                e.frozen = e.released = True
                self.released += 1
                out.append(pb.GameMessage(release=pb.Release(
                    entity_id=e.id, entity_epoch=e.epoch, state=encode_snapshot(e))))
        if self.tick_no % ATTACK_EVERY_TICKS == 0:
            out.extend(self.attack())
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
    area = OwnedArea((shape.width, shape.height), shape.chunk_size,
                     [(r.x, r.y, r.width, r.height) for r in welcome.owned_area],
                     welcome.handoff_margin_chunks)
    world = World(pb, args.center, args.npcs, rng, (shape.width, shape.height), area,
                  release=not args.no_release, node_id=welcome.node_id)
    # Ticks start on the world's common clock, so what one node releases at the end of a tick the
    # next adopts for its following one. An older sidecar names no phase: the Unix epoch, our rate.
    phase = welcome.tick_phase if welcome.HasField("tick_phase") else None
    origin_ms = phase.origin_unix_ms if phase else 0
    rate = phase.tick_rate_hz if phase and phase.tick_rate_hz else TICK_HZ
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
    last = next_load = clock()
    tick_k, start = next_tick_at(time.time(), origin_ms, rate)
    next_tick = clock() + max(0.0, start - time.time())
    await asyncio.wait({reader_task, stop_task}, timeout=max(0.0, next_tick - clock()),
                       return_when=asyncio.FIRST_COMPLETED)
    try:
        while not stop.is_set() and not reader_task.done():
            now = clock()
            started = time.perf_counter()
            messages = world.tick(now - last)
            tick_ms = (time.perf_counter() - started) * 1000
            last = now
            if now >= next_load:
                next_load = now + 1.0
                messages.insert(0, pb.GameMessage(load=pb.Load(
                    tick_ms=tick_ms, budget_ms=TICK_SECS * 1000, entity_count=world.entity_count())))
            writer.write(encode_frame(pb, messages))
            await writer.drain()
            # The next tick of the common clock; after a stall, the next one to come (never catch up).
            k, start = next_tick_at(time.time(), origin_ms, rate)
            if k <= tick_k:  # woken a hair early: still the next one
                k, start = tick_k + 1, origin_ms / 1000.0 + (tick_k + 1) / rate
            tick_k = k
            next_tick = clock() + max(0.0, start - time.time())
            await asyncio.wait({reader_task, stop_task}, timeout=max(0.0, next_tick - clock()),
                               return_when=asyncio.FIRST_COMPLETED)
        if reader_task.done():
            reader_task.result()  # re-raises a ProtocolError from the reader
    finally:
        reader_task.cancel()
        stop_task.cancel()
        writer.close()
        log.info("commands: %s", world.command_summary())


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
    p.add_argument("--no-release", action="store_true",
                   help="leave every handoff to the sidecar's Freeze instead of releasing NPCs that walk out")
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
