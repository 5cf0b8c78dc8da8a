//! Combat across borders, on entity commands: a player attacks the nearest NPC in reach,
//! whichever node simulates it (its own, or one it sees as a ghost); the NPC's writer keeps its
//! damage table (which travels in its snapshot); the kill's XP goes to every attacker's avatar,
//! again by command, wherever that avatar is simulated.
//!
//! The payloads are the sample games' own convention (cellmesh never reads them).

use std::collections::BTreeMap;

use bytes::Bytes;

/// Command type: an attack. Payload: u32 BE damage, u64 BE attack id.
pub const CMD_ATTACK: u32 = 1;
/// Command type: experience for a kill. Payload: u32 BE XP, u64 BE attack id of the kill.
pub const CMD_XP: u32 = 2;

/// Damage of one attack.
pub const DAMAGE: u32 = 10;
/// XP a kill shares among its attackers, by damage dealt.
pub const KILL_XP: u32 = 100;
/// How far a player reaches with an attack (metres).
pub const REACH_M: f64 = 30.0;
/// A player attacks at most this often (ticks).
pub const ATTACK_EVERY_TICKS: u64 = 10;

pub fn encode(amount: u32, attack_id: u64) -> Bytes {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&amount.to_be_bytes());
    b.extend_from_slice(&attack_id.to_be_bytes());
    b.into()
}

pub fn decode(b: &[u8]) -> Option<(u32, u64)> {
    let b: &[u8; 12] = b.try_into().ok()?;
    Some((
        u32::from_be_bytes(b[0..4].try_into().ok()?),
        u64::from_be_bytes(b[4..12].try_into().ok()?),
    ))
}

/// One attacker's share of an NPC's damage: its account, its avatar's id, the damage dealt.
pub type Share = (String, u64, u32);

/// An NPC's damage table: everyone who hit it since it last died.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DamageTable {
    by_account: BTreeMap<String, (u64, u32)>,
}

impl DamageTable {
    pub fn from_shares(shares: &[Share]) -> Self {
        Self {
            by_account: shares
                .iter()
                .map(|(a, avatar, d)| (a.clone(), (*avatar, *d)))
                .collect(),
        }
    }

    pub fn shares(&self) -> Vec<Share> {
        self.by_account
            .iter()
            .map(|(a, (avatar, d))| (a.clone(), *avatar, *d))
            .collect()
    }

    pub fn hit(&mut self, account: &str, avatar: u64, damage: u32) {
        let e = self
            .by_account
            .entry(account.to_string())
            .or_insert((avatar, 0));
        e.0 = avatar;
        e.1 += damage;
    }

    /// The kill's XP for each attacker (account, avatar, xp), by damage dealt; the table is
    /// cleared for the NPC's next life.
    pub fn share_out(&mut self, xp: u32) -> Vec<(String, u64, u32)> {
        let total: u64 = self.by_account.values().map(|(_, d)| *d as u64).sum();
        let shares = std::mem::take(&mut self.by_account);
        if total == 0 {
            return Vec::new();
        }
        shares
            .into_iter()
            .map(|(a, (avatar, d))| {
                let part = (xp as u64 * d as u64 / total).max(1) as u32;
                (a, avatar, part)
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.by_account.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_account.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_junk_is_refused() {
        assert_eq!(decode(&encode(10, 1 << 40)), Some((10, 1 << 40)));
        assert_eq!(decode(b"short"), None);
    }

    #[test]
    fn a_kill_shares_its_xp_by_damage_and_clears_the_table() {
        let mut t = DamageTable::default();
        t.hit("ann", 1, 30);
        t.hit("bob", 2, 10);
        t.hit("ann", 3, 10);
        let again = DamageTable::from_shares(&t.shares());
        assert_eq!(again, t, "the table survives a snapshot");
        let xp = t.share_out(100);
        assert_eq!(xp, [("ann".into(), 3, 80), ("bob".into(), 2, 20)]);
        assert!(t.is_empty());
    }
}
