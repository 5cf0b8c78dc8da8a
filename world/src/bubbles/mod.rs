//! Bubble placement (docs/geo.md, seed `003`): which site (datacenter) simulates each group of
//! players, so that most of them play near the server while everyone stays in one world.
//!
//! The director calls [`Placement::evaluate`] every [`Params::evaluate_every_ms`] with the
//! players' positions, speeds and roles, the server-measured RTTs ([`RttBook`]) and the sites that
//! are down. It answers a list of [`Decision`]s: for every bubble alive afterwards, where it is
//! simulated and why, and for every player that changed bubble, from where to where. Applying a
//! decision (freezing a bubble, shipping its state, resuming it on the other site) is the caller's
//! business; nothing here does I/O or reads a clock, and the same inputs give the same decisions.
//!
//! The rules, in the order they are applied each evaluation:
//! 1. **Groups** ([`groups`]): players closer than their link distance are in one group,
//!    transitively. The distance grows with speed: `max(link_base_m, lead_time_s × (vᵢ + vⱼ))`,
//!    so two ships closing fast are grouped tens of kilometres apart, two walkers at 2 km. Players
//!    already in one bubble stay linked up to `split_factor` times that, so a group does not
//!    flicker apart at the threshold.
//! 2. **Membership**: a group carries on the bubble that holds most of its weight. Two bubbles on
//!    different sites in one group are merged at once onto the best site for their union
//!    (pre-emptive merge: the group distance is the warning, long before anyone can touch). A
//!    player who left their bubble and joined another group crosses to that group's site. A
//!    bubble's area follows its players: with nobody near, it is never a reason to move.
//! 3. **Site choice** ([`choice`]): the lowest weighted mean RTT over available sites, each
//!    player's RTT capped at the fairness cap; a site that puts a player above the cap is not
//!    chosen when another keeps everyone under it; a tie keeps the current site.
//! 4. **Hysteresis**: a bubble moves for a gain of at least `gain_ms` per weighted player,
//!    sustained `sustain_ms`, and not within `dwell_ms` of its previous move. Three things move a
//!    bubble at once, whatever the hysteresis says: its site going down (fallback to the core), the
//!    fairness cap, and a pre-emptive merge. Each is named in the [`Reason`].
//!
//! RTTs are the server's measurements, reduced per session to a robust estimate whose rises
//! beyond a tolerance are ignored ([`RttBook`]): a player who inflates their ping or switches VPN
//! mid-session cannot pull a bubble away from the others, nor veto a site through the cap.

pub mod choice;
pub mod groups;
mod placement;
pub mod regions;
mod rtt;

pub use placement::{BubbleSnapshot, Placement};
pub use regions::{place_regions, RegionMove, RegionPlan};
pub use rtt::{RttBook, RttParams, RttSource};

use serde::{Deserialize, Serialize};

use crate::geometry::{GeometryError, Pos};

/// A player (or an NPC) as the placement knows it: a session, not an account, so that a new
/// login starts a new RTT baseline.
pub type MemberId = u64;

/// A bubble: a part of the world delegated to one site. Ids are allocated in order by one
/// [`Placement`] and never reused.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct BubbleId(pub u64);

impl std::fmt::Display for BubbleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A site (a geo) by its index in [`Sites`]; the core is always index 0.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct SiteId(pub u16);

/// The sites, core first. The core is the fallback: it is never unavailable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sites {
    names: Vec<String>,
}

impl Sites {
    pub fn new<S: Into<String>>(
        core: S,
        edges: impl IntoIterator<Item = S>,
    ) -> Result<Self, BubbleError> {
        let names: Vec<String> = std::iter::once(core.into())
            .chain(edges.into_iter().map(Into::into))
            .collect();
        if names.len() > usize::from(u16::MAX) {
            return Err(BubbleError::Sites(format!(
                "{} sites is too many",
                names.len()
            )));
        }
        for (i, n) in names.iter().enumerate() {
            if n.trim().is_empty() {
                return Err(BubbleError::Sites("a site has an empty name".into()));
            }
            if names[..i].contains(n) {
                return Err(BubbleError::Sites(format!("site {n:?} is listed twice")));
            }
        }
        Ok(Self { names })
    }

    pub const CORE: SiteId = SiteId(0);

    pub fn core(&self) -> SiteId {
        Self::CORE
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn contains(&self, site: SiteId) -> bool {
        usize::from(site.0) < self.names.len()
    }

    /// The site's name; `"?"` for an id from another list.
    pub fn name(&self, site: SiteId) -> &str {
        self.names
            .get(usize::from(site.0))
            .map_or("?", String::as_str)
    }

    pub fn id(&self, name: &str) -> Option<SiteId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| SiteId(i as u16))
    }

    pub fn ids(&self) -> impl Iterator<Item = SiteId> + '_ {
        (0..self.names.len()).map(|i| SiteId(i as u16))
    }
}

/// What a member is doing, which sets its weight in the site choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Player,
    /// Flies a ship: everyone aboard depends on their input.
    Pilot,
    /// Idle: still a player for the fairness cap, barely counted for the mean.
    Afk,
    /// Not a player: grouped with the others, never counted.
    Npc,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Player => "player",
            Role::Pilot => "pilot",
            Role::Afk => "afk",
            Role::Npc => "npc",
        })
    }
}

/// Weight of each role in a group's weighted mean RTT. A member of weight 0 counts for nothing,
/// not even the fairness cap.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    pub player: f64,
    pub pilot: f64,
    pub afk: f64,
    pub npc: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            player: 1.0,
            pilot: 2.0,
            afk: 0.05,
            npc: 0.0,
        }
    }
}

impl Weights {
    pub fn of(&self, role: Role) -> f64 {
        match role {
            Role::Player => self.player,
            Role::Pilot => self.pilot,
            Role::Afk => self.afk,
            Role::Npc => self.npc,
        }
    }
}

/// The knobs of the placement. Defaults are those of docs/geo.md#parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Params {
    /// How often the director evaluates. The policy itself only sees the times it is given.
    pub evaluate_every_ms: u64,
    /// Group distance between two slow members.
    pub link_base_m: f64,
    /// Seconds of warning wanted before two groups can meet: the group distance of two members is
    /// at least their closing speed bound (the sum of their speeds) times this.
    pub lead_time_s: f64,
    /// Members of one bubble stay grouped up to this many times the group distance.
    pub split_factor: f64,
    pub weights: Weights,
    /// No site that puts a player above this is chosen if another keeps everyone under it; also
    /// the most one player's RTT can add to the mean.
    pub fairness_cap_ms: f64,
    /// A site is only moved to for gain if it keeps everyone this far under the cap, so that RTT
    /// rises the baseline lets through cannot push it over the cap right after the move.
    pub cap_margin_ms: f64,
    /// Sites whose weighted means differ by at most this are tied; a tie keeps the current site.
    pub tie_ms: f64,
    /// Least gain in weighted mean RTT worth a move.
    pub gain_ms: f64,
    /// How long the gain must hold, toward the same site, before the move.
    pub sustain_ms: u64,
    /// Least time between two moves of a bubble (fallback, cap and merge excepted).
    pub dwell_ms: u64,
    /// A group of at least this many players (NPCs excluded) is a big event: spread over its
    /// site's nodes.
    pub big_event_players: usize,
    pub rtt: RttParams,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            evaluate_every_ms: 5_000,
            link_base_m: 2_000.0,
            lead_time_s: 60.0,
            split_factor: 1.5,
            weights: Weights::default(),
            fairness_cap_ms: 180.0,
            cap_margin_ms: 15.0,
            tie_ms: 2.0,
            gain_ms: 25.0,
            sustain_ms: 30_000,
            dwell_ms: 180_000,
            big_event_players: 100,
            rtt: RttParams::default(),
        }
    }
}

impl Params {
    /// The same choice without hysteresis: every evaluation puts each group on its best site.
    /// The yardstick the simulator measures the policy against.
    pub fn without_hysteresis(&self) -> Self {
        Self {
            gain_ms: 0.0,
            sustain_ms: 0,
            dwell_ms: 0,
            ..self.clone()
        }
    }

    pub fn validate(&self) -> Result<(), BubbleError> {
        let finite_nonneg = [
            ("link_base_m", self.link_base_m),
            ("lead_time_s", self.lead_time_s),
            ("cap_margin_ms", self.cap_margin_ms),
            ("tie_ms", self.tie_ms),
            ("gain_ms", self.gain_ms),
            ("weights.player", self.weights.player),
            ("weights.pilot", self.weights.pilot),
            ("weights.afk", self.weights.afk),
            ("weights.npc", self.weights.npc),
        ];
        for (name, v) in finite_nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(BubbleError::param(
                    name,
                    format!("{v} must be finite and >= 0"),
                ));
            }
        }
        if self.link_base_m == 0.0 {
            return Err(BubbleError::param("link_base_m", "must be > 0"));
        }
        if !(self.split_factor.is_finite() && self.split_factor >= 1.0) {
            return Err(BubbleError::param(
                "split_factor",
                format!("{} must be finite and >= 1", self.split_factor),
            ));
        }
        if !(self.fairness_cap_ms.is_finite() && self.fairness_cap_ms > 0.0) {
            return Err(BubbleError::param(
                "fairness_cap_ms",
                format!("{} must be finite and > 0", self.fairness_cap_ms),
            ));
        }
        if self.cap_margin_ms >= self.fairness_cap_ms {
            return Err(BubbleError::param(
                "cap_margin_ms",
                format!(
                    "{} must be below fairness_cap_ms ({})",
                    self.cap_margin_ms, self.fairness_cap_ms
                ),
            ));
        }
        if self.evaluate_every_ms == 0 {
            return Err(BubbleError::param("evaluate_every_ms", "must be > 0"));
        }
        if self.big_event_players == 0 {
            return Err(BubbleError::param("big_event_players", "must be > 0"));
        }
        self.rtt.validate()
    }

    /// How far apart two members can be and still be grouped (before the split factor).
    pub fn link_distance(&self, speed_a: f64, speed_b: f64) -> f64 {
        self.link_base_m.max(self.lead_time_s * (speed_a + speed_b))
    }
}

/// One member's state at an evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub id: MemberId,
    pub pos: Pos,
    /// Current speed over ground (m/s); the group distance grows with it.
    pub speed_mps: f64,
    pub role: Role,
}

/// Where a bubble is, for whoever maps it onto regions: a disc on the torus covering every member
/// with half their link distance to spare. It follows its members from one evaluation to the
/// next (the moving border); members never leave it for lack of room.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Area {
    pub centre: Pos,
    pub radius_m: f64,
}

/// One decision of an evaluation. `from_site != to_site` means the listed members' simulation
/// moves; otherwise the decision records why nothing moves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Virtual time of the evaluation (ms).
    pub at_ms: u64,
    pub group_id: BubbleId,
    /// The members concerned, ascending: the whole bubble for a placement decision, those that
    /// changed bubble for [`Reason::Merged`] and [`Reason::Crossed`], none for
    /// [`Reason::Dissolved`].
    pub members: Vec<MemberId>,
    /// Where the members were simulated; `None` for a bubble created by this evaluation, unless
    /// the caller said where they are simulated ([`Placement::simulated_at`]).
    pub from_site: Option<SiteId>,
    pub to_site: SiteId,
    pub reason: Reason,
    /// A big event: the site should spread this bubble over several of its nodes.
    pub spread_over_nodes: bool,
    pub area: Area,
}

impl Decision {
    /// The members' simulation changes site.
    pub fn is_move(&self) -> bool {
        self.from_site.is_some_and(|from| from != self.to_site)
    }
}

/// Why a decision is what it is. Placement decisions (one per live bubble) carry every variant
/// but [`Merged`](Reason::Merged), [`Crossed`](Reason::Crossed) and
/// [`Dissolved`](Reason::Dissolved), which record players changing bubble.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// A new group, placed on its best site (nobody moves: they were not simulated anywhere yet
    /// as a group).
    Created,
    /// Members drifted away from their bubble: they keep its site in a bubble of their own.
    Split { from: BubbleId },
    /// Pre-emptive merge: bubbles on different sites came within group distance; the union
    /// goes to its best site now, whatever the hysteresis, before anyone can meet across a
    /// site border.
    Merge { absorbed: Vec<BubbleId> },
    /// Hysteresis satisfied: the gain held long enough and the dwell is over.
    Moved { gain_ms: f64, sustained_ms: u64 },
    /// The current site puts a player above the cap while another site keeps everyone under it.
    CapForced { worst_ms: f64 },
    /// The current site is unavailable: back to the core.
    Fallback { unavailable: SiteId },
    /// Already on the best site.
    Best,
    /// Another site is as good within `tie_ms`: stay.
    Tie { other: SiteId },
    /// Another site is better, by less than `gain_ms`.
    GainTooSmall { to: SiteId, gain_ms: f64 },
    /// Worth moving, but not for `sustain_ms` yet.
    NotSustained {
        to: SiteId,
        gain_ms: f64,
        sustained_ms: u64,
    },
    /// Worth moving and sustained, but the bubble moved less than `dwell_ms` ago.
    Dwell {
        to: SiteId,
        gain_ms: f64,
        remaining_ms: u64,
    },
    /// The site with the lowest mean would put a player above the cap.
    FairnessCap { site: SiteId, worst_ms: f64 },
    /// Nobody with a weight (NPCs or weightless players only): the bubble stays where it is.
    NoWeight,
    /// These members joined bubble `into` in a merge.
    Merged { into: BubbleId },
    /// These members left the bubble `group_id` and crossed to bubble `into`: they walked into
    /// a group simulated elsewhere (the other side of a moving border).
    Crossed { into: BubbleId },
    /// The bubble has no members left.
    Dissolved,
}

impl Reason {
    /// A short stable name, as in the JSON `kind` field.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::Created => "created",
            Reason::Split { .. } => "split",
            Reason::Merge { .. } => "merge",
            Reason::Moved { .. } => "moved",
            Reason::CapForced { .. } => "cap_forced",
            Reason::Fallback { .. } => "fallback",
            Reason::Best => "best",
            Reason::Tie { .. } => "tie",
            Reason::GainTooSmall { .. } => "gain_too_small",
            Reason::NotSustained { .. } => "not_sustained",
            Reason::Dwell { .. } => "dwell",
            Reason::FairnessCap { .. } => "fairness_cap",
            Reason::NoWeight => "no_weight",
            Reason::Merged { .. } => "merged",
            Reason::Crossed { .. } => "crossed",
            Reason::Dissolved => "dissolved",
        }
    }

    /// A placement decision that keeps the bubble where it is, by choice.
    pub fn is_stay(&self) -> bool {
        matches!(
            self,
            Reason::Best
                | Reason::Tie { .. }
                | Reason::GainTooSmall { .. }
                | Reason::NotSustained { .. }
                | Reason::Dwell { .. }
                | Reason::FairnessCap { .. }
                | Reason::NoWeight
        )
    }

    /// Moves that ignore the gain, sustain and dwell rules.
    pub fn is_forced(&self) -> bool {
        matches!(
            self,
            Reason::Merge { .. }
                | Reason::Merged { .. }
                | Reason::CapForced { .. }
                | Reason::Fallback { .. }
        )
    }

    /// One line for people, with site names.
    pub fn describe(&self, sites: &Sites) -> String {
        let s = |id: &SiteId| sites.name(*id).to_owned();
        let secs = |ms: &u64| *ms as f64 / 1000.0;
        match self {
            Reason::Created => "new group, placed on its best site".into(),
            Reason::Split { from } => format!("split from bubble {from}, keeps its site"),
            Reason::Merge { absorbed } => {
                let ids: Vec<String> = absorbed.iter().map(ToString::to_string).collect();
                format!(
                    "pre-emptive merge with {}: best site for the union",
                    ids.join(", ")
                )
            }
            Reason::Moved {
                gain_ms,
                sustained_ms,
            } => format!(
                "gain {gain_ms:.1} ms per weighted player, sustained {:.0} s",
                secs(sustained_ms)
            ),
            Reason::CapForced { worst_ms } => format!(
                "fairness cap: a player was at {worst_ms:.0} ms here while another site keeps everyone under the cap"
            ),
            Reason::Fallback { unavailable } => {
                format!("{} is unavailable: fallback to the core", s(unavailable))
            }
            Reason::Best => "already on the best site".into(),
            Reason::Tie { other } => format!("tie with {}: keeps its site", s(other)),
            Reason::GainTooSmall { to, gain_ms } => {
                format!("gain too small: {} better by {gain_ms:.1} ms", s(to))
            }
            Reason::NotSustained {
                to,
                gain_ms,
                sustained_ms,
            } => format!(
                "not sustained: {} better by {gain_ms:.1} ms for {:.0} s",
                s(to),
                secs(sustained_ms)
            ),
            Reason::Dwell {
                to,
                gain_ms,
                remaining_ms,
            } => format!(
                "dwell: {} better by {gain_ms:.1} ms, {:.0} s of dwell left",
                s(to),
                secs(remaining_ms)
            ),
            Reason::FairnessCap { site, worst_ms } => format!(
                "fairness cap: {} has the lowest mean but would put a player at {worst_ms:.0} ms",
                s(site)
            ),
            Reason::NoWeight => "no weighted player: stays".into(),
            Reason::Merged { into } => format!("merged into bubble {into}"),
            Reason::Crossed { into } => format!("crossed into bubble {into}"),
            Reason::Dissolved => "no members left".into(),
        }
    }
}

/// The decisions of one evaluation: membership changes first ([`Reason::Merged`],
/// [`Reason::Crossed`], [`Reason::Dissolved`]), then one placement decision per live bubble,
/// by bubble id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub at_ms: u64,
    pub decisions: Vec<Decision>,
}

impl Evaluation {
    /// Decisions that change some members' site.
    pub fn moves(&self) -> impl Iterator<Item = &Decision> {
        self.decisions.iter().filter(|d| d.is_move())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BubbleError {
    #[error("world: {0}")]
    World(#[from] GeometryError),
    #[error("parameter {name}: {detail}")]
    Param { name: &'static str, detail: String },
    #[error("sites: {0}")]
    Sites(String),
    #[error("member {id}: position ({x}, {y}) is not finite")]
    Position { id: MemberId, x: f64, y: f64 },
    #[error("member {id}: speed {speed} m/s must be finite and >= 0")]
    Speed { id: MemberId, speed: f64 },
    #[error("member {0} is listed twice")]
    DuplicateMember(MemberId),
    #[error("evaluation at {now_ms} ms comes before the previous one at {last_ms} ms")]
    TimeWentBack { now_ms: u64, last_ms: u64 },
    #[error("unknown site {0}")]
    UnknownSite(u16),
    #[error("the core site cannot be unavailable: it is the fallback")]
    CoreUnavailable,
    #[error("member {id}, site {site}: RTT sample {rtt_ms} ms must be finite and >= 0")]
    Rtt {
        id: MemberId,
        site: u16,
        rtt_ms: f64,
    },
}

impl BubbleError {
    fn param(name: &'static str, detail: impl Into<String>) -> Self {
        BubbleError::Param {
            name,
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_named_once_core_first() {
        let s = Sites::new("paris", ["montreal", "hongkong"]).unwrap();
        assert_eq!(
            (s.core(), s.id("hongkong"), s.name(SiteId(1))),
            (SiteId(0), Some(SiteId(2)), "montreal")
        );
        assert_eq!(s.name(SiteId(7)), "?");
        let e = Sites::new("paris", ["paris"]).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        assert!(Sites::new("paris", [" "]).is_err());
    }

    #[test]
    fn bad_parameters_are_named() {
        assert!(Params::default().validate().is_ok());
        let cases = [
            (
                Params {
                    gain_ms: f64::NAN,
                    ..Params::default()
                },
                "gain_ms",
            ),
            (
                Params {
                    split_factor: 0.5,
                    ..Params::default()
                },
                "split_factor",
            ),
            (
                Params {
                    cap_margin_ms: 200.0,
                    ..Params::default()
                },
                "cap_margin_ms",
            ),
            (
                Params {
                    evaluate_every_ms: 0,
                    ..Params::default()
                },
                "evaluate_every_ms",
            ),
            (
                Params {
                    rtt: RttParams {
                        window: 0,
                        ..RttParams::default()
                    },
                    ..Params::default()
                },
                "rtt.window",
            ),
        ];
        for (p, name) in cases {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{name}: {e}");
        }
    }

    #[test]
    fn the_link_distance_grows_with_speed() {
        let p = Params::default();
        assert_eq!(p.link_distance(5.0, 0.0), 2_000.0);
        assert_eq!(p.link_distance(250.0, 250.0), 30_000.0);
    }
}
