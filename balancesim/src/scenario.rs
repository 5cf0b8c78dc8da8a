//! Scenario files: a world of chunks, nodes and spares, crowds that gather, walk and disperse,
//! loads that flap, and the balancer's parameters. [`ScenarioFile`] is the TOML as written;
//! [`Scenario`] is the same, checked, with every entity's place drawn from the seed, so that a run
//! needs no randomness of its own.
//!
//! Positions and radii are in chunks, speeds in chunks per second. The world is a torus: every
//! position is taken modulo its size, and a crowd walks to its next waypoint the shortest way
//! around, across the seam if that is shorter.

use std::collections::{BTreeMap, BTreeSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use cellmesh_world::balance::{LoadConfig, LoadConfigError};
use cellmesh_world::geometry::{ChunkPos, Pos, WorldShape};
use cellmesh_world::partition::NodeId;

/// Longest scenario accepted: a day of virtual time.
pub const MAX_DURATION_S: u64 = 24 * 3600;
/// Largest world side, in chunks.
pub const MAX_CHUNKS: i64 = 1024;
/// Most entities a scenario may hold (crowds, flaps and background together).
pub const MAX_ENTITIES: u64 = 200_000;
/// Most nodes, spares included.
pub const MAX_NODES: u64 = 64;
/// Most (node, round) pairs a run may record: the report keeps every node's load every round.
pub const MAX_SAMPLES: u64 = 4_000_000;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScenarioError {
    #[error("scenario is not valid TOML: {0}")]
    Toml(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Balance(#[from] LoadConfigError),
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
    /// Seeds where entities stand; the same seed gives the same run.
    #[serde(default = "one")]
    pub seed: u64,
    pub world: WorldSpec,
    pub nodes: NodesSpec,
    /// Apply lags of single nodes, over `nodes.lag_*`.
    #[serde(default)]
    pub lag: Vec<LagSpec>,
    #[serde(default)]
    pub spares: Vec<SpareSpec>,
    #[serde(default)]
    pub load: LoadSpec,
    /// Overrides of the balancer's parameters (`balance::LoadConfig`).
    #[serde(default)]
    pub balance: LoadConfig,
    #[serde(default)]
    pub background: BackgroundSpec,
    #[serde(default)]
    pub crowds: Vec<CrowdSpec>,
    #[serde(default)]
    pub flaps: Vec<FlapSpec>,
}

fn one() -> u64 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorldSpec {
    pub chunks_x: i64,
    pub chunks_y: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesSpec {
    /// Nodes 1..=initial hold a cell each from the start, laid out by halving the world.
    pub initial: u32,
    /// How far past its cell each node holds ghosts (the sidecar's view radius + release margin).
    #[serde(default = "default_ghost_chunks")]
    pub ghost_chunks: i64,
    /// How long after a commit a node applies the new layout, in rounds or in ms (one of them).
    pub lag_rounds: Option<u64>,
    pub lag_ms: Option<u64>,
    /// What a node becomes once its retired cell is deleted.
    #[serde(default)]
    pub retired: Retired,
}

fn default_ghost_chunks() -> i64 {
    6
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Retired {
    /// It stays running, a spare the balancer may give a cell again.
    #[default]
    Spare,
    /// It exits.
    Exit,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LagSpec {
    pub node: NodeId,
    pub rounds: Option<u64>,
    pub ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpareSpec {
    /// When the spare starts, holding no cell.
    #[serde(default)]
    pub join_s: f64,
    #[serde(default = "one_u32")]
    pub count: u32,
}

fn one_u32() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadSpec {
    /// The share of a node's tick budget one entity costs (the sidecar's estimate for a silent
    /// game: 0.05 ms of a 50 ms tick).
    pub cost_per_entity: f64,
    /// The share of the way to the latest load covered per second, as the sidecar smooths.
    pub smoothing_bias: f64,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self {
            cost_per_entity: 0.001,
            smoothing_bias: 0.2,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackgroundSpec {
    /// Entities standing still, spread evenly over the world.
    pub entities: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disperse {
    /// The entities log out one by one.
    #[default]
    Leave,
    /// They walk back to where they gathered from, and stay.
    Scatter,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrowdSpec {
    pub name: String,
    pub entities: u32,
    /// Entities stand evenly over a disc of this radius (chunks) around the crowd's centre.
    #[serde(default = "default_radius")]
    pub radius: f64,
    /// The centre when the crowd forms.
    pub at: [f64; 2],
    #[serde(default)]
    pub start_s: f64,
    /// The entities walk in from all over the world over this long (0: they log in on the spot).
    #[serde(default)]
    pub gather_s: f64,
    /// Chunks per second the centre walks between waypoints.
    pub speed: Option<f64>,
    /// Followed in order from `start_s`, each the shortest way around the torus.
    #[serde(default)]
    pub waypoints: Vec<WaypointSpec>,
    /// When the crowd starts to disperse (never, without it).
    pub end_s: Option<f64>,
    /// How long dispersing takes.
    #[serde(default)]
    pub disperse_s: f64,
    #[serde(default)]
    pub disperse: Disperse,
}

fn default_radius() -> f64 {
    4.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaypointSpec {
    pub to: [f64; 2],
    /// Pause on arrival.
    #[serde(default)]
    pub wait_s: f64,
}

/// A load that flaps: a crowd at `a` for the first half of each period and at `b` for the
/// second (a raid that hops between two bosses, players who teleport back and forth).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlapSpec {
    pub name: String,
    pub entities: u32,
    #[serde(default = "default_radius")]
    pub radius: f64,
    pub a: [f64; 2],
    pub b: [f64; 2],
    pub period_s: f64,
    #[serde(default)]
    pub start_s: f64,
    pub end_s: Option<f64>,
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
    /// The world in chunks.
    pub chunks: (i64, i64),
    /// The same world as the partition sees it: one unit is one chunk.
    pub shape: WorldShape,
    pub initial: Vec<NodeId>,
    /// Spares and when each starts.
    pub spares: Vec<(NodeId, u64)>,
    /// Every node's apply lag (ms).
    pub lag_ms: BTreeMap<NodeId, u64>,
    pub ghost_chunks: i64,
    pub retired: Retired,
    pub cost_per_entity: f64,
    pub smoothing_bias: f64,
    pub balance: LoadConfig,
    pub background: Vec<Pos>,
    pub crowds: Vec<Crowd>,
    pub flaps: Vec<Flap>,
}

/// A crowd, resolved: its path and each member's place.
#[derive(Debug, Clone)]
pub struct Crowd {
    pub name: String,
    pub at: Pos,
    pub start_ms: u64,
    pub gather_ms: u64,
    pub end_ms: Option<u64>,
    pub disperse_ms: u64,
    pub disperse: Disperse,
    legs: Vec<Leg>,
    members: Vec<Member>,
}

/// A straight leg from the end of the previous one, then a pause.
#[derive(Debug, Clone, Copy)]
struct Leg {
    dx: f64,
    dy: f64,
    move_ms: f64,
    wait_ms: f64,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    /// Where it stands from the centre.
    offset: (f64, f64),
    /// Where it gathers from and scatters to.
    home: Pos,
    /// When it leaves, as a share of the dispersal.
    leave_at: f64,
}

#[derive(Debug, Clone)]
pub struct Flap {
    pub name: String,
    pub a: Pos,
    pub b: Pos,
    pub period_ms: u64,
    pub start_ms: u64,
    pub end_ms: Option<u64>,
    offsets: Vec<(f64, f64)>,
}

fn ms(what: &str, s: f64) -> Result<u64, ScenarioError> {
    if !(s.is_finite() && s >= 0.0 && s <= MAX_DURATION_S as f64) {
        return Err(invalid(format!(
            "{what}: {s} s must be between 0 and {MAX_DURATION_S}"
        )));
    }
    Ok((s * 1000.0).round() as u64)
}

fn finite_pos(what: &str, p: [f64; 2]) -> Result<Pos, ScenarioError> {
    if p.iter().all(|v| v.is_finite()) {
        Ok(Pos { x: p[0], y: p[1] })
    } else {
        Err(invalid(format!("{what}: {p:?} must be finite")))
    }
}

fn radius(what: &str, r: f64, shape: &WorldShape) -> Result<f64, ScenarioError> {
    let most = shape.width.min(shape.height) / 2.0;
    if !(r.is_finite() && (0.0..=most).contains(&r)) {
        return Err(invalid(format!(
            "{what}: radius {r} must be within 0..={most} chunks (half the world)"
        )));
    }
    Ok(r)
}

/// An evenly drawn point of a disc of radius `r`.
fn in_disc(rng: &mut StdRng, r: f64) -> (f64, f64) {
    let d = r * rng.random::<f64>().sqrt();
    let a = std::f64::consts::TAU * rng.random::<f64>();
    (d * a.cos(), d * a.sin())
}

fn anywhere(rng: &mut StdRng, shape: &WorldShape) -> Pos {
    Pos {
        x: rng.random::<f64>() * shape.width,
        y: rng.random::<f64>() * shape.height,
    }
}

impl Scenario {
    pub fn from_toml(text: &str) -> Result<Self, ScenarioError> {
        Self::new(ScenarioFile::from_toml(text)?)
    }

    pub fn new(f: ScenarioFile) -> Result<Self, ScenarioError> {
        let (cx, cy) = (f.world.chunks_x, f.world.chunks_y);
        if !((1..=MAX_CHUNKS).contains(&cx) && (1..=MAX_CHUNKS).contains(&cy)) {
            return Err(invalid(format!(
                "world: {cx} × {cy} chunks, each side must be within 1..={MAX_CHUNKS}"
            )));
        }
        let shape = WorldShape {
            width: cx as f64,
            height: cy as f64,
            chunk_size: 1.0,
            region_size: 1.0,
        };
        f.balance.validate()?;
        let period = f.balance.balance_period_ms;
        if f.duration_s == 0 || f.duration_s > MAX_DURATION_S {
            return Err(invalid(format!(
                "duration_s: {} must be within 1..={MAX_DURATION_S}",
                f.duration_s
            )));
        }
        let duration_ms = f.duration_s * 1000;
        if period > duration_ms {
            return Err(invalid(format!(
                "balance.balance_period_ms: {period} is longer than the scenario"
            )));
        }

        let n = &f.nodes;
        if n.initial == 0 {
            return Err(invalid("nodes.initial: at least one node must hold a cell"));
        }
        if !(0..=64).contains(&n.ghost_chunks) {
            return Err(invalid(format!(
                "nodes.ghost_chunks: {} must be within 0..=64",
                n.ghost_chunks
            )));
        }
        let lag_of = |what: &str, rounds: Option<u64>, ms: Option<u64>| match (rounds, ms) {
            (Some(_), Some(_)) => Err(invalid(format!(
                "{what}: give the lag in rounds or in ms, not both"
            ))),
            (Some(r), None) => Ok(r.saturating_mul(period)),
            (None, Some(ms)) => Ok(ms),
            (None, None) => Ok(period),
        };
        let default_lag = lag_of("nodes", n.lag_rounds, n.lag_ms)?;
        let initial: Vec<NodeId> = (1..=n.initial).collect();
        let mut spares = Vec::new();
        let mut next = n.initial;
        for (i, s) in f.spares.iter().enumerate() {
            let what = format!("spare {}", i + 1);
            if s.count == 0 {
                return Err(invalid(format!("{what}: count must be >= 1")));
            }
            let join_ms = ms(&format!("{what}: join_s"), s.join_s)?;
            if join_ms >= duration_ms {
                return Err(invalid(format!("{what}: joins after the scenario ends")));
            }
            for _ in 0..s.count {
                next = next.saturating_add(1);
                spares.push((next, join_ms));
            }
        }
        let nodes = u64::from(n.initial) + spares.len() as u64;
        if nodes > MAX_NODES {
            return Err(invalid(format!(
                "{nodes} nodes is more than the {MAX_NODES} a scenario may have"
            )));
        }
        let rounds = duration_ms / period + 1;
        if nodes * rounds > MAX_SAMPLES {
            return Err(invalid(format!(
                "{nodes} nodes over {rounds} rounds is more than the {MAX_SAMPLES} samples a run \
                 may record: shorten it, or balance less often"
            )));
        }
        let mut lag_ms: BTreeMap<NodeId, u64> = initial
            .iter()
            .chain(spares.iter().map(|(s, _)| s))
            .map(|n| (*n, default_lag))
            .collect();
        let mut seen = BTreeSet::new();
        for l in &f.lag {
            let what = format!("lag of node {}", l.node);
            if !lag_ms.contains_key(&l.node) {
                return Err(invalid(format!(
                    "{what}: no such node (nodes are 1..={nodes})"
                )));
            }
            if !seen.insert(l.node) {
                return Err(invalid(format!("{what}: given twice")));
            }
            if l.rounds.is_none() && l.ms.is_none() {
                return Err(invalid(format!("{what}: give rounds or ms")));
            }
            lag_ms.insert(l.node, lag_of(&what, l.rounds, l.ms)?);
        }

        let c = &f.load.cost_per_entity;
        if !(c.is_finite() && *c > 0.0 && *c <= 1.0) {
            return Err(invalid(format!(
                "load.cost_per_entity: {c} must be within (0, 1]"
            )));
        }
        let b = f.load.smoothing_bias;
        if !(b > 0.0 && b <= 1.0) {
            return Err(invalid(format!(
                "load.smoothing_bias: {b} must be within (0, 1] (1: no smoothing)"
            )));
        }

        let total: u64 = u64::from(f.background.entities)
            + f.crowds.iter().map(|c| u64::from(c.entities)).sum::<u64>()
            + f.flaps.iter().map(|c| u64::from(c.entities)).sum::<u64>();
        if total > MAX_ENTITIES {
            return Err(invalid(format!(
                "{total} entities is more than the {MAX_ENTITIES} a scenario may have"
            )));
        }
        let mut names = BTreeSet::new();
        let mut rng = StdRng::seed_from_u64(f.seed);
        let background = (0..f.background.entities)
            .map(|_| anywhere(&mut rng, &shape))
            .collect();

        let mut crowds = Vec::with_capacity(f.crowds.len());
        for c in &f.crowds {
            let what = format!("crowd {:?}", c.name);
            if !names.insert(c.name.clone()) {
                return Err(invalid(format!("{what}: the name is used twice")));
            }
            let r = radius(&what, c.radius, &shape)?;
            let at = finite_pos(&format!("{what}: at"), c.at)?;
            let start_ms = ms(&format!("{what}: start_s"), c.start_s)?;
            if start_ms >= duration_ms {
                return Err(invalid(format!("{what}: starts after the scenario ends")));
            }
            let gather_ms = ms(&format!("{what}: gather_s"), c.gather_s)?;
            let end_ms = c
                .end_s
                .map(|s| ms(&format!("{what}: end_s"), s))
                .transpose()?;
            if end_ms.is_some_and(|e| e < start_ms + gather_ms) {
                return Err(invalid(format!(
                    "{what}: end_s comes before the crowd has gathered (start_s + gather_s)"
                )));
            }
            let disperse_ms = ms(&format!("{what}: disperse_s"), c.disperse_s)?;
            if !c.waypoints.is_empty() && !c.speed.is_some_and(|v| v.is_finite() && v > 0.0) {
                return Err(invalid(format!(
                    "{what}: speed must be > 0 chunks/s to follow waypoints"
                )));
            }
            let mut legs = Vec::with_capacity(c.waypoints.len());
            let mut from = at;
            for (i, w) in c.waypoints.iter().enumerate() {
                let ww = format!("{what}: waypoint {}", i + 1);
                let to = finite_pos(&ww, w.to)?;
                let (dx, dy) = shape.delta(from, to);
                let speed = c.speed.unwrap_or(1.0);
                legs.push(Leg {
                    dx,
                    dy,
                    move_ms: dx.hypot(dy) / speed * 1000.0,
                    wait_ms: ms(&format!("{ww}: wait_s"), w.wait_s)? as f64,
                });
                from = to;
            }
            let members = (0..c.entities)
                .map(|_| Member {
                    offset: in_disc(&mut rng, r),
                    home: anywhere(&mut rng, &shape),
                    leave_at: 1.0 - rng.random::<f64>(),
                })
                .collect();
            crowds.push(Crowd {
                name: c.name.clone(),
                at,
                start_ms,
                gather_ms,
                end_ms,
                disperse_ms,
                disperse: c.disperse,
                legs,
                members,
            });
        }

        let mut flaps = Vec::with_capacity(f.flaps.len());
        for fl in &f.flaps {
            let what = format!("flap {:?}", fl.name);
            if !names.insert(fl.name.clone()) {
                return Err(invalid(format!("{what}: the name is used twice")));
            }
            let r = radius(&what, fl.radius, &shape)?;
            let period_ms = ms(&format!("{what}: period_s"), fl.period_s)?;
            if period_ms < 2 * period {
                return Err(invalid(format!(
                    "{what}: period_s must be at least two balance periods ({} ms)",
                    2 * period
                )));
            }
            let start_ms = ms(&format!("{what}: start_s"), fl.start_s)?;
            let end_ms = fl
                .end_s
                .map(|s| ms(&format!("{what}: end_s"), s))
                .transpose()?;
            if end_ms.is_some_and(|e| e <= start_ms) {
                return Err(invalid(format!("{what}: end_s must come after start_s")));
            }
            flaps.push(Flap {
                name: fl.name.clone(),
                a: finite_pos(&format!("{what}: a"), fl.a)?,
                b: finite_pos(&format!("{what}: b"), fl.b)?,
                period_ms,
                start_ms,
                end_ms,
                offsets: (0..fl.entities).map(|_| in_disc(&mut rng, r)).collect(),
            });
        }

        Ok(Self {
            name: f.name,
            description: f.description,
            duration_ms,
            seed: f.seed,
            chunks: (cx, cy),
            shape,
            initial,
            spares,
            lag_ms,
            ghost_chunks: n.ghost_chunks,
            retired: n.retired,
            cost_per_entity: f.load.cost_per_entity,
            smoothing_bias: f.load.smoothing_bias,
            balance: f.balance,
            background,
            crowds,
            flaps,
        })
    }

    /// Every entity present at `t_ms`, by chunk.
    pub fn entities_at(&self, t_ms: u64, mut out: impl FnMut(ChunkPos)) {
        let w = &self.shape;
        for p in &self.background {
            out(w.chunk_of(*p));
        }
        for c in &self.crowds {
            c.each_at(w, t_ms, &mut out);
        }
        for f in &self.flaps {
            let Some(at) = f.centre_at(t_ms) else {
                continue;
            };
            for (dx, dy) in &f.offsets {
                out(w.chunk_of(Pos {
                    x: at.x + dx,
                    y: at.y + dy,
                }));
            }
        }
    }

    /// Every entity present at `t_ms` on a grid of counts, row by row (`y * chunks_x + x`).
    pub fn grid_at(&self, t_ms: u64, grid: &mut [u32]) {
        grid.fill(0);
        let cx = self.chunks.0;
        self.entities_at(t_ms, |c| grid[(c.y * cx + c.x) as usize] += 1);
    }
}

fn lerp(w: &WorldShape, a: Pos, b: Pos, f: f64) -> Pos {
    let (dx, dy) = w.delta(a, b);
    Pos {
        x: a.x + dx * f,
        y: a.y + dy * f,
    }
}

impl Crowd {
    /// The centre at `t_ms` (normalised), whether or not the crowd is there yet or still.
    pub fn centre_at(&self, w: &WorldShape, t_ms: u64) -> Pos {
        let mut t = t_ms.saturating_sub(self.start_ms) as f64;
        let mut pos = self.at;
        for leg in &self.legs {
            if t < leg.move_ms {
                let f = t / leg.move_ms;
                return w.normalise(Pos {
                    x: pos.x + leg.dx * f,
                    y: pos.y + leg.dy * f,
                });
            }
            pos = Pos {
                x: pos.x + leg.dx,
                y: pos.y + leg.dy,
            };
            t -= leg.move_ms + leg.wait_ms;
            if t < 0.0 {
                break;
            }
        }
        w.normalise(pos)
    }

    /// Whether the crowd stands gathered at its centre at `t_ms`.
    pub fn gathered_at(&self, t_ms: u64) -> bool {
        t_ms >= self.start_ms + self.gather_ms && self.end_ms.is_none_or(|e| t_ms < e)
    }

    /// How many of its entities are in the world at `t_ms`.
    pub fn present_at(&self, t_ms: u64) -> usize {
        let mut n = 0;
        self.each_at(&WorldShape::default(), t_ms, &mut |_| n += 1);
        n
    }

    fn each_at(&self, w: &WorldShape, t_ms: u64, out: &mut impl FnMut(ChunkPos)) {
        if t_ms < self.start_ms {
            return;
        }
        let spot = |m: &Member, at: Pos| Pos {
            x: at.x + m.offset.0,
            y: at.y + m.offset.1,
        };
        if let Some(end) = self.end_ms.filter(|e| t_ms >= *e) {
            let f = if self.disperse_ms == 0 {
                1.0
            } else {
                (t_ms - end) as f64 / self.disperse_ms as f64
            };
            let at = self.centre_at(w, end);
            for m in &self.members {
                match self.disperse {
                    Disperse::Leave if f < m.leave_at => out(w.chunk_of(spot(m, at))),
                    Disperse::Leave => {}
                    Disperse::Scatter => {
                        out(w.chunk_of(lerp(w, spot(m, at), m.home, f.min(1.0))));
                    }
                }
            }
            return;
        }
        let at = self.centre_at(w, t_ms);
        let gathering = t_ms < self.start_ms + self.gather_ms;
        let f = (t_ms - self.start_ms) as f64 / self.gather_ms.max(1) as f64;
        for m in &self.members {
            let p = spot(m, at);
            out(w.chunk_of(if gathering { lerp(w, m.home, p, f) } else { p }));
        }
    }
}

impl Flap {
    /// Where the flapping crowd stands at `t_ms`, if it is there.
    pub fn centre_at(&self, t_ms: u64) -> Option<Pos> {
        if t_ms < self.start_ms || self.end_ms.is_some_and(|e| t_ms >= e) {
            return None;
        }
        let first_half = (t_ms - self.start_ms) % self.period_ms < self.period_ms / 2;
        Some(if first_half { self.a } else { self.b })
    }
}
