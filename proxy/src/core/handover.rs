//! The handover policy at work (README.md#geos-bridge-first-hand-over-later): every second, each
//! session's whereabouts (from its gateway) and RTT figures (this proxy's own, and what other
//! geos' proxies measured and published on this geo's board) go through
//! [`Handover::observe`]; a session it says is worth a reconnect is handed over.

use std::collections::HashMap;

use cellmesh_world::geometry::{Pos, WorldShape};
use cellmesh_world::handover::{GeoRtt, Handover, HandoverParams, RttFigure, Verdict, Whereabouts};

use super::{BoardRequest, ConnId, Output, ProxyCore, TimerKey};
use crate::{HandoverCause, HandoverRecord};

/// How often the policy looks at every session.
pub(super) const EVERY_MS: u64 = 1_000;

/// The policy, made at the first session (it needs the world's size, which `Attached` says),
/// and the handovers asked of the boards.
pub(super) struct Policy {
    params: HandoverParams,
    home: String,
    policy: Option<Handover<ConnId>>,
    /// Handovers under way, by connection: the cause, until the boards answer.
    transfers: HashMap<ConnId, HandoverCause>,
}

impl Policy {
    pub(super) fn new(params: HandoverParams, home: &str) -> Self {
        Self {
            params,
            home: home.to_string(),
            policy: None,
            transfers: HashMap::new(),
        }
    }

    pub(super) fn forget(&mut self, conn: ConnId) {
        if let Some(p) = &mut self.policy {
            p.forget(&conn);
        }
        self.transfers.remove(&conn);
    }
}

impl ProxyCore {
    /// Every session away from home asks the board for the far geos' figures; each answer goes
    /// through the policy (a session at home goes through it at once).
    pub(super) fn handover_tick(&mut self) {
        self.timers
            .arm(TimerKey::Handover, self.now.ms() + EVERY_MS);
        let sessions: Vec<(ConnId, String, (f64, f64))> = self
            .conns
            .iter()
            .filter_map(|(id, c)| {
                let s = c.session()?;
                let w = s.whereabouts.as_ref()?;
                Some((*id, w.geo.clone(), s.world))
            })
            .collect();
        if let Some((_, _, world)) = sessions.first() {
            let Policy {
                params,
                home,
                policy,
                ..
            } = &mut self.handover;
            policy.get_or_insert_with(|| {
                let world = WorldShape {
                    width: world.0,
                    height: world.1,
                    ..WorldShape::default()
                };
                Handover::new(params.clone(), world, home.clone())
            });
        }
        for (conn, geo, _) in sessions {
            if geo == self.handover.home {
                self.observe(conn, HashMap::new());
            } else if let Some(account) = self.conns[&conn].session_account() {
                let request = BoardRequest::FarRtts {
                    account: account.to_string(),
                };
                self.out.push_back(Output::Board { conn, request });
            }
        }
        let live: std::collections::HashSet<ConnId> = self.conns.keys().copied().collect();
        if let Some(p) = &mut self.handover.policy {
            p.retain(|k| live.contains(k));
            self.metrics.bridged_sessions.set(p.bridged() as i64);
        }
    }

    /// Kept on the connection too, for the gateway's next `SessionRtt`.
    pub(super) fn on_far_rtts(&mut self, conn: ConnId, far: HashMap<String, RttFigure>) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.set_far_rtt(&far);
        }
        self.observe(conn, far);
    }

    /// One session through the policy; a handover if it says so.
    fn observe(&mut self, conn: ConnId, far: HashMap<String, RttFigure>) {
        let Some(policy) = &mut self.handover.policy else {
            return;
        };
        let Some(s) = self.conns.get(&conn).and_then(|c| c.session()) else {
            return;
        };
        let Some(w) = &s.whereabouts else {
            return;
        };
        let p = w.position.unwrap_or_default();
        let at = Whereabouts {
            geo: w.geo.clone(),
            region: w.region,
            pos: Pos { x: p.x, y: p.y },
        };
        let rtt = if at.geo == self.handover.home {
            GeoRtt::default()
        } else {
            GeoRtt {
                current: s.rtt_figure(),
                far,
            }
        };
        if let Verdict::HandOver { to_geo, because } =
            policy.observe(self.now.ms(), &conn, &at, &rtt)
        {
            self.hand_over(conn, &to_geo, because.into());
        }
    }

    /// Hands a session over to `geo`'s proxies: the boards seal the hint and pin it there, the
    /// client gets `Transfer`, and the session ends here (its avatar waits for the login there).
    pub(super) fn hand_over(&mut self, conn: ConnId, geo: &str, because: HandoverCause) {
        let account = self
            .conns
            .get(&conn)
            .and_then(|c| c.session_account())
            .unwrap_or_default()
            .to_string();
        let refused = if geo == self.handover.home {
            Some(format!("`{geo}` is this proxy's own geo"))
        } else if !self.peer_geos.iter().any(|g| g == geo) {
            Some(format!("geo `{geo}` is not among this proxy's peers"))
        } else {
            let mut started = false;
            self.with_conn(conn, |c, cx, _| {
                started = c.start_transfer(cx, geo, because)
            });
            (!started).then(|| format!("the session of `{account}` is ending already"))
        };
        match refused {
            None => {
                self.handover.transfers.insert(conn, because);
            }
            Some(error) => self.out.push_back(Output::HandedOver {
                account,
                result: Err(error),
            }),
        }
    }

    /// The boards made the `Transfer` (or could not).
    pub(super) fn on_transfer(
        &mut self,
        conn: ConnId,
        result: Result<cellmesh_proto::edge::Transfer, String>,
    ) {
        let Some(because) = self.handover.transfers.remove(&conn) else {
            return;
        };
        let Some(account) = self
            .conns
            .get(&conn)
            .and_then(|c| c.session_account())
            .map(str::to_string)
        else {
            return;
        };
        let outcome = result.as_ref().map(|t| t.geo.clone()).map_err(Clone::clone);
        let mut done = false;
        self.with_conn(conn, |c, cx, g| {
            done = c.finish_transfer(cx, g, result, because)
        });
        let result = match outcome {
            Ok(to_geo) if done => Ok(HandoverRecord {
                unix_ms: self.now.unix_ms,
                account: account.clone(),
                to_geo,
                because,
            }),
            Ok(_) => Err(format!("the session of `{account}` is ending already")),
            Err(e) => Err(e),
        };
        self.out.push_back(Output::HandedOver { account, result });
    }
}
