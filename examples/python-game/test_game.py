"""Tests of the Python sample game: its game logic, and the real game.py process against a
scripted sidecar on a real socket. Run: python -m unittest test_game (in this directory)."""

import asyncio
import json
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


def for_entity(messages, kind, entity_id):
    return [b for b in bodies(messages, kind) if b.entity_id == entity_id]


def freeze(entity_id, epoch):
    return sidecar_msg(freeze=pb.Freeze(entity_id=entity_id, entity_epoch=epoch))


def adopt(entity_id, epoch, state, position, owner="", is_master=False):
    return sidecar_msg(adopt=pb.Adopt(entity_id=entity_id, entity_epoch=epoch, state=state,
                                      position=pb.Vec3(x=position[0], y=position[1]),
                                      owner_account=owner, is_master=is_master))


def ghost_enter(entity_id, x, y, kind=None):
    ghost = pb.GhostEnter(entity_id=entity_id, position=pb.Vec3(x=x, y=y))
    if kind:
        ghost.components.add(type=game.KIND, payload=kind)
    return sidecar_msg(ghost_enter=ghost)


def command_in(target, kind, payload, request_id, account="", from_entity=0, from_node=1):
    return sidecar_msg(command_in=pb.CommandIn(
        target=target, type=kind, payload=payload, request_id=request_id, from_account=account,
        from_entity=from_entity, from_node=from_node))


def attack_in(target, request_id, account, avatar, from_node=1, key=None):
    payload = game.encode_command(game.DAMAGE, request_id if key is None else key)
    return command_in(target, game.CMD_ATTACK, payload, request_id, account, avatar, from_node)


def result(request_id, error=0, target=0):
    return sidecar_msg(command_result=pb.CommandResult(request_id=request_id, target=target,
                                                       ok=error == pb.COMMAND_OK, error=error))


# The shared snapshot format's fields, written out here so that a change to the game's encoder that
# breaks the format fails a test instead of the other game's adoption.
SNAPSHOT_FIELDS = {"v": int, "kind": str, "name": str, "pos": list, "dir": list, "health": list,
                   "inventory": str, "session_epoch": int, "last_seq": int, "applied": int, "turn_in": int,
                   "damage": list, "xp": int}

# A player's snapshot as the Rust arena writes it (serde_json, compact): bob walked east over the
# world's seam (x wrapped from 4095.9 to 0.25) into this node's area.
ARENA_PLAYER = (b'{"v":1,"kind":"player","name":"bob","pos":[0.25,10.0,0.0],"dir":[1.0,0.0],'
                b'"health":[90,100],"inventory":"sword,bread,10 gold","session_epoch":3,'
                b'"last_seq":17,"applied":12,"turn_in":0}')
ARENA_NPC = (b'{"v":1,"kind":"npc","name":"wanderer-3","pos":[800.0,900.0,0.0],"dir":[0.0,1.0],'
             b'"health":[50,50],"inventory":"","session_epoch":0,"last_seq":0,"applied":0,'
             b'"turn_in":3,"mood":"curious"}')
# An NPC the arena's players hurt, with its damage table: (account, avatar, damage) each.
ARENA_HURT_NPC = (b'{"v":1,"kind":"npc","name":"wanderer-5","pos":[800.0,900.0,0.0],"dir":[0.0,1.0],'
                  b'"health":[60,100],"inventory":"","session_epoch":0,"last_seq":0,"applied":0,'
                  b'"turn_in":3,"damage":[["ann",7,30],["bob",8,10]],"xp":0}')


class WorldCase(unittest.TestCase):
    def decoded(self, snapshot):
        """A Snapshot's state, checked against the shared format: exactly its fields, of its types."""
        state = json.loads(snapshot.state.decode("utf-8"))
        self.assertEqual(set(state), set(SNAPSHOT_FIELDS))
        for name, kind in SNAPSHOT_FIELDS.items():
            self.assertIs(type(state[name]), kind, name)
        for name, length, kind in (("pos", 3, float), ("dir", 2, float), ("health", 2, int)):
            self.assertEqual([type(v) for v in state[name]], [kind] * length, name)
        return state

    def world(self, npcs=3, center=(500.0, 700.0)):
        w = game.World(pb, center, npcs, random.Random(7), (4096.0, 4096.0))
        reserve = bodies(w.tick(0.05), "reserve_ids")
        self.assertEqual(len(reserve), 1)
        self.assertGreaterEqual(reserve[0].count, npcs + game.ID_SPARE)
        w.handle(sidecar_msg(ids_reserved=pb.IdsReserved(
            request_id=reserve[0].request_id, ids=range(100, 100 + reserve[0].count))))
        return w

    def walking(self, account="alice"):
        """A world whose player `account` joined, spawned, and walks at (3, 4) m/s after input 41."""
        w = self.world(npcs=0)
        w.handle(join(account, 1))
        w.tick(0.05)
        w.handle(move(account, 1, 41, 3.0, 4.0))
        w.tick(0.1)
        return w, w.players[account]


class WorldTest(WorldCase):
    def test_npcs_spawn_once_ids_arrive_with_public_kind_and_health(self):
        w = self.world(npcs=3)
        out = w.tick(0.05)
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
        w.tick(0.05)
        for i in range(2, 2000):
            w.tick(0.05)
            for npc in w.npcs:
                self.assertAlmostEqual(math.hypot(npc.vx, npc.vy), game.NPC_SPEED)
                self.assertLess(math.hypot(npc.x - 500, npc.y - 700), game.NPC_ROAM_RADIUS + 1)

    def test_player_avatar_schema_relogin_and_leave(self):
        w = self.world(npcs=0)
        w.handle(join("alice", 1))
        spawn = bodies(w.tick(0.05), "spawn")[0]
        self.assertTrue(spawn.is_master)
        self.assertEqual(spawn.owner_account, "alice")
        c = components(spawn)
        self.assertEqual(c[game.KIND], (b"player:alice", pb.PUBLIC_IN_RANGE))
        self.assertEqual(c[game.HEALTH][1], pb.OWNER_AND_PARTY)
        self.assertEqual(c[game.INVENTORY][1], pb.OWNER_ONLY)
        self.assertEqual(c[game.INPUT_ACK], (bytes(16), pb.OWNER_ONLY))
        self.assertLess(math.hypot(spawn.position.x - 500, spawn.position.y - 700), 5)

        w.handle(join("alice", 2))  # re-login keeps the avatar
        out = w.tick(0.05)
        self.assertEqual(bodies(out, "spawn") + bodies(out, "despawn"), [])
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=1)))
        self.assertEqual(bodies(w.tick(0.05), "despawn"), [])  # the old session's leave
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=2)))
        self.assertEqual([d.entity_id for d in bodies(w.tick(0.05), "despawn")], [spawn.entity_id])

    def test_returning_player_spawns_at_last_position(self):
        w = self.world(npcs=0)
        w.handle(join("bob", 1, position=(3000.5, 12.25)))
        spawn = bodies(w.tick(0.05), "spawn")[0]
        self.assertEqual((spawn.position.x, spawn.position.y), (3000.5, 12.25))

    def test_input_walks_the_avatar_and_advances_input_ack(self):
        w = self.world(npcs=0)
        w.handle(join("alice", 1))
        w.tick(0.05)
        self.assertEqual(bodies(w.tick(0.05), "update"), [])  # idle avatar: nothing to send
        w.handle(move("alice", 1, 41, 3.0, 4.0))
        w.handle(move("alice", 0, 42, 1.0, 0.0))  # an older session: ignored
        with self.assertLogs("python-game", "WARNING") as logs:
            w.handle(sidecar_msg(input=pb.Input(account="alice", session_epoch=1, seq=43, payload=b"\x01")))
        self.assertIn("payload of 1 bytes, expected 8", logs.output[0])
        avatar = w.players["alice"]
        before = (avatar.x, avatar.y)
        update = bodies(w.tick(0.1), "update")[0]
        self.assertAlmostEqual(update.position.x - before[0], 0.3)
        self.assertAlmostEqual(update.position.y - before[1], 0.4)
        self.assertEqual(components(update), {game.INPUT_ACK: (struct.pack(">QQ", 41, 1), pb.OWNER_ONLY)})
        w.handle(move("alice", 1, 41, -1.0, 0.0))  # a replay of 41: a duplicate, not applied again
        update = bodies(w.tick(0.1), "update")[0]
        self.assertAlmostEqual(update.position.x - before[0], 0.6)
        self.assertEqual(len(update.changed), 0)  # moved, but the ack did not change
        self.assertEqual(w.inputs_duplicate, 1)
        w.handle(move("alice", 1, 44, 0.0, 0.0))
        w.handle(move("alice", 1, 45, float("nan"), 1.0))
        self.assertEqual(components(bodies(w.tick(0.1), "update")[0])[game.INPUT_ACK][0],
                         struct.pack(">QQ", 45, 3))
        self.assertEqual(bodies(w.tick(0.1), "update"), [])  # stopped


class HandoffTest(WorldCase):
    def test_freeze_stops_a_player_and_answers_its_complete_snapshot_in_the_next_frame(self):
        w, alice = self.walking()
        where = (alice.x, alice.y)
        w.handle(freeze(alice.id, 7))
        out = w.tick(0.1)
        [snapshot] = bodies(out, "snapshot")
        self.assertEqual((snapshot.entity_id, snapshot.entity_epoch), (alice.id, 7))
        self.assertEqual(bodies(out, "update") + bodies(out, "despawn"), [])
        self.assertEqual(self.decoded(snapshot), {
            "v": 1, "kind": "player", "name": "alice", "pos": [where[0], where[1], 0.0], "dir": [0.6, 0.8],
            "health": [100, 100], "inventory": "wooden-sword,bread", "session_epoch": 1, "last_seq": 41,
            "applied": 1, "turn_in": 0, "damage": [], "xp": 0})

        # Frozen: inputs are ignored (and counted), a leave despawns nothing, and nothing is written.
        w.handle(move("alice", 1, 42, -1.0, 0.0))
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=1)))
        for _ in range(5):
            self.assertEqual([m.WhichOneof("body") for m in w.tick(0.1)], ["tick_end"])
        self.assertEqual((alice.x, alice.y, alice.last_seq), (*where, 41))
        self.assertEqual(w.inputs_while_frozen, 1)

    def test_a_checkpoint_answers_the_state_without_freezing_under_the_adopted_epoch(self):
        w, alice = self.walking()
        w.handle(sidecar_msg(checkpoint=pb.Checkpoint(entity_ids=[alice.id, 424242])))
        out = w.tick(0.1)
        [state] = bodies(out, "checkpoint_state")
        self.assertEqual((state.entity_id, state.entity_epoch), (alice.id, 1))
        self.assertEqual(self.decoded(state)["name"], "alice")
        self.assertFalse(alice.frozen)
        self.assertEqual(len(for_entity(out, "update", alice.id)), 1, "still simulated")
        # An adopted entity is checkpointed under the epoch it was adopted with.
        w.handle(ghost_enter(9001, 0.25, 10.0))
        w.handle(adopt(9001, 4, ARENA_PLAYER, (0.25, 10.0), owner="bob", is_master=True))
        w.tick(0.1)
        w.handle(sidecar_msg(checkpoint=pb.Checkpoint(entity_ids=[9001])))
        [state] = bodies(w.tick(0.1), "checkpoint_state")
        self.assertEqual((state.entity_id, state.entity_epoch), (9001, 4))

    def test_a_frozen_npc_snapshot_carries_its_heading_and_turn(self):
        w = self.world(npcs=1)
        w.tick(0.05)
        w.tick(0.05)
        npc = w.npcs[0]
        w.handle(freeze(npc.id, 2))
        state = self.decoded(bodies(w.tick(0.05), "snapshot")[0])
        self.assertEqual(state, {
            "v": 1, "kind": "npc", "name": "wolf-0", "pos": [npc.x, npc.y, 0.0],
            "dir": [npc.vx / game.NPC_SPEED, npc.vy / game.NPC_SPEED], "health": [100, 100],
            "inventory": "", "session_epoch": 0, "last_seq": 0, "applied": 0, "turn_in": npc.turn_in,
            "damage": [], "xp": 0})
        self.assertGreater(state["turn_in"], 0)
        self.assertAlmostEqual(math.hypot(*state["dir"]), 1.0)

    def test_the_owned_area_follows_the_sidecars_handoff_rule(self):
        area = game.OwnedArea((1024.0, 1024.0), 32.0, [(0.0, 0.0, 512.0, 1024.0)], 1)
        self.assertEqual(area.chunks_outside(100.0, 100.0), 0)
        self.assertEqual(area.chunks_outside(512.01, 100.0), 1)  # a centimetre over the line
        self.assertFalse(area.release_due(543.9, 100.0))
        self.assertTrue(area.release_due(544.0, 100.0))
        self.assertEqual(area.chunks_outside(1000.0, 100.0), 1)  # across the seam
        self.assertIsNone(game.OwnedArea((1024.0, 1024.0), 32.0, [], 1).chunks_outside(600.0, 1.0))
        self.assertEqual(game.next_tick_at(1.05, 1000, 30), (2, 1.0 + 2 / 30))
        self.assertEqual(game.next_tick_at(1.1, 1000, 30)[0], 3)

    def test_an_npc_that_walks_out_of_the_area_is_released_with_its_state_then_frozen(self):
        area = game.OwnedArea((4096.0, 4096.0), 64.0, [(0.0, 0.0, 512.0, 4096.0)], 1)
        w = game.World(pb, (500.0, 700.0), 1, random.Random(7), (4096.0, 4096.0), area)
        reserve = bodies(w.tick(0.05), "reserve_ids")[0]
        w.handle(sidecar_msg(ids_reserved=pb.IdsReserved(
            request_id=reserve.request_id, ids=range(100, 100 + reserve.count))))
        w.tick(0.05)
        npc = w.npcs[0]
        self.assertFalse(bodies(w.tick(0.05), "release"), "inside the area: kept")
        npc.x, npc.vx, npc.vy, npc.turn_in = 700.0, game.NPC_SPEED, 0.0, 10  # 3 chunks past the line
        messages = w.tick(0.05)
        [release] = for_entity(messages, "release", npc.id)
        kinds = [m.WhichOneof("body") for m in messages]
        self.assertLess(kinds.index("update"), kinds.index("release"), "its last move first")
        state = self.decoded(release)
        self.assertEqual(state["pos"], [npc.x, npc.y, 0.0])
        self.assertEqual(release.entity_epoch, npc.epoch)
        self.assertTrue(npc.frozen)
        self.assertEqual(w.released, 1)
        self.assertFalse(for_entity(w.tick(0.05), "update", npc.id), "frozen once released")
        # Kept by the sidecar: it moves again, and is not released again before the back-off.
        w.handle(sidecar_msg(thaw=pb.Thaw(entity_id=npc.id, reason="released, but kept")))
        self.assertEqual(w.releases_kept, 1)
        for _ in range(game.RELEASE_BACKOFF_TICKS - 1):
            npc.vx, npc.vy = game.NPC_SPEED, 0.0
            messages = w.tick(0.05)
            self.assertTrue(for_entity(messages, "update", npc.id))
            self.assertFalse(for_entity(messages, "release", npc.id))

    def test_a_players_avatar_is_never_released(self):
        w, alice = self.walking()
        w.area = game.OwnedArea((4096.0, 4096.0), 64.0, [(0.0, 0.0, 64.0, 64.0)], 0)
        alice.x = 2000.0
        self.assertFalse(bodies(w.tick(0.1), "release"))
        self.assertFalse(alice.frozen)

    def test_thaw_resumes_moving_and_writing(self):
        w, alice = self.walking()
        w.handle(freeze(alice.id, 7))
        w.tick(0.1)
        x = alice.x
        w.handle(sidecar_msg(thaw=pb.Thaw(entity_id=alice.id, reason="target does not own the position")))
        [update] = for_entity(w.tick(0.1), "update", alice.id)
        self.assertAlmostEqual(update.position.x - x, 0.3)
        w.handle(move("alice", 1, 42, 0.0, 0.0))
        self.assertEqual(components(for_entity(w.tick(0.1), "update", alice.id)[0])[game.INPUT_ACK][0],
                         struct.pack(">QQ", 42, 2))

    def test_a_player_who_left_while_frozen_is_despawned_only_if_thawed(self):
        w, alice = self.walking()
        w.handle(freeze(alice.id, 7))
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=1)))
        self.assertEqual(bodies(w.tick(0.1), "despawn"), [])
        w.handle(sidecar_msg(thaw=pb.Thaw(entity_id=alice.id)))
        self.assertEqual([d.entity_id for d in bodies(w.tick(0.1), "despawn")], [alice.id])
        self.assertNotIn("alice", w.players)

    def test_evict_forgets_silently_and_the_player_is_simulated_elsewhere(self):
        w, alice = self.walking()
        w.handle(freeze(alice.id, 7))
        w.tick(0.1)
        w.handle(sidecar_msg(evict=pb.Evict(entity_id=alice.id)))
        self.assertEqual([m.WhichOneof("body") for m in w.tick(0.1)], ["tick_end"])
        self.assertIsNone(w.entity(alice.id))
        self.assertEqual(w.entity_count(), 0)

        # Its leave and its input now belong to the game it moved to.
        w.handle(move("alice", 1, 42, 1.0, 0.0))
        w.handle(sidecar_msg(player_leave=pb.PlayerLeave(account="alice", session_epoch=1)))
        self.assertEqual([m.WhichOneof("body") for m in w.tick(0.1)], ["tick_end"])

        # It comes back as a ghost: a read-only copy of a foreign entity.
        w.handle(ghost_enter(alice.id, alice.x, alice.y))
        w.handle(sidecar_msg(ghost_update=pb.GhostUpdate(entity_id=alice.id, position=pb.Vec3(x=9.0, y=8.0))))
        self.assertEqual((w.ghosts[alice.id].x, w.ghosts[alice.id].y), (9.0, 8.0))
        self.assertEqual([m.WhichOneof("body") for m in w.tick(0.1)], ["tick_end"])

    def test_evict_of_an_npc_removes_it_without_despawn(self):
        w = self.world(npcs=2)
        w.tick(0.05)
        gone, kept = w.npcs
        w.handle(freeze(gone.id, 2))
        w.tick(0.05)
        w.handle(sidecar_msg(evict=pb.Evict(entity_id=gone.id)))
        out = w.tick(0.05)
        self.assertEqual(bodies(out, "despawn"), [])
        self.assertEqual([u.entity_id for u in bodies(out, "update")], [kept.id])
        self.assertEqual(w.npcs, [kept])

    def test_adopts_a_player_from_an_arena_snapshot_and_continues_its_inputs(self):
        w = self.world(npcs=0)
        w.handle(ghost_enter(9001, 0.25, 10.0))
        w.handle(adopt(9001, 4, ARENA_PLAYER, (0.25, 10.0), owner="bob", is_master=True))
        out = w.tick(0.1)
        self.assertEqual(bodies(out, "spawn"), [])
        self.assertEqual([(a.entity_id, a.entity_epoch) for a in bodies(out, "adopted")], [(9001, 4)])
        self.assertNotIn(9001, w.ghosts)
        bob = w.players["bob"]
        self.assertEqual(bob.components, {
            game.KIND: (b"player:bob", pb.PUBLIC_IN_RANGE),
            game.HEALTH: (struct.pack(">II", 90, 100), pb.OWNER_AND_PARTY),
            game.INVENTORY: (b"sword,bread,10 gold", pb.OWNER_ONLY),
            game.INPUT_ACK: (struct.pack(">QQ", 17, 12), pb.OWNER_ONLY)})
        # Adopted, then written as usual: bob keeps walking east, and his acknowledgement is re-sent.
        order = [m.WhichOneof("body") for m in out]
        self.assertLess(order.index("adopted"), order.index("update"))
        [update] = for_entity(out, "update", 9001)
        self.assertAlmostEqual(update.position.x, 0.75)
        self.assertEqual(components(update), {game.INPUT_ACK: (struct.pack(">QQ", 17, 12), pb.OWNER_ONLY)})

        # The arena applied 17 already: a replay of it is a duplicate; 18 turns him west over the seam.
        w.handle(move("bob", 3, 17, 0.0, 1.0))
        w.handle(move("bob", 3, 18, -1.0, 0.0))
        [update] = for_entity(w.tick(0.4), "update", 9001)
        self.assertEqual(w.inputs_duplicate, 1)
        self.assertAlmostEqual(update.position.x, 4094.75)
        self.assertAlmostEqual(update.position.y, 10.0)
        self.assertEqual(components(update), {game.INPUT_ACK: (struct.pack(">QQ", 18, 13), pb.OWNER_ONLY)})

    def test_adopts_an_npc_that_keeps_its_heading_and_ignores_unknown_fields(self):
        w = self.world(npcs=0)
        w.handle(adopt(77, 2, ARENA_NPC, (800.0, 900.0)))
        out = w.tick(0.1)
        self.assertEqual([a.entity_id for a in bodies(out, "adopted")], [77])
        [npc] = w.npcs
        self.assertEqual(npc.components, {game.KIND: (b"npc:wanderer-3", pb.PUBLIC_IN_RANGE),
                                          game.HEALTH: (struct.pack(">II", 50, 50), pb.PUBLIC_IN_RANGE)})
        self.assertEqual(len(for_entity(out, "update", 77)[0].changed), 0)
        w.tick(0.1)
        self.assertAlmostEqual(npc.x, 800.0)
        self.assertAlmostEqual(npc.y, 900.4)  # turn_in 3: north on the adoption tick and the next...
        w.tick(0.1)
        self.assertNotAlmostEqual(npc.vy, game.NPC_SPEED)  # ...and a new heading on the third
        self.assertAlmostEqual(math.hypot(npc.vx, npc.vy), game.NPC_SPEED)

    def test_a_replayed_adopt_is_answered_again_without_a_second_copy(self):
        w = self.world(npcs=0)
        message = adopt(9001, 4, ARENA_PLAYER, (0.25, 10.0), owner="bob", is_master=True)
        w.handle(message)
        w.tick(0.1)
        w.handle(message)
        out = w.tick(0.1)
        self.assertEqual([(a.entity_id, a.entity_epoch) for a in bodies(out, "adopted")], [(9001, 4)])
        self.assertEqual(bodies(out, "spawn"), [])
        self.assertEqual(w.entity_count(), 1)
        self.assertAlmostEqual(w.players["bob"].x, 1.25)  # one copy, walking on

    def test_adopt_of_an_entity_held_frozen_takes_it_back(self):
        w, alice = self.walking()
        w.handle(freeze(alice.id, 7))
        snapshot = bodies(w.tick(0.1), "snapshot")[0]
        # The handoff target died; this node got its area back and adopts from the snapshot.
        w.handle(adopt(alice.id, 8, snapshot.state, (alice.x, alice.y), owner="alice", is_master=True))
        out = w.tick(0.1)
        self.assertEqual([(a.entity_id, a.entity_epoch) for a in bodies(out, "adopted")], [(alice.id, 8)])
        self.assertEqual(len(for_entity(out, "update", alice.id)), 1)
        self.assertEqual(w.entity_count(), 1)

    def test_a_snapshot_of_this_game_round_trips_through_adopt(self):
        source, alice = self.walking()
        source.handle(sidecar_msg(player_join=pb.PlayerJoin(account="alice", session_epoch=2)))
        source.handle(freeze(alice.id, 7))
        state = self.decoded(bodies(source.tick(0.1), "snapshot")[0])
        self.assertEqual(state["session_epoch"], 2)

        target = self.world(npcs=0, center=(3000.0, 3000.0))
        target.handle(adopt(alice.id, 8, json.dumps(state).encode(), state["pos"][:2], owner="alice",
                            is_master=True))
        self.assertEqual(bodies(target.tick(0.1), "adopted")[0].entity_id, alice.id)
        adopted = target.players["alice"]
        self.assertEqual(adopted.components, alice.components)
        self.assertAlmostEqual(adopted.x, alice.x + 0.3)
        self.assertAlmostEqual(adopted.y, alice.y + 0.4)
        target.handle(freeze(alice.id, 9))
        again = self.decoded(bodies(target.tick(0.1), "snapshot")[0])
        for axis in range(2):
            self.assertAlmostEqual(again["dir"][axis], state["dir"][axis])
        self.assertEqual({**again, "pos": None, "dir": None}, {**state, "pos": None, "dir": None})

    def test_an_unreadable_snapshot_is_not_adopted(self):
        good = json.loads(ARENA_PLAYER)
        cases = {
            b"\xff": "not UTF-8 JSON",
            b"{": "not UTF-8 JSON",
            b"[]": "expected a JSON object",
            json.dumps({**good, "turn_in": None}).encode(): "turn_in must be an integer",
            json.dumps({k: v for k, v in good.items() if k != "pos"}).encode(): "missing field(s) pos",
            json.dumps({**good, "v": 2}).encode(): "format version 2",
            json.dumps({**good, "kind": "dragon"}).encode(): "kind must be",
            json.dumps({**good, "health": [-1, 100]}).encode(): "health must be an integer",
            json.dumps({**good, "last_seq": "17"}).encode(): "last_seq must be an integer",
            json.dumps({**good, "dir": [1.0]}).encode(): "dir must be a list of 2 finite numbers",
            json.dumps({**good, "name": "carol"}).encode(): "adopted for account 'bob'",
            json.dumps({**good, "damage": "lots"}).encode(): "damage must be a list",
            json.dumps({**good, "damage": [["ann", -1, 3]]}).encode(): "damage avatar must be an integer",
            json.dumps({**good, "xp": -1}).encode(): "xp must be an integer",
        }
        w = self.world(npcs=0)
        for state, error in cases.items():
            with self.assertLogs("python-game", "ERROR") as logs:
                w.handle(adopt(9001, 4, state, (0.25, 10.0), owner="bob", is_master=True))
            self.assertIn(error, logs.output[0])
            self.assertEqual(bodies(w.tick(0.1), "adopted"), [])
            self.assertEqual(w.entity_count(), 0)

    def test_npcs_roam_across_the_world_seam(self):
        w = self.world(npcs=4, center=(4090.0, 3.0))
        seen = set()
        for _ in range(2000):
            w.tick(0.05)
            for npc in w.npcs:
                self.assertTrue(0 <= npc.x < 4096 and 0 <= npc.y < 4096, (npc.x, npc.y))
                dx = game.wrap_delta(npc.x - 4090.0, 4096.0)
                dy = game.wrap_delta(npc.y - 3.0, 4096.0)
                self.assertLess(math.hypot(dx, dy), game.NPC_ROAM_RADIUS + 1)
                seen.add((npc.x < 2048, npc.y < 2048))
        self.assertEqual(len(seen), 4)  # all four sides of both seams


class CombatTest(WorldCase):
    """Entity commands, in the Rust arena's convention (examples/arena/src/combat.rs)."""

    def replies(self, messages):
        return [(r.request_id, r.refused, r.detail) for r in bodies(messages, "command_reply")]

    def next_attack_tick(self, w):
        """The messages of the next tick in which avatars attack."""
        while w.tick_no % game.ATTACK_EVERY_TICKS:
            w.tick(0.05)
        return w.tick(0.05)

    def test_payloads_and_shares_are_the_arenas(self):
        self.assertEqual(game.encode_command(10, 1 << 40), bytes.fromhex("0000000a" "0000010000000000"))
        self.assertEqual(game.decode_command(game.encode_command(7, 2**64 - 1)), (7, 2**64 - 1))
        self.assertIsNone(game.decode_command(b"short"))
        table = {"ann": [3, 40], "bob": [2, 10]}
        self.assertEqual(game.share_out(table, 100), [("ann", 3, 80), ("bob", 2, 20)])
        self.assertEqual(table, {})
        self.assertEqual(game.share_out({"ann": [3, 1], "bob": [2, 999]}, 100),
                         [("ann", 3, 1), ("bob", 2, 99)], "everyone who hit gets some")
        self.assertEqual(game.share_out({}, 100), [])

    def test_an_npc_keeps_its_attackers_damage_and_a_kill_rewards_each_avatar(self):
        w = self.world(npcs=1)
        w.node_id = 2
        w.tick(0.05)
        npc = w.npcs[0]
        for i in range(1, 9):  # 80 damage from alice on node 1...
            w.handle(attack_in(npc.id, i, "alice", 900, from_node=1))
        w.handle(attack_in(npc.id, 9, "bob", 901, from_node=2))  # ...and 10 from bob, here
        w.handle(sidecar_msg(checkpoint=pb.Checkpoint(entity_ids=[npc.id])))
        out = w.tick(0.05)
        self.assertEqual(self.replies(out), [(i, False, "") for i in range(1, 10)])
        [update] = for_entity(out, "update", npc.id)
        self.assertEqual(components(update)[game.HEALTH], (struct.pack(">II", 10, 100), pb.PUBLIC_IN_RANGE))
        [state] = bodies(out, "checkpoint_state")
        self.assertEqual(self.decoded(state)["damage"], [["alice", 900, 80], ["bob", 901, 10]])

        w.handle(attack_in(npc.id, 10, "alice", 902))  # the kill, by alice's avatar as it is now
        out = w.tick(0.05)
        self.assertEqual(self.replies(out), [(10, False, "")])
        self.assertEqual(components(for_entity(out, "update", npc.id)[0])[game.HEALTH][0],
                         struct.pack(">II", 100, 100), "it rises again")
        rewards = bodies(out, "command")
        self.assertEqual([(c.target_entity, c.type, c.from_entity, game.decode_command(c.payload)[0])
                          for c in rewards], [(902, game.CMD_XP, npc.id, 90), (901, game.CMD_XP, npc.id, 10)])
        self.assertEqual(set(w.commands_waiting), {c.request_id for c in rewards})
        self.assertEqual(len(w.commands_waiting), 2, "a request id each")
        self.assertEqual(npc.damage, {}, "a new life")
        s = w.command_stats
        self.assertEqual((s["applied"], s["applied_from_other_nodes"], s["kills"], s["xp_sent"]),
                         (10, 9, 1, 2))

    def test_a_command_it_cannot_apply_is_refused_with_a_reason_and_each_is_answered_once(self):
        w, alice = self.walking()
        w.handle(adopt(77, 2, ARENA_NPC, (800.0, 900.0)))
        w.tick(0.05)
        w.handle(command_in(77, 7, b"", 1))
        w.handle(attack_in(alice.id, 2, "bob", 5))
        w.handle(command_in(77, game.CMD_XP, game.encode_command(5, 1), 3))
        w.handle(attack_in(4242, 4, "bob", 5))
        w.handle(command_in(77, game.CMD_ATTACK, b"\x00", 5))
        w.handle(attack_in(77, 0, "bob", 5, key=99))  # no result wanted: applied, not answered
        w.handle(freeze(77, 3))
        w.handle(attack_in(77, 6, "bob", 5))
        out = w.tick(0.05)
        self.assertEqual(self.replies(out), [
            (1, True, "unknown command type 7"), (2, True, "only NPCs are attacked"),
            (3, True, "only players gain XP"), (4, True, "no such entity here"),
            (5, True, "unreadable attack"), (6, True, "frozen")])
        self.assertEqual((w.command_stats["refused"], w.command_stats["applied"]), (6, 1))
        self.assertEqual(w.npcs[0].damage, {"bob": [5, 10]})
        self.assertEqual(json.loads(bodies(out, "snapshot")[0].state)["health"], [40, 50])

    def test_xp_goes_to_the_avatar_once_and_travels_in_its_snapshot(self):
        w, alice = self.walking()
        w.node_id = 2
        w.handle(command_in(alice.id, game.CMD_XP, game.encode_command(30, 7), 1, from_node=1))
        with self.assertLogs("python-game", "WARNING") as logs:  # the same reward again: a broken promise
            w.handle(command_in(alice.id, game.CMD_XP, game.encode_command(30, 7), 2, from_node=1))
        self.assertIn("came twice", logs.output[0])
        w.handle(freeze(alice.id, 7))
        out = w.tick(0.05)
        self.assertEqual(self.replies(out), [(1, False, ""), (2, False, "")])
        self.assertEqual(alice.xp, 30)
        s = w.command_stats
        self.assertEqual((s["xp_gained"], s["xp_from_other_nodes"], s["twice"]), (30, 1, 1))
        self.assertEqual(self.decoded(bodies(out, "snapshot")[0])["xp"], 30)

    def test_adopts_the_arenas_damage_table_and_xp_and_a_kill_rewards_the_attackers_before_the_handoff(self):
        w = self.world(npcs=0)
        w.handle(adopt(78, 2, ARENA_HURT_NPC, (800.0, 900.0)))
        bob = json.dumps({**json.loads(ARENA_PLAYER), "xp": 40}).encode()
        w.handle(adopt(9001, 4, bob, (0.25, 10.0), owner="bob", is_master=True))
        w.tick(0.05)
        [npc] = w.npcs
        self.assertEqual(npc.damage, {"ann": [7, 30], "bob": [8, 10]})
        self.assertEqual(w.players["bob"].xp, 40)
        for i in range(1, 7):  # 60 more damage from bob's avatar now
            w.handle(attack_in(78, i, "bob", 9001))
        rewards = bodies(w.tick(0.05), "command")
        self.assertEqual(sorted((c.target_entity, game.decode_command(c.payload)[0]) for c in rewards),
                         [(7, 30), (9001, 70)])

    def test_an_avatar_attacks_the_nearest_npc_in_reach_one_attack_at_a_time(self):
        w, alice = self.walking()
        alice.vx = alice.vy = 0.0
        x, y = alice.x, alice.y
        w.handle(ghost_enter(501, x + 25.0, y, kind=b"npc:wanderer-1"))  # another node's NPC, in reach
        w.handle(ghost_enter(502, x + 5.0, y, kind=b"player:bob"))  # players are not attacked
        w.handle(ghost_enter(503, x, y + 30.5, kind=b"npc:wanderer-2"))  # out of reach
        [attack] = bodies(self.next_attack_tick(w), "command")
        self.assertEqual((attack.target_entity, attack.type, attack.from_entity),
                         (501, game.CMD_ATTACK, alice.id))
        damage, key = game.decode_command(attack.payload)
        self.assertEqual(damage, game.DAMAGE)
        self.assertEqual(bodies(self.next_attack_tick(w), "command"), [], "one attack at a time")

        w.handle(adopt(77, 2, ARENA_NPC, (x - 10.0, y)))  # an NPC of this game's, nearer
        w.handle(result(attack.request_id, pb.COMMAND_OK, 501))
        [again] = bodies(self.next_attack_tick(w), "command")
        self.assertEqual(again.target_entity, 77)
        self.assertNotEqual(again.request_id, attack.request_id)
        self.assertNotEqual(game.decode_command(again.payload)[1], key)
        s = w.command_stats
        self.assertEqual((s["attacks_sent"], s["attacks_across_border"], s["results_ok"]), (2, 1, 1))

        w.handle(result(again.request_id, pb.TIMEOUT, 77))
        w.handle(freeze(alice.id, 5))
        self.assertEqual(bodies(self.next_attack_tick(w), "command"), [], "a frozen avatar does not attack")

    def test_each_result_is_counted_by_kind_and_a_second_one_is_unexpected(self):
        w = self.world(npcs=0)
        errors = [pb.COMMAND_OK, pb.REFUSED, pb.ENTITY_GONE, pb.TIMEOUT, pb.NOT_DELIVERED, 99]
        sent = [w._command(9000 + i, game.CMD_XP, game.encode_command(1, i), 0).command
                for i in range(len(errors))]
        self.assertEqual([c.request_id for c in sent], [1, 2, 3, 4, 5, 6])
        for c, error in zip(sent, errors):
            w.handle(result(c.request_id, error, c.target_entity))
        with self.assertLogs("python-game", "WARNING"):
            w.handle(result(1))
        figures = {k: int(v) for k, v in (word.split("=") for word in w.command_summary().split())}
        self.assertEqual(list(figures), [*game.COMMAND_FIGURES, "waiting"])
        self.assertEqual({k: v for k, v in figures.items() if v}, {
            "sent": 6, "results_ok": 1, "results_refused": 1, "results_entity_gone": 1, "results_timeout": 1,
            "results_not_delivered": 2, "results_unexpected": 1})


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
            self.assertEqual((hello.version.major, hello.version.minor, hello.tick_rate_hz, hello.game),
                             (1, 4, 20, "python-game"))
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

            # Commands: one to an NPC from another node is applied and answered, an unknown one refused;
            # alice attacks an NPC near her (she stands next to the center) and gets her result.
            npc = next(s.entity_id for s in bodies(spawned, "spawn") if not s.owner_account)
            await sc.send(attack_in(npc, 70, "bob", 5, from_node=3), command_in(npc, 9, b"", 71))
            replies = await sc.recv_until(lambda m: bodies(m, "command_reply"))
            self.assertEqual([(r.request_id, r.refused) for r in bodies(replies, "command_reply")],
                             [(70, False), (71, True)])
            while not (attacks := bodies([m for f in sc.frames for m in f.messages], "command")):
                await sc.recv()
            await sc.send(result(attacks[0].request_id, pb.COMMAND_OK, attacks[0].target_entity))

        code, stderr, sidecar = asyncio.run(run_game(script, "--npcs", "2", "--duration", "3"))
        self.assertEqual(code, 0, stderr)
        self.assertIn("UNKNOWN_ENTITY", stderr)
        self.assertRegex(stderr, r"commands: sent=\d+ attacks_sent=\d+ .*results_ok=1 .*"
                                 r"applied=1 applied_from_other_nodes=1 refused=1 twice=0 ")
        ticks = [m.tick_end.tick for f in sidecar.frames for m in f.messages if m.HasField("tick_end")]
        self.assertEqual(ticks, list(range(1, len(ticks) + 1)))
        self.assertTrue(all(sum(m.HasField("tick_end") for m in f.messages) == 1 for f in sidecar.frames[1:]))
        self.assertEqual(sidecar.connections, 1)

    def test_hands_an_npc_over_and_adopts_a_player_over_the_socket(self):
        async def script(sc):
            await sc.recv()
            welcome = pb.Welcome(version=pb.ProtocolVersion(major=1),
                                 world=pb.WorldShape(width=4096, height=4096, chunk_size=64))
            await sc.send(sidecar_msg(welcome=welcome))
            reserve = bodies(await sc.recv(), "reserve_ids")[0]
            await sc.send(sidecar_msg(ids_reserved=pb.IdsReserved(
                request_id=reserve.request_id, ids=range(1, reserve.count + 1))))
            npc = bodies(await sc.recv_until(lambda m: bodies(m, "spawn")), "spawn")[0].entity_id

            await sc.send(freeze(npc, 2))
            snapshot = bodies(await sc.recv_until(lambda m: bodies(m, "snapshot")), "snapshot")[0]
            self.assertEqual((snapshot.entity_id, snapshot.entity_epoch), (npc, 2))
            self.assertEqual(json.loads(snapshot.state)["kind"], "npc")
            for _ in range(3):
                self.assertEqual(for_entity(await sc.recv(), "update", npc), [])
            await sc.send(sidecar_msg(evict=pb.Evict(entity_id=npc)), ghost_enter(npc, 1.0, 2.0))

            await sc.send(adopt(9001, 4, ARENA_PLAYER, (0.25, 10.0), owner="bob", is_master=True))
            await sc.recv_until(lambda m: for_entity(m, "adopted", 9001))
            await sc.send(move("bob", 3, 18, 0.0, 1.0))
            await sc.recv_until(lambda m: any(
                components(u).get(game.INPUT_ACK, (None,))[0] == struct.pack(">QQ", 18, 13)
                for u in for_entity(m, "update", 9001)))
            sc.proc.send_signal(signal.SIGTERM)

        code, stderr, sidecar = asyncio.run(run_game(script, "--npcs", "1"))
        self.assertEqual(code, 0, stderr)
        sent = [m for f in sidecar.frames for m in f.messages]
        self.assertEqual(bodies(sent, "despawn"), [])
        self.assertEqual([s.entity_id for s in bodies(sent, "spawn")], [1])  # never the adopted player
        self.assertNotIn("ERROR", stderr)
        self.assertNotIn("WARNING", stderr)

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
