//! The sample games' own conventions for component payloads. cellmesh never looks inside these:
//! they are only what the arena, the Python sample and the bots agree on.

use bytes::Bytes;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects() {
        assert_eq!(parse_health(&health(7, 10)), Some((7, 10)));
        assert_eq!(parse_input(&input(1.0, -0.5)), Some((1.0, -0.5)));
        assert_eq!(parse_input(&input(f32::NAN, 0.0)), None);
        assert_eq!(parse_input(b"short"), None);
        assert_eq!(parse_input_ack(&input_ack(9, 3)), Some((9, 3)));
    }
}
