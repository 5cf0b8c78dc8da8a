//! Scenario files: sites, an RTT model per (player location, site), players with roles and
//! waypoints, outages. [`ScenarioFile`] is the TOML as written; [`Scenario`] is the same, checked
//! and resolved into what the runner steps through.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use cellmesh_world::bubbles::{BubbleError, Params, Role, SiteId, Sites};
use cellmesh_world::geometry::{Pos, WorldShape};

/// Longest scenario accepted: a week of virtual time.
pub const MAX_DURATION_S: u64 = 7 * 24 * 3600;
/// Most players a scenario may spawn (counts included).
pub const MAX_PLAYERS: u64 = 20_000;
/// Most (player, evaluation) pairs a run may record: the report keeps every player's RTT at every
/// evaluation, for the plot.
pub const MAX_SAMPLES: u64 = 2_000_000;
/// Samples each player takes toward each site when logging in, before the first evaluation sees
/// them (the client probes every site once it is admitted).
pub const LOGIN_PROBES: usize = 3;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScenarioError {
    #[error("scenario is not valid TOML: {0}")]
    Toml(String),
    #[error("{0}")]
    Invalid(String),
    #[error("policy: {0}")]
    Policy(#[from] BubbleError),
}

fn invalid(msg: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid(msg.into())
}

/// A scenario file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioFile {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub duration_s: u64,
    /// Seeds the RTT jitter; the same seed gives the same run.
    #[serde(default = "one")]
    pub seed: u64,
    #[serde(default)]
    pub world: WorldShape,
    /// Overrides of the placement parameters (see `bubbles::Params`).
    #[serde(default)]
    pub policy: Params,
    pub sites: Vec<SiteSpec>,
    pub rtt: RttSpec,
    #[serde(default)]
    pub players: Vec<PlayerSpec>,
    #[serde(default)]
    pub outages: Vec<OutageSpec>,
}

fn one() -> u64 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteSpec {
    pub name: String,
    /// Exactly one site is the core: the fallback, never down.
    #[serde(default)]
    pub core: bool,
}

/// RTT from where a player is to each site: `base + U(0, jitter_ms)`, plus `spike_ms` with
/// probability `spike_chance` (a lost ping retried), plus the player's own `rtt_changes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RttSpec {
    #[serde(default = "default_jitter")]
    pub jitter_ms: f64,
    #[serde(default = "default_spike_chance")]
    pub spike_chance: f64,
    #[serde(default = "default_spike")]
    pub spike_ms: f64,
    /// `from.<location>.<site> = base RTT in ms`: every location used by a player needs every
    /// site.
    pub from: BTreeMap<String, BTreeMap<String, f64>>,
    /// What the proxies' figure is made of.
    #[serde(default)]
    pub probe: Probe,
}

/// What a proxy measures a client's RTT with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// The kernel's round-trip estimate of the TCP connection, driven by the client's kernel
    /// ACKs: a game client that delays its answers does not move it (`measured_only` changes
    /// are not seen).
    #[default]
    Tcp,
    /// The proxy's own timed pings: a client can delay its pongs and look further away.
    Ping,
}

fn default_jitter() -> f64 {
    4.0
}
fn default_spike_chance() -> f64 {
    0.01
}
fn default_spike() -> f64 {
    80.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlayerSpec {
    /// With `count > 1`, the players are `name-1` … `name-N`.
    pub name: String,
    #[serde(default = "one_u32")]
    pub count: u32,
    /// Where the player is in the real world: a key of `rtt.from`.
    pub location: String,
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub join_s: f64,
    pub leave_s: Option<f64>,
    /// Position in the game world (m) at login.
    pub start: [f64; 2],
    /// Copies of a `count` stand on a square grid this far apart, and move together.
    #[serde(default = "default_spacing")]
    pub spacing_m: f64,
    /// Followed in order from login, each straight along the shortest way around the torus.
    #[serde(default)]
    pub waypoints: Vec<WaypointSpec>,
    #[serde(default)]
    pub rtt_changes: Vec<RttChangeSpec>,
}

fn one_u32() -> u32 {
    1
}
fn default_spacing() -> f64 {
    25.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaypointSpec {
    pub to: [f64; 2],
    /// m/s; a player walks at 5, a ship flies at hundreds.
    pub speed: f64,
    /// Pause on arrival.
    #[serde(default)]
    pub wait_s: f64,
}

/// `add_ms` on this player's RTT to `site` from `from_s` until `to_s` (or the end). With
/// `period_s`, it flaps: on for the first half of each period, off for the second. Negative
/// values are allowed (a better route); the RTT never drops below 1 ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RttChangeSpec {
    pub site: String,
    pub add_ms: f64,
    /// Only the proxies' measurement rises, not the game's latency: a client delaying its
    /// pongs. Otherwise the change is real (a route change, a VPN).
    #[serde(default)]
    pub measured_only: bool,
    #[serde(default)]
    pub from_s: f64,
    pub to_s: Option<f64>,
    pub period_s: Option<f64>,
}

/// An edge site down from `from_s` to `to_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutageSpec {
    pub site: String,
    pub from_s: f64,
    pub to_s: f64,
}

impl ScenarioFile {
    pub fn from_toml(text: &str) -> Result<Self, ScenarioError> {
        toml::from_str(text).map_err(|e| ScenarioError::Toml(e.to_string()))
    }
}

/// A checked scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub duration_ms: u64,
    pub seed: u64,
    pub world: WorldShape,
    pub params: Params,
    pub sites: Sites,
    pub rtt: RttModel,
    /// One per player, copies expanded; a player's member id is its index here.
    pub players: Vec<PlayerPlan>,
    pub outages: Vec<Outage>,
}

#[derive(Debug, Clone)]
pub struct RttModel {
    pub jitter_ms: f64,
    pub spike_chance: f64,
    pub spike_ms: f64,
    pub probe: Probe,
    pub locations: Vec<String>,
    /// `base_ms[location][site]`.
    pub base_ms: Vec<Vec<f64>>,
}

#[derive(Debug, Clone)]
pub struct PlayerPlan {
    pub name: String,
    pub location: usize,
    pub role: Role,
    pub join_ms: u64,
    pub leave_ms: Option<u64>,
    pub start: Pos,
    legs: Vec<Leg>,
    pub rtt_changes: Vec<RttChange>,
}

/// A straight leg, from the end of the previous one, then a pause.
#[derive(Debug, Clone, Copy)]
struct Leg {
    dx: f64,
    dy: f64,
    speed: f64,
    move_ms: f64,
    wait_ms: f64,
}

#[derive(Debug, Clone, Copy)]
pub struct RttChange {
    pub site: SiteId,
    pub add_ms: f64,
    pub measured_only: bool,
    pub from_ms: u64,
    pub to_ms: Option<u64>,
    pub period_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
pub struct Outage {
    pub site: SiteId,
    pub from_ms: u64,
    pub to_ms: u64,
}

fn ms(what: &str, s: f64) -> Result<u64, ScenarioError> {
    if !(s.is_finite() && s >= 0.0 && s <= MAX_DURATION_S as f64) {
        return Err(invalid(format!(
            "{what}: {s} s must be between 0 and {MAX_DURATION_S}"
        )));
    }
    Ok((s * 1000.0).round() as u64)
}

impl Scenario {
    pub fn from_toml(text: &str) -> Result<Self, ScenarioError> {
        Self::new(ScenarioFile::from_toml(text)?)
    }

    pub fn new(f: ScenarioFile) -> Result<Self, ScenarioError> {
        f.world
            .validate()
            .map_err(|e| invalid(format!("world: {e}")))?;
        f.policy.validate()?;
        if !f.policy.evaluate_every_ms.is_multiple_of(1000) {
            return Err(invalid(format!(
                "policy.evaluate_every_ms: {} must be a whole number of seconds (the simulator steps by 1 s)",
                f.policy.evaluate_every_ms
            )));
        }
        if f.duration_s == 0 || f.duration_s > MAX_DURATION_S {
            return Err(invalid(format!(
                "duration_s: {} must be within 1..={MAX_DURATION_S}",
                f.duration_s
            )));
        }

        let cores: Vec<&SiteSpec> = f.sites.iter().filter(|s| s.core).collect();
        let [core] = cores.as_slice() else {
            return Err(invalid(format!(
                "sites: exactly one must have core = true, {} do",
                cores.len()
            )));
        };
        let sites = Sites::new(
            core.name.clone(),
            f.sites.iter().filter(|s| !s.core).map(|s| s.name.clone()),
        )?;
        let site = |what: &str, name: &str| {
            sites
                .id(name)
                .ok_or_else(|| invalid(format!("{what}: unknown site {name:?}")))
        };

        for (what, v) in [
            ("rtt.jitter_ms", f.rtt.jitter_ms),
            ("rtt.spike_ms", f.rtt.spike_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(format!("{what}: {v} must be finite and >= 0")));
            }
        }
        if !(0.0..=1.0).contains(&f.rtt.spike_chance) {
            return Err(invalid(format!(
                "rtt.spike_chance: {} must be within 0..=1",
                f.rtt.spike_chance
            )));
        }
        let locations: Vec<String> = f.rtt.from.keys().cloned().collect();
        let mut base_ms = Vec::with_capacity(locations.len());
        for (loc, row) in &f.rtt.from {
            let mut out = vec![f64::NAN; sites.len()];
            for (name, &v) in row {
                let s = site(&format!("rtt.from.{loc}"), name)?;
                if !(v.is_finite() && v >= 0.0) {
                    return Err(invalid(format!(
                        "rtt.from.{loc}.{name}: {v} must be finite and >= 0"
                    )));
                }
                out[usize::from(s.0)] = v;
            }
            if let Some(missing) = sites.ids().find(|s| out[usize::from(s.0)].is_nan()) {
                return Err(invalid(format!(
                    "rtt.from.{loc}: no RTT to site {:?}",
                    sites.name(missing)
                )));
            }
            base_ms.push(out);
        }

        let total: u64 = f.players.iter().map(|p| u64::from(p.count)).sum();
        if total > MAX_PLAYERS {
            return Err(invalid(format!(
                "{total} players is more than the {MAX_PLAYERS} a scenario may have"
            )));
        }
        let mut names = BTreeSet::new();
        let mut players = Vec::with_capacity(total as usize);
        for p in &f.players {
            let what = format!("player {:?}", p.name);
            if p.count == 0 {
                return Err(invalid(format!("{what}: count must be >= 1")));
            }
            let location = locations
                .iter()
                .position(|l| *l == p.location)
                .ok_or_else(|| {
                    invalid(format!(
                        "{what}: location {:?} has no row in rtt.from",
                        p.location
                    ))
                })?;
            let join_ms = ms(&format!("{what}: join_s"), p.join_s)?;
            let leave_ms = p
                .leave_s
                .map(|s| ms(&format!("{what}: leave_s"), s))
                .transpose()?;
            if leave_ms.is_some_and(|l| l <= join_ms) {
                return Err(invalid(format!("{what}: leave_s must come after join_s")));
            }
            for (i, v) in p.start.iter().chain(&[p.spacing_m]).enumerate() {
                if !v.is_finite() || (i == 2 && *v < 0.0) {
                    return Err(invalid(format!(
                        "{what}: start and spacing_m must be finite (spacing >= 0)"
                    )));
                }
            }
            let start = Pos {
                x: p.start[0],
                y: p.start[1],
            };
            let mut legs = Vec::with_capacity(p.waypoints.len());
            let mut from = start;
            for (i, w) in p.waypoints.iter().enumerate() {
                if !(w.speed.is_finite() && w.speed > 0.0) {
                    return Err(invalid(format!(
                        "{what}: waypoint {}: speed {} must be > 0",
                        i + 1,
                        w.speed
                    )));
                }
                if !(w.to[0].is_finite() && w.to[1].is_finite()) {
                    return Err(invalid(format!(
                        "{what}: waypoint {}: position must be finite",
                        i + 1
                    )));
                }
                let to = Pos {
                    x: w.to[0],
                    y: w.to[1],
                };
                let (dx, dy) = f.world.delta(from, to);
                legs.push(Leg {
                    dx,
                    dy,
                    speed: w.speed,
                    move_ms: dx.hypot(dy) / w.speed * 1000.0,
                    wait_ms: ms(&format!("{what}: waypoint {}: wait_s", i + 1), w.wait_s)? as f64,
                });
                from = to;
            }
            let mut rtt_changes = Vec::with_capacity(p.rtt_changes.len());
            for (i, c) in p.rtt_changes.iter().enumerate() {
                let cw = format!("{what}: rtt change {}", i + 1);
                if !c.add_ms.is_finite() {
                    return Err(invalid(format!("{cw}: add_ms must be finite")));
                }
                let period_ms = c
                    .period_s
                    .map(|s| ms(&format!("{cw}: period_s"), s))
                    .transpose()?;
                if period_ms.is_some_and(|p| p < 2000) {
                    return Err(invalid(format!("{cw}: period_s must be at least 2 s")));
                }
                rtt_changes.push(RttChange {
                    site: site(&cw, &c.site)?,
                    add_ms: c.add_ms,
                    measured_only: c.measured_only,
                    from_ms: ms(&format!("{cw}: from_s"), c.from_s)?,
                    to_ms: c.to_s.map(|s| ms(&format!("{cw}: to_s"), s)).transpose()?,
                    period_ms,
                });
            }
            // Copies on a square grid around the start, all following the same legs.
            let side = (f64::from(p.count)).sqrt().ceil() as u32;
            for k in 0..p.count {
                let name = if p.count == 1 {
                    p.name.clone()
                } else {
                    format!("{}-{}", p.name, k + 1)
                };
                if !names.insert(name.clone()) {
                    return Err(invalid(format!("player {name:?} is defined twice")));
                }
                let (gx, gy) = (f64::from(k % side), f64::from(k / side));
                let off = (f64::from(side) - 1.0) / 2.0;
                players.push(PlayerPlan {
                    name,
                    location,
                    role: p.role,
                    join_ms,
                    leave_ms,
                    start: f.world.normalise(Pos {
                        x: start.x + (gx - off) * p.spacing_m,
                        y: start.y + (gy - off) * p.spacing_m,
                    }),
                    legs: legs.clone(),
                    rtt_changes: rtt_changes.clone(),
                });
            }
        }
        let evaluations = f.duration_s * 1000 / f.policy.evaluate_every_ms + 1;
        if total * evaluations > MAX_SAMPLES {
            return Err(invalid(format!(
                "{total} players over {evaluations} evaluations is more than the \
                 {MAX_SAMPLES} samples a run may record: shorten it, or evaluate less often"
            )));
        }
        if let Some(p) = players.iter().find(|p| p.join_ms >= f.duration_s * 1000) {
            return Err(invalid(format!(
                "player {:?} joins after the scenario ends",
                p.name
            )));
        }

        let mut outages = Vec::with_capacity(f.outages.len());
        for (i, o) in f.outages.iter().enumerate() {
            let what = format!("outage {}", i + 1);
            let s = site(&what, &o.site)?;
            if s == Sites::CORE {
                return Err(invalid(format!(
                    "{what}: the core site {:?} cannot go down: it is the fallback",
                    o.site
                )));
            }
            let (from_ms, to_ms) = (ms(&what, o.from_s)?, ms(&what, o.to_s)?);
            if to_ms <= from_ms {
                return Err(invalid(format!("{what}: to_s must come after from_s")));
            }
            outages.push(Outage {
                site: s,
                from_ms,
                to_ms,
            });
        }

        Ok(Self {
            name: f.name,
            description: f.description,
            duration_ms: f.duration_s * 1000,
            seed: f.seed,
            world: f.world,
            params: f.policy,
            sites,
            rtt: RttModel {
                jitter_ms: f.rtt.jitter_ms,
                spike_chance: f.rtt.spike_chance,
                spike_ms: f.rtt.spike_ms,
                probe: f.rtt.probe,
                locations,
                base_ms,
            },
            players,
            outages,
        })
    }

    /// Sites down at `t_ms`.
    pub fn unavailable_at(&self, t_ms: u64) -> Vec<SiteId> {
        let mut down: Vec<SiteId> = self
            .outages
            .iter()
            .filter(|o| (o.from_ms..o.to_ms).contains(&t_ms))
            .map(|o| o.site)
            .collect();
        down.sort_unstable();
        down.dedup();
        down
    }

    /// A player's RTT to a site at `t_ms` without jitter: what their game traffic takes.
    pub fn true_rtt(&self, player: usize, site: SiteId, t_ms: u64) -> f64 {
        self.rtt_at(player, site, t_ms, false)
    }

    /// What the proxies measure at `t_ms`, before jitter: the true RTT, plus any delay the client
    /// adds to its answers when the probe is a ping.
    pub fn measured_rtt(&self, player: usize, site: SiteId, t_ms: u64) -> f64 {
        self.rtt_at(player, site, t_ms, self.rtt.probe == Probe::Ping)
    }

    fn rtt_at(&self, player: usize, site: SiteId, t_ms: u64, measured: bool) -> f64 {
        let p = &self.players[player];
        let base = self.rtt.base_ms[p.location][usize::from(site.0)];
        let add: f64 = p
            .rtt_changes
            .iter()
            .filter(|c| c.site == site && (measured || !c.measured_only) && c.active_at(t_ms))
            .map(|c| c.add_ms)
            .sum();
        (base + add).max(1.0)
    }
}

impl RttChange {
    pub fn active_at(&self, t_ms: u64) -> bool {
        if t_ms < self.from_ms || self.to_ms.is_some_and(|end| t_ms >= end) {
            return false;
        }
        self.period_ms
            .is_none_or(|p| (t_ms - self.from_ms) % p < p / 2)
    }
}

impl PlayerPlan {
    pub fn present_at(&self, t_ms: u64) -> bool {
        t_ms >= self.join_ms && self.leave_ms.is_none_or(|l| t_ms < l)
    }

    /// Position and speed at `t_ms` (the legs start at login).
    pub fn state_at(&self, world: &WorldShape, t_ms: u64) -> (Pos, f64) {
        let mut t = t_ms.saturating_sub(self.join_ms) as f64;
        let mut pos = self.start;
        for leg in &self.legs {
            if t < leg.move_ms {
                let f = t / leg.move_ms;
                let p = Pos {
                    x: pos.x + leg.dx * f,
                    y: pos.y + leg.dy * f,
                };
                return (world.normalise(p), leg.speed);
            }
            pos = Pos {
                x: pos.x + leg.dx,
                y: pos.y + leg.dy,
            };
            t -= leg.move_ms;
            if t < leg.wait_ms {
                return (world.normalise(pos), 0.0);
            }
            t -= leg.wait_ms;
        }
        (world.normalise(pos), 0.0)
    }
}
