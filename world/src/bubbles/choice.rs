//! Site choice for one group, without memory: the weighted mean RTT of each available site, the
//! fairness cap, and ties. The hysteresis that decides *when* to act on it is in
//! [`Placement`](super::Placement).

use super::{Member, Params, RttSource, SiteId, Sites};

/// One available site's figures for a group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SiteScore {
    pub site: SiteId,
    /// Weighted mean RTT, each member's RTT capped at the fairness cap (a member without a
    /// measurement counts at the cap).
    pub mean_ms: f64,
    /// The highest RTT of a weighted member; infinite if one has no measurement.
    pub worst_ms: f64,
}

/// Every available site's figures for a group, ascending by site.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    pub sites: Vec<SiteScore>,
    /// Total weight of the group; 0 means nobody counts.
    pub weight: f64,
}

impl Scores {
    pub fn compute(
        members: &[Member],
        params: &Params,
        available: impl Iterator<Item = SiteId>,
        rtt: &dyn RttSource,
    ) -> Self {
        let cap = params.fairness_cap_ms;
        let weight: f64 = members.iter().map(|m| params.weights.of(m.role)).sum();
        let sites = available
            .map(|site| {
                let (mut sum, mut worst) = (0.0, 0.0f64);
                for m in members {
                    let w = params.weights.of(m.role);
                    if w <= 0.0 {
                        continue;
                    }
                    let r = rtt
                        .placement_rtt(m.id, site)
                        .filter(|r| r.is_finite() && *r >= 0.0);
                    sum += w * r.map_or(cap, |r| r.min(cap));
                    worst = worst.max(r.unwrap_or(f64::INFINITY));
                }
                SiteScore {
                    site,
                    mean_ms: if weight > 0.0 { sum / weight } else { 0.0 },
                    worst_ms: worst,
                }
            })
            .collect();
        Self { sites, weight }
    }

    pub fn get(&self, site: SiteId) -> Option<&SiteScore> {
        self.sites.iter().find(|s| s.site == site)
    }

    /// Some available site keeps every weighted member at or under the cap.
    pub fn any_compliant(&self, params: &Params) -> bool {
        self.sites
            .iter()
            .any(|s| s.worst_ms <= params.fairness_cap_ms)
    }

    /// Where to put a group that must be placed now (new, merged, or forced off its site): among
    /// sites that keep everyone under the cap, else among all; the lowest mean, a tie going to
    /// `prefer`, then the core, then the lowest id. `None` if no site is available.
    ///
    /// The cap margin plays no part: it keeps a move *for gain* from landing a player where a
    /// tolerated rise would force the bubble straight back, and a group placed now is not moving
    /// for gain. Holding it to the margin would let one player at 166 ms on the best site send
    /// the whole group to a worse one.
    pub fn place(&self, params: &Params, prefer: Option<SiteId>) -> Option<SiteId> {
        let pool: Vec<&SiteScore> = [params.fairness_cap_ms, f64::INFINITY]
            .into_iter()
            .map(|limit| {
                self.sites
                    .iter()
                    .filter(|s| s.worst_ms <= limit)
                    .collect::<Vec<_>>()
            })
            .find(|pool| !pool.is_empty())?;
        lowest(&pool, params.tie_ms, prefer)
    }

    /// The site a group on `current` should aim for: the lowest mean among `current` and the
    /// sites that keep everyone under the cap with the margin to spare (every site when none
    /// keeps everyone under the cap at all), a tie keeping `current`.
    pub fn target(&self, params: &Params, current: SiteId) -> SiteId {
        let comfortable = params.fairness_cap_ms - params.cap_margin_ms;
        let any_compliant = self.any_compliant(params);
        let pool: Vec<&SiteScore> = self
            .sites
            .iter()
            .filter(|s| s.site == current || !any_compliant || s.worst_ms <= comfortable)
            .collect();
        lowest(&pool, params.tie_ms, Some(current)).unwrap_or(current)
    }

    /// The lowest mean of all available sites, cap or not, a tie keeping `current`.
    pub fn lowest_mean(&self, params: &Params, current: SiteId) -> SiteId {
        let pool: Vec<&SiteScore> = self.sites.iter().collect();
        lowest(&pool, params.tie_ms, Some(current)).unwrap_or(current)
    }
}

/// The lowest mean in `pool`; among those within `tie_ms` of it, `prefer`, then the core, then
/// the lowest id.
fn lowest(pool: &[&SiteScore], tie_ms: f64, prefer: Option<SiteId>) -> Option<SiteId> {
    let min = pool.iter().map(|s| s.mean_ms).fold(f64::INFINITY, f64::min);
    let tied = || pool.iter().filter(|s| s.mean_ms <= min + tie_ms);
    prefer
        .filter(|p| tied().any(|s| s.site == *p))
        .or_else(|| tied().find(|s| s.site == Sites::CORE).map(|s| s.site))
        .or_else(|| tied().map(|s| s.site).min())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::bubbles::{MemberId, Role};
    use crate::geometry::Pos;

    const PAR: SiteId = SiteId(0);
    const MTL: SiteId = SiteId(1);
    const HKG: SiteId = SiteId(2);

    fn members(roles: &[Role]) -> Vec<Member> {
        roles
            .iter()
            .enumerate()
            .map(|(i, &role)| Member {
                id: i as MemberId,
                pos: Pos::default(),
                speed_mps: 0.0,
                role,
            })
            .collect()
    }

    /// `rows[i]` = member i's RTT to (paris, montreal, hong kong).
    fn table(rows: &[[f64; 3]]) -> BTreeMap<(MemberId, SiteId), f64> {
        let mut t = BTreeMap::new();
        for (i, row) in rows.iter().enumerate() {
            for (s, &v) in row.iter().enumerate() {
                t.insert((i as MemberId, SiteId(s as u16)), v);
            }
        }
        t
    }

    fn scores(roles: &[Role], rows: &[[f64; 3]]) -> Scores {
        let all = [PAR, MTL, HKG];
        Scores::compute(
            &members(roles),
            &Params::default(),
            all.into_iter(),
            &table(rows),
        )
    }

    const MTL_ROW: [f64; 3] = [92.0, 10.0, 220.0];
    const PAR_ROW: [f64; 3] = [8.0, 92.0, 175.0];
    const HKG_ROW: [f64; 3] = [175.0, 220.0, 8.0];

    #[test]
    fn the_majority_wins() {
        let s = scores(&[Role::Player; 4], &[MTL_ROW, MTL_ROW, MTL_ROW, PAR_ROW]);
        assert_eq!(s.place(&Params::default(), None), Some(MTL));
        assert_eq!(s.target(&Params::default(), PAR), MTL);
    }

    #[test]
    fn the_cap_keeps_the_minority_under_180() {
        let p = Params::default();
        let s = scores(
            &[Role::Player; 5],
            &[MTL_ROW, MTL_ROW, MTL_ROW, MTL_ROW, HKG_ROW],
        );
        assert_eq!(s.lowest_mean(&p, PAR), MTL);
        assert_eq!(s.place(&p, None), Some(PAR));
        assert_eq!(s.target(&p, PAR), PAR);
    }

    #[test]
    fn a_group_placed_now_is_held_to_the_cap_not_the_margin() {
        let p = Params::default();
        // Three in Montreal, one at 166 ms from it: under the cap (180) but within the 15 ms
        // margin. Montreal is best by far and keeps everyone under the cap: a new group goes
        // there...
        let edge = [160.0, 166.0, 300.0];
        let s = scores(&[Role::Player; 4], &[MTL_ROW, MTL_ROW, MTL_ROW, edge]);
        assert_eq!(s.place(&p, None), Some(MTL));
        // ...while a bubble in Paris does not move there for gain: landing within the margin of
        // the cap, a tolerated rise would force it straight back.
        assert_eq!(s.target(&p, PAR), PAR);
    }

    #[test]
    fn with_no_compliant_site_the_mean_decides() {
        let p = Params::default();
        let far = [400.0, 300.0, 350.0];
        let s = scores(&[Role::Player; 2], &[far, MTL_ROW]);
        assert!(!s.any_compliant(&p));
        assert_eq!(s.place(&p, None), Some(MTL));
    }

    #[test]
    fn a_tie_keeps_the_current_site() {
        let p = Params::default();
        let s = scores(&[Role::Player; 4], &[MTL_ROW, MTL_ROW, PAR_ROW, PAR_ROW]);
        assert_eq!(s.target(&p, MTL), MTL);
        assert_eq!(s.target(&p, PAR), PAR);
        // Nowhere yet: the core takes a tie.
        assert_eq!(s.place(&p, None), Some(PAR));
    }

    #[test]
    fn pilots_double_afk_barely_npcs_never() {
        let p = Params::default();
        // One pilot in Paris outweighs one player in Montreal.
        let s = scores(&[Role::Pilot, Role::Player], &[PAR_ROW, MTL_ROW]);
        assert_eq!(s.place(&p, None), Some(PAR));
        // Three AFK players in Montreal do not outweigh one active player in Paris.
        let s = scores(
            &[Role::Afk, Role::Afk, Role::Afk, Role::Player],
            &[MTL_ROW, MTL_ROW, MTL_ROW, PAR_ROW],
        );
        assert_eq!(s.place(&p, None), Some(PAR));
        // NPCs do not count, not even for the cap.
        let s = scores(&[Role::Npc, Role::Player], &[HKG_ROW, MTL_ROW]);
        assert_eq!(s.place(&p, None), Some(MTL));
        assert_eq!(s.get(MTL).unwrap().worst_ms, 10.0);
    }

    #[test]
    fn a_missing_measurement_counts_at_the_cap_and_is_not_compliant() {
        let p = Params::default();
        let mut t = table(&[MTL_ROW, MTL_ROW]);
        t.remove(&(1, MTL));
        let s = Scores::compute(&members(&[Role::Player; 2]), &p, [PAR, MTL].into_iter(), &t);
        let mtl = s.get(MTL).unwrap();
        assert_eq!(mtl.mean_ms, (10.0 + 180.0) / 2.0);
        assert!(mtl.worst_ms.is_infinite());
        assert_eq!(s.place(&p, None), Some(PAR));
    }

    #[test]
    fn one_player_adds_at_most_the_cap() {
        let s = scores(&[Role::Player; 2], &[[5000.0, 10.0, 10.0], MTL_ROW]);
        assert_eq!(s.get(PAR).unwrap().mean_ms, (180.0 + 92.0) / 2.0);
        assert_eq!(s.get(PAR).unwrap().worst_ms, 5000.0);
    }
}
