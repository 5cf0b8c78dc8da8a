//! Handover policy (README.md#geos-bridge-first-hand-over-later, seed `002`): when a player whose avatar is simulated in another
//! geo is worth a reconnect to that geo's proxies.
//!
//! **Bridge first, hand over later.** A player who walks into a region homed in another geo keeps
//! their connection: input and view cross the geo link inside the mesh. A handover
//! (`Transfer{host, port, cookie}`) costs a reconnect, and is worth it only when the player is
//! *clearly nearer* the geo simulating them than the geo they are connected to, judged from
//! server-measured RTT, never from where the region is: a player next to this proxy pays the
//! ocean whichever proxy they use. Then, in order of preference:
//!
//! 1. **They cross back**: nothing happens, and no reconnect was ever paid for.
//! 2. **They settle** (stay `settle_ms` and walk `settle_depth_m` past where they crossed) and
//!    then cross a region border again inside the far geo: they are handed over at that crossing,
//!    where a server switch was happening anyway and a moment of hesitation is masked.
//! 3. **Neither, for `max_bridge_ms`**: handed over anyway; a whole session across an ocean is
//!    worse than one loading screen.
//!
//! [`Handover`] keeps one [`Bridge`] per session and is fed, in virtual time, with where the
//! player's avatar is simulated ([`Handover::observe`]) and the RTT figures ([`GeoRtt`]). It reads
//! no clock and does no I/O.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::geometry::{Pos, WorldShape};

/// Every threshold of the policy, with the defaults README's *Geos: bridge first, hand over later* gives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HandoverParams {
    /// A player whose RTT to the proxy they are on is at most this is never handed over: they
    /// are next to it, and every other proxy is further.
    pub near_ms: f64,
    /// How much lower the far geo's RTT must be than the current proxy's to be worth a reconnect.
    pub min_gain_ms: f64,
    /// ...and the far RTT must also be at most this fraction of the current one, so that two
    /// far-away geos a few tens of milliseconds apart do not trade a player back and forth.
    pub max_ratio: f64,
    /// Samples wanted on both sides before the figures count.
    pub min_samples: u32,
    /// Time in the far geo's regions before the player counts as settled.
    pub settle_ms: u64,
    /// Distance from where the player crossed into the far geo before they count as settled
    /// (straight line on the torus, metres).
    pub settle_depth_m: f64,
    /// Bridged this long and worth it: handed over at once, crossing or not.
    pub max_bridge_ms: u64,
}

impl Default for HandoverParams {
    fn default() -> Self {
        Self {
            near_ms: 10.0,
            min_gain_ms: 30.0,
            max_ratio: 0.6,
            min_samples: 5,
            settle_ms: 60_000,
            settle_depth_m: 200.0,
            max_bridge_ms: 600_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("handover.{name}: {detail}")]
pub struct ParamError {
    pub name: &'static str,
    pub detail: String,
}

impl HandoverParams {
    pub fn validate(&self) -> Result<(), ParamError> {
        let finite = [
            ("near_ms", self.near_ms),
            ("min_gain_ms", self.min_gain_ms),
            ("settle_depth_m", self.settle_depth_m),
        ];
        for (name, v) in finite {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ParamError {
                    name,
                    detail: format!("{v} must be a finite number >= 0"),
                });
            }
        }
        if !(self.max_ratio > 0.0 && self.max_ratio <= 1.0) {
            return Err(ParamError {
                name: "max_ratio",
                detail: format!("{} must be within (0, 1]", self.max_ratio),
            });
        }
        if self.min_samples == 0 {
            return Err(ParamError {
                name: "min_samples",
                detail: "must be at least 1".into(),
            });
        }
        if self.max_bridge_ms < self.settle_ms {
            return Err(ParamError {
                name: "max_bridge_ms",
                detail: format!(
                    "{} must be at least settle_ms ({})",
                    self.max_bridge_ms, self.settle_ms
                ),
            });
        }
        Ok(())
    }
}

/// Server-measured round-trip figures toward one geo's proxies, over a window: the minimum (the
/// path itself; a client can delay answers but never speed them up) and the median.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RttFigure {
    pub min_ms: f64,
    pub median_ms: f64,
    pub samples: u32,
}

/// What the policy knows of one session's RTTs: toward the proxy it is on (measured there), and
/// toward other geos (each measured by that geo's proxy and published to this geo). Figures a
/// client reports about itself have no place here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GeoRtt {
    pub current: Option<RttFigure>,
    pub far: HashMap<String, RttFigure>,
}

/// Why a bridged player stays where they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stay {
    /// Simulated in the geo they are connected to: nothing to decide.
    Home,
    /// Their RTT to this proxy is already low: no other proxy can do better.
    NearProxy,
    /// Not enough samples yet toward this proxy or the far one.
    NotMeasured,
    /// The far geo is not clearly nearer.
    NotNearer,
    /// Worth it, but they have not settled yet (they may cross back for free).
    Settling,
    /// Settled: waiting for their next region crossing inside the far geo.
    AwaitingCrossing,
}

/// Why a player is handed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Because {
    /// Settled, then crossed a region border inside the far geo.
    SettledCrossing,
    /// Bridged for `max_bridge_ms`, crossing or not.
    MaxBridge,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    Stay { why: Stay },
    HandOver { to_geo: String, because: Because },
}

/// Where a session's avatar is, as the gateway last heard.
#[derive(Debug, Clone, PartialEq)]
pub struct Whereabouts {
    /// The home geo of the region simulating the avatar.
    pub geo: String,
    /// That region (any stable id: a region or node number).
    pub region: u64,
    pub pos: Pos,
}

/// One session's bridge, while its avatar is simulated outside the connected geo.
#[derive(Debug, Clone, PartialEq)]
pub struct Bridge {
    pub geo: String,
    pub since_ms: u64,
    pub entry: Pos,
    pub region: u64,
    /// Settled and worth it: the next region crossing inside `geo` hands the player over.
    pub armed: bool,
}

/// The handover policy of one proxy (its geo is `home`): a [`Bridge`] per bridged session.
#[derive(Debug, Clone)]
pub struct Handover<K> {
    params: HandoverParams,
    world: WorldShape,
    home: String,
    bridges: HashMap<K, Bridge>,
}

impl<K: std::hash::Hash + Eq + Clone> Handover<K> {
    pub fn new(params: HandoverParams, world: WorldShape, home: impl Into<String>) -> Self {
        Self {
            params,
            world,
            home: home.into(),
            bridges: HashMap::new(),
        }
    }

    pub fn params(&self) -> &HandoverParams {
        &self.params
    }

    pub fn bridge(&self, session: &K) -> Option<&Bridge> {
        self.bridges.get(session)
    }

    /// Sessions bridged now.
    pub fn bridged(&self) -> usize {
        self.bridges.len()
    }

    pub fn forget(&mut self, session: &K) {
        self.bridges.remove(session);
    }

    /// Forgets every session but those `keep` says are still there.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.bridges.retain(|k, _| keep(k));
    }

    /// Where the session's avatar is now, and its RTT figures: the verdict at `now_ms`. Call it
    /// whenever either changes (a region crossing must be observed when it happens, or the
    /// crossing that would have handed the player over is missed until the next one).
    pub fn observe(&mut self, now_ms: u64, session: &K, at: &Whereabouts, rtt: &GeoRtt) -> Verdict {
        let p = &self.params;
        if at.geo == self.home {
            // Crossed back, or never left: a bridge that never turned into a handover cost nothing.
            self.bridges.remove(session);
            return Verdict::Stay { why: Stay::Home };
        }
        let bridge = self
            .bridges
            .entry(session.clone())
            .and_modify(|b| {
                if b.geo != at.geo {
                    // A third geo: the clock starts again there.
                    *b = Bridge {
                        geo: at.geo.clone(),
                        since_ms: now_ms,
                        entry: at.pos,
                        region: at.region,
                        armed: false,
                    };
                }
            })
            .or_insert_with(|| Bridge {
                geo: at.geo.clone(),
                since_ms: now_ms,
                entry: at.pos,
                region: at.region,
                armed: false,
            });
        let crossed = bridge.region != at.region;
        bridge.region = at.region;

        let why = worth_it(p, &at.geo, rtt);
        if let Err(why) = why {
            // Not worth it (now): whatever was armed waits for the figures to say so again.
            bridge.armed = false;
            return Verdict::Stay { why };
        }
        let bridged_ms = now_ms.saturating_sub(bridge.since_ms);
        if bridged_ms >= p.max_bridge_ms {
            return Verdict::HandOver {
                to_geo: at.geo.clone(),
                because: Because::MaxBridge,
            };
        }
        if bridge.armed && crossed {
            return Verdict::HandOver {
                to_geo: at.geo.clone(),
                because: Because::SettledCrossing,
            };
        }
        let depth = self.world.distance(bridge.entry, at.pos);
        if bridged_ms >= p.settle_ms && depth >= p.settle_depth_m {
            bridge.armed = true;
            return Verdict::Stay {
                why: Stay::AwaitingCrossing,
            };
        }
        Verdict::Stay {
            why: if bridge.armed {
                Stay::AwaitingCrossing
            } else {
                Stay::Settling
            },
        }
    }
}

/// Whether the figures say the far geo is clearly nearer than the current proxy.
fn worth_it(p: &HandoverParams, far_geo: &str, rtt: &GeoRtt) -> Result<(), Stay> {
    let Some(current) = rtt.current.filter(|c| c.samples >= p.min_samples) else {
        return Err(Stay::NotMeasured);
    };
    if current.min_ms <= p.near_ms {
        return Err(Stay::NearProxy);
    }
    let Some(far) = rtt.far.get(far_geo).filter(|f| f.samples >= p.min_samples) else {
        return Err(Stay::NotMeasured);
    };
    // Minimums on both sides: a client that delays its answers raises a minimum, never lowers
    // it, so it can only make a handover less likely, never force one.
    let gain = current.min_ms - far.min_ms;
    if gain < p.min_gain_ms || far.min_ms > current.min_ms * p.max_ratio {
        return Err(Stay::NotNearer);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
