//! The input ledger: every hop's input counters at the end of a run, and the undelivered
//! inputs each hop's losses explain.

use std::collections::BTreeMap;

use serde::Serialize;

/// Every hop's input counters at the end of a run: bots → proxy → gateway sidecar → (peer
/// sidecars) → game. Each hop counts what it read, passed on, dropped under a reason, and what
/// it wrote to connections that broke since, so every undelivered input gets a name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct InputLedger {
    pub bots_sent: u64,
    /// Sent on sessions that ended by a kick or an error.
    pub bots_on_broken_sessions: u64,
    pub proxy_received: u64,
    pub proxy_rate_limited: u64,
    pub proxy_lost: BTreeMap<&'static str, u64>,
    pub proxy_written: u64,
    /// Written to gateway link connections that ended since.
    pub proxy_on_ended_links: u64,
    pub sidecars_from_proxies: u64,
    pub sidecars_from_peers: u64,
    pub sidecars_forwarded: u64,
    pub sidecars_lost_in_links: u64,
    /// Forwarded on peer links that ended since.
    pub sidecars_on_ended_links: u64,
    pub sidecars_dropped: BTreeMap<&'static str, u64>,
    /// Inputs applied at a source after a refusal although a copy went to the target...
    pub sidecars_copies_applied: u64,
    /// ...and copies the target dropped for it: each pair is one input.
    pub sidecars_copies_refused: u64,
    /// Held at the end: for an entity still frozen (a handoff in doubt), for an epoch not seen
    /// yet, or for an older input after an adoption. An input and its copy can both be held.
    pub sidecars_held: u64,
    /// Held by nodes when they were killed (`--chaos`): lost with them.
    pub sidecars_held_by_killed: u64,
    pub delivered: u64,
}

impl InputLedger {
    /// The undelivered inputs by reason, and what no reason explains (sent − delivered − named;
    /// negative if inputs were counted twice).
    ///
    /// A connection that breaks loses what it carried and its reader never read. That loss is
    /// the gap between what one hop wrote and the next read, and it is named only up to what was
    /// written to connections that broke: a gap larger than that stays unaccounted.
    pub fn undelivered(&self) -> (BTreeMap<String, u64>, i64) {
        let mut by = BTreeMap::new();
        let mut add = |name: String, n: u64| {
            if n > 0 {
                *by.entry(name).or_insert(0) += n;
            }
        };
        let broken = |written: u64, read: u64, bound: u64| written.saturating_sub(read).min(bound);
        add(
            "client_connection_broken".into(),
            broken(
                self.bots_sent,
                self.proxy_received,
                self.bots_on_broken_sessions,
            ),
        );
        add("proxy_rate_limited".into(), self.proxy_rate_limited);
        for (reason, n) in &self.proxy_lost {
            add(format!("proxy_{reason}"), *n);
        }
        add(
            "gateway_link_broken".into(),
            broken(
                self.proxy_written,
                self.sidecars_from_proxies,
                self.proxy_on_ended_links,
            ),
        );
        add("peer_link_closed".into(), self.sidecars_lost_in_links);
        add(
            "peer_link_broken".into(),
            broken(
                self.sidecars_forwarded
                    .saturating_sub(self.sidecars_lost_in_links),
                self.sidecars_from_peers,
                self.sidecars_on_ended_links,
            ),
        );
        for (reason, n) in &self.sidecars_dropped {
            add(format!("sidecar_{reason}"), *n);
        }
        let named: u64 = by.values().sum();
        // An input applied at the source after a refusal also left as a copy, which the target
        // dropped (counted by neither hop) or a link lost (named above): take the copy back out.
        let copies = self.sidecars_copies_applied as i64 - self.sidecars_copies_refused as i64;
        let open = self.bots_sent as i64 - self.delivered as i64 - named as i64 + copies;
        // What killed nodes held, then what nodes still hold, explain a gap up to its size (an
        // input and its copy are two).
        let killed = (open.max(0) as u64).min(self.sidecars_held_by_killed);
        if killed > 0 {
            by.insert("sidecar_lost_with_node".into(), killed);
        }
        let open = open - killed as i64;
        let held = (open.max(0) as u64).min(self.sidecars_held);
        if held > 0 {
            by.insert("sidecar_held_at_end".into(), held);
        }
        (by, open - held as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(sent: u64) -> InputLedger {
        InputLedger {
            bots_sent: sent,
            proxy_received: sent,
            proxy_written: sent,
            sidecars_from_proxies: sent,
            delivered: sent,
            ..InputLedger::default()
        }
    }

    #[test]
    fn a_clean_run_leaves_nothing_undelivered() {
        assert_eq!(clean(100).undelivered(), (BTreeMap::new(), 0));
    }

    #[test]
    fn every_hop_names_its_losses() {
        let l = InputLedger {
            bots_sent: 100,
            bots_on_broken_sessions: 30,
            // 5 never read by the proxy, within the 30 sent on broken sessions.
            proxy_received: 95,
            proxy_rate_limited: 2,
            proxy_lost: [("link_closed", 3)].into_iter().collect(),
            // 90 written, 4 lost in a gateway link that broke.
            proxy_written: 90,
            proxy_on_ended_links: 40,
            sidecars_from_proxies: 86,
            // 20 forwarded: 1 never written, 2 lost in flight, 17 read by peers.
            sidecars_forwarded: 20,
            sidecars_lost_in_links: 1,
            sidecars_on_ended_links: 10,
            sidecars_from_peers: 17,
            sidecars_dropped: [("input_late", 1)].into_iter().collect(),
            // One input applied at its source after a refusal; its copy was one of the 2 lost.
            sidecars_copies_applied: 1,
            sidecars_copies_refused: 0,
            sidecars_held: 0,
            sidecars_held_by_killed: 0,
            delivered: 83,
        };
        let (by, unaccounted) = l.undelivered();
        let want: BTreeMap<String, u64> = [
            ("client_connection_broken", 5),
            ("proxy_rate_limited", 2),
            ("proxy_link_closed", 3),
            ("gateway_link_broken", 4),
            ("peer_link_closed", 1),
            ("peer_link_broken", 2),
            ("sidecar_input_late", 1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!((by, unaccounted), (want, 0));
    }

    #[test]
    fn a_gap_no_broken_connection_explains_stays_unaccounted() {
        // 3 inputs vanish between the proxy and the gateway, and no link broke.
        let mut l = clean(100);
        l.sidecars_from_proxies = 97;
        l.delivered = 97;
        assert_eq!(l.undelivered(), (BTreeMap::new(), 3));
        // Broken links explain at most what they carried.
        l.proxy_on_ended_links = 2;
        let (by, unaccounted) = l.undelivered();
        assert_eq!((by["gateway_link_broken"], unaccounted), (2, 1));
        // An input delivered twice shows as a negative remainder.
        let mut twice = clean(10);
        twice.delivered = 11;
        assert_eq!(twice.undelivered().1, -1);
        // A refused copy the target dropped balances the original applied at the source.
        let mut refused = clean(10);
        refused.sidecars_copies_applied = 1;
        refused.sidecars_copies_refused = 1;
        assert_eq!(refused.undelivered().1, 0);
    }

    #[test]
    fn inputs_held_at_the_end_explain_a_gap_up_to_its_size() {
        // 4 inputs never reached a game; a frozen entity's source holds 3 and its target holds
        // the copies of 2 of them: 5 held, but they name only the 4 missing.
        let mut l = clean(100);
        l.delivered = 96;
        l.sidecars_held = 5;
        let (by, unaccounted) = l.undelivered();
        assert_eq!((by["sidecar_held_at_end"], unaccounted), (4, 0));
        // Held inputs do not hide a double delivery.
        let mut twice = clean(10);
        twice.delivered = 11;
        twice.sidecars_held = 2;
        assert_eq!(twice.undelivered(), (BTreeMap::new(), -1));
    }

    #[test]
    fn inputs_held_by_killed_nodes_are_named_before_those_held_at_the_end() {
        let mut l = clean(100);
        l.delivered = 94;
        l.sidecars_held_by_killed = 4;
        l.sidecars_held = 5;
        let (by, unaccounted) = l.undelivered();
        assert_eq!(
            (
                by["sidecar_lost_with_node"],
                by["sidecar_held_at_end"],
                unaccounted
            ),
            (4, 2, 0)
        );
    }
}
