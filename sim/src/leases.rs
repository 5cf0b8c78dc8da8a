//! Node leases as the topology store keeps them, and the clocks of the processes that hold them.
//!
//! The store judges lapse by its own clock: the simulation's true time. A process only has its
//! own clock, which may run fast or slow and show another wall time (see [`Clock`]); it stops
//! writing at a deadline of that clock, as the real sidecar does. The checker holds the two
//! together: whenever the store grants a node id, no other process of that id may still write.

use std::collections::BTreeMap;

use cellmesh_stores::topology::{Fence, Lease};
use cellmesh_world::partition::NodeId;

/// One process's clocks against true time: its monotonic clock runs `rate_ppm` parts per
/// million fast (negative: slow) and its wall clock reads `unix_skew_ms` off the store's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Clock {
    /// True time at which the process started, and its monotonic reading then.
    pub base_true: u64,
    pub base_local: u64,
    pub rate_ppm: i64,
    pub unix_skew_ms: i64,
}

const MILLION: i128 = 1_000_000;

impl Clock {
    /// The process's monotonic reading at true time `t` (never before its start).
    pub fn local(&self, t: u64) -> u64 {
        let elapsed = i128::from(t.saturating_sub(self.base_true));
        self.base_local + (elapsed * (MILLION + i128::from(self.rate_ppm)) / MILLION) as u64
    }

    /// The first true time at which the process's monotonic clock reads `local` or more.
    pub fn true_at(&self, local: u64) -> u64 {
        let ahead = i128::from(local.saturating_sub(self.base_local));
        let rate = MILLION + i128::from(self.rate_ppm);
        let mut t = self.base_true + ((ahead * MILLION + rate - 1) / rate) as u64;
        // Integer rounding may land a millisecond early: step until the clock reads `local`.
        while self.local(t) < local {
            t += 1;
        }
        t
    }

    /// The process's wall clock at true time `t`, given the store's wall clock at true time 0.
    pub fn unix(&self, t: u64, start_unix_ms: u64) -> u64 {
        (start_unix_ms + t).saturating_add_signed(self.unix_skew_ms)
    }
}

/// A grant as the store holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grant {
    /// The process holding it (a number unique to the run, like the real holder's nonce).
    holder: u64,
    epoch: u64,
    /// True ms (the store's clock).
    expires: u64,
}

/// The holder of a restore's fence: no process is this one.
const FENCE_HOLDER: u64 = u64::MAX;

/// The topology store's leases: one per node id, every grant under a new epoch.
#[derive(Default)]
pub(crate) struct SimLeases {
    grants: BTreeMap<NodeId, Grant>,
    /// The latest expiry any grant of a node had: a new grant's ids start there.
    ids_below: BTreeMap<NodeId, u64>,
}

/// The store's answer to a lease request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    Granted(Lease),
    /// Another process holds the id until this true time.
    Held {
        until: u64,
    },
}

impl SimLeases {
    /// Grants `holder` the lease of `node` if it is free, lapsed or already `holder`'s, or if
    /// `successor_of` names the current grant (a process restarted in place proves it took
    /// over from that one).
    pub fn acquire(
        &mut self,
        now: u64,
        start_unix_ms: u64,
        node: NodeId,
        holder: u64,
        successor_of: Option<(u64, u64)>,
        ttl: u64,
    ) -> Answer {
        if let Some(g) = self.grants.get(&node) {
            let takeover = successor_of == Some((g.holder, g.epoch));
            if g.expires > now && g.holder != holder && !takeover {
                return Answer::Held { until: g.expires };
            }
        }
        let epoch = self.grants.get(&node).map_or(0, |g| g.epoch) + 1;
        let floor = self.ids_below.get(&node).copied().unwrap_or(0);
        let expires = now + ttl;
        self.grants.insert(
            node,
            Grant {
                holder,
                epoch,
                expires,
            },
        );
        let below = self.ids_below.entry(node).or_default();
        *below = (*below).max(expires);
        Answer::Granted(Lease {
            node,
            holder: format!("sim-{holder}"),
            epoch,
            expires_unix_ms: start_unix_ms + expires,
            ids_floor_unix_ms: if floor > 0 { start_unix_ms + floor } else { 0 },
        })
    }

    /// Extends `holder`'s grant `epoch` of `node`, live or lapsed, if it is still current
    /// (nobody was granted the id since), as the real store's `reclaim_lease`.
    pub fn reclaim(
        &mut self,
        now: u64,
        start_unix_ms: u64,
        node: NodeId,
        holder: u64,
        epoch: u64,
        ttl: u64,
    ) -> Option<Lease> {
        let g = self.grants.get_mut(&node)?;
        if g.holder != holder || g.epoch != epoch || g.holder == FENCE_HOLDER {
            return None;
        }
        g.expires = g.expires.max(now + ttl);
        let below = self.ids_below.entry(node).or_default();
        *below = (*below).max(g.expires);
        Some(Lease {
            node,
            holder: format!("sim-{holder}"),
            epoch,
            expires_unix_ms: start_unix_ms + g.expires,
            ids_floor_unix_ms: 0,
        })
    }

    /// A restore's fence of grant `epoch` of `node` (the real `topology::fence_lease`): a new
    /// grant, lapsed at once, to a holder no process has, if `epoch` is current and lapsed.
    pub fn fence(&mut self, now: u64, node: NodeId, epoch: u64) -> Fence {
        match self.grants.get(&node) {
            Some(g) if g.epoch != epoch => Fence::Moved,
            None => Fence::Moved,
            Some(g) if g.expires > now => Fence::Live,
            Some(g) => {
                let fenced = Grant {
                    holder: FENCE_HOLDER,
                    epoch: g.epoch + 1,
                    expires: now,
                };
                self.grants.insert(node, fenced);
                Fence::Fenced
            }
        }
    }

    /// Every node whose lease is lapsed at `now` but not replaced, with its epoch.
    pub fn lapsed(&self, now: u64) -> Vec<(NodeId, u64)> {
        self.grants
            .iter()
            .filter(|(_, g)| g.expires <= now)
            .map(|(n, g)| (*n, g.epoch))
            .collect()
    }

    /// Every node whose lease is live at `now`, with its epoch.
    pub fn live(&self, now: u64) -> Vec<(NodeId, u64)> {
        self.grants
            .iter()
            .filter(|(_, g)| g.expires > now)
            .map(|(n, g)| (*n, g.epoch))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_converts_both_ways() {
        for rate_ppm in [-20_000, -1, 0, 1, 15_000] {
            let c = Clock {
                base_true: 1_000,
                base_local: 77,
                rate_ppm,
                unix_skew_ms: 0,
            };
            for local in [77, 78, 500, 1_234, 99_999] {
                let t = c.true_at(local);
                assert!(c.local(t) >= local, "rate {rate_ppm} local {local}");
                assert!(t == c.base_true || c.local(t - 1) < local);
            }
        }
    }

    #[test]
    fn a_live_lease_goes_only_to_its_holder_or_its_successor() {
        let mut l = SimLeases::default();
        let Answer::Granted(a) = l.acquire(0, 0, 3, 1, None, 1_000) else {
            panic!("free")
        };
        assert_eq!(
            l.acquire(10, 0, 3, 2, None, 1_000),
            Answer::Held { until: 1_000 }
        );
        assert!(l.reclaim(500, 0, 3, 1, a.epoch, 1_000).is_some());
        // A restart in place names the grant it succeeds.
        let Answer::Granted(b) = l.acquire(600, 0, 3, 2, Some((1, a.epoch)), 1_000) else {
            panic!("takeover")
        };
        assert_eq!(b.epoch, a.epoch + 1);
        assert_eq!(
            b.ids_floor_unix_ms, 1_500,
            "ids start past every earlier grant"
        );
        assert!(l.reclaim(700, 0, 3, 1, a.epoch, 1_000).is_none());
        // Lapsed: anyone may have it.
        assert!(matches!(
            l.acquire(1_600, 0, 3, 9, None, 1_000),
            Answer::Granted(_)
        ));
    }

    #[test]
    fn a_lapsed_lease_is_taken_back_unless_fenced() {
        let mut l = SimLeases::default();
        let Answer::Granted(a) = l.acquire(0, 0, 4, 1, None, 1_000) else {
            panic!("free")
        };
        // Lapsed, not replaced: listed as such, and its holder takes it back under its epoch.
        assert_eq!(l.lapsed(1_500), vec![(4, a.epoch)]);
        let back = l
            .reclaim(1_500, 0, 4, 1, a.epoch, 1_000)
            .expect("taken back");
        assert_eq!(back.epoch, a.epoch);
        assert_eq!(l.live(1_600), vec![(4, a.epoch)]);
        // A live lease is not fenced; a lapsed one is, and its holder never has it again.
        assert_eq!(l.fence(1_600, 4, a.epoch), Fence::Live);
        assert_eq!(l.fence(3_000, 4, a.epoch), Fence::Fenced);
        assert_eq!(l.fence(3_000, 4, a.epoch), Fence::Moved);
        assert!(l.reclaim(3_001, 0, 4, 1, a.epoch, 1_000).is_none());
        assert!(matches!(
            l.acquire(3_001, 0, 4, 2, None, 1_000),
            Answer::Granted(Lease { epoch, .. }) if epoch == a.epoch + 2
        ));
    }
}
