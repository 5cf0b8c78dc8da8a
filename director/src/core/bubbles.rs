//! The geo-aware round: bubble placement (docs/geo.md#bubbles) applied to the partition.
//!
//! Every evaluation period the round reads the players every live gateway published (position,
//! speed, and the RTTs the proxies measured to each geo), runs the placement policy of
//! [`cellmesh_world::bubbles`] over them, and reconciles the grid with the bubbles: each region a
//! bubble touches goes to a node of the bubble's geo ([`place_regions`]). If a region changes
//! hands, the grid is committed as the next epoch under the lease, by the one commit path of a
//! balance round, and the entities cross by the handoff every new epoch starts: an entity has
//! one writer at every instant, whichever geo it crosses to.
//!
//! A player is placed once the proxies measured it toward every available geo: a geo nobody
//! measured counts as the worst possible, and would force a bubble off the geo simulating it
//! before the probes came back. A geo none of whose nodes is live is unavailable: its bubbles
//! fall back to the core. A new group starts where it is simulated now
//! ([`Placement::simulated_at`]), so a director taking over moves nothing until the policy's
//! hysteresis says so.

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_stores::topology::{DirectorLease, PlayerSample};
use cellmesh_world::bubbles::{
    place_regions, Member, MemberId, Placement, RegionMove, Role, RttBook, SiteId, Sites,
};
use cellmesh_world::partition::{Layout, NodeId, Partition};

use super::{DirectorCore, Event, Now, PendingCommit, WorldRead};
use crate::config::BubbleConfig;

/// Placement decisions kept for `/state`.
const PLACEMENTS_KEPT: usize = 256;

/// The placement's state between rounds.
pub(super) struct Bubbles {
    sites: Sites,
    params: cellmesh_world::bubbles::Params,
    /// Made at the first round, for the shape of the committed world.
    placement: Option<Placement>,
    rtt: RttBook,
    /// Members seen at the last evaluation: a member gone ends its RTT session.
    present: Vec<MemberId>,
}

impl Bubbles {
    /// `None` if the configuration does not validate (the driver validates it first).
    pub(super) fn new(cfg: &BubbleConfig) -> Option<Self> {
        let sites = cfg.to_sites().ok()?;
        cfg.params.validate().ok()?;
        let rtt = RttBook::new(cfg.params.rtt, sites.len()).ok()?;
        Some(Self {
            sites,
            params: cfg.params.clone(),
            placement: None,
            rtt,
            present: Vec::new(),
        })
    }
}

/// A placement member's id: one per login (account and session), so that a new login starts a
/// new RTT baseline. FNV-1a: stable across processes, so a director that takes over numbers the
/// same players alike.
pub(crate) fn member_id(account: &str, session_id: u64) -> MemberId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in account
        .as_bytes()
        .iter()
        .chain(&[0])
        .chain(&session_id.to_le_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// One sample per account: the latest login's, should two gateways list it (a player logging
/// in again elsewhere, before the old gateway's next report).
fn latest_per_account(players: &BTreeMap<NodeId, Vec<PlayerSample>>) -> Vec<&PlayerSample> {
    let mut by_account: BTreeMap<&str, &PlayerSample> = BTreeMap::new();
    for p in players.values().flatten() {
        let keep = by_account
            .get(p.account.as_str())
            .is_none_or(|o| o.session_id < p.session_id);
        if keep {
            by_account.insert(&p.account, p);
        }
    }
    by_account.into_values().collect()
}

/// Whether a decision is worth logging: it moves members or changes who is in which bubble.
fn worth_logging(d: &cellmesh_world::bubbles::Decision) -> bool {
    d.is_move() || !d.reason.is_stay()
}

impl DirectorCore {
    /// A bubble placement over what the store holds, and a commit if a region changes geo.
    pub(super) fn placement_round(
        &mut self,
        now: Now,
        world: WorldRead,
        current: Partition,
        lease: DirectorLease,
        valid_until: u64,
    ) {
        let Layout::Grid(grid) = current.layout() else {
            self.stats.idle_because = Some(format!(
                "bubbles move grid regions, and the partition of epoch {} is a BSP",
                current.epoch()
            ));
            return;
        };
        let shape = *current.shape();
        let b = self
            .bubbles
            .as_mut()
            .expect("a placement round has bubbles");
        // A live node's record comes right after its lease: until it does, its geo is unknown,
        // and a placement would move its regions as if it were dead.
        let live = || world.nodes.iter().filter(|n| n.live);
        if let Some(n) = live().find(|n| n.record.is_none()) {
            self.stats.idle_because = Some(format!(
                "node {} has not published its record (its geo) yet",
                n.lease.node
            ));
            return;
        }
        // The geo of every live node; a node of a geo not listed keeps what it has.
        let site_of: BTreeMap<NodeId, SiteId> = live()
            .filter_map(|n| Some((n.lease.node, b.sites.id(&n.record.as_ref()?.geo)?)))
            .collect();
        let foreign: BTreeSet<NodeId> = live()
            .map(|n| n.lease.node)
            .filter(|n| !site_of.contains_key(n))
            .collect();
        let down: Vec<SiteId> = b
            .sites
            .ids()
            .filter(|s| *s != Sites::CORE && !site_of.values().any(|v| v == s))
            .collect();
        let mut members = Vec::new();
        let mut here = Vec::new();
        let mut unmeasured = 0;
        let mut ids = Vec::new();
        for p in latest_per_account(&world.players) {
            if !(p.pos.x.is_finite() && p.pos.y.is_finite()) {
                continue;
            }
            let id = member_id(&p.account, p.session_id);
            ids.push(id);
            for (geo, ms) in &p.rtt_ms {
                if let Some(site) = b.sites.id(geo) {
                    // A bad figure is refused by the book and changes nothing.
                    let _ = b.rtt.record(id, site, f64::from(*ms));
                }
            }
            // Placed once measured toward every available geo: a geo nobody measured would
            // count as the worst possible, and force the bubble off the geo simulating it now
            // before the proxies' probes came back.
            let measured = |site: SiteId| {
                p.rtt_ms
                    .get(b.sites.name(site))
                    .is_some_and(|ms| ms.is_finite() && *ms >= 0.0)
            };
            if !b.sites.ids().filter(|s| !down.contains(s)).all(measured) {
                unmeasured += 1;
                continue;
            }
            let pos = shape.normalise(p.pos);
            let speed_mps = if p.speed_mps.is_finite() && p.speed_mps >= 0.0 {
                p.speed_mps
            } else {
                0.0
            };
            if let Some(site) = site_of.get(&current.owner_of_chunk(shape.chunk_of(pos))) {
                here.push((id, *site));
            }
            members.push(Member {
                id,
                pos,
                speed_mps,
                role: Role::Player,
            });
        }
        // A player left out for now keeps its RTT baseline: only one gone ends its session.
        ids.sort_unstable();
        for gone in b.present.iter().filter(|m| ids.binary_search(m).is_err()) {
            b.rtt.end_session(*gone);
        }
        b.present = ids;
        let placement = match &mut b.placement {
            Some(p) if *p.world() == shape => p,
            slot => slot.insert(
                Placement::new(shape, b.sites.clone(), b.params.clone())
                    .expect("the shape of a committed partition and validated parameters"),
            ),
        };
        placement.simulated_at(here);
        let evaluation = match placement.evaluate(now.ms(), &members, &b.rtt, &down) {
            Ok(e) => e,
            Err(e) => return self.placement_failed(e),
        };
        let bubbles = placement.bubbles();
        let plan = place_regions(grid, &shape, &bubbles, &site_of, &foreign);
        let logged: Vec<_> = evaluation
            .decisions
            .into_iter()
            .filter(worth_logging)
            .collect();
        self.metrics.rounds.inc();
        self.metrics.partition_epoch.set(current.epoch() as i64);
        self.metrics.bubbles.set(bubbles.len() as i64);
        self.metrics.players_placed.set(members.len() as i64);
        let s = &mut self.stats;
        s.rounds += 1;
        s.idle_because = None;
        s.partition_epoch = current.epoch();
        s.bubbles = bubbles;
        s.players_placed = members.len();
        s.players_unmeasured = unmeasured;
        s.placements.extend(logged.iter().cloned());
        while s.placements.len() > PLACEMENTS_KEPT {
            s.placements.pop_front();
        }
        self.event(Event::Placed {
            epoch: current.epoch(),
            players: members.len(),
            decisions: logged,
        });
        let plan = match plan {
            Ok(plan) => plan,
            Err(e) => return self.placement_failed(e),
        };
        self.stats.regions_stranded = plan.stranded;
        if plan.moves.is_empty() {
            return;
        }
        if now.ms() >= valid_until {
            self.stand_by(now.ms(), None, "lapsed");
            return;
        }
        let next = match current.successor(Layout::Grid(plan.grid)) {
            Ok(next) => next,
            Err(e) => return self.placement_failed(e),
        };
        let chunks_moved = current
            .diff(&next)
            .map(|t| t.iter().map(|t| t.area.area()).sum())
            .unwrap_or(0);
        let pending = PendingCommit {
            epoch: next.epoch(),
            chunks_moved,
            decisions: Vec::new(),
            regions: plan.moves,
            at_unix_ms: now.unix_ms,
        };
        self.ask_commit(lease, current.epoch(), next, pending);
    }

    fn placement_failed(&mut self, error: impl std::fmt::Display) {
        self.metrics.error("placement");
        self.event(Event::PlacementFailed {
            error: error.to_string(),
        });
    }

    /// A grid whose regions follow the bubbles is committed.
    pub(super) fn record_regions(
        &mut self,
        epoch: u64,
        chunks_moved: i64,
        regions: Vec<RegionMove>,
        at_unix_ms: u64,
    ) {
        let bubbles: std::collections::BTreeSet<_> = regions.iter().map(|r| r.bubble).collect();
        let m = &self.metrics;
        m.epochs_committed.inc();
        m.partition_epoch.set(epoch as i64);
        m.chunks_moved.inc_by(chunks_moved.max(0) as u64);
        m.bubble_moves.inc_by(bubbles.len() as u64);
        m.regions_moved.inc_by(regions.len() as u64);
        let s = &mut self.stats;
        s.epochs_committed += 1;
        s.partition_epoch = epoch;
        s.chunks_moved += chunks_moved.max(0) as u64;
        s.bubble_moves += bubbles.len() as u64;
        s.regions_moved += regions.len() as u64;
        for r in &regions {
            if !s.first_moves.iter().any(|f| f.region == r.region) {
                s.first_moves.push(super::stats::FirstMove {
                    region: r.region,
                    epoch,
                    at_unix_ms,
                });
            }
        }
        s.region_moves.push_back(super::stats::RegionRecord {
            epoch,
            at_unix_ms,
            moves: regions.clone(),
        });
        while s.region_moves.len() > PLACEMENTS_KEPT {
            s.region_moves.pop_front();
        }
        self.event(Event::RegionsCommitted {
            epoch,
            chunks_moved,
            moves: regions,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_ids_differ_by_login_and_are_stable() {
        assert_eq!(member_id("alice", 1), member_id("alice", 1));
        assert_ne!(member_id("alice", 1), member_id("alice", 2));
        assert_ne!(member_id("alice", 1), member_id("bob", 1));
        // The separator keeps ("a", …) and ("a\0…", …) apart from a shifted split.
        assert_ne!(member_id("ab", 0), member_id("a", u64::from(b'b')));
    }
}

/// The placement in virtual time against the real in-memory topology store on the same clock:
/// stand-in gateways publish players, and the director moves their region across geos.
#[cfg(test)]
mod placement_tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use cellmesh_stores::topology::memory::MemoryTopology;
    use cellmesh_stores::topology::{Acquire, Commit, Lease, NodeRecord, TopologyStore};
    use cellmesh_world::bubbles::Params;
    use cellmesh_world::geometry::{Pos, WorldShape};
    use cellmesh_world::partition::Grid;
    use futures::executor::block_on;

    use super::*;
    use crate::config::DirectorConfig;
    use crate::core::{Input, Output};
    use crate::Metrics;

    const START_UNIX_MS: u64 = 1_800_000_000_000;
    const SUSTAIN_MS: u64 = 10_000;

    struct World {
        t: u64,
        clock: Arc<AtomicU64>,
        store: Arc<MemoryTopology>,
        leases: BTreeMap<NodeId, Lease>,
        core: DirectorCore,
        events: Vec<(u64, Event)>,
    }

    impl World {
        /// Paris's nodes 1 and 2 own the world but its last column, which is Hong Kong's
        /// node 3.
        fn new() -> Self {
            let clock = Arc::new(AtomicU64::new(START_UNIX_MS));
            let read = clock.clone();
            let store = Arc::new(MemoryTopology::with_clock(Arc::new(move || {
                read.load(Ordering::SeqCst)
            })));
            let shape = WorldShape::default();
            let (cols, rows) = (shape.regions_x() as u32, shape.regions_y() as u32);
            let table = (0..rows)
                .flat_map(|_| {
                    (0..cols).map(move |x| match x {
                        x if x + 1 == cols => 3,
                        x if x < cols / 2 => 1,
                        _ => 2,
                    })
                })
                .collect();
            let grid = Grid::new(&shape, cols, rows, table).unwrap();
            let first = Partition::new(shape, 1, Layout::Grid(grid)).unwrap();
            assert_eq!(
                block_on(store.commit_partition(0, &first)).unwrap(),
                Commit::Committed
            );
            let mut leases = BTreeMap::new();
            for (node, geo) in [(1, "paris"), (2, "paris"), (3, "hongkong")] {
                let lease = match block_on(store.acquire_lease(
                    node,
                    &format!("stand-in-{node}"),
                    Duration::from_secs(3_600),
                ))
                .unwrap()
                {
                    Acquire::Granted(l) => l,
                    other => panic!("{other:?}"),
                };
                let record = NodeRecord {
                    node,
                    geo: geo.into(),
                    mesh_addr: format!("127.0.0.1:{}", 7000 + node),
                    admin_addr: String::new(),
                };
                assert!(block_on(store.publish_node(&lease, &record)).unwrap());
                leases.insert(node, lease);
            }
            let cfg = DirectorConfig {
                topology_url: "memory".into(),
                lease_ms: 2_000,
                standby_poll_ms: 100,
                bubbles: Some(BubbleConfig {
                    sites: vec!["paris".into(), "hongkong".into()],
                    params: Params {
                        evaluate_every_ms: 1_000,
                        sustain_ms: SUSTAIN_MS,
                        dwell_ms: 60_000,
                        ..Params::default()
                    },
                }),
                ..DirectorConfig::default()
            };
            cfg.validate().unwrap();
            let core = DirectorCore::new(cfg, "d".into(), Metrics::new().0);
            Self {
                t: 0,
                clock,
                store,
                leases,
                core,
                events: Vec::new(),
            }
        }

        /// `n` players of `gateway` around `at`, with these RTTs by geo.
        fn players(&self, gateway: NodeId, session: u64, n: u64, at: Pos, rtt: &[(&str, f32)]) {
            let players: Vec<PlayerSample> = (0..n)
                .map(|i| PlayerSample {
                    account: format!("player-{i}"),
                    session_id: session + i,
                    pos: Pos {
                        x: at.x + i as f64 * 10.0,
                        y: at.y,
                    },
                    speed_mps: 1.5,
                    rtt_ms: rtt.iter().map(|(g, ms)| (g.to_string(), *ms)).collect(),
                })
                .collect();
            let lease = &self.leases[&gateway];
            assert!(block_on(self.store.publish_players(lease, &players)).unwrap());
        }

        /// Runs the director until virtual time `until`, its store calls answered at once.
        fn run_until(&mut self, until: u64) {
            let mut input = Some(Input::Timer);
            loop {
                let now = Now {
                    mono: Duration::from_millis(self.t),
                    unix_ms: START_UNIX_MS + self.t,
                };
                self.clock.store(now.unix_ms, Ordering::SeqCst);
                if let Some(i) = input.take() {
                    self.core.handle(now, i);
                }
                while let Some(out) = self.core.poll_output() {
                    match out {
                        Output::Store(r) => {
                            let reply = block_on(crate::io::store::call(&*self.store, r));
                            input = Some(Input::Store(reply));
                        }
                        Output::Event(e) => self.events.push((self.t, e)),
                        Output::Ready(_) | Output::Stopped => {}
                    }
                }
                if input.is_some() {
                    continue;
                }
                match self.core.poll_timeout() {
                    Some(at) if at <= until => {
                        self.t = at.max(self.t);
                        input = Some(Input::Timer);
                    }
                    _ => {
                        self.t = until;
                        return;
                    }
                }
            }
        }

        fn owner_at(&self, p: Pos) -> NodeId {
            block_on(self.store.partition())
                .unwrap()
                .unwrap()
                .owner_of(p)
                .unwrap()
        }

        fn region_commits(&self) -> Vec<(u64, u64, usize)> {
            self.events
                .iter()
                .filter_map(|(t, e)| match e {
                    Event::RegionsCommitted { epoch, moves, .. } => Some((*t, *epoch, moves.len())),
                    _ => None,
                })
                .collect()
        }
    }

    #[test]
    fn far_players_get_their_region_moved_to_their_geo_once_the_gain_is_sustained() {
        let mut w = World::new();
        // Hong Kong's players, attached to a gateway of Paris (node 1: they logged in far from
        // home), in Paris's node 1, under the fairness cap there (a player over it would move
        // the bubble at once).
        let spot = Pos {
            x: 4_000.0,
            y: 4_000.0,
        };
        // Until Paris's proxy measured them, they are not placed.
        w.players(1, 100, 5, spot, &[("hongkong", 6.0)]);
        w.run_until(3_000);
        let s = w.core.stats();
        assert_eq!((s.players_placed, s.players_unmeasured), (0, 5));
        assert!(s.bubbles.is_empty());
        w.players(1, 100, 5, spot, &[("hongkong", 6.0), ("paris", 150.0)]);
        let t0 = w.t;
        w.run_until(t0 + SUSTAIN_MS - 1_000);
        assert_eq!(
            w.owner_at(spot),
            1,
            "nothing moves before the gain is sustained"
        );
        assert!(w.region_commits().is_empty());
        let placed = w.core.stats().bubbles.clone();
        assert_eq!(placed.len(), 1);
        assert_eq!(
            placed[0].site,
            SiteId(0),
            "the group starts where it is simulated"
        );

        w.run_until(t0 + SUSTAIN_MS + 2_000);
        let commits = w.region_commits();
        assert_eq!(commits.len(), 1, "{commits:?}");
        let placed = &w.core.stats().placements;
        assert!(
            placed
                .iter()
                .any(|d| d.is_move() && d.reason.kind() == "moved"),
            "{placed:?}"
        );
        let (at, epoch, regions) = commits[0];
        assert!(at >= t0 + SUSTAIN_MS, "moved at {at} ms");
        assert_eq!(epoch, 2);
        assert_eq!(w.owner_at(spot), 3);
        let s = w.core.stats();
        assert_eq!((s.bubble_moves, s.regions_moved), (1, regions as u64));
        assert_eq!(s.bubbles[0].site, SiteId(1));
        // Reconciled: later rounds commit nothing more.
        w.run_until(t0 + SUSTAIN_MS + 10_000);
        assert_eq!(w.region_commits().len(), 1);

        // Hong Kong's only node goes: with no live node there, the bubble falls back to the core
        // at the next round, and its region with it.
        let three = w.leases[&3].clone();
        assert!(block_on(w.store.release_lease(&three)).unwrap());
        let before = w.t;
        w.run_until(before + 2_000);
        let commits = w.region_commits();
        assert_eq!(commits.len(), 2, "{commits:?}");
        assert!(
            commits[1].0 - before <= 1_000,
            "fell back after {} ms",
            commits[1].0 - before
        );
        assert!([1, 2].contains(&w.owner_at(spot)), "back with a Paris node");
        let placed = &w.core.stats().placements;
        assert!(
            placed
                .iter()
                .any(|d| d.reason.kind() == "fallback" && d.is_move()),
            "{placed:?}"
        );
    }

    #[test]
    fn a_live_node_whose_record_is_not_read_yet_idles_the_placement() {
        let mut w = World::new();
        let four =
            match block_on(w.store.acquire_lease(4, "late", Duration::from_secs(60))).unwrap() {
                Acquire::Granted(l) => l,
                other => panic!("{other:?}"),
            };
        w.players(
            1,
            1,
            3,
            Pos { x: 10.0, y: 10.0 },
            &[("paris", 5.0), ("hongkong", 200.0)],
        );
        w.run_until(3_000);
        let why = w.core.stats().idle_because.clone().unwrap_or_default();
        assert!(why.contains("node 4"), "{why}");
        assert!(w.core.stats().bubbles.is_empty());
        let record = NodeRecord {
            node: 4,
            geo: "hongkong".into(),
            mesh_addr: "127.0.0.1:7004".into(),
            admin_addr: String::new(),
        };
        assert!(block_on(w.store.publish_node(&four, &record)).unwrap());
        w.run_until(6_000);
        assert_eq!(w.core.stats().idle_because, None);
        assert_eq!(w.core.stats().bubbles.len(), 1);
    }

    #[test]
    fn a_bsp_partition_idles_the_placement_and_says_why() {
        let mut w = World::new();
        let shape = WorldShape::default();
        let bsp = cellmesh_world::partition::Bsp::even(&shape, &[1, 2, 3]).unwrap();
        let next = Partition::new(shape, 2, Layout::Bsp(bsp)).unwrap();
        assert_eq!(
            block_on(w.store.commit_partition(1, &next)).unwrap(),
            Commit::Committed
        );
        w.players(3, 1, 3, Pos { x: 10.0, y: 10.0 }, &[("hongkong", 5.0)]);
        w.run_until(3_000);
        let why = w.core.stats().idle_because.clone().unwrap_or_default();
        assert!(why.contains("BSP"), "{why}");
        assert!(w.region_commits().is_empty());
    }
}
