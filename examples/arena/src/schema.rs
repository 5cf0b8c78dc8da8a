//! The sample games' own conventions for component payloads. cellmesh never looks inside these:
//! they are only what the arena, the Python sample and the bots agree on.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// UTF-8 `player:<account>` or `npc:<name>`; public.
pub const KIND: u32 = 1;
/// u32 BE current, u32 BE max; public for NPCs, owner-and-party for players.
pub const HEALTH: u32 = 2;
/// UTF-8 comma-separated items; owner-only.
pub const INVENTORY: u32 = 3;
/// u64 BE last applied input seq, u64 BE inputs applied; owner-only.
pub const INPUT_ACK: u32 = 4;
/// Event type: an emote, payload UTF-8.
pub const EVENT_EMOTE: u32 = 1;

pub const PLAYER_SPEED: f64 = 5.0;
pub const NPC_SPEED: f64 = 2.0;

pub fn health(current: u32, max: u32) -> Bytes {
    let mut b = Vec::with_capacity(8);
    b.extend_from_slice(&current.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b.into()
}

pub fn parse_health(b: &[u8]) -> Option<(u32, u32)> {
    let b: &[u8; 8] = b.try_into().ok()?;
    Some((
        u32::from_be_bytes(b[0..4].try_into().ok()?),
        u32::from_be_bytes(b[4..8].try_into().ok()?),
    ))
}

/// A walking direction; the game normalises it, zero stops.
pub fn input(dx: f32, dy: f32) -> Bytes {
    let mut b = Vec::with_capacity(8);
    b.extend_from_slice(&dx.to_be_bytes());
    b.extend_from_slice(&dy.to_be_bytes());
    b.into()
}

pub fn parse_input(b: &[u8]) -> Option<(f32, f32)> {
    let b: &[u8; 8] = b.try_into().ok()?;
    let dx = f32::from_be_bytes(b[0..4].try_into().ok()?);
    let dy = f32::from_be_bytes(b[4..8].try_into().ok()?);
    (dx.is_finite() && dy.is_finite()).then_some((dx, dy))
}

pub fn input_ack(last_seq: u64, applied: u64) -> Bytes {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&last_seq.to_be_bytes());
    b.extend_from_slice(&applied.to_be_bytes());
    b.into()
}

pub fn parse_input_ack(b: &[u8]) -> Option<(u64, u64)> {
    let b: &[u8; 16] = b.try_into().ok()?;
    Some((
        u64::from_be_bytes(b[0..8].try_into().ok()?),
        u64::from_be_bytes(b[8..16].try_into().ok()?),
    ))
}

/// Version of [`SampleSnapshot`]'s format.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Which sort of entity a snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    Player,
    Npc,
}

/// The complete state of one sample-game entity, handed from one game to another through the
/// sidecars (`Snapshot.state` -> `Adopt.state`). UTF-8 JSON, shared with the Python sample so
/// either game adopts what the other froze. Every field is required; unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleSnapshot {
    pub v: u32,
    pub kind: SnapshotKind,
    /// The account of a player, the name of an NPC (`wanderer-3`).
    pub name: String,
    pub pos: [f64; 3],
    /// Walking direction, a unit vector or zero.
    pub dir: [f64; 2],
    /// Current, max.
    pub health: [u32; 2],
    /// Comma-separated items; empty for NPCs.
    pub inventory: String,
    /// 0 for NPCs.
    pub session_epoch: u64,
    /// The last input seq applied: an input at or below it is a duplicate.
    pub last_seq: u64,
    /// Inputs applied so far.
    pub applied: u64,
    /// Ticks until an NPC picks a new direction; 0 for players.
    pub turn_in: u32,
    /// An NPC's damage table: (account, avatar id, damage) of everyone who hit it since it
    /// last died. Absent from older snapshots.
    #[serde(default)]
    pub damage: Vec<(String, u64, u32)>,
    /// A player's experience. Absent from older snapshots.
    #[serde(default)]
    pub xp: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot is not a sample snapshot: {0}")]
    Json(#[from] serde_json::Error),
    #[error("snapshot format version {0}, this game reads version {SNAPSHOT_VERSION}")]
    Version(u32),
    #[error("snapshot holds a non-finite position or direction")]
    NotFinite,
}

impl SampleSnapshot {
    pub fn encode(&self) -> Bytes {
        serde_json::to_vec(self)
            .expect("a snapshot of plain numbers and strings always serialises")
            .into()
    }

    pub fn decode(state: &[u8]) -> Result<Self, SnapshotError> {
        let s: Self = serde_json::from_slice(state)?;
        if s.v != SNAPSHOT_VERSION {
            return Err(SnapshotError::Version(s.v));
        }
        if !s.pos.iter().chain(&s.dir).all(|c| c.is_finite()) {
            return Err(SnapshotError::NotFinite);
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn player() -> SampleSnapshot {
        SampleSnapshot {
            v: SNAPSHOT_VERSION,
            kind: SnapshotKind::Player,
            name: "ann".into(),
            pos: [999.5, 0.25, 3.0],
            dir: [0.6, -0.8],
            health: [90, 100],
            inventory: "sword,bread,10 gold".into(),
            session_epoch: 4,
            last_seq: 17,
            applied: 15,
            turn_in: 0,
            damage: vec![],
            xp: 40,
        }
    }

    #[test]
    fn snapshot_round_trips() {
        let s = player();
        assert_eq!(SampleSnapshot::decode(&s.encode()).unwrap(), s);
        let npc = SampleSnapshot {
            kind: SnapshotKind::Npc,
            name: "wanderer-3".into(),
            inventory: String::new(),
            session_epoch: 0,
            turn_in: 12,
            ..player()
        };
        assert_eq!(SampleSnapshot::decode(&npc.encode()).unwrap(), npc);
    }

    #[test]
    fn snapshot_reads_what_another_game_writes() {
        // Integers where floats are expected, and a field this game does not know.
        let json = br#"{"v":1,"kind":"npc","name":"wanderer-1","pos":[1,2,0],"dir":[0,1],
            "health":[50,50],"inventory":"","session_epoch":0,"last_seq":0,"applied":0,
            "turn_in":7,"mood":"calm"}"#;
        let s = SampleSnapshot::decode(json).unwrap();
        assert_eq!(s.kind, SnapshotKind::Npc);
        assert_eq!((s.pos, s.dir, s.turn_in), ([1.0, 2.0, 0.0], [0.0, 1.0], 7));
    }

    #[test]
    fn snapshot_rejects_what_it_cannot_adopt() {
        let mut v = serde_json::to_value(player()).unwrap();
        v.as_object_mut().unwrap().remove("last_seq");
        let missing = serde_json::to_vec(&v).unwrap();
        assert!(matches!(
            SampleSnapshot::decode(&missing),
            Err(SnapshotError::Json(_))
        ));
        let newer = SampleSnapshot { v: 2, ..player() };
        assert!(matches!(
            SampleSnapshot::decode(&newer.encode()),
            Err(SnapshotError::Version(2))
        ));
        assert!(SampleSnapshot::decode(b"\xff not json").is_err());
        let nan = SampleSnapshot {
            pos: [f64::NAN, 0.0, 0.0],
            ..player()
        };
        // JSON has no NaN: it is written as null and refused on the way in.
        assert!(SampleSnapshot::decode(&nan.encode()).is_err());
    }

    #[test]
    fn round_trips_and_rejects() {
        assert_eq!(parse_health(&health(7, 10)), Some((7, 10)));
        assert_eq!(parse_input(&input(1.0, -0.5)), Some((1.0, -0.5)));
        assert_eq!(parse_input(&input(f32::NAN, 0.0)), None);
        assert_eq!(parse_input(b"short"), None);
        assert_eq!(parse_input_ack(&input_ack(9, 3)), Some((9, 3)));
    }
}
