//! The criterion micro-benchmarks' shared helpers (deterministic inputs, so two runs measure the
//! same work), and in [`load`] the cluster load generator behind `cellmesh bench`.

pub mod load;

use bytes::Bytes;
use cellmesh_sidecar::model::audience::Audience;
use cellmesh_sidecar::model::entities::{Component, NewEntity, Position};
use cellmesh_world::geometry::{Pos, WorldShape};

/// Chunk size of every benchmark world, as in the default world.
pub const CHUNK: f64 = 32.0;

/// Payload bytes of a typical component, event or snapshot piece (a few dozen bytes).
pub const PAYLOAD: usize = 32;

/// xorshift64*: deterministic, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // Zero is xorshift's one fixed point.
        Self(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A square torus of `chunks` × `chunks` chunks of [`CHUNK`] metres, one region wide.
pub fn square_world(chunks: u32) -> WorldShape {
    let side = f64::from(chunks) * CHUNK;
    WorldShape {
        width: side,
        height: side,
        chunk_size: CHUNK,
        region_size: side,
    }
}

/// `n` positions spread uniformly over the world.
pub fn positions(shape: &WorldShape, n: usize, seed: u64) -> Vec<Pos> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| Pos {
            x: rng.unit() * shape.width,
            y: rng.unit() * shape.height,
        })
        .collect()
}

/// The account name of player `i`.
pub fn account(i: usize) -> String {
    format!("player-{i:04}")
}

/// [`PAYLOAD`] bytes, different per `seed`.
pub fn payload(seed: u64) -> Bytes {
    (0..PAYLOAD as u64)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

pub fn component(audience: Audience, seed: u64) -> Component {
    Component {
        audience,
        payload: payload(seed),
    }
}

/// An NPC as a game spawns it: a public appearance (type 1) and public health (type 2).
pub fn npc(id: u64, at: Pos) -> NewEntity {
    NewEntity {
        id,
        position: Position::new(at.x, at.y, 0.0),
        components: vec![
            (1, component(Audience::PublicInRange, id)),
            (2, component(Audience::PublicInRange, id + 1)),
        ],
        epoch: 1,
        ..Default::default()
    }
}

/// The avatar of `account`: public appearance (type 1) and a type 2 component under `audience`.
pub fn avatar(id: u64, account: &str, at: Pos, audience: Audience) -> NewEntity {
    NewEntity {
        id,
        position: Position::new(at.x, at.y, 0.0),
        owner_account: account.to_string(),
        is_master: true,
        components: vec![
            (1, component(Audience::PublicInRange, id)),
            (2, component(audience, id + 1)),
        ],
        epoch: 1,
        ..Default::default()
    }
}
