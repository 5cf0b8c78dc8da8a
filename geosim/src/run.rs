//! The virtual-time runner: one RTT sample per player and site every second, one evaluation of
//! the policy every `evaluate_every_ms`, and two yardsticks evaluated alongside it: everyone on
//! the core, and an oracle that knows the true RTTs and has no hysteresis.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use cellmesh_world::bubbles::{
    BubbleId, Decision, Member, MemberId, Placement, Reason, RttBook, RttSource, SiteId, Sites,
};

use super::scenario::{Scenario, LOGIN_PROBES};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error("placement: {0}")]
    Placement(#[from] cellmesh_world::bubbles::BubbleError),
}

/// Everything a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub summary: Summary,
    /// Decisions worth reading: every move and membership change, and each bubble's reason for
    /// staying whenever it changes.
    pub timeline: Vec<TimelineEntry>,
    /// Every decision of the policy, in order (member ids index [`Report::players`]).
    #[serde(skip)]
    pub decisions: Vec<Decision>,
    /// Every decision of the no-hysteresis oracle.
    #[serde(skip)]
    pub oracle_decisions: Vec<Decision>,
    #[serde(skip)]
    pub series: Series,
    /// Player names by member id.
    #[serde(skip)]
    pub players: Vec<String>,
    #[serde(skip)]
    pub sites: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub scenario: String,
    pub duration_s: f64,
    pub evaluations: u64,
    /// Bubbles that changed site, for any reason (merged into a bubble on another site
    /// included).
    pub moves: u64,
    pub moves_by_reason: BTreeMap<String, u64>,
    /// Evaluations that left a bubble where it was, by reason.
    pub stays_by_reason: BTreeMap<String, u64>,
    /// Pre-emptive merges of bubbles on different sites.
    pub merges: u64,
    /// Players who crossed into a bubble on another site.
    pub crossings: u64,
    /// Players whose simulation changed site, summed over every move.
    pub player_switches: u64,
    pub fairness_cap_ms: f64,
    pub policy: Yardstick,
    pub always_core: Yardstick,
    pub oracle: Yardstick,
    pub players: Vec<PlayerSummary>,
}

/// One way of placing bubbles, judged on the true (jitter-free) RTTs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Yardstick {
    /// Time average of the weighted mean RTT of the players present.
    pub weighted_mean_rtt_ms: f64,
    /// Player-seconds spent above the fairness cap.
    pub above_cap_player_s: f64,
    pub players_above_cap: usize,
    /// Bubble moves.
    pub moves: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlayerSummary {
    pub name: String,
    pub location: String,
    pub role: String,
    pub mean_rtt_ms: f64,
    pub always_core_rtt_ms: f64,
    pub oracle_rtt_ms: f64,
    pub above_cap_s: f64,
    /// Times this player's simulation changed site.
    pub switches: u64,
    /// Site at the player's last evaluation.
    pub last_site: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineEntry {
    pub at_s: f64,
    pub bubble: u64,
    pub members: Vec<String>,
    pub from: Option<String>,
    pub to: String,
    pub moved: bool,
    pub kind: String,
    pub reason: String,
    pub spread_over_nodes: bool,
}

/// Sampled at every evaluation, for plots.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    pub t_s: Vec<f64>,
    /// `player_rtt_ms[player][i]`: true RTT to the site simulating them, `None` while absent.
    pub player_rtt_ms: Vec<Vec<Option<f64>>>,
    /// Weighted means; `None` when no weighted player is present.
    pub policy_ms: Vec<Option<f64>>,
    pub always_core_ms: Vec<Option<f64>>,
    pub oracle_ms: Vec<Option<f64>>,
    /// Bubble moves, in time order.
    pub moves: Vec<MoveMark>,
    /// Sites down: site name, from and to (s).
    pub outages: Vec<(String, f64, f64)>,
}

/// One bubble move as the plot draws it.
#[derive(Debug, Clone, PartialEq)]
pub struct MoveMark {
    pub t_s: f64,
    pub group: BubbleId,
    /// `gain`, `cap`, `merge` or `fallback`.
    pub kind: &'static str,
    pub from: String,
    pub to: String,
}

impl MoveMark {
    /// `#3 gain paris→montreal`.
    pub fn label(&self) -> String {
        format!("{} {} {}→{}", self.group, self.kind, self.from, self.to)
    }
}

/// Running totals for one yardstick.
#[derive(Default)]
struct Tally {
    mean_sum: f64,
    mean_n: u64,
    above_cap_s: Vec<f64>,
    rtt_sum: Vec<f64>,
    rtt_n: Vec<u64>,
}

impl Tally {
    fn new(players: usize) -> Self {
        Self {
            above_cap_s: vec![0.0; players],
            rtt_sum: vec![0.0; players],
            rtt_n: vec![0; players],
            ..Self::default()
        }
    }

    /// One evaluation: `(player, weight, rtt)` of each player present. Returns the weighted mean.
    fn add(&mut self, rtts: &[(usize, f64, f64)], cap: f64, dt_s: f64) -> Option<f64> {
        let (mut sum, mut w) = (0.0, 0.0);
        for &(i, weight, rtt) in rtts {
            sum += weight * rtt;
            w += weight;
            self.rtt_sum[i] += rtt;
            self.rtt_n[i] += 1;
            if weight > 0.0 && rtt > cap {
                self.above_cap_s[i] += dt_s;
            }
        }
        (w > 0.0).then(|| {
            self.mean_sum += sum / w;
            self.mean_n += 1;
            sum / w
        })
    }

    fn yardstick(&self, moves: u64) -> Yardstick {
        Yardstick {
            weighted_mean_rtt_ms: self.mean_sum / self.mean_n.max(1) as f64,
            above_cap_player_s: self.above_cap_s.iter().sum(),
            players_above_cap: self.above_cap_s.iter().filter(|s| **s > 0.0).count(),
            moves,
        }
    }

    fn mean(&self, i: usize) -> f64 {
        self.rtt_sum[i] / self.rtt_n[i].max(1) as f64
    }
}

/// Runs a scenario to its end. Deterministic: the same scenario gives the same report.
pub fn run(s: &Scenario) -> Result<Report, SimError> {
    let n = s.players.len();
    let sites: Vec<SiteId> = s.sites.ids().collect();
    let mut rng = StdRng::seed_from_u64(s.seed);
    let mut book = RttBook::new(s.params.rtt, s.sites.len())?;
    let mut policy = Placement::new(s.world, s.sites.clone(), s.params.clone())?;
    let mut oracle = Placement::new(s.world, s.sites.clone(), s.params.without_hysteresis())?;
    let cap = s.params.fairness_cap_ms;
    let every = s.params.evaluate_every_ms;
    let dt_s = every as f64 / 1000.0;

    let mut decisions = Vec::new();
    let mut oracle_decisions = Vec::new();
    let mut series = Series {
        player_rtt_ms: vec![Vec::new(); n],
        outages: s
            .outages
            .iter()
            .map(|o| {
                (
                    s.sites.name(o.site).to_string(),
                    o.from_ms as f64 / 1000.0,
                    o.to_ms as f64 / 1000.0,
                )
            })
            .collect(),
        ..Series::default()
    };
    let (mut t_policy, mut t_core, mut t_oracle) = (Tally::new(n), Tally::new(n), Tally::new(n));
    let mut switches = vec![0u64; n];
    let mut last_site: Vec<Option<SiteId>> = vec![None; n];
    let mut present = vec![false; n];
    let mut truth = TrueRtts {
        sites: sites.len(),
        rtt: Vec::with_capacity(n * sites.len()),
    };

    let sample = |rng: &mut StdRng, i: usize, site: SiteId, t_ms: u64| {
        // Two draws whatever the values, so that changing one player's RTT leaves every other
        // sample of the run as it was.
        let jitter: f64 = rng.random::<f64>() * s.rtt.jitter_ms;
        let spike = rng.random::<f64>() < s.rtt.spike_chance;
        s.measured_rtt(i, site, t_ms) + jitter + if spike { s.rtt.spike_ms } else { 0.0 }
    };

    for t_ms in (0..=s.duration_ms).step_by(1000) {
        for (i, p) in s.players.iter().enumerate() {
            let here = p.present_at(t_ms);
            let id = i as MemberId;
            if here && !present[i] {
                book.start_session(id);
                for _ in 1..LOGIN_PROBES {
                    for &site in &sites {
                        book.record(id, site, sample(&mut rng, i, site, t_ms))?;
                    }
                }
            } else if !here && present[i] {
                book.end_session(id);
            }
            present[i] = here;
            if here {
                for &site in &sites {
                    book.record(id, site, sample(&mut rng, i, site, t_ms))?;
                }
            }
        }
        if t_ms % every != 0 {
            continue;
        }

        let members: Vec<Member> = (0..n)
            .filter(|&i| present[i])
            .map(|i| {
                let (pos, speed_mps) = s.players[i].state_at(&s.world, t_ms);
                Member {
                    id: i as MemberId,
                    pos,
                    speed_mps,
                    role: s.players[i].role,
                }
            })
            .collect();
        let down = s.unavailable_at(t_ms);
        let eval = policy.evaluate(t_ms, &members, &book, &down)?;
        truth.rtt.clear();
        truth.rtt.extend((0..n).flat_map(|i| {
            let here = present[i];
            sites
                .iter()
                .map(move |&site| here.then(|| s.true_rtt(i, site, t_ms)))
        }));
        let oracle_eval = oracle.evaluate(t_ms, &members, &truth, &down)?;

        let t = t_ms as f64 / 1000.0;
        series.t_s.push(t);
        for d in eval.moves() {
            for &m in &d.members {
                switches[m as usize] += 1;
            }
        }
        for d in &eval.decisions {
            let kind = match d.reason {
                Reason::Merge { .. } => "merge",
                Reason::Merged { .. } | Reason::Crossed { .. } => continue,
                Reason::CapForced { .. } if d.is_move() => "cap",
                Reason::Fallback { .. } if d.is_move() => "fallback",
                _ if d.is_move() => "gain",
                _ => continue,
            };
            series.moves.push(MoveMark {
                t_s: t,
                group: d.group_id,
                kind,
                from: s.sites.name(d.from_site.unwrap_or(d.to_site)).to_string(),
                to: s.sites.name(d.to_site).to_string(),
            });
        }
        let (mut rp, mut rc, mut ro) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            if !present[i] {
                series.player_rtt_ms[i].push(None);
                continue;
            }
            let id = i as MemberId;
            let w = s.params.weights.of(s.players[i].role);
            let site = policy.site_of(id).unwrap_or(Sites::CORE);
            last_site[i] = Some(site);
            let r = s.true_rtt(i, site, t_ms);
            series.player_rtt_ms[i].push(Some(r));
            rp.push((i, w, r));
            rc.push((i, w, s.true_rtt(i, Sites::CORE, t_ms)));
            let o = oracle.site_of(id).unwrap_or(Sites::CORE);
            ro.push((i, w, s.true_rtt(i, o, t_ms)));
        }
        series.policy_ms.push(t_policy.add(&rp, cap, dt_s));
        series.always_core_ms.push(t_core.add(&rc, cap, dt_s));
        series.oracle_ms.push(t_oracle.add(&ro, cap, dt_s));
        decisions.extend(eval.decisions);
        oracle_decisions.extend(oracle_eval.decisions);
    }

    let names: Vec<String> = s.players.iter().map(|p| p.name.clone()).collect();
    let site_names: Vec<String> = sites.iter().map(|&x| s.sites.name(x).to_owned()).collect();
    // A bubble moves when its placement changes site, or when it is merged into one on another
    // site; players crossing into another bubble are counted apart.
    let is_bubble_move = |d: &&Decision| d.is_move() && !matches!(d.reason, Reason::Crossed { .. });
    let mut moves_by_reason = BTreeMap::new();
    for d in decisions.iter().filter(is_bubble_move) {
        *moves_by_reason
            .entry(d.reason.kind().to_owned())
            .or_insert(0u64) += 1;
    }
    let moves = moves_by_reason.values().sum();
    let mut stays_by_reason = BTreeMap::new();
    for d in decisions
        .iter()
        .filter(|d| !d.is_move() && d.reason.is_stay())
    {
        *stays_by_reason
            .entry(d.reason.kind().to_owned())
            .or_insert(0u64) += 1;
    }
    let oracle_moves = oracle_decisions.iter().filter(is_bubble_move).count() as u64;
    let summary = Summary {
        scenario: s.name.clone(),
        duration_s: s.duration_ms as f64 / 1000.0,
        evaluations: series.t_s.len() as u64,
        moves,
        moves_by_reason,
        stays_by_reason,
        merges: decisions
            .iter()
            .filter(|d| matches!(d.reason, Reason::Merge { .. }))
            .count() as u64,
        crossings: decisions
            .iter()
            .filter(|d| d.is_move() && matches!(d.reason, Reason::Crossed { .. }))
            .map(|d| d.members.len() as u64)
            .sum(),
        player_switches: switches.iter().sum(),
        fairness_cap_ms: cap,
        policy: t_policy.yardstick(moves),
        always_core: t_core.yardstick(0),
        oracle: t_oracle.yardstick(oracle_moves),
        players: (0..n)
            .map(|i| PlayerSummary {
                name: names[i].clone(),
                location: s.rtt.locations[s.players[i].location].clone(),
                role: s.players[i].role.to_string(),
                mean_rtt_ms: t_policy.mean(i),
                always_core_rtt_ms: t_core.mean(i),
                oracle_rtt_ms: t_oracle.mean(i),
                above_cap_s: t_policy.above_cap_s[i],
                switches: switches[i],
                last_site: last_site[i].map(|x| s.sites.name(x).to_owned()),
            })
            .collect(),
    };
    Ok(Report {
        timeline: timeline(&decisions, &s.sites, &names),
        summary,
        decisions,
        oracle_decisions,
        series,
        players: names,
        sites: site_names,
    })
}

/// The players' true RTTs at one evaluation, for the oracle: a row of sites per player (member
/// ids are the players' indices), `None` for a player not present.
struct TrueRtts {
    sites: usize,
    rtt: Vec<Option<f64>>,
}

impl RttSource for TrueRtts {
    fn placement_rtt(&self, member: MemberId, site: SiteId) -> Option<f64> {
        let at = usize::try_from(member).ok()? * self.sites + usize::from(site.0);
        self.rtt.get(at).copied().flatten()
    }
}

fn timeline(decisions: &[Decision], sites: &Sites, names: &[String]) -> Vec<TimelineEntry> {
    // A bubble's reason for staying is shown the first time it comes up after the bubble last
    // changed (moved, or gained or lost members): a flapping gain shows its two reasons once, not
    // every few seconds for an hour. Being on the best site is not news.
    let mut shown: HashMap<u64, (Vec<MemberId>, Vec<&'static str>)> = HashMap::new();
    let mut out = Vec::new();
    for d in decisions {
        let kind = d.reason.kind();
        let (members, seen) = shown.entry(d.group_id.0).or_default();
        let stay = d.reason.is_stay();
        let regrouped = stay && *members != d.members;
        let placement = !matches!(
            d.reason,
            Reason::Merged { .. } | Reason::Crossed { .. } | Reason::Dissolved
        );
        if placement {
            members.clone_from(&d.members);
        }
        if stay && !regrouped {
            if matches!(d.reason, Reason::Best) && seen.is_empty() || seen.contains(&kind) {
                continue;
            }
            seen.push(kind);
        } else {
            seen.clear();
            if regrouped {
                seen.push(kind);
            }
        }
        out.push(TimelineEntry {
            at_s: d.at_ms as f64 / 1000.0,
            bubble: d.group_id.0,
            members: d
                .members
                .iter()
                .map(|&m| names[m as usize].clone())
                .collect(),
            from: d.from_site.map(|x| sites.name(x).to_owned()),
            to: sites.name(d.to_site).to_owned(),
            moved: d.is_move(),
            kind: kind.to_owned(),
            reason: d.reason.describe(sites),
            spread_over_nodes: d.spread_over_nodes,
        });
    }
    out
}

fn clock(t_s: f64) -> String {
    let t = t_s.round() as u64;
    format!("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
}

fn who(members: &[String]) -> String {
    match members.len() {
        0 => "nobody".into(),
        1..=4 => members.join(", "),
        n => format!("{}, … ({n} players)", members[..3].join(", ")),
    }
}

impl Report {
    /// The timeline and summary for people.
    pub fn render_text(&self) -> String {
        let s = &self.summary;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "scenario {:?}: {} s, sites {} (core first), {} players, {} evaluations",
            s.scenario,
            s.duration_s,
            self.sites.join(", "),
            self.players.len(),
            s.evaluations
        );
        let _ = writeln!(o, "\ntimeline");
        for e in &self.timeline {
            let place = match (&e.from, e.moved) {
                (Some(from), true) => format!("{from} → {}", e.to),
                (None, _) => format!("new on {}", e.to),
                (Some(_), false) => format!("on {}", e.to),
            };
            let spread = if e.spread_over_nodes {
                " [big event: spread over nodes]"
            } else {
                ""
            };
            let _ = writeln!(
                o,
                "  {}  bubble #{:<3} {:<22} {}: {}{}",
                clock(e.at_s),
                e.bubble,
                place,
                who(&e.members),
                e.reason,
                spread
            );
        }
        let _ = writeln!(o, "\nsummary");
        let _ = writeln!(
            o,
            "  {:<34} {:>10} {:>12} {:>10}",
            "", "policy", "always-core", "oracle"
        );
        let row = |o: &mut String, label: &str, f: &dyn Fn(&Yardstick) -> String| {
            let _ = writeln!(
                o,
                "  {:<34} {:>10} {:>12} {:>10}",
                label,
                f(&s.policy),
                f(&s.always_core),
                f(&s.oracle)
            );
        };
        row(&mut o, "weighted mean RTT (ms)", &|y| {
            format!("{:.1}", y.weighted_mean_rtt_ms)
        });
        row(
            &mut o,
            &format!("player-seconds above {:.0} ms", s.fairness_cap_ms),
            &|y| format!("{:.0}", y.above_cap_player_s),
        );
        row(&mut o, "players ever above the cap", &|y| {
            y.players_above_cap.to_string()
        });
        row(&mut o, "bubble moves", &|y| y.moves.to_string());
        let by: Vec<String> = s
            .moves_by_reason
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let _ = writeln!(
            o,
            "  moves by reason: {}; merges {}, crossings {}, player switches {}",
            if by.is_empty() {
                "none".into()
            } else {
                by.join(", ")
            },
            s.merges,
            s.crossings,
            s.player_switches
        );
        let stays: Vec<String> = s
            .stays_by_reason
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let _ = writeln!(
            o,
            "  evaluations that kept a bubble in place: {}",
            stays.join(", ")
        );
        let _ = writeln!(o, "\nplayers (mean RTT in ms)");
        let _ = writeln!(
            o,
            "  {:<16} {:<10} {:<7} {:>7} {:>7} {:>7} {:>10} {:>8}  last site",
            "name", "location", "role", "policy", "core", "oracle", "above cap", "switches"
        );
        for p in &s.players {
            let _ = writeln!(
                o,
                "  {:<16} {:<10} {:<7} {:>7.1} {:>7.1} {:>7.1} {:>9.0}s {:>8}  {}",
                p.name,
                p.location,
                p.role,
                p.mean_rtt_ms,
                p.always_core_rtt_ms,
                p.oracle_rtt_ms,
                p.above_cap_s,
                p.switches,
                p.last_site.as_deref().unwrap_or("-")
            );
        }
        o
    }
}
