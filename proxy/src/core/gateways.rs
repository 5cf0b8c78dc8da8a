//! The gateway links as the proxy's core sees them: which are up, which admit no new session,
//! which session id of each link belongs to which client connection, and the round robin that
//! picks a gateway for a session. Pure: the link tasks of the driver dial, read and write.

use std::collections::HashMap;

use super::ConnId;

/// A gateway, by its index in the configured list.
pub type GatewayId = usize;

/// Why a gateway takes no new sessions, as it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub reason: String,
    pub retry_after_ms: u32,
}

/// Why no gateway was picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoGateway {
    /// No link is up.
    Down,
    /// Every link that is up admits no new session: the client should retry after
    /// `retry_after_ms` (the soonest any of them hinted; 0: none did).
    Full { retry_after_ms: u32, detail: String },
}

/// One connection of a link, from its `LinkHello` to its end.
#[derive(Debug)]
struct Up {
    node_id: u32,
    /// Set while the gateway says it admits no new session (each connection starts open: a
    /// gateway that is closed says so as the link comes up).
    closed: Option<Closed>,
    /// Session id → the client connection it serves.
    routes: HashMap<u64, ConnId>,
}

#[derive(Debug)]
struct Gateway {
    addr: String,
    /// Session ids of this link: monotonic and never reused, even across reconnects, so a late
    /// message for an old session can never reach a new one.
    next_session: u64,
    up: Option<Up>,
}

/// The configured gateways, one link each.
#[derive(Debug)]
pub struct Gateways {
    all: Vec<Gateway>,
    next: usize,
}

impl Gateways {
    pub fn new(addrs: &[String]) -> Self {
        Self {
            all: addrs
                .iter()
                .map(|a| Gateway {
                    addr: a.clone(),
                    next_session: 1,
                    up: None,
                })
                .collect(),
            next: 0,
        }
    }

    pub fn addr(&self, g: GatewayId) -> &str {
        &self.all[g].addr
    }

    pub fn node_id(&self, g: GatewayId) -> Option<u32> {
        self.all.get(g)?.up.as_ref().map(|u| u.node_id)
    }

    /// A link came up to the gateway `node_id`.
    pub fn link_up(&mut self, g: GatewayId, node_id: u32) {
        self.all[g].up = Some(Up {
            node_id,
            closed: None,
            routes: HashMap::new(),
        });
    }

    /// A link ended; returns the client connections its sessions served.
    pub fn link_down(&mut self, g: GatewayId) -> Vec<(u64, ConnId)> {
        let Some(up) = self.all.get_mut(g).and_then(|l| l.up.take()) else {
            return Vec::new();
        };
        let mut orphans: Vec<(u64, ConnId)> = up.routes.into_iter().collect();
        orphans.sort_unstable();
        orphans
    }

    pub fn is_up(&self, g: GatewayId) -> bool {
        self.all.get(g).is_some_and(|l| l.up.is_some())
    }

    pub fn any_up(&self) -> bool {
        self.all.iter().any(|l| l.up.is_some())
    }

    /// Links that are up and admit no new session.
    pub fn closed(&self) -> usize {
        self.all
            .iter()
            .filter_map(|l| l.up.as_ref())
            .filter(|u| u.closed.is_some())
            .count()
    }

    /// The gateway's latest word on new sessions; whether it changed anything.
    pub fn set_admission(&mut self, g: GatewayId, closed: Option<Closed>) -> bool {
        let Some(up) = self.all.get_mut(g).and_then(|l| l.up.as_mut()) else {
            return false;
        };
        let changed = up.closed.is_some() != closed.is_some();
        up.closed = closed;
        changed
    }

    pub fn admission(&self, g: GatewayId) -> Option<&Closed> {
        self.all.get(g)?.up.as_ref()?.closed.as_ref()
    }

    /// Routes a new session of `g` to `conn`; its id, or `None` if the link is down.
    pub fn open_session(&mut self, g: GatewayId, conn: ConnId) -> Option<u64> {
        let link = self.all.get_mut(g)?;
        let up = link.up.as_mut()?;
        let id = link.next_session;
        link.next_session += 1;
        up.routes.insert(id, conn);
        Some(id)
    }

    /// The connection a session of `g` serves, if it is still routed.
    pub fn route(&self, g: GatewayId, session: u64) -> Option<ConnId> {
        self.all.get(g)?.up.as_ref()?.routes.get(&session).copied()
    }

    /// Unroutes a session; true if it was still routed, i.e. the gateway has not ended it.
    pub fn release(&mut self, g: GatewayId, session: u64) -> bool {
        self.all
            .get_mut(g)
            .and_then(|l| l.up.as_mut())
            .is_some_and(|u| u.routes.remove(&session).is_some())
    }

    /// Sessions routed over the link now.
    pub fn sessions(&self, g: GatewayId) -> usize {
        self.all
            .get(g)
            .and_then(|l| l.up.as_ref())
            .map_or(0, |u| u.routes.len())
    }

    /// The next link that is up and, for a new login, admits new sessions. A session that
    /// moves because its gateway's link broke is already admitted: it goes to an open gateway
    /// if there is one, and to any gateway that is up if not.
    pub fn pick(&mut self, new_login: bool) -> Result<GatewayId, NoGateway> {
        let len = self.all.len();
        if len == 0 {
            return Err(NoGateway::Down);
        }
        let start = self.next % len;
        self.next = self.next.wrapping_add(1);
        let mut closed = Vec::new();
        for g in (0..len).map(|i| (start + i) % len) {
            let Some(up) = &self.all[g].up else {
                continue;
            };
            match &up.closed {
                None => {
                    // The turn passes on from the one picked, so the gateway after a skipped
                    // one does not get a double share.
                    self.next = g + 1;
                    return Ok(g);
                }
                Some(why) => closed.push((g, up.node_id, why.clone())),
            }
        }
        if closed.is_empty() {
            return Err(NoGateway::Down);
        }
        if !new_login {
            return Ok(closed[0].0);
        }
        let retry_after_ms = closed
            .iter()
            .map(|(_, _, c)| c.retry_after_ms)
            .filter(|ms| *ms > 0)
            .min()
            .unwrap_or(0);
        closed.sort_by_key(|(_, node, _)| *node);
        let why: Vec<String> = closed
            .iter()
            .map(|(_, node, c)| format!("node {node}: {}", c.reason))
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

    /// Gateways configured.
    pub fn count(&self) -> usize {
        self.all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed(reason: &str, retry_after_ms: u32) -> Option<Closed> {
        Some(Closed {
            reason: reason.into(),
            retry_after_ms,
        })
    }

    /// Gateways 1..: each up (as node i + 1), open or closed as given.
    fn gateways(states: Vec<Option<Closed>>) -> Gateways {
        let addrs: Vec<String> = (0..states.len()).map(|i| format!("g{}", i + 1)).collect();
        let mut g = Gateways::new(&addrs);
        for (i, c) in states.into_iter().enumerate() {
            g.link_up(i, i as u32 + 1);
            g.set_admission(i, c);
        }
        g
    }

    fn node(g: &Gateways, picked: Result<GatewayId, NoGateway>) -> u32 {
        g.node_id(picked.expect("a gateway")).unwrap()
    }

    #[test]
    fn new_logins_skip_closed_gateways_round_robin_over_the_open_ones() {
        let mut g = gateways(vec![None, closed("tick_overrun", 1000), None]);
        let picks: Vec<u32> = (0..6)
            .map(|_| {
                let p = g.pick(true);
                node(&g, p)
            })
            .collect();
        assert_eq!(picks, [1, 3, 1, 3, 1, 3]);
        assert_eq!(g.closed(), 1);
    }

    #[test]
    fn when_every_gateway_is_closed_a_login_is_refused_and_a_moving_session_still_lands() {
        let mut g = gateways(vec![
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
        let moved = g.pick(false);
        assert!([1, 2].contains(&node(&g, moved)));
    }

    #[test]
    fn with_no_link_up_nothing_is_picked() {
        let mut g = Gateways::new(&["127.0.0.1:1".to_string()]);
        assert_eq!(g.pick(true).err(), Some(NoGateway::Down));
        assert_eq!(g.pick(false).err(), Some(NoGateway::Down));
        assert_eq!(Gateways::new(&[]).pick(true).err(), Some(NoGateway::Down));
    }

    #[test]
    fn session_ids_never_repeat_across_reconnects_and_a_link_down_hands_back_its_sessions() {
        let mut g = gateways(vec![None]);
        assert_eq!(g.open_session(0, 10), Some(1));
        assert_eq!(g.open_session(0, 11), Some(2));
        assert!(g.release(0, 2));
        assert!(!g.release(0, 2), "released once");
        assert_eq!(g.link_down(0), vec![(1, 10)]);
        assert_eq!(g.open_session(0, 12), None, "the link is down");
        assert_eq!(g.route(0, 1), None);
        g.link_up(0, 1);
        assert_eq!(
            g.open_session(0, 12),
            Some(3),
            "ids go on after a reconnect"
        );
        assert_eq!(g.sessions(0), 1);
    }
}
