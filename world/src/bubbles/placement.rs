//! The placement state machine: bubbles, their sites and their hysteresis, carried from one
//! evaluation to the next.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;

use serde::Serialize;

use crate::geometry::WorldShape;

use super::choice::Scores;
use super::{
    groups, Area, BubbleError, BubbleId, Decision, Evaluation, Member, MemberId, Params, Reason,
    Role, RttSource, SiteId, Sites,
};

/// Bubble placement for one world. See the [module documentation](super) for the rules.
#[derive(Debug, Clone)]
pub struct Placement {
    world: WorldShape,
    sites: Sites,
    params: Params,
    bubbles: BTreeMap<BubbleId, Bubble>,
    member_bubble: HashMap<MemberId, BubbleId>,
    next_id: u64,
    last_at_ms: Option<u64>,
    /// Where the caller simulates members now, for the next evaluation only (see
    /// [`Placement::simulated_at`]).
    simulated_at: HashMap<MemberId, SiteId>,
}

#[derive(Debug, Clone)]
struct Bubble {
    site: SiteId,
    members: Vec<MemberId>,
    last_move_ms: Option<u64>,
    /// A better site seen at every evaluation since `since_ms`.
    pending: Option<Pending>,
    area: Area,
    spread: bool,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    site: SiteId,
    since_ms: u64,
}

/// A bubble as it stands after the last evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BubbleSnapshot {
    pub id: BubbleId,
    pub site: SiteId,
    pub members: Vec<MemberId>,
    pub area: Area,
    pub spread_over_nodes: bool,
    pub last_move_ms: Option<u64>,
}

/// What one group of this evaluation is made of: its members by the bubble they were in.
struct Parts {
    /// Prior bubble → (weight, count, members) within the group.
    by_bubble: BTreeMap<BubbleId, (f64, usize, Vec<MemberId>)>,
}

impl Parts {
    /// The bubble with the most weight here, then the most members, then the lowest id.
    fn heaviest<'a>(&self, among: impl Iterator<Item = &'a BubbleId>) -> Option<BubbleId> {
        among
            .map(|b| (b, &self.by_bubble[b]))
            .max_by(|(ba, (wa, ca, _)), (bb, (wb, cb, _))| {
                wa.total_cmp(wb).then(ca.cmp(cb)).then(bb.cmp(ba))
            })
            .map(|(b, _)| *b)
    }
}

impl Placement {
    pub fn new(world: WorldShape, sites: Sites, params: Params) -> Result<Self, BubbleError> {
        world.validate()?;
        params.validate()?;
        if sites.is_empty() {
            return Err(BubbleError::Sites("no site".into()));
        }
        Ok(Self {
            world,
            sites,
            params,
            bubbles: BTreeMap::new(),
            member_bubble: HashMap::default(),
            next_id: 1,
            last_at_ms: None,
            simulated_at: HashMap::default(),
        })
    }

    /// Where members are simulated now, for the next evaluation: a new group starts on the site
    /// simulating most of its weight and leaves it only as a bubble leaves its site (hysteresis,
    /// fallback, cap), instead of being placed afresh. A live director says this, so that a
    /// director that just took over does not move every group at once; the simulator of the
    /// policy, with nobody simulated before the first evaluation, does not.
    pub fn simulated_at(&mut self, sites: impl IntoIterator<Item = (MemberId, SiteId)>) {
        self.simulated_at = sites
            .into_iter()
            .filter(|(_, s)| self.sites.contains(*s))
            .collect();
    }

    /// The site holding most of `members`' weight as the caller simulates them (then the most
    /// members, then the lowest id); `None` if it said nothing of them.
    fn current_site(&self, members: &[Member]) -> Option<SiteId> {
        let mut by_site: BTreeMap<SiteId, (f64, usize)> = BTreeMap::new();
        for m in members {
            if let Some(&s) = self.simulated_at.get(&m.id) {
                let e = by_site.entry(s).or_default();
                e.0 += self.params.weights.of(m.role);
                e.1 += 1;
            }
        }
        by_site
            .into_iter()
            .max_by(|(sa, (wa, ca)), (sb, (wb, cb))| {
                wa.total_cmp(wb).then(ca.cmp(cb)).then(sb.cmp(sa))
            })
            .map(|(s, _)| s)
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn sites(&self) -> &Sites {
        &self.sites
    }

    pub fn world(&self) -> &WorldShape {
        &self.world
    }

    pub fn bubble_of(&self, member: MemberId) -> Option<BubbleId> {
        self.member_bubble.get(&member).copied()
    }

    /// The site simulating a member, as of the last evaluation.
    pub fn site_of(&self, member: MemberId) -> Option<SiteId> {
        self.bubbles.get(&self.bubble_of(member)?).map(|b| b.site)
    }

    pub fn bubbles(&self) -> Vec<BubbleSnapshot> {
        self.bubbles
            .iter()
            .map(|(&id, b)| BubbleSnapshot {
                id,
                site: b.site,
                members: b.members.clone(),
                area: b.area,
                spread_over_nodes: b.spread,
                last_move_ms: b.last_move_ms,
            })
            .collect()
    }

    /// One evaluation at virtual time `now_ms` over every member present (those absent have left),
    /// with the sites that are down. On bad input, nothing changes and the error says why.
    pub fn evaluate(
        &mut self,
        now_ms: u64,
        members: &[Member],
        rtt: &dyn RttSource,
        unavailable: &[SiteId],
    ) -> Result<Evaluation, BubbleError> {
        if let Some(last_ms) = self.last_at_ms {
            if now_ms < last_ms {
                return Err(BubbleError::TimeWentBack { now_ms, last_ms });
            }
        }
        let mut available = vec![true; self.sites.len()];
        for &s in unavailable {
            if !self.sites.contains(s) {
                return Err(BubbleError::UnknownSite(s.0));
            }
            if s == Sites::CORE {
                return Err(BubbleError::CoreUnavailable);
            }
            available[usize::from(s.0)] = false;
        }
        let mut ms = members.to_vec();
        ms.sort_unstable_by_key(|m| m.id);
        for (i, m) in ms.iter().enumerate() {
            if i > 0 && ms[i - 1].id == m.id {
                return Err(BubbleError::DuplicateMember(m.id));
            }
            if !(m.pos.x.is_finite() && m.pos.y.is_finite()) {
                return Err(BubbleError::Position {
                    id: m.id,
                    x: m.pos.x,
                    y: m.pos.y,
                });
            }
            if !(m.speed_mps.is_finite() && m.speed_mps >= 0.0) {
                return Err(BubbleError::Speed {
                    id: m.id,
                    speed: m.speed_mps,
                });
            }
        }

        let prior: Vec<Option<BubbleId>> = ms.iter().map(|m| self.bubble_of(m.id)).collect();
        let groups = groups::cluster(&self.world, &self.params, &ms, &prior);
        let parts: Vec<Parts> = groups
            .iter()
            .map(|g| {
                let mut by_bubble: BTreeMap<BubbleId, (f64, usize, Vec<MemberId>)> =
                    BTreeMap::new();
                for &i in g {
                    if let Some(b) = prior[i] {
                        let e = by_bubble.entry(b).or_default();
                        e.0 += self.params.weights.of(ms[i].role);
                        e.1 += 1;
                        e.2.push(ms[i].id);
                    }
                }
                Parts { by_bubble }
            })
            .collect();

        // Each prior bubble carries on in the group holding most of its weight (then most of its
        // members, then the earliest group); a group claimed by several bubbles merges them.
        let mut main: BTreeMap<BubbleId, (usize, f64, usize)> = BTreeMap::new();
        for (gi, p) in parts.iter().enumerate() {
            for (&b, &(w, c, _)) in &p.by_bubble {
                let better = main.get(&b).is_none_or(|&(_, bw, bc)| {
                    w.total_cmp(&bw).then(c.cmp(&bc)) == std::cmp::Ordering::Greater
                });
                if better {
                    main.insert(b, (gi, w, c));
                }
            }
        }
        let mut owners: Vec<Vec<BubbleId>> = vec![Vec::new(); groups.len()];
        for (&b, &(gi, _, _)) in &main {
            owners[gi].push(b);
        }

        let available_ids: Vec<SiteId> = self
            .sites
            .ids()
            .filter(|s| available[usize::from(s.0)])
            .collect();
        let mut next: BTreeMap<BubbleId, Bubble> = BTreeMap::new();
        let mut member_bubble = HashMap::with_capacity_and_hasher(ms.len(), Default::default());
        let mut membership = Vec::new();
        let mut placement = Vec::new();
        let mut next_id = self.next_id;

        for (gi, g) in groups.iter().enumerate() {
            let gm: Vec<Member> = g.iter().map(|&i| ms[i]).collect();
            let ids: Vec<MemberId> = gm.iter().map(|m| m.id).collect();
            let scores = Scores::compute(&gm, &self.params, available_ids.iter().copied(), rtt);
            let area = groups::area(&self.world, &self.params, &gm);
            let players = gm.iter().filter(|m| m.role != Role::Npc).count();
            let spread = players >= self.params.big_event_players;
            let parts = &parts[gi];
            let own = &owners[gi];

            // Who this group is, where it was, and where it goes now.
            let (id, mut bubble, from_site, reason, skip) = if own.is_empty() {
                let id = BubbleId(next_id);
                next_id += 1;
                match (
                    parts.heaviest(parts.by_bubble.keys()),
                    self.current_site(&gm),
                ) {
                    (None, Some(here)) => {
                        // Already simulated somewhere: it stays there unless a bubble would
                        // leave.
                        let mut b = Bubble {
                            site: here,
                            members: Vec::new(),
                            last_move_ms: None,
                            pending: None,
                            area,
                            spread,
                        };
                        let reason = self.settle(&mut b, &scores, now_ms, &available);
                        (id, b, Some(here), reason, None)
                    }
                    (None, None) => {
                        let site = scores.place(&self.params, None).unwrap_or(Sites::CORE);
                        let b = Bubble {
                            site,
                            members: Vec::new(),
                            last_move_ms: None,
                            pending: None,
                            area,
                            spread,
                        };
                        (id, b, None, Reason::Created, None)
                    }
                    (Some(parent), _) => {
                        let pb = &self.bubbles[&parent];
                        let mut b = Bubble {
                            site: pb.site,
                            members: Vec::new(),
                            last_move_ms: pb.last_move_ms,
                            pending: None,
                            area,
                            spread,
                        };
                        // Keeping the parent's site is the split; leaving it says why.
                        let settled = self.settle(&mut b, &scores, now_ms, &available);
                        let reason = if b.site == pb.site {
                            Reason::Split { from: parent }
                        } else {
                            settled
                        };
                        (id, b, Some(pb.site), reason, Some(parent))
                    }
                }
            } else {
                let survivor = parts
                    .heaviest(own.iter())
                    .expect("an owner has members here");
                let mut b = self.bubbles[&survivor].clone();
                let from = b.site;
                b.area = area;
                b.spread = spread;
                let owner_sites: BTreeSet<SiteId> =
                    own.iter().map(|o| self.bubbles[o].site).collect();
                let reason = if owner_sites.len() > 1 {
                    // Pre-emptive merge. A tie goes to the side being approached: the owner
                    // moving least.
                    let approached = own
                        .iter()
                        .min_by(|a, b| {
                            let speed = |o: &BubbleId| {
                                let ids = &parts.by_bubble[o].2;
                                gm.iter()
                                    .filter(|m| ids.binary_search(&m.id).is_ok())
                                    .map(|m| m.speed_mps)
                                    .sum::<f64>()
                                    / ids.len() as f64
                            };
                            speed(a)
                                .total_cmp(&speed(b))
                                .then(parts.by_bubble[b].0.total_cmp(&parts.by_bubble[a].0))
                                .then(a.cmp(b))
                        })
                        .map(|o| self.bubbles[o].site)
                        .filter(|s| available[usize::from(s.0)]);
                    b.site = scores
                        .place(&self.params, approached)
                        .unwrap_or(Sites::CORE);
                    b.last_move_ms = Some(now_ms);
                    b.pending = None;
                    Reason::Merge {
                        absorbed: own.iter().filter(|&&o| o != survivor).copied().collect(),
                    }
                } else {
                    if own.len() > 1 {
                        // Same site: nobody moves, but the union keeps the most recent dwell
                        // and weighs its options afresh.
                        b.last_move_ms = own
                            .iter()
                            .filter_map(|o| self.bubbles[o].last_move_ms)
                            .max();
                        b.pending = None;
                    }
                    self.settle(&mut b, &scores, now_ms, &available)
                };
                (survivor, b, Some(from), reason, None)
            };

            bubble.members = ids.clone();
            for (&prev, (_, _, moved)) in &parts.by_bubble {
                if prev == id || Some(prev) == skip {
                    continue;
                }
                let into = id;
                let reason = if own.contains(&prev) {
                    Reason::Merged { into }
                } else {
                    Reason::Crossed { into }
                };
                membership.push(Decision {
                    at_ms: now_ms,
                    group_id: prev,
                    members: moved.clone(),
                    from_site: Some(self.bubbles[&prev].site),
                    to_site: bubble.site,
                    reason,
                    spread_over_nodes: spread,
                    area,
                });
            }
            placement.push(Decision {
                at_ms: now_ms,
                group_id: id,
                members: ids.clone(),
                from_site,
                to_site: bubble.site,
                reason,
                spread_over_nodes: spread,
                area,
            });
            for m in ids {
                member_bubble.insert(m, id);
            }
            next.insert(id, bubble);
        }

        for (&id, b) in &self.bubbles {
            if !main.contains_key(&id) {
                membership.push(Decision {
                    at_ms: now_ms,
                    group_id: id,
                    members: Vec::new(),
                    from_site: Some(b.site),
                    to_site: b.site,
                    reason: Reason::Dissolved,
                    spread_over_nodes: false,
                    area: b.area,
                });
            }
        }
        membership.sort_by_key(|d| d.group_id);
        placement.sort_by_key(|d| d.group_id);
        membership.extend(placement);

        self.bubbles = next;
        self.member_bubble = member_bubble;
        self.next_id = next_id;
        self.last_at_ms = Some(now_ms);
        self.simulated_at.clear();
        Ok(Evaluation {
            at_ms: now_ms,
            decisions: membership,
        })
    }

    /// Fallback, fairness cap, then hysteresis, for a bubble staying a group. Updates the
    /// bubble's site and timers and says why.
    fn settle(&self, b: &mut Bubble, scores: &Scores, now_ms: u64, available: &[bool]) -> Reason {
        let p = &self.params;
        let compliant = scores.any_compliant(p);
        if !available[usize::from(b.site.0)] {
            let down = b.site;
            // The core, unless it breaks the cap where another site would not.
            let core_ok = !compliant
                || scores
                    .get(Sites::CORE)
                    .is_some_and(|s| s.worst_ms <= p.fairness_cap_ms);
            b.site = if core_ok {
                Sites::CORE
            } else {
                scores.place(p, Some(Sites::CORE)).unwrap_or(Sites::CORE)
            };
            b.last_move_ms = Some(now_ms);
            b.pending = None;
            return Reason::Fallback { unavailable: down };
        }
        if scores.weight <= 0.0 {
            b.pending = None;
            return Reason::NoWeight;
        }
        let cur = *scores.get(b.site).expect("the current site is available");
        if cur.worst_ms > p.fairness_cap_ms && compliant {
            b.site = scores.place(p, None).expect("a compliant site exists");
            b.last_move_ms = Some(now_ms);
            b.pending = None;
            return Reason::CapForced {
                worst_ms: cur.worst_ms,
            };
        }
        let target = scores.target(p, b.site);
        if target == b.site {
            b.pending = None;
            let lowest = scores.lowest_mean(p, b.site);
            if lowest != b.site {
                let worst_ms = scores.get(lowest).map_or(f64::INFINITY, |s| s.worst_ms);
                return Reason::FairnessCap {
                    site: lowest,
                    worst_ms,
                };
            }
            return match scores
                .sites
                .iter()
                .find(|s| s.site != b.site && (s.mean_ms - cur.mean_ms).abs() <= p.tie_ms)
            {
                Some(other) => Reason::Tie { other: other.site },
                None => Reason::Best,
            };
        }
        let gain_ms = cur.mean_ms - scores.get(target).expect("target is scored").mean_ms;
        if gain_ms < p.gain_ms {
            b.pending = None;
            return Reason::GainTooSmall {
                to: target,
                gain_ms,
            };
        }
        let since_ms = match b.pending {
            Some(pd) if pd.site == target => pd.since_ms,
            _ => now_ms,
        };
        b.pending = Some(Pending {
            site: target,
            since_ms,
        });
        let sustained_ms = now_ms - since_ms;
        if sustained_ms < p.sustain_ms {
            return Reason::NotSustained {
                to: target,
                gain_ms,
                sustained_ms,
            };
        }
        if let Some(last) = b.last_move_ms {
            let elapsed = now_ms - last;
            if elapsed < p.dwell_ms {
                return Reason::Dwell {
                    to: target,
                    gain_ms,
                    remaining_ms: p.dwell_ms - elapsed,
                };
            }
        }
        b.site = target;
        b.last_move_ms = Some(now_ms);
        b.pending = None;
        Reason::Moved {
            gain_ms,
            sustained_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Pos;

    const PAR: SiteId = SiteId(0);
    const MTL: SiteId = SiteId(1);

    type Table = BTreeMap<(MemberId, SiteId), f64>;

    fn placement(params: Params) -> Placement {
        let sites = Sites::new("paris", ["montreal"]).unwrap();
        Placement::new(WorldShape::default(), sites, params).unwrap()
    }

    fn at(id: MemberId, x: f64) -> Member {
        Member {
            id,
            pos: Pos { x, y: 1_000.0 },
            speed_mps: 0.0,
            role: Role::Player,
        }
    }

    /// Members `ids` are near Paris (8 / 92 ms), the others near Montreal (92 / 10 ms).
    fn rtt(parisians: &[MemberId], all: impl IntoIterator<Item = MemberId>) -> Table {
        let mut t = Table::new();
        for id in all {
            let (p, m) = if parisians.contains(&id) {
                (8.0, 92.0)
            } else {
                (92.0, 10.0)
            };
            t.insert((id, PAR), p);
            t.insert((id, MTL), m);
        }
        t
    }

    fn placements(e: &Evaluation) -> Vec<&Decision> {
        e.decisions
            .iter()
            .filter(|d| {
                !matches!(
                    d.reason,
                    Reason::Merged { .. } | Reason::Crossed { .. } | Reason::Dissolved
                )
            })
            .collect()
    }

    #[test]
    fn a_new_group_the_caller_simulates_somewhere_stays_there_until_the_gain_is_sustained() {
        let mut p = placement(Params::default());
        // Montrealers, simulated in Paris when the director first sees them.
        let group: Vec<Member> = (1..=3).map(|i| at(i, i as f64)).collect();
        let t = rtt(&[], 1..=3);
        p.simulated_at((1..=3).map(|i| (i, PAR)));
        let e = p.evaluate(0, &group, &t, &[]).unwrap();
        let d = placements(&e)[0].clone();
        assert_eq!((d.from_site, d.to_site), (Some(PAR), PAR));
        assert_eq!(d.reason.kind(), "not_sustained", "{d:?}");
        assert!(!d.is_move());
        // The hint is for one evaluation: it does not outlive it.
        assert!(p.simulated_at.is_empty());
        let mut moved_at = None;
        for s in 1..=8u64 {
            let e = p.evaluate(s * 5_000, &group, &t, &[]).unwrap();
            let first = e.moves().next().cloned();
            if let Some(m) = first {
                assert_eq!((m.from_site, m.to_site), (Some(PAR), MTL));
                moved_at = Some(s * 5_000);
                break;
            }
        }
        assert_eq!(moved_at, Some(Params::default().sustain_ms));
        // Without the hint, a new group goes straight to its best site.
        let mut fresh = placement(Params::default());
        fresh.evaluate(0, &group, &t, &[]).unwrap();
        assert_eq!(fresh.site_of(1), Some(MTL));
    }

    #[test]
    fn a_gain_moves_after_it_is_sustained_then_dwells() {
        let mut p = placement(Params::default());
        let t = rtt(&[1], 1..=1);
        let e = p.evaluate(0, &[at(1, 0.0)], &t, &[]).unwrap();
        assert_eq!(e.decisions[0].reason, Reason::Created);
        assert_eq!(p.site_of(1), Some(PAR));
        // Three Montrealers log in beside the Parisian.
        let group: Vec<Member> = (1..=4).map(|i| at(i, i as f64)).collect();
        let t = rtt(&[1], 1..=4);
        let mut kinds = Vec::new();
        for s in 1..=8 {
            let e = p.evaluate(s * 5_000, &group, &t, &[]).unwrap();
            kinds.push(placements(&e)[0].reason.kind());
        }
        assert_eq!(kinds[..6], ["not_sustained"; 6]);
        assert_eq!(kinds[6], "moved", "30 s after the gain first showed");
        assert_eq!(kinds[7], "best");
        assert_eq!(p.site_of(1), Some(MTL));

        // The Montrealers leave: Paris is better again, but the dwell holds for 3 minutes.
        let t = rtt(&[1], 1..=1);
        let mut moved_at = None;
        for s in 9..=60u64 {
            let e = p.evaluate(s * 5_000, &[at(1, 0.0)], &t, &[]).unwrap();
            let d = placements(&e)[0];
            if d.is_move() {
                moved_at = Some(s * 5_000);
                break;
            }
            if s * 5_000 >= 45_000 + 30_000 {
                assert_eq!(d.reason.kind(), "dwell", "at {}", s * 5_000);
            }
        }
        assert_eq!(moved_at, Some(35_000 + 180_000), "one dwell after the move");
    }

    #[test]
    fn a_gain_that_comes_and_goes_never_moves() {
        let mut p = placement(Params::default());
        let group: Vec<Member> = (1..=4).map(|i| at(i, i as f64)).collect();
        let good = rtt(&[1, 2, 3], 1..=4);
        p.evaluate(0, &group, &good, &[]).unwrap();
        assert_eq!(p.site_of(1), Some(PAR));
        let bad = rtt(&[1], 1..=4);
        for s in 1..200u64 {
            let t = if (s / 4) % 2 == 0 { &bad } else { &good };
            let e = p.evaluate(s * 5_000, &group, t, &[]).unwrap();
            assert!(e.moves().next().is_none(), "moved at {} s", s * 5);
        }
    }

    #[test]
    fn an_unavailable_site_falls_back_to_the_core_at_once() {
        let mut p = placement(Params::default());
        let group: Vec<Member> = (1..=3).map(|i| at(i, i as f64)).collect();
        let t = rtt(&[], 1..=3);
        p.evaluate(0, &group, &t, &[]).unwrap();
        assert_eq!(p.site_of(1), Some(MTL));
        let e = p.evaluate(5_000, &group, &t, &[MTL]).unwrap();
        let d = placements(&e)[0];
        assert_eq!(d.reason, Reason::Fallback { unavailable: MTL });
        assert_eq!((d.from_site, d.to_site), (Some(MTL), PAR));
        for s in 2..40 {
            let e = p.evaluate(s * 5_000, &group, &t, &[MTL]).unwrap();
            assert_eq!(placements(&e)[0].to_site, PAR);
        }
    }

    #[test]
    fn bad_input_is_refused_and_changes_nothing() {
        let mut p = placement(Params::default());
        let t = rtt(&[], 1..=2);
        p.evaluate(10_000, &[at(1, 0.0)], &t, &[]).unwrap();
        let before = p.bubbles();
        let nan = Member {
            pos: Pos {
                x: f64::NAN,
                y: 0.0,
            },
            ..at(2, 0.0)
        };
        let cases: Vec<(u64, Vec<Member>, Vec<SiteId>)> = vec![
            (5_000, vec![at(1, 0.0)], vec![]),
            (20_000, vec![at(1, 0.0), at(1, 5.0)], vec![]),
            (20_000, vec![at(1, 0.0), nan], vec![]),
            (
                20_000,
                vec![Member {
                    speed_mps: -1.0,
                    ..at(1, 0.0)
                }],
                vec![],
            ),
            (20_000, vec![at(1, 0.0)], vec![PAR]),
            (20_000, vec![at(1, 0.0)], vec![SiteId(9)]),
        ];
        for (now, ms, down) in cases {
            let e = p.evaluate(now, &ms, &t, &down).unwrap_err();
            assert!(!e.to_string().is_empty());
            assert_eq!(p.bubbles(), before, "after {e}");
        }
    }

    #[test]
    fn groups_on_two_sites_merge_onto_the_best_for_their_union() {
        let mut p = placement(Params::default());
        // Three Montrealers far from one Parisian.
        let mut ms: Vec<Member> = vec![
            at(1, 0.0),
            at(2, 10_000.0),
            at(3, 10_001.0),
            at(4, 10_002.0),
        ];
        let t = rtt(&[1], 1..=4);
        p.evaluate(0, &ms, &t, &[]).unwrap();
        assert_eq!((p.site_of(1), p.site_of(2)), (Some(PAR), Some(MTL)));
        // The Parisian walks up to 1.9 km: merged at once, onto Montreal.
        ms[0].pos.x = 8_100.0;
        ms[0].speed_mps = 5.0;
        let e = p.evaluate(5_000, &ms, &t, &[]).unwrap();
        let merged = &e.decisions[0];
        assert_eq!(merged.reason, Reason::Merged { into: BubbleId(2) });
        assert_eq!(
            (merged.members.as_slice(), merged.from_site, merged.to_site),
            (&[1][..], Some(PAR), MTL)
        );
        let d = placements(&e);
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].reason,
            Reason::Merge {
                absorbed: vec![BubbleId(1)]
            }
        );
        assert_eq!(d[0].members, vec![1, 2, 3, 4]);
        assert!(!d[0].is_move(), "the survivor stays on Montreal");
        assert_eq!(p.site_of(1), Some(MTL));
    }

    #[test]
    fn a_player_who_walks_off_splits_then_crosses_into_another_group() {
        let mut p = placement(Params::default());
        let t = rtt(&[3], 1..=3);
        // 1 and 2 together (Montreal), 3 alone far away (Paris).
        let mut ms = vec![at(1, 0.0), at(2, 10.0), at(3, 20_000.0)];
        p.evaluate(0, &ms, &t, &[]).unwrap();
        let b12 = p.bubble_of(1).unwrap();
        // 2 walks away: a bubble of its own, still in Montreal.
        ms[1].pos.x = 10_000.0;
        let e = p.evaluate(5_000, &ms, &t, &[]).unwrap();
        let split = placements(&e)
            .into_iter()
            .find(|d| d.members == [2])
            .unwrap();
        assert_eq!(split.reason, Reason::Split { from: b12 });
        assert_eq!((split.from_site, split.to_site), (Some(MTL), MTL));
        // 2 walks up to 3 (who stands still) and crosses: a merge where the Parisian's side is
        // approached and the union's means are 50 (Paris) and 51 (Montreal).
        ms[1].pos.x = 19_000.0;
        ms[1].speed_mps = 5.0;
        let e = p.evaluate(10_000, &ms, &t, &[]).unwrap();
        assert_eq!(p.site_of(2), Some(PAR));
        assert!(e
            .decisions
            .iter()
            .any(|d| matches!(d.reason, Reason::Merged { .. }) && d.members == [2]));
        // Player 1 alone: walks 30 km with nobody around; the area follows, the site stays.
        let mut last = p.bubbles()[0].area;
        for s in 3..100u64 {
            ms[0].pos.y = 1_000.0 + 300.0 * s as f64;
            ms[0].speed_mps = 5.0;
            let e = p.evaluate(s * 5_000, &ms, &t, &[]).unwrap();
            let d = placements(&e)
                .into_iter()
                .find(|d| d.members == [1])
                .unwrap();
            assert_eq!((d.group_id, d.to_site, d.is_move()), (b12, MTL, false));
            assert!(d.area.centre != last.centre);
            last = d.area;
        }
    }

    #[test]
    fn a_member_who_leaves_dissolves_their_bubble() {
        let mut p = placement(Params::default());
        let t = rtt(&[], 1..=1);
        p.evaluate(0, &[at(1, 0.0)], &t, &[]).unwrap();
        let e = p.evaluate(5_000, &[], &t, &[]).unwrap();
        assert_eq!(e.decisions.len(), 1);
        assert_eq!(e.decisions[0].reason, Reason::Dissolved);
        assert!(p.bubbles().is_empty());
    }

    #[test]
    fn a_big_event_is_one_bubble_spread_over_nodes() {
        let mut p = placement(Params::default());
        let ms: Vec<Member> = (0..120).map(|i| at(i, (i * 10) as f64)).collect();
        let t = rtt(&(0..70).collect::<Vec<_>>(), 0..120);
        let e = p.evaluate(0, &ms, &t, &[]).unwrap();
        assert_eq!(e.decisions.len(), 1);
        assert!(e.decisions[0].spread_over_nodes);
        assert_eq!(e.decisions[0].to_site, PAR);
    }

    #[test]
    fn the_same_inputs_give_the_same_decisions() {
        let run = || {
            let mut p = placement(Params::default());
            let t = rtt(&[0, 3, 5], 0..8);
            (0..40u64)
                .map(|s| {
                    let ms: Vec<Member> = (0..8)
                        .map(|i| at(i, (i * 1_500) as f64 + (s * i * 37 % 900) as f64))
                        .collect();
                    p.evaluate(s * 5_000, &ms, &t, &[]).unwrap()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }
}
