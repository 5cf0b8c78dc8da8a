//! The gateway links as the proxy's core sees them: which are up, which admit no new session,
//! which session id of each link belongs to which client connection, and the round robin that
//! picks a gateway for a session. Pure: the link tasks of the driver dial, read and write.
//!
//! Gateways come in two tiers: the primaries (`gateways`, this geo's sidecars) and the fallbacks
//! (`fallback_gateways`, another geo's), which take sessions only while no primary is up.

use std::collections::HashMap;

use super::ConnId;

/// A gateway, by its index in the configured list: the primaries, then the fallbacks.
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
    /// Of the second tier: picked only while no primary is up.
    fallback: bool,
    /// Session ids of this link: monotonic and never reused, even across reconnects, so a late
    /// message for an old session can never reach a new one.
    next_session: u64,
    up: Option<Up>,
}

/// The configured gateways, one link each: the primaries first, then the fallbacks.
#[derive(Debug)]
pub struct Gateways {
    all: Vec<Gateway>,
    /// How many of `all` are primaries.
    primaries: usize,
    /// Each tier's round-robin turn (primaries, fallbacks): one tier's picks never shift the
    /// other's.
    next: [usize; 2],
    /// Sessions went to a fallback since the last primary link came up: the spell is said once.
    falling_back: bool,
}

impl Gateways {
    pub fn new(primaries: &[String], fallbacks: &[String]) -> Self {
        let tier = |addrs: &[String], fallback: bool| -> Vec<Gateway> {
            addrs
                .iter()
                .map(|a| Gateway {
                    addr: a.clone(),
                    fallback,
                    next_session: 1,
                    up: None,
                })
                .collect()
        };
        let mut all = tier(primaries, false);
        all.extend(tier(fallbacks, true));
        Self {
            all,
            primaries: primaries.len(),
            next: [0; 2],
            falling_back: false,
        }
    }

    pub fn addr(&self, g: GatewayId) -> &str {
        &self.all[g].addr
    }

    pub fn node_id(&self, g: GatewayId) -> Option<u32> {
        self.all.get(g)?.up.as_ref().map(|u| u.node_id)
    }

    /// Whether `g` is a fallback gateway (another geo's).
    pub fn is_fallback(&self, g: GatewayId) -> bool {
        self.all.get(g).is_some_and(|l| l.fallback)
    }

    /// Primary gateways configured.
    pub fn primaries(&self) -> usize {
        self.primaries
    }

    /// A link came up to the gateway `node_id`.
    pub fn link_up(&mut self, g: GatewayId, node_id: u32) {
        if !self.all[g].fallback {
            self.falling_back = false;
        }
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

    /// Primary links up now.
    pub fn primaries_up(&self) -> usize {
        self.all[..self.primaries]
            .iter()
            .filter(|l| l.up.is_some())
            .count()
    }

    /// Sessions routed over fallback links now.
    pub fn sessions_on_fallback(&self) -> usize {
        self.all[self.primaries..]
            .iter()
            .filter_map(|l| l.up.as_ref())
            .map(|u| u.routes.len())
            .sum()
    }

    /// A session went to a fallback gateway: true for the first since a primary link was last
    /// up, so that a spell without this geo's gateways is said once, not once per session.
    pub fn fell_back(&mut self) -> bool {
        !std::mem::replace(&mut self.falling_back, true)
    }

    /// The next link that is up and, for a new login, admits new sessions. A session that
    /// moves because its gateway's link broke is already admitted: it goes to an open gateway
    /// if there is one, and to any gateway that is up if not.
    ///
    /// Only the primaries are looked at while one of them is up, closed or not: a full geo
    /// refuses new logins rather than send them to another geo. Only when none is up are the
    /// same rules applied to the fallbacks.
    pub fn pick(&mut self, new_login: bool) -> Result<GatewayId, NoGateway> {
        let primary_up = self.all[..self.primaries].iter().any(|l| l.up.is_some());
        let (tier, range) = if primary_up {
            (0, 0..self.primaries)
        } else {
            (1, self.primaries..self.all.len())
        };
        let len = range.len();
        if len == 0 {
            return Err(NoGateway::Down);
        }
        let start = self.next[tier] % len;
        self.next[tier] = self.next[tier].wrapping_add(1);
        let mut closed = Vec::new();
        for g in (0..len).map(|i| range.start + (start + i) % len) {
            let Some(up) = &self.all[g].up else {
                continue;
            };
            match &up.closed {
                None => {
                    // The turn passes on from the one picked, so the gateway after a skipped
                    // one does not get a double share.
                    self.next[tier] = g - range.start + 1;
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
        let mut g = Gateways::new(&addrs, &[]);
        for (i, c) in states.into_iter().enumerate() {
            g.link_up(i, i as u32 + 1);
            g.set_admission(i, c);
        }
        g
    }

    /// Primaries `p1..` and fallbacks `f1..`, every link down; gateway i is node i + 1 once up.
    fn tiers(primaries: usize, fallbacks: usize) -> Gateways {
        let p: Vec<String> = (1..=primaries).map(|i| format!("p{i}")).collect();
        let f: Vec<String> = (1..=fallbacks).map(|i| format!("f{i}")).collect();
        Gateways::new(&p, &f)
    }

    fn up(g: &mut Gateways, ids: &[GatewayId]) {
        for &i in ids {
            g.link_up(i, i as u32 + 1);
        }
    }

    /// The addresses of `n` picks.
    fn picks(g: &mut Gateways, n: usize, new_login: bool) -> Vec<String> {
        (0..n)
            .map(|_| {
                let picked = g.pick(new_login).expect("a gateway");
                g.addr(picked).to_string()
            })
            .collect()
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
        let mut g = Gateways::new(&["127.0.0.1:1".to_string()], &["127.0.0.2:1".to_string()]);
        assert_eq!(g.pick(true).err(), Some(NoGateway::Down));
        assert_eq!(g.pick(false).err(), Some(NoGateway::Down));
        assert_eq!(
            Gateways::new(&[], &[]).pick(true).err(),
            Some(NoGateway::Down)
        );
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

    #[test]
    fn fallbacks_come_after_the_primaries_and_say_so() {
        let g = tiers(2, 1);
        assert_eq!(g.count(), 3);
        assert_eq!(g.primaries(), 2);
        assert_eq!(
            (0..3)
                .map(|i| (g.addr(i), g.is_fallback(i)))
                .collect::<Vec<_>>(),
            [("p1", false), ("p2", false), ("f1", true)]
        );
    }

    #[test]
    fn while_a_primary_is_up_no_fallback_is_picked() {
        let mut g = tiers(2, 2);
        up(&mut g, &[0, 2, 3]);
        assert_eq!(picks(&mut g, 4, true), ["p1"; 4]);
        assert_eq!(picks(&mut g, 2, false), ["p1"; 2]);
        up(&mut g, &[1]);
        assert_eq!(picks(&mut g, 4, true), ["p2", "p1", "p2", "p1"]);
    }

    #[test]
    fn full_primaries_refuse_a_login_rather_than_spill_it_to_a_fallback() {
        let mut g = tiers(1, 1);
        up(&mut g, &[0, 1]);
        g.set_admission(0, closed("tick_overrun", 2000));
        let Err(NoGateway::Full { detail, .. }) = g.pick(true) else {
            panic!("the only primary is closed")
        };
        assert!(detail.contains("node 1: tick_overrun"), "{detail}");
        // A moving session was admitted already: it lands on the closed primary, not afar.
        assert_eq!(picks(&mut g, 1, false), ["p1"]);
    }

    #[test]
    fn with_no_primary_up_the_fallbacks_take_turns_under_the_same_rules() {
        let mut g = tiers(2, 3);
        up(&mut g, &[2, 3, 4]);
        g.set_admission(3, closed("outbox_pressure", 0));
        assert_eq!(picks(&mut g, 4, true), ["f1", "f3", "f1", "f3"]);
        g.set_admission(2, closed("tick_overrun", 1500));
        g.set_admission(4, closed("tick_overrun", 0));
        let Err(NoGateway::Full {
            retry_after_ms,
            detail,
        }) = g.pick(true)
        else {
            panic!("every fallback up is closed")
        };
        assert_eq!(retry_after_ms, 1500);
        assert!(detail.contains("node 3: tick_overrun"), "{detail}");
        let moving = g.pick(false).expect("a moving session lands");
        assert!(g.is_fallback(moving));
        // A primary back: the next picks are its own again.
        up(&mut g, &[1]);
        assert_eq!(picks(&mut g, 2, true), ["p2", "p2"]);
    }

    #[test]
    fn a_spell_on_the_fallbacks_is_said_once_until_a_primary_is_back() {
        let mut g = tiers(1, 1);
        up(&mut g, &[1]);
        assert!(g.fell_back(), "the first session of the spell");
        assert!(!g.fell_back());
        up(&mut g, &[1]);
        assert!(!g.fell_back(), "a fallback link coming up ends no spell");
        up(&mut g, &[0]);
        g.link_down(0);
        assert!(g.fell_back(), "a new spell after the primary was up");
    }

    #[test]
    fn sessions_on_fallback_count_the_routes_of_fallback_links_only() {
        let mut g = tiers(1, 2);
        up(&mut g, &[0, 1, 2]);
        g.open_session(0, 10);
        g.open_session(1, 11);
        g.open_session(2, 12);
        let on_f2 = g.open_session(2, 13).unwrap();
        assert_eq!(g.sessions_on_fallback(), 3);
        g.release(2, on_f2);
        assert_eq!(g.sessions_on_fallback(), 2);
        g.link_down(1);
        assert_eq!(g.sessions_on_fallback(), 1);
        assert_eq!(tiers(1, 0).sessions_on_fallback(), 0);
    }
}
