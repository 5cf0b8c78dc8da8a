//! Trades across borders, on exclusive claims: a player opens a trade with the nearest other
//! player in reach (on its own node or seen as a ghost of another's) by claiming both players'
//! trade escrow (`trade:<account>`) for its avatar. Only with both claims granted does the gift
//! go out, as an entity command to the partner's avatar wherever it is simulated; its result
//! closes the trade and both claims are released. A claim held by anyone else refuses the trade:
//! a player is never in two trades at once, whichever nodes the traders stand on.
//!
//! A trade lives in the opening arena's memory: if its avatar is frozen for a handoff, the trade
//! is called off (its claims released) rather than carried along.

use bytes::Bytes;

/// Command type: a trade's gift. Payload: u32 BE gold, u64 BE trade id (see `combat::encode`).
pub const CMD_TRADE: u32 = 3;
/// Gold one trade gives.
pub const GIFT_GOLD: u32 = 1;
/// How far apart two traders may stand (metres).
pub const REACH_M: f64 = 40.0;
/// A player opens a trade at most this often (ticks), when in none.
pub const TRADE_EVERY_TICKS: u64 = 40;
/// The claims' lease: a trade whose node dies frees its players this long after.
pub const CLAIM_TTL_MS: u32 = 5_000;
/// Trades open `TICK_OFFSET` ticks before each multiple of `TRADE_EVERY_TICKS`: never in an
/// attack's tick (a multiple of ten).
pub const TICK_OFFSET: u64 = 5;
/// How long the two players haggle (ticks) once both escrows are held, before the gift.
pub const HAGGLE_TICKS: u64 = 30;

/// The escrow claim of `account`.
pub fn escrow(account: &str) -> String {
    format!("trade:{account}")
}

/// How far one claim of a trade got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escrow {
    /// Asked under this request id.
    Asked(u64),
    Granted,
    /// Not granted (held by another, or failed): nothing to release.
    Refused,
}

/// A trade this arena opened, by its avatar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trade {
    pub partner: u64,
    /// (account, escrow) of the opener, then of the partner.
    pub parties: [(String, Escrow); 2],
    /// Both granted: the tick the gift goes out, and (once sent) its command's request id.
    pub gift_at: Option<u64>,
    pub gift: Option<u64>,
}

impl Trade {
    pub fn new(partner: u64, own: &str, theirs: &str, requests: [u64; 2]) -> Self {
        Self {
            partner,
            parties: [
                (own.to_string(), Escrow::Asked(requests[0])),
                (theirs.to_string(), Escrow::Asked(requests[1])),
            ],
            gift_at: None,
            gift: None,
        }
    }

    /// The answer to the claim asked under `request_id`; true when it was this trade's.
    pub fn answered(&mut self, request_id: u64, granted: bool) -> bool {
        for (_, e) in &mut self.parties {
            if *e == Escrow::Asked(request_id) {
                *e = if granted {
                    Escrow::Granted
                } else {
                    Escrow::Refused
                };
                return true;
            }
        }
        false
    }

    /// The claim of `key` was lost: nothing to release of it. True when it was this trade's (a
    /// grant; one still asked for is another grant's news).
    pub fn lost(&mut self, key: &str) -> bool {
        for (a, e) in &mut self.parties {
            if escrow(a) == key && *e == Escrow::Granted {
                *e = Escrow::Refused;
                return true;
            }
        }
        false
    }

    pub fn both_granted(&self) -> bool {
        self.parties.iter().all(|(_, e)| *e == Escrow::Granted)
    }

    pub fn refused(&self) -> bool {
        self.parties.iter().any(|(_, e)| *e == Escrow::Refused)
    }

    pub fn accounts(&self) -> [&str; 2] {
        [&self.parties[0].0, &self.parties[1].0]
    }
}

pub fn encode(gold: u32, trade_id: u64) -> Bytes {
    crate::combat::encode(gold, trade_id)
}

pub fn decode(b: &[u8]) -> Option<(u32, u64)> {
    crate::combat::decode(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trade_goes_ahead_only_with_both_escrows_and_releases_what_it_asked_for() {
        let mut t = Trade::new(9, "ada", "bob", [1, 2]);
        assert!(!t.answered(3, true), "another request");
        assert!(t.answered(1, true));
        assert!(!t.both_granted());
        assert_eq!(t.parties[0].1, Escrow::Granted);
        assert_eq!(t.parties[1].1, Escrow::Asked(2));
        assert!(t.answered(2, false));
        assert!(t.refused());
        assert!(!t.both_granted());
        assert_eq!(t.parties[1].1, Escrow::Refused);

        let mut t = Trade::new(9, "ada", "bob", [1, 2]);
        t.answered(2, true);
        t.answered(1, true);
        assert!(t.both_granted() && !t.refused());
        assert_eq!(t.accounts(), ["ada", "bob"]);
        // A claim lost midway is not released again.
        assert!(t.lost("trade:bob"));
        assert!(!t.lost("trade:bob"));
        assert_eq!(t.parties[1].1, Escrow::Refused);
        assert_eq!(t.parties[0].1, Escrow::Granted);
    }
}
