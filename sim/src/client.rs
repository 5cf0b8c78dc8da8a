//! Simulated players: a session on a gateway, the view they are sent (decoded from the real edge
//! batches), and the inputs they send once they see their avatar.

use std::collections::BTreeMap;

use bytes::Bytes;
use cellmesh_proto::edge::{server_message, DeltaKind, ServerFrame};
use cellmesh_world::geometry::{ChunkPos, Pos, WorldShape};
use cellmesh_world::partition::NodeId;
use prost::Message;
use rand::rngs::StdRng;
use rand::Rng;

/// A vanish this soon after an appear of the same entity (or the reverse) is a flap.
const FLAP_MS: u64 = 1_000;

pub(crate) struct Client {
    pub account: String,
    /// The proxy it plays through (an index), and its connection there (0: none).
    pub proxy: usize,
    pub conn: u64,
    /// Sent to another geo: its connection closes, and it connects there.
    pub leaving: bool,
    /// The gateway its proxy attached its session on, as the `Welcome` says.
    pub gateway: NodeId,
    pub epoch: Option<u64>,
    /// Kicked or displaced: this session is over; nothing it sees is checked any more.
    pub ended: bool,
    /// Entities in view: id -> last position the client was told.
    pub seen: BTreeMap<u64, (f64, f64)>,
    /// When each entity last vanished from this client's view.
    pub vanished_at: BTreeMap<u64, u64>,
    pub avatar: Option<u64>,
    /// Handed over to another geo with this avatar: the new session must find the same one.
    pub keep_avatar: Option<u64>,
    /// The next input's sequence number (per account, across sessions).
    pub next_seq: u64,
    pub waypoint: (f64, f64),
    pub waypoint_until: u64,
    /// Its waypoints are drawn in this square (centre, side in metres) rather than the world.
    pub roams: Option<((f64, f64), f64)>,
    pub halted: bool,
    /// Entities that reappeared within a second of vanishing (not an error by itself: an entity
    /// may leave and re-enter the view's edge).
    pub flaps: u64,
}

impl Client {
    pub fn new(account: String) -> Self {
        Self {
            account,
            proxy: 0,
            conn: 0,
            leaving: false,
            gateway: 0,
            epoch: None,
            ended: true,
            seen: BTreeMap::new(),
            vanished_at: BTreeMap::new(),
            avatar: None,
            keep_avatar: None,
            next_seq: 1,
            waypoint: (0.0, 0.0),
            waypoint_until: 0,
            roams: None,
            halted: false,
            flaps: 0,
        }
    }

    /// A session (new, or moved by its proxy) on `gateway`: the view starts empty.
    pub fn begin(&mut self, gateway: NodeId) {
        self.gateway = gateway;
        self.epoch = None;
        self.ended = false;
        self.seen.clear();
        self.vanished_at.clear();
        self.avatar = None;
    }

    /// The next input to send: (seq, payload), walking towards a waypoint that changes every
    /// few seconds (so players cross borders both ways); a halted client stands still.
    pub fn next_input(
        &mut self,
        now: u64,
        world: &WorldShape,
        rng: &mut StdRng,
    ) -> Option<(u64, Bytes)> {
        if self.ended || self.epoch.is_none() {
            return None;
        }
        let me = self.avatar.and_then(|id| self.seen.get(&id).copied())?;
        let (dx, dy) = if self.halted {
            (0.0, 0.0)
        } else {
            if now >= self.waypoint_until {
                self.waypoint = match self.roams {
                    Some(((x, y), side)) => {
                        let p = world.normalise(Pos {
                            x: x + (rng.random::<f64>() - 0.5) * side,
                            y: y + (rng.random::<f64>() - 0.5) * side,
                        });
                        (p.x, p.y)
                    }
                    None => (
                        rng.random_range(0.0..world.width),
                        rng.random_range(0.0..world.height),
                    ),
                };
                self.waypoint_until = now + rng.random_range(2_000..6_000);
            }
            world.delta(
                Pos { x: me.0, y: me.1 },
                Pos {
                    x: self.waypoint.0,
                    y: self.waypoint.1,
                },
            )
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        Some((seq, cellmesh_arena::schema::input(dx as f32, dy as f32)))
    }

    /// Applies a frame's batches from the gateway, each batch's deltas in order (an entity may
    /// vanish and appear again within one). `truth` tells where an entity really is (if any game
    /// holds it), and `avatar_at` where this client's avatar is. Returns what looks wrong.
    pub fn on_frame(
        &mut self,
        now: u64,
        bytes: &Bytes,
        world: &WorldShape,
        inside_view: i64,
        truth: impl Fn(u64) -> Option<(f64, f64)>,
        avatar_at: &[(f64, f64)],
    ) -> Vec<String> {
        let mut wrong = Vec::new();
        let frame = match ServerFrame::decode(bytes.clone()) {
            Ok(f) => f,
            Err(e) => {
                wrong.push(format!("{}: undecodable batch: {e}", self.account));
                return wrong;
            }
        };
        // The view follows the avatar as the gateway shows it: where this very frame moves the
        // avatar counts too (a view re-anchored after an outage, while the avatar's game is down
        // and its true place unknown, moves in the same batch as the avatar does).
        let moved_to = self.avatar.and_then(|me| {
            frame
                .messages
                .iter()
                .filter_map(|m| match &m.body {
                    Some(server_message::Body::Batch(b)) => Some(b),
                    _ => None,
                })
                .flat_map(|b| &b.deltas)
                .filter(|d| d.entity_id == me)
                .filter_map(|d| d.position.as_ref().map(|p| (p.x, p.y)))
                .last()
        });
        let avatar_at: Vec<(f64, f64)> = avatar_at.iter().copied().chain(moved_to).collect();
        for m in frame.messages {
            let Some(server_message::Body::Batch(batch)) = m.body else {
                continue;
            };
            for d in batch.deltas {
                let id = d.entity_id;
                match DeltaKind::try_from(d.kind) {
                    Ok(DeltaKind::Appear) => {
                        let p = d.position.map(|p| (p.x, p.y)).unwrap_or_default();
                        if self.seen.insert(id, p).is_some() {
                            wrong.push(format!("{}: entity {id} appeared twice", self.account));
                        }
                        if d.owner_account == self.account {
                            self.avatar = Some(id);
                            if let Some(kept) = self.keep_avatar.take() {
                                if kept != id {
                                    wrong.push(format!(
                                        "{}: handed over with avatar {kept}, found avatar {id} instead",
                                        self.account
                                    ));
                                }
                            }
                        }
                        if self.vanished_at.get(&id).is_some_and(|t| now < t + FLAP_MS) {
                            self.flaps += 1;
                        }
                    }
                    Ok(DeltaKind::Update) => {
                        if let Some(p) = d.position {
                            if let Some(s) = self.seen.get_mut(&id) {
                                *s = (p.x, p.y);
                            }
                        }
                    }
                    Ok(DeltaKind::Vanish) => {
                        let shown = self.seen.remove(&id);
                        self.vanished_at.insert(id, now);
                        let Some(at) = truth(id) else {
                            continue; // gone from every game: a real vanish
                        };
                        if Some(id) == self.avatar {
                            wrong.push(format!(
                                "{}: its own avatar {id} vanished while it exists at ({:.0}, {:.0})",
                                self.account, at.0, at.1
                            ));
                            continue;
                        }
                        // Where it is and where the client last saw it (a stale ghost stands
                        // still): only a vanish close to both is wrong.
                        let d = avatar_at
                            .iter()
                            .flat_map(|me| {
                                [Some(at), shown].into_iter().flatten().map(move |p| {
                                    world.chunk_distance(chunk(world, *me), chunk(world, p))
                                })
                            })
                            .max();
                        if let Some(d) = d {
                            if d <= inside_view {
                                wrong.push(format!(
                                    "{}: entity {id} vanished {d} chunks from the avatar, well inside the view",
                                    self.account
                                ));
                            }
                        }
                    }
                    Err(_) => {
                        wrong.push(format!("{}: unknown delta kind {}", self.account, d.kind))
                    }
                }
            }
        }
        wrong
    }
}

fn chunk(world: &WorldShape, p: (f64, f64)) -> ChunkPos {
    world.chunk_of(Pos { x: p.0, y: p.1 })
}

#[cfg(test)]
mod tests {
    use cellmesh_proto::edge::{Batch, EntityDelta, ServerMessage, Vec3};

    use super::*;

    const WORLD: WorldShape = WorldShape {
        width: 512.0,
        height: 512.0,
        chunk_size: 32.0,
        region_size: 256.0,
    };
    const AVATAR: u64 = 1;
    const NPC: u64 = 2;

    fn delta(id: u64, kind: DeltaKind, at: Option<(f64, f64)>, owner: &str) -> EntityDelta {
        EntityDelta {
            entity_id: id,
            kind: kind as i32,
            position: at.map(|(x, y)| Vec3 { x, y, z: 0.0 }),
            owner_account: owner.into(),
            ..Default::default()
        }
    }

    fn frame(deltas: Vec<EntityDelta>) -> Bytes {
        ServerFrame {
            messages: vec![ServerMessage {
                body: Some(server_message::Body::Batch(Batch {
                    deltas,
                    ..Default::default()
                })),
            }],
        }
        .encode_to_vec()
        .into()
    }

    /// The avatar and an NPC 3 chunks from it, both shown; the avatar's game is down, so only
    /// where the client saw the avatar is known.
    fn client_seeing_both() -> Client {
        let mut c = Client::new("alice".into());
        c.begin(1);
        let shown = frame(vec![
            delta(AVATAR, DeltaKind::Appear, Some((336.0, 400.0)), "alice"),
            delta(NPC, DeltaKind::Appear, Some((336.0, 304.0)), ""),
        ]);
        assert!(c
            .on_frame(0, &shown, &WORLD, 3, |_| None, &[(336.0, 400.0)])
            .is_empty());
        c
    }

    /// commands seed 556: after an outage the gateway's view moved with the avatar, and the NPC
    /// left the view, in one batch; the check measured from where the avatar stood before it.
    #[test]
    fn a_vanish_in_the_batch_that_moves_the_avatar_far_away_is_no_error() {
        let mut c = client_seeing_both();
        let npc_at = |id| (id == NPC).then_some((336.0, 304.0));
        let moved_away = frame(vec![
            delta(AVATAR, DeltaKind::Update, Some((336.0, 7.0)), ""),
            delta(NPC, DeltaKind::Vanish, None, ""),
        ]);
        let wrong = c.on_frame(10, &moved_away, &WORLD, 3, npc_at, &[(336.0, 400.0)]);
        assert!(wrong.is_empty(), "{wrong:?}");
    }

    #[test]
    fn a_vanish_near_the_avatar_before_and_after_its_move_is_an_error() {
        let mut c = client_seeing_both();
        let npc_at = |id| (id == NPC).then_some((336.0, 304.0));
        let moved_a_little = frame(vec![
            delta(AVATAR, DeltaKind::Update, Some((336.0, 380.0)), ""),
            delta(NPC, DeltaKind::Vanish, None, ""),
        ]);
        let wrong = c.on_frame(10, &moved_a_little, &WORLD, 3, npc_at, &[(336.0, 400.0)]);
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(wrong[0].contains("well inside the view"));
    }
}
