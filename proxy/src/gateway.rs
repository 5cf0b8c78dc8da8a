//! Choosing a gateway for a session: round-robin over the links that are up, skipping, for a new
//! login, the gateways that say they admit no new session.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::link::{Link, LinkConn};

/// The configured gateways, one link each.
#[derive(Debug)]
pub(crate) struct Gateways {
    links: Vec<Arc<Link>>,
    next: AtomicUsize,
}

/// Why no gateway was picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoGateway {
    /// No link is up.
    Down,
    /// Every link that is up admits no new session: the client should retry after
    /// `retry_after_ms` (the soonest any of them hinted; 0: none did).
    Full { retry_after_ms: u32, detail: String },
}

impl Gateways {
    pub(crate) fn new(addrs: &[String]) -> Self {
        Self {
            links: addrs.iter().map(|a| Arc::new(Link::new(a))).collect(),
            next: AtomicUsize::new(0),
        }
    }

    pub(crate) fn links(&self) -> &[Arc<Link>] {
        &self.links
    }

    /// The next link that is up and, for a new login, admits new sessions. A session that
    /// moves because its gateway's link broke is already admitted: it goes to an open gateway
    /// if there is one, and to any gateway that is up if not.
    pub(crate) fn pick(&self, new_login: bool) -> Result<(Arc<Link>, Arc<LinkConn>), NoGateway> {
        let len = self.links.len();
        if len == 0 {
            return Err(NoGateway::Down);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % len;
        let mut closed = Vec::new();
        for i in (0..len).map(|i| (start + i) % len) {
            let link = &self.links[i];
            let Some(conn) = link.conn() else {
                continue;
            };
            match conn.closed() {
                None => {
                    // The turn passes on from the one picked, so the gateway after a skipped
                    // one does not get a double share.
                    self.next.store(i + 1, Ordering::Relaxed);
                    return Ok((link.clone(), conn));
                }
                Some(why) => closed.push((link.clone(), conn, why)),
            }
        }
        if closed.is_empty() {
            return Err(NoGateway::Down);
        }
        if !new_login {
            let (link, conn, _) = closed.swap_remove(0);
            return Ok((link, conn));
        }
        let retry_after_ms = closed
            .iter()
            .map(|(_, _, c)| c.retry_after_ms)
            .filter(|ms| *ms > 0)
            .min()
            .unwrap_or(0);
        closed.sort_by_key(|(_, conn, _)| conn.node_id);
        let why: Vec<String> = closed
            .iter()
            .map(|(_, conn, c)| format!("node {}: {}", conn.node_id, c.reason))
            .collect();
        let detail = format!(
            "the server is full: no gateway admits a new session ({}); retry in {} ms",
            why.join(", "),
            retry_after_ms
        );
        Err(NoGateway::Full {
            retry_after_ms,
            detail,
        })
    }

    pub(crate) fn any_up(&self) -> bool {
        self.links.iter().any(|l| l.conn().is_some())
    }

    /// Links that are up and admit no new session.
    pub(crate) fn closed(&self) -> usize {
        self.links
            .iter()
            .filter_map(|l| l.conn())
            .filter(|c| c.closed().is_some())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Closed;

    fn closed(reason: &str, retry_after_ms: u32) -> Option<Closed> {
        Some(Closed {
            reason: reason.into(),
            retry_after_ms,
        })
    }

    /// Gateways 1..: each up, open or closed as given; the outboxes are kept alive.
    fn gateways(
        states: Vec<Option<Closed>>,
    ) -> (
        Gateways,
        Vec<tokio::sync::mpsc::Receiver<cellmesh_proto::mesh::MeshMessage>>,
    ) {
        let (links, outboxes) = states
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let (link, rx) = Link::up_for_test(&format!("g{}", i + 1), i as u32 + 1, c);
                (Arc::new(link), rx)
            })
            .unzip();
        (
            Gateways {
                links,
                next: AtomicUsize::new(0),
            },
            outboxes,
        )
    }

    fn node(picked: Result<(Arc<Link>, Arc<LinkConn>), NoGateway>) -> u32 {
        picked.expect("a gateway").1.node_id
    }

    #[test]
    fn new_logins_skip_closed_gateways_round_robin_over_the_open_ones() {
        let (g, _outboxes) = gateways(vec![None, closed("tick_overrun", 1000), None]);
        let picks: Vec<u32> = (0..6).map(|_| node(g.pick(true))).collect();
        assert_eq!(picks, [1, 3, 1, 3, 1, 3]);
        assert_eq!(g.closed(), 1);
    }

    #[test]
    fn when_every_gateway_is_closed_a_login_is_refused_and_a_moving_session_still_lands() {
        let (g, _outboxes) = gateways(vec![
            closed("outbox_pressure", 0),
            closed("tick_overrun", 3000),
        ]);
        let Err(NoGateway::Full {
            retry_after_ms,
            detail,
        }) = g.pick(true)
        else {
            panic!("every gateway is closed")
        };
        assert_eq!(retry_after_ms, 3000, "the soonest hint given");
        assert!(
            detail.contains("node 1: outbox_pressure, node 2: tick_overrun"),
            "{detail}"
        );
        // A session whose gateway's link broke was admitted before: it moves all the same.
        let moved: Vec<u32> = (0..2).map(|_| node(g.pick(false))).collect();
        assert_eq!(moved.len(), 2);
        assert!(moved.iter().all(|n| [1, 2].contains(n)));
    }

    #[test]
    fn with_no_link_up_nothing_is_picked() {
        let g = Gateways::new(&["127.0.0.1:1".to_string()]);
        assert_eq!(g.pick(true).err(), Some(NoGateway::Down));
        assert_eq!(g.pick(false).err(), Some(NoGateway::Down));
        assert_eq!(Gateways::new(&[]).pick(true).err(), Some(NoGateway::Down));
    }
}
