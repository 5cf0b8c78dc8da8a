//! The director's core in virtual time, against the real in-memory topology store on the same
//! clock (its calls run by the driver's own [`crate::io::store::call`]). Stand-in nodes hold real
//! node leases and publish a hotspot's load as measured against the committed layout, so the
//! balancer has lines to move.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::{Acquire, Commit, DirectorLease, Lease, TopologyStore};
use cellmesh_world::balance::{CellReport, EntityBoundLevels};
use cellmesh_world::geometry::{ChunkPos, WorldShape};
use cellmesh_world::partition::{Bsp, Layout, Partition};
use futures::executor::block_on;

use super::stats::Role;
use super::*;

/// The store's wall clock at virtual time 0.
const START_UNIX_MS: u64 = 1_800_000_000_000;
const LEASE_MS: u64 = 2_000;
const POLL_MS: u64 = 100;
const PERIOD_MS: u64 = 200;
/// A node's game: the cost of one entity, in ticks.
const COST: f64 = 0.001;

/// One director process: its core, and its store call on the way there and its answer on the
/// way back, each with the time it arrives.
struct Process {
    core: DirectorCore,
    to_store: Option<(u64, StoreRequest)>,
    to_core: Option<(u64, StoreReply)>,
    /// How long the store takes to answer this process.
    answer_ms: u64,
    /// A stalled process: nothing reaches it and it does nothing.
    paused: bool,
    /// Its commits wait on their way to the store.
    hold_commits: bool,
    /// Every store call it made, with when.
    asked: Vec<(u64, StoreRequest)>,
    events: Vec<(u64, Event)>,
    stopped: bool,
}

impl Process {
    fn holds(&self, request: &StoreRequest) -> bool {
        self.hold_commits && matches!(request, StoreRequest::Commit { .. })
    }
}

struct Cluster {
    t: u64,
    clock: Arc<AtomicU64>,
    store: Arc<MemoryTopology>,
    nodes: Vec<Lease>,
    /// Entities of the stand-in nodes' games: a hotspot in node 1's cell and a few spread over
    /// the world.
    entities: Vec<(ChunkPos, u32)>,
    reported_epoch: u64,
    directors: Vec<Process>,
}

fn config() -> DirectorConfig {
    let mut cfg = DirectorConfig {
        topology_url: "memory".into(),
        lease_ms: LEASE_MS,
        standby_poll_ms: POLL_MS,
        ..DirectorConfig::default()
    };
    cfg.balance.balance_period_ms = PERIOD_MS;
    cfg
}

impl Cluster {
    /// A store with four cells of a BSP committed as epoch 1 and, if `reporting`, four stand-in
    /// nodes under leases.
    fn new(reporting: bool) -> Self {
        let clock = Arc::new(AtomicU64::new(START_UNIX_MS));
        let read = clock.clone();
        let store = Arc::new(MemoryTopology::with_clock(Arc::new(move || {
            read.load(Ordering::SeqCst)
        })));
        let shape = WorldShape::default();
        let even = Bsp::even(&shape, &[1, 2, 3, 4]).unwrap();
        let first = Partition::new(shape, 1, Layout::Bsp(even)).unwrap();
        assert_eq!(
            block_on(store.commit_partition(0, &first)).unwrap(),
            Commit::Committed
        );
        let hot = first.area_of(1)[0];
        let (cx, cy) = (hot.x1 - 20, hot.y1 - 12);
        let mut entities = Vec::new();
        for dx in -15..15 {
            for dy in -10..10 {
                entities.push((
                    ChunkPos {
                        x: cx + dx,
                        y: cy + dy,
                    },
                    1,
                ));
            }
        }
        for i in 0..400 {
            let x = (i * 7919) % shape.chunks_x();
            let y = (i * 104_729) % shape.chunks_y();
            entities.push((ChunkPos { x, y }, 1));
        }
        let mut nodes = Vec::new();
        if reporting {
            for node in 1..=4 {
                let granted = block_on(store.acquire_lease(
                    node,
                    &format!("stand-in-{node}"),
                    Duration::from_secs(3_600),
                ));
                match granted.unwrap() {
                    Acquire::Granted(lease) => nodes.push(lease),
                    other => panic!("node {node}'s lease: {other:?}"),
                }
            }
        }
        let mut cluster = Self {
            t: 0,
            clock,
            store,
            nodes,
            entities,
            reported_epoch: 0,
            directors: Vec::new(),
        };
        cluster.report();
        cluster
    }

    /// Starts a director; its index.
    fn director(&mut self, name: &str) -> usize {
        let (metrics, _) = Metrics::new();
        self.directors.push(Process {
            core: DirectorCore::new(config(), name.into(), metrics),
            to_store: None,
            to_core: None,
            answer_ms: 0,
            paused: false,
            hold_commits: false,
            asked: Vec::new(),
            events: Vec::new(),
            stopped: false,
        });
        let i = self.directors.len() - 1;
        self.feed(i, Input::Timer);
        i
    }

    fn now(&self) -> Now {
        Now {
            mono: Duration::from_millis(self.t),
            unix_ms: START_UNIX_MS + self.t,
        }
    }

    fn partition(&self) -> Partition {
        block_on(self.store.partition()).unwrap().unwrap()
    }

    /// Each stand-in reports what lies in its cell of the committed layout (so it acknowledges
    /// every epoch as soon as it is committed).
    fn report(&mut self) {
        let Some(p) = block_on(self.store.partition()).unwrap() else {
            return;
        };
        if p.epoch() == self.reported_epoch {
            return;
        }
        self.reported_epoch = p.epoch();
        for lease in &self.nodes {
            let rect = p.area_of(lease.node).first().copied().unwrap_or_default();
            let levels = EntityBoundLevels::measure(rect, self.entities.iter().copied(), COST);
            let report = CellReport {
                load: levels.load,
                entities: levels.entities,
                rect,
                levels,
                ghost_chunks: 4,
                partition_epoch: p.epoch(),
            };
            assert!(block_on(self.store.publish_load(lease, &report)).unwrap());
        }
    }

    fn feed(&mut self, i: usize, input: Input) {
        let now = self.now();
        let t = self.t;
        let d = &mut self.directors[i];
        d.core.handle(now, input);
        while let Some(output) = d.core.poll_output() {
            match output {
                Output::Store(request) => {
                    assert!(
                        d.to_store.is_none() && d.to_core.is_none(),
                        "one call at a time"
                    );
                    d.asked.push((t, request.clone()));
                    d.to_store = Some((t, request));
                }
                Output::Event(e) => d.events.push((t, e)),
                Output::Stopped => d.stopped = true,
                Output::Ready(_) => {}
            }
        }
    }

    /// Everything due at the present time, until nothing is.
    fn settle(&mut self) {
        loop {
            let mut acted = false;
            for i in 0..self.directors.len() {
                let t = self.t;
                let d = &mut self.directors[i];
                if d.paused {
                    continue;
                }
                if d.to_store
                    .as_ref()
                    .is_some_and(|(at, r)| *at <= t && !d.holds(r))
                {
                    let (_, request) = d.to_store.take().unwrap();
                    let reply = block_on(crate::io::store::call(&*self.store, request));
                    d.to_core = Some((t + d.answer_ms, reply));
                    acted = true;
                }
                let d = &mut self.directors[i];
                if d.to_core.as_ref().is_some_and(|(at, _)| *at <= t) {
                    let (_, reply) = d.to_core.take().unwrap();
                    self.feed(i, Input::Store(reply));
                    acted = true;
                } else if d.core.poll_timeout().is_some_and(|at| at <= t) {
                    self.feed(i, Input::Timer);
                    acted = true;
                }
            }
            self.report();
            if !acted {
                return;
            }
        }
    }

    /// Runs until virtual time `until`.
    fn run_until(&mut self, until: u64) {
        loop {
            self.settle();
            let next = self
                .directors
                .iter()
                .filter(|d| !d.paused)
                .flat_map(|d| {
                    let sent = d.to_store.as_ref().filter(|(_, r)| !d.holds(r));
                    [
                        d.core.poll_timeout(),
                        sent.map(|(at, _)| *at),
                        d.to_core.as_ref().map(|(at, _)| *at),
                    ]
                })
                .flatten()
                .min();
            match next {
                Some(at) if at <= until => self.t = at.max(self.t),
                _ => {
                    self.t = until;
                    self.clock.store(START_UNIX_MS + until, Ordering::SeqCst);
                    self.settle();
                    return;
                }
            }
            self.clock.store(START_UNIX_MS + self.t, Ordering::SeqCst);
        }
    }

    fn commits(&self, i: usize) -> Vec<(u64, u64, u64)> {
        self.directors[i]
            .asked
            .iter()
            .filter_map(|(t, r)| match r {
                StoreRequest::Commit {
                    expected_epoch,
                    next,
                    ..
                } => Some((*t, *expected_epoch, next.epoch())),
                _ => None,
            })
            .collect()
    }

    fn committed_epochs(&self, i: usize) -> Vec<u64> {
        self.directors[i]
            .events
            .iter()
            .filter_map(|(_, e)| match e {
                Event::Committed { epoch, .. } => Some(*epoch),
                _ => None,
            })
            .collect()
    }

    fn lease(&self, i: usize) -> Option<DirectorLease> {
        self.directors[i].core.stats().lease.clone()
    }

    fn role(&self, i: usize) -> Role {
        self.directors[i].core.stats().role
    }
}

#[test]
fn a_hotspot_is_balanced_one_epoch_at_a_time() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    c.run_until(20 * PERIOD_MS);
    assert_eq!(c.role(a), Role::Active);
    let epochs = c.committed_epochs(a);
    assert!(epochs.len() >= 3, "{epochs:?}");
    // Each commit asked for the epoch after the one the round read, and each was made once.
    for (n, (_, expected, next)) in c.commits(a).iter().enumerate() {
        assert_eq!((*expected, *next), (n as u64 + 1, n as u64 + 2));
    }
    assert_eq!(epochs, (2..2 + epochs.len() as u64).collect::<Vec<_>>());
    let s = c.directors[a].core.stats();
    assert_eq!(s.epochs_committed, epochs.len() as u64);
    assert_eq!(c.partition().epoch(), 1 + epochs.len() as u64);
    assert!(s.balance_moves > 0 && s.chunks_moved > 0, "{s:?}");
    // A round each period while active: the first as the lease is granted.
    assert_eq!(s.rounds, 21, "{s:?}");
}

/// With no report from any cell's node, no cell is created in the balancer's eyes: every line
/// holds (`not_created`) and nothing is committed, however many rounds run.
#[test]
fn a_round_with_no_reports_commits_nothing() {
    let mut c = Cluster::new(false);
    let a = c.director("a");
    c.run_until(30 * PERIOD_MS);
    assert_eq!(c.role(a), Role::Active);
    assert!(c.commits(a).is_empty(), "{:?}", c.commits(a));
    let s = c.directors[a].core.stats();
    assert_eq!((s.rounds, s.epochs_committed), (31, 0), "{s:?}");
    let rounds: Vec<&Vec<Decision>> = c.directors[a]
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Round { decisions, .. } => Some(decisions),
            _ => None,
        })
        .collect();
    assert_eq!(rounds.len(), 31);
    for decisions in rounds {
        for d in decisions {
            if let Decision::Line { line, .. } = d {
                assert_eq!(line.by, 0, "{d:?}");
            }
        }
    }
    assert_eq!(c.partition().epoch(), 1);
}

/// The store stalls for the director's read longer than its lease: when the read comes back
/// with a layout to commit, the director may hold its lease no more, so it commits nothing and
/// stands by; a standby took the lease meanwhile and commits the next epoch itself.
#[test]
fn a_lease_lost_mid_round_commits_nothing() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    c.run_until(PERIOD_MS / 2);
    assert_eq!(c.role(a), Role::Active);
    let b = c.director("b");
    c.run_until(PERIOD_MS / 2 + 1);
    assert_eq!(c.role(b), Role::Standby);
    let before = c.commits(a).len();
    c.directors[a].answer_ms = 2 * LEASE_MS;
    // A round that reads the hotspot is due: its read is answered two leases later.
    c.run_until(PERIOD_MS + 1);
    let stalled_at = c.t;
    assert!(
        matches!(
            c.directors[a].asked.last(),
            Some((_, StoreRequest::Read { .. }))
        ),
        "a round's read is in flight"
    );
    c.run_until(stalled_at + 2 * LEASE_MS + PERIOD_MS / 2);
    assert_eq!(
        c.commits(a).len(),
        before,
        "no commit after the lease ran out"
    );
    let lost = c.directors[a]
        .events
        .iter()
        .any(|(t, e)| *t >= stalled_at && matches!(e, Event::LeaseLost { why: "lapsed" }));
    assert!(lost, "{:?}", c.directors[a].events);
    assert_eq!(c.role(b), Role::Active);
    assert!(c.lease(b).unwrap().epoch > 1);
    assert!(!c.committed_epochs(b).is_empty(), "the standby balances on");
}

/// An operator's re-plan is committed between the director's read and its commit: the store
/// answers stale, the director records no epoch of its own, and its next round commits the
/// epoch after the operator's: no epoch is made twice.
#[test]
fn a_stale_commit_makes_no_second_epoch() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    // The first round (as the lease is granted) commits epoch 2 at once: hold its request.
    c.directors[a].hold_commits = true;
    c.run_until(1);
    let (_, request) = c.directors[a]
        .to_store
        .take()
        .expect("the first round commits");
    let StoreRequest::Commit {
        expected_epoch: 1,
        next,
        ..
    } = request.clone()
    else {
        panic!("{request:?}")
    };
    assert_eq!(next.epoch(), 2);
    // The operator's epoch 2: the same world, laid out again.
    let current = c.partition();
    let replan = current.successor(current.layout().clone()).unwrap();
    assert_eq!(
        block_on(c.store.commit_partition(1, &replan)).unwrap(),
        Commit::Committed
    );
    c.directors[a].to_store = Some((c.t, request));
    c.directors[a].hold_commits = false;
    c.run_until(2);
    let s = c.directors[a].core.stats();
    assert_eq!((s.commits_stale, s.epochs_committed), (1, 0), "{s:?}");
    assert!(c.directors[a]
        .events
        .iter()
        .any(|(_, e)| *e == Event::CommitStale { current_epoch: 2 }));
    assert!(c.committed_epochs(a).is_empty());

    c.run_until(10 * PERIOD_MS);
    let commits = c.commits(a);
    assert_eq!(commits[0].1..=commits[0].2, 1..=2);
    assert_eq!((commits[1].1, commits[1].2), (2, 3), "{commits:?}");
    let epochs = c.committed_epochs(a);
    assert_eq!(epochs, (3..3 + epochs.len() as u64).collect::<Vec<_>>());
    assert_eq!(c.partition().epoch(), 2 + epochs.len() as u64);
}

/// The active director stalls (a long pause) with a commit on its way to the store; the standby
/// takes the lease once it lapses at the store, within a lease and a poll. The stalled one,
/// resumed, finds its commit fenced and stands by: it never commits under its old lease, and the
/// new director's commit goes through.
#[test]
fn a_standby_takes_over_after_the_lease_lapses() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    let b = c.director("b");
    c.run_until(PERIOD_MS / 2);
    assert_eq!((c.role(a), c.role(b)), (Role::Active, Role::Standby));
    let old = c.lease(a).unwrap();
    assert_eq!(c.directors[b].core.stats().other.as_ref(), Some(&old));
    // The next round commits a move: a stalls with that commit on its way.
    c.directors[a].hold_commits = true;
    while !matches!(
        c.directors[a].to_store,
        Some((_, StoreRequest::Commit { .. }))
    ) {
        c.run_until(c.t + 1);
        assert!(c.t < 10 * PERIOD_MS, "a commits again");
    }
    c.directors[a].paused = true;
    c.directors[a].hold_commits = false;
    let stalled_at = c.t;
    let epoch_then = c.partition().epoch();
    // b's first commit waits until a's has reached the store.
    c.directors[b].hold_commits = true;
    while c.role(b) != Role::Active {
        c.run_until(c.t + 1);
        assert!(
            c.t <= stalled_at + LEASE_MS + POLL_MS,
            "b takes over within a lease and a poll"
        );
    }
    let new = c.lease(b).unwrap();
    assert!(new.epoch > old.epoch);
    let committed_by_a = c.committed_epochs(a).len();

    c.directors[a].paused = false;
    c.run_until(c.t + 1);
    assert_eq!(c.role(a), Role::Standby);
    let s = c.directors[a].core.stats();
    assert_eq!(s.commits_fenced, 1, "{s:?}");
    assert_eq!(s.other.as_ref().map(|l| l.epoch), Some(new.epoch));
    assert_eq!(
        c.partition().epoch(),
        epoch_then,
        "the fenced commit made no epoch"
    );

    c.directors[b].hold_commits = false;
    c.run_until(c.t + 10 * PERIOD_MS);
    assert_eq!(c.committed_epochs(b).first(), Some(&(epoch_then + 1)));
    assert!(c.partition().epoch() > epoch_then, "b balances");
    assert_eq!(c.role(a), Role::Standby);
    assert_eq!(c.committed_epochs(a).len(), committed_by_a);
}

#[test]
fn a_stopping_director_gives_its_lease_back_and_a_standby_takes_over_at_once() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    let b = c.director("b");
    c.run_until(3 * PERIOD_MS);
    assert_eq!(c.role(b), Role::Standby);
    c.feed(a, Input::Stop);
    let stopped_at = c.t;
    c.run_until(c.t + POLL_MS);
    assert!(c.directors[a].stopped);
    assert!(c.directors[a]
        .events
        .iter()
        .any(|(_, e)| *e == Event::LeaseReleased { released: true }));
    assert_eq!(c.role(a), Role::Standby);
    assert_eq!(c.directors[a].core.poll_timeout(), None);
    assert_eq!(
        c.role(b),
        Role::Active,
        "within a poll of the stop at {stopped_at}"
    );
}

/// A store that does not answer a stopping director lets it stop anyway, after the wait.
#[test]
fn a_stop_waits_for_a_silent_store_no_longer_than_the_release_wait() {
    let mut c = Cluster::new(true);
    let a = c.director("a");
    c.run_until(PERIOD_MS / 2);
    c.directors[a].answer_ms = 60_000;
    c.run_until(PERIOD_MS + 1);
    c.feed(a, Input::Stop);
    let stopped_at = c.t;
    c.run_until(stopped_at + RELEASE_WAIT_MS - 1);
    assert!(!c.directors[a].stopped);
    c.run_until(stopped_at + RELEASE_WAIT_MS);
    assert!(c.directors[a].stopped);
    assert!(c.directors[a]
        .events
        .iter()
        .any(|(_, e)| *e == Event::StopUnanswered));
}

#[test]
fn a_standby_waits_for_a_partition_and_renews_what_it_was_granted() {
    let clock = Arc::new(AtomicU64::new(START_UNIX_MS));
    let mut c = Cluster::new(true);
    // A store with no partition: the director asks every poll, and says why it waits.
    let read = clock.clone();
    c.store = Arc::new(MemoryTopology::with_clock(Arc::new(move || {
        read.load(Ordering::SeqCst)
    })));
    c.clock = clock;
    c.nodes.clear();
    let a = c.director("a");
    c.run_until(10 * POLL_MS);
    let asks = |c: &Cluster| {
        c.directors[a]
            .asked
            .iter()
            .filter(|(_, r)| matches!(r, StoreRequest::Acquire { .. }))
            .count()
    };
    assert_eq!(asks(&c), 11);
    assert_eq!(c.role(a), Role::Standby);
    assert_eq!(
        c.directors[a].core.stats().idle_because.as_deref(),
        Some("no partition is committed yet")
    );
    let shape = WorldShape::default();
    let even = Bsp::even(&shape, &[1, 2]).unwrap();
    let first = Partition::new(shape, 1, Layout::Bsp(even)).unwrap();
    block_on(c.store.commit_partition(0, &first)).unwrap();
    c.run_until(10 * POLL_MS + POLL_MS);
    assert_eq!(c.role(a), Role::Active);
    let granted = c.lease(a).unwrap();
    // Renewed every half second (a quarter lease at most) under the same epoch, the expiry
    // moving on.
    c.run_until(c.t + 3 * LEASE_MS);
    let renewed = c.lease(a).unwrap();
    assert_eq!(renewed.epoch, granted.epoch);
    assert!(renewed.expires_unix_ms >= granted.expires_unix_ms + 2 * LEASE_MS);
    let renewals = c.directors[a]
        .asked
        .iter()
        .filter(|(_, r)| matches!(r, StoreRequest::Renew { .. }))
        .count();
    assert_eq!(renewals, 12, "every {} ms", renew_every_ms(LEASE_MS));
}
