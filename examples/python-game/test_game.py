"""Tests of the Python sample game: its game logic, and the real game.py process against a
scripted sidecar on a real socket. Run: python -m unittest test_game (in this directory)."""

import asyncio
import math
import random
import signal
import socket
import struct
import subprocess
import sys
import unittest
from pathlib import Path

import game

pb = game.load_protocol()
GAME_PY = Path(game.__file__).resolve()


def sidecar_msg(**body):
    return pb.SidecarMessage(**body)


def join(account, epoch, position=None):
    j = pb.PlayerJoin(account=account, session_epoch=epoch)
    if position:
        j.last_position.CopyFrom(pb.Vec3(x=position[0], y=position[1]))
    return sidecar_msg(player_join=j)


def move(account, epoch, seq, dx, dy):
    payload = struct.pack(">ff", dx, dy)
    return sidecar_msg(input=pb.Input(account=account, session_epoch=epoch, seq=seq, payload=payload))


def bodies(messages, kind):
    return [getattr(m, kind) for m in messages if m.WhichOneof("body") == kind]


def components(spawn_or_update):
    items = spawn_or_update.components if hasattr(spawn_or_update, "components") else spawn_or_update.changed
    return {c.type: (c.payload, c.audience.kind) for c in items}


class WorldTest(unittest.TestCase):
    def world(self, npcs=3):
        w = game.World(pb, (500.0, 700.0), npcs, random.Random(7), (4096.0, 4096.0))
        reserve = bodies(w.tick(0.05, 0.0), "reserve_ids")
        self.assertEqual(len(reserve), 1)
        self.assertGreaterEqual(reserve[0].count, npcs + game.ID_SPARE)
        w.handle(sidecar_msg(ids_reserved=pb.IdsReserved(
            request_id=reserve[0].request_id, ids=range(100, 100 + reserve[0].count))))
        return w

    def test_npcs_spawn_once_ids_arrive_with_public_kind_and_health(self):
        w = self.world(npcs=3)
        out = w.tick(0.05, 0.05)
        spawns = bodies(out, "spawn")
        self.assertEqual(len(spawns), 3)
        self.assertEqual(out[-1].WhichOneof("body"), "tick_end")
        for s in spawns:
            c = components(s)
            self.assertTrue(c[game.KIND][0].startswith(b"npc:"))
            self.assertEqual(c[game.HEALTH], (struct.pack(">II", 100, 100), pb.PUBLIC_IN_RANGE))
            self.assertEqual(c[game.KIND][1], pb.PUBLIC_IN_RANGE)
            self.assertFalse(s.is_master)
            self.assertLess(math.hypot(s.position.x - 500, s.position.y - 700), game.NPC_ROAM_RADIUS)
        self.assertEqual(len({s.entity_id for s in spawns}), 3)

    def test_npcs_wander_at_npc_speed_and_stay_near_the_center(self):
        w = self.world(npcs=2)
        w.tick(0.05, 0.05)
        for i in range(2, 2000):
            w.tick(0.05, i * 0.05)
            for npc in w.npcs:
                self.assertAlmostEqual(math.hypot(npc.vx, npc.vy), game.NPC_SPEED)
                self.assertLess(math.hypot(npc.x - 500, npc.y - 700), game.NPC_ROAM_RADIUS + 1)

    def test_player_avatar_schema_relogin_and_leave(self):
        w = self.world(npcs=0)
        w.handle(join("alice", 1))
        spawn = bodies(w.tick(0.05, 0.1), "spawn")[0]
        self.assertTrue(spawn.is_master)
        self.assertEqual(spawn.owner_account, "alice")
        c = components(spawn)
        self.assertEqual(c[game.KIND], (b"player:alice", pb.PUBLIC_IN_RANGE))
        self.assertEqual(c[game.HEALTH][1], pb.OWNER_AND_PARTY)
        self.assertEqual(c[game.INVENTORY][1], pb.OWNER_ONLY)
        self.assertEqual(c[game.INPUT_ACK], (bytes(16), pb.OWNER_ONLY))
        self.assertLess(math.hypot(spawn.position.x - 500, spawn.position.y - 700), 5)

        w.handle(join("alice", 2))  # re-login keeps the avatar
        out = w.tick(0.05, 0.15)
        self.assertEqual(bodies(out, "spawn") + bodies(out, "despawn"), [])
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=1)))
        self.assertEqual(bodies(w.tick(0.05, 0.2), "despawn"), [])  # the old session's leave
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=2)))
        self.assertEqual([d.entity_id for d in bodies(w.tick(0.05, 0.25), "despawn")], [spawn.entity_id])

    def test_returning_player_spawns_at_last_position(self):
        w = self.world(npcs=0)
        w.handle(join("bob", 1, position=(3000.5, 12.25)))
        spawn = bodies(w.tick(0.05, 0.1), "spawn")[0]
        self.assertEqual((spawn.position.x, spawn.position.y), (3000.5, 12.25))

    def test_input_walks_the_avatar_and_advances_input_ack(self):
        w = self.world(npcs=0)
        w.handle(join("alice", 1))
        w.tick(0.05, 0.1)
        self.assertEqual(bodies(w.tick(0.05, 0.15), "update"), [])  # idle avatar: nothing to send
        w.handle(move("alice", 1, 41, 3.0, 4.0))
        w.handle(move("alice", 0, 42, 1.0, 0.0))  # an older session: ignored
        with self.assertLogs("python-game", "WARNING") as logs:
            w.handle(sidecar_msg(input=pb.Input(account="alice", session_epoch=1, seq=43, payload=b"\x01")))
        self.assertIn("payload of 1 bytes, expected 8", logs.output[0])
        avatar = w.players["alice"]
        before = (avatar.x, avatar.y)
        update = bodies(w.tick(0.1, 0.25), "update")[0]
        self.assertAlmostEqual(update.position.x - before[0], 0.3)
        self.assertAlmostEqual(update.position.y - before[1], 0.4)
        self.assertEqual(components(update), {game.INPUT_ACK: (struct.pack(">QQ", 41, 1), pb.OWNER_ONLY)})
        update = bodies(w.tick(0.1, 0.35), "update")[0]
        self.assertEqual(len(update.changed), 0)  # moved, but the ack did not change
        w.handle(move("alice", 1, 44, 0.0, 0.0))
        w.handle(move("alice", 1, 45, float("nan"), 1.0))
        self.assertEqual(components(bodies(w.tick(0.1, 0.45), "update")[0])[game.INPUT_ACK][0],
                         struct.pack(">QQ", 45, 3))
        self.assertEqual(bodies(w.tick(0.1, 0.55), "update"), [])  # stopped


class ScriptedSidecar:
    """A real listening socket that plays the sidecar's side of the local protocol."""

    def __init__(self, script):
        self.script = script
        self.frames = []
        self.connections = 0
        self.failure = None  # what went wrong inside the script: asyncio would swallow it

    async def start(self, port=0):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", port)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader, writer):
        self.connections += 1
        if self.connections > 1:
            writer.close()
            return
        self.reader, self.writer = reader, writer
        try:
            await self.script(self)
            while True:  # keep the game connected until it leaves
                await self.recv()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except BaseException as e:
            self.failure = e
        writer.close()

    async def recv(self):
        length = struct.unpack(">I", await self.reader.readexactly(4))[0]
        frame = pb.GameFrame.FromString(await self.reader.readexactly(length))
        self.frames.append(frame)
        return list(frame.messages)

    async def send(self, *messages):
        body = pb.SidecarFrame(messages=messages).SerializeToString()
        self.writer.write(struct.pack(">I", len(body)) + body)
        await self.writer.drain()

    async def recv_until(self, predicate):
        while True:
            messages = await self.recv()
            if predicate(messages):
                return messages


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_game(script, *args, listen_late=False, timeout=20):
    """Runs game.py against `script`; with `listen_late` the game starts before the sidecar listens."""
    sidecar = ScriptedSidecar(script)
    port = free_port() if listen_late else 0
    addr = f"127.0.0.1:{port}" if listen_late else await sidecar.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(GAME_PY), "--sidecar", addr, *args,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sidecar.proc = proc
    try:
        if listen_late:
            await asyncio.sleep(1.0)  # the game is retrying meanwhile
            await sidecar.start(port)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
        sidecar.server.close()
    if sidecar.failure:
        raise sidecar.failure
    return proc.returncode, stderr.decode(), sidecar


class ProcessTest(unittest.TestCase):
    def test_plays_the_local_protocol(self):
        async def script(sc):
            hello = (await sc.recv())[0].hello
            self.assertEqual((hello.version.major, hello.tick_rate_hz, hello.game), (1, 20, "python-game"))
            welcome = pb.Welcome(version=pb.ProtocolVersion(major=1, minor=3), node_id=7,
                                 world=pb.WorldShape(width=4096, height=4096, chunk_size=64))
            await sc.send(sidecar_msg(welcome=welcome), join("alice", 1))
            reserve = bodies(await sc.recv(), "reserve_ids")[0]
            await sc.send(sidecar_msg(ids_reserved=pb.IdsReserved(
                request_id=reserve.request_id, ids=range(1, reserve.count + 1))))
            spawned = await sc.recv_until(lambda m: bodies(m, "spawn"))
            self.assertEqual(len(bodies(spawned, "spawn")), 3)  # 2 NPCs and alice in one tick
            await sc.send(move("alice", 1, 1, 1.0, 0.0),
                          sidecar_msg(error=pb.Error(code=pb.UNKNOWN_ENTITY, detail="x", entity_id=9)))
            acked = await sc.recv_until(lambda m: any(c.type == game.INPUT_ACK
                                                      for u in bodies(m, "update") for c in u.changed))
            self.assertEqual(acked[-1].WhichOneof("body"), "tick_end")
            await sc.recv_until(lambda m: bodies(m, "load"))

        code, stderr, sidecar = asyncio.run(run_game(script, "--npcs", "2", "--duration", "3"))
        self.assertEqual(code, 0, stderr)
        self.assertIn("UNKNOWN_ENTITY", stderr)
        ticks = [m.tick_end.tick for f in sidecar.frames for m in f.messages if m.HasField("tick_end")]
        self.assertEqual(ticks, list(range(1, len(ticks) + 1)))
        self.assertTrue(all(sum(m.HasField("tick_end") for m in f.messages) == 1 for f in sidecar.frames[1:]))
        self.assertEqual(sidecar.connections, 1)

    def test_waits_for_a_late_sidecar_and_exits_cleanly_on_sigterm(self):
        async def script(sc):
            await sc.recv()
            welcome = pb.Welcome(version=pb.ProtocolVersion(major=1),
                                 world=pb.WorldShape(width=4096, height=4096))
            await sc.send(sidecar_msg(welcome=welcome))
            await sc.recv_until(lambda m: bodies(m, "tick_end"))
            sc.proc.send_signal(signal.SIGTERM)

        code, stderr, sidecar = asyncio.run(run_game(script, listen_late=True))
        self.assertEqual(code, 0, stderr)
        self.assertIn("not reachable", stderr)
        self.assertIn("stopped", stderr)

    def test_an_error_instead_of_welcome_exits_non_zero(self):
        async def script(sc):
            await sc.recv()
            error = pb.Error(code=pb.VERSION_MISMATCH, detail="game speaks 1.0, sidecar speaks 2.0",
                             fatal=True)
            await sc.send(sidecar_msg(error=error))

        code, stderr, _ = asyncio.run(run_game(script))
        self.assertNotEqual(code, 0)
        self.assertIn("VERSION_MISMATCH: game speaks 1.0, sidecar speaks 2.0", stderr)

    def test_a_frame_of_another_protocol_is_refused_by_name(self):
        async def script(sc):
            await sc.recv()
            sc.writer.write(struct.pack(">I", 2) + b"\x1a\x00")  # field 3: an edge ClientFrame
            await sc.writer.drain()

        code, stderr, _ = asyncio.run(run_game(script))
        self.assertNotEqual(code, 0)
        self.assertIn("expected a SidecarFrame", stderr)


if __name__ == "__main__":
    unittest.main()
