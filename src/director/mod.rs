//! `cellmesh director`: the one process per world that balances it (docs/balance.md). It holds the
//! director's lease in the topology store (a standby asks for it until it lapses), and every
//! balance period reads the committed partition, the nodes' load reports and the spare nodes,
//! runs the [`Balancer`] and commits the layout it proposes as the next epoch. The store checks
//! the lease in the same step as the epoch, so a director that lost its lease (lapsed while it
//! stalled, or taken by a standby) can never commit: its commit comes back [`Commit::Fenced`] and
//! it stands by.
//!
//! The balancer is pure ([`cellmesh_world::balance`]); this module is its driver: the lease,
//! the clock, the store, the admin surface (`/live`, `/ready`, `/metrics`, `/state` with the
//! decisions and their reasons, and the live map: `/map`, `/api/world`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use cellmesh_admin::Admin;
use cellmesh_stores::topology::{
    self, renew_every_ms, writable_ms, Commit, DirectorAcquire, DirectorLease, TopologyError,
    TopologyStore,
};
use cellmesh_world::balance::{Balancer, Decision, Reason};
use cellmesh_world::partition::{Bsp, BspTree, Layout, NodeId, Partition};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub mod config;
mod metrics;

pub use config::DirectorConfig;
use metrics::Metrics;

/// Committed epochs kept for `/state`.
const EPOCHS_KEPT: usize = 64;
/// How long a stopping director waits for the store to take its lease back.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Not holding the lease (another director does, or no partition is committed yet).
    #[default]
    Standby,
    Active,
}

/// One balance round as the director saw it.
#[derive(Debug, Clone, Serialize)]
pub struct RoundView {
    pub at_unix_ms: u64,
    /// The epoch the round balanced.
    pub epoch: u64,
    pub avg_load: f64,
    pub max_load: f64,
    pub safety_bound: f64,
    /// Each cell's node and its smoothed load (0 for a node that has not reported).
    pub loads: BTreeMap<NodeId, f64>,
    pub spares: Vec<NodeId>,
}

impl RoundView {
    /// The busiest cell's load over the average: 1 is a balanced world.
    pub fn max_over_avg(&self) -> f64 {
        if self.avg_load > 0.0 {
            self.max_load / self.avg_load
        } else {
            1.0
        }
    }
}

/// An epoch this director committed.
#[derive(Debug, Clone, Serialize)]
pub struct EpochRecord {
    pub epoch: u64,
    pub at_unix_ms: u64,
    /// Chunks that changed hands from the epoch before: each a mass handoff.
    pub chunks_moved: i64,
    /// What made the layout: the lines that moved and the cells added or deleted.
    pub decisions: Vec<Decision>,
}

/// A decision worth reading later: a move, a cell's change, or a line whose reason to hold
/// changed (a line holding for the same reason every round is logged once).
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub at_unix_ms: u64,
    /// The epoch the round balanced.
    pub epoch: u64,
    #[serde(flatten)]
    pub decision: Decision,
}

/// What the director did, for `/state`, `cellmesh up` and tests.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DirectorStats {
    pub holder: String,
    pub role: Role,
    pub lease: Option<DirectorLease>,
    /// Another director's lease, as last read while standing by.
    pub other: Option<DirectorLease>,
    /// Why an active director does not balance (no partition yet, a layout it cannot read).
    pub idle_because: Option<String>,
    pub partition_epoch: u64,
    pub rounds: u64,
    pub epochs_committed: u64,
    /// Line moves in committed epochs.
    pub balance_moves: u64,
    pub cells_added: u64,
    pub retires_started: u64,
    pub retires_cancelled: u64,
    /// Retired cells deleted from the layout (empty, and every node had the layout without them).
    pub cells_retired: u64,
    /// Second cells (a failover's) given to a spare node.
    pub cells_reassigned: u64,
    pub chunks_moved: u64,
    pub commits_stale: u64,
    pub commits_fenced: u64,
    pub leases_granted: u64,
    pub leases_lost: u64,
    pub last_round: Option<RoundView>,
    pub epochs: VecDeque<EpochRecord>,
    pub decisions: VecDeque<DecisionRecord>,
}

struct Shared {
    stats: Mutex<DirectorStats>,
    metrics: Metrics,
    admin: Arc<Admin>,
    decisions_kept: usize,
}

impl Shared {
    fn with<R>(&self, f: impl FnOnce(&mut DirectorStats) -> R) -> R {
        f(&mut self.stats.lock().expect("director stats poisoned"))
    }
}

/// A running director.
pub struct DirectorHandle {
    pub admin_addr: SocketAddr,
    /// This director's name in the lease.
    pub holder: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl DirectorHandle {
    pub fn stats(&self) -> DirectorStats {
        self.shared.with(|s| s.clone())
    }

    /// Waits for the director to stop (after its stop token is cancelled, it gives its lease up).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Starts a director on the store `cfg.topology_url` names.
pub async fn start(cfg: DirectorConfig, stop: CancellationToken) -> anyhow::Result<DirectorHandle> {
    cfg.validate()?;
    let store = topology::open(&cfg.topology_url)
        .await
        .with_context(|| format!("opening the topology store {}", cfg.shown().topology_url))?;
    start_with(cfg, store, stop).await
}

/// Starts a director on `store` (one shared in-process, as `cellmesh up` does).
pub async fn start_with(
    cfg: DirectorConfig,
    store: Arc<dyn TopologyStore>,
    stop: CancellationToken,
) -> anyhow::Result<DirectorHandle> {
    cfg.validate()?;
    let holder = topology::process_holder(&cfg.name);
    let (metrics, registry) = Metrics::new();
    let shared = Arc::new_cyclic(|me: &std::sync::Weak<Shared>| {
        let me = me.clone();
        let admin = Admin::new(registry, move || {
            me.upgrade().map_or(serde_json::Value::Null, |s| {
                s.with(|st| serde_json::to_value(&*st).unwrap_or_default())
            })
        });
        Shared {
            stats: Mutex::new(DirectorStats {
                holder: holder.clone(),
                ..DirectorStats::default()
            }),
            metrics,
            admin,
            decisions_kept: cfg.decisions_kept,
        }
    });
    shared.admin.set_token(&cfg.admin_token);
    // Every director draws the map, the standby too: it reads the same store. It asks the nodes
    // with its own token: a cluster shares one.
    crate::live_map::serve(&shared.admin, store.clone(), &cfg.admin_token);
    let admin_addr = cellmesh_admin::spawn(&cfg.admin_listen, shared.admin.clone(), stop.clone())
        .await
        .with_context(|| format!("binding admin_listen {}", cfg.admin_listen))?;
    let task = tokio::spawn(
        Driver {
            balancer: Balancer::new(cfg.balance.clone()),
            cfg,
            store,
            shared: shared.clone(),
            holder: holder.clone(),
            started: Instant::now(),
            last_reason: HashMap::new(),
        }
        .run(stop),
    );
    Ok(DirectorHandle {
        admin_addr,
        holder,
        shared,
        task,
    })
}

/// The director while it holds the lease.
struct Active {
    lease: DirectorLease,
    /// Past this (by our clock) the lease may have lapsed at the store: renew or stand by.
    valid_until: Instant,
    renew_at: Instant,
    round_at: Instant,
}

/// How a round ended.
enum Outcome {
    Done,
    /// The store refused the commit: this director's lease is not the current one.
    Fenced(Option<DirectorLease>),
}

struct Driver {
    cfg: DirectorConfig,
    store: Arc<dyn TopologyStore>,
    shared: Arc<Shared>,
    holder: String,
    balancer: Balancer,
    /// The balancer's clock: its aggression recovers in time.
    started: Instant,
    /// Each line's last logged reason.
    last_reason: HashMap<String, Reason>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Driver {
    async fn run(mut self, stop: CancellationToken) {
        let ttl = Duration::from_millis(self.cfg.lease_ms);
        let poll = Duration::from_millis(self.cfg.standby_poll_ms);
        let mut active: Option<Active> = None;
        loop {
            let wake = match active.as_mut() {
                None => {
                    if let Some(a) = self.acquire(ttl).await {
                        active = Some(a);
                        continue;
                    }
                    Instant::now() + poll
                }
                Some(a) => {
                    if Instant::now() >= a.renew_at && !self.renew(a, ttl).await {
                        self.stand_by(None, "lapsed");
                        active = None;
                        continue;
                    }
                    if Instant::now() >= a.round_at {
                        let period = Duration::from_millis(self.cfg.balance.balance_period_ms);
                        // A round that ran late does not make the next come sooner.
                        a.round_at = (a.round_at + period).max(Instant::now());
                        if let Outcome::Fenced(other) = self.round(&a.lease).await {
                            self.stand_by(other, "fenced");
                            active = None;
                            continue;
                        }
                    }
                    a.renew_at.min(a.round_at)
                }
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
        if let Some(a) = active {
            // Handing the lease back lets a standby take over now rather than a lease later.
            match tokio::time::timeout(RELEASE_WAIT, self.store.release_director(&a.lease)).await {
                Ok(Ok(true)) => tracing::info!("director's lease released"),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "releasing the director's lease"),
                Err(_) => tracing::warn!("the store did not answer the lease's release"),
            }
            self.shared.metrics.active.set(0);
            self.shared.with(|s| {
                s.role = Role::Standby;
                s.lease = None;
            });
        }
    }

    /// Asks for the lease once; `Some` when granted.
    async fn acquire(&mut self, ttl: Duration) -> Option<Active> {
        let asked = Instant::now();
        match self.store.acquire_director(&self.holder, ttl).await {
            Ok(DirectorAcquire::Granted(lease)) => {
                tracing::info!(epoch = lease.epoch, "director's lease granted: balancing");
                self.shared.admin.set_ready(true);
                self.shared.metrics.active.set(1);
                self.shared.metrics.leases_granted.inc();
                self.shared.with(|s| {
                    s.role = Role::Active;
                    s.lease = Some(lease.clone());
                    s.other = None;
                    s.leases_granted += 1;
                });
                // A fresh start: another director may have changed the world since this one
                // last balanced it, and the layout it reads now is the truth.
                self.balancer = Balancer::new(self.cfg.balance.clone());
                self.last_reason.clear();
                let renew = Duration::from_millis(renew_every_ms(self.cfg.lease_ms));
                Some(Active {
                    lease,
                    valid_until: asked + Duration::from_millis(writable_ms(self.cfg.lease_ms)),
                    renew_at: asked + renew,
                    round_at: Instant::now(),
                })
            }
            Ok(DirectorAcquire::Held(other)) => {
                self.shared.admin.set_ready(true);
                self.shared.with(|s| {
                    s.other = Some(other);
                    s.idle_because = None;
                });
                None
            }
            Err(TopologyError::NoPartition) => {
                self.shared.admin.set_ready(true);
                self.shared.with(|s| {
                    s.idle_because = Some("no partition is committed yet".into());
                });
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "asking for the director's lease");
                self.shared.metrics.error("store");
                None
            }
        }
    }

    /// Renews the lease; false once it is lost (or may have lapsed while the store was silent).
    async fn renew(&mut self, a: &mut Active, ttl: Duration) -> bool {
        let asked = Instant::now();
        let renew = Duration::from_millis(renew_every_ms(self.cfg.lease_ms));
        match self.store.renew_director(&a.lease, ttl).await {
            Ok(Some(lease)) => {
                a.lease = lease.clone();
                a.valid_until = asked + Duration::from_millis(writable_ms(self.cfg.lease_ms));
                a.renew_at = asked + renew;
                self.shared.with(|s| s.lease = Some(lease));
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "renewing the director's lease");
                self.shared.metrics.error("store");
                a.renew_at = Instant::now() + renew.min(Duration::from_millis(100));
                // The store would refuse a commit past the lease anyway; standing by is for
                // the readers of `/state` and the metrics.
                Instant::now() < a.valid_until
            }
        }
    }

    fn stand_by(&mut self, other: Option<DirectorLease>, why: &'static str) {
        tracing::warn!(why, "director's lease lost: standing by");
        self.shared.metrics.active.set(0);
        self.shared.metrics.leases_lost.inc();
        self.shared.with(|s| {
            s.role = Role::Standby;
            s.lease = None;
            s.other = other;
            s.leases_lost += 1;
        });
    }

    /// One balance round; store errors are logged and counted, and the next round tries again.
    async fn round(&mut self, lease: &DirectorLease) -> Outcome {
        match self.try_round(lease).await {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "balance round");
                self.shared.metrics.error("round");
                Outcome::Done
            }
        }
    }

    async fn try_round(&mut self, lease: &DirectorLease) -> anyhow::Result<Outcome> {
        let Some(current) = self.store.partition().await? else {
            self.shared
                .with(|s| s.idle_because = Some("no partition is committed".into()));
            return Ok(Outcome::Done);
        };
        let tree = match current.layout() {
            Layout::Bsp(b) => b.tree(),
            // A grid is balanced as the BSP that cuts the world alike; the first layout that
            // moves a line is committed as a BSP, and nothing changes hands for the change of
            // kind alone.
            Layout::Grid(g) => match Bsp::from_grid(g) {
                Ok(b) => b.tree(),
                Err(e) => {
                    self.shared.with(|s| {
                        s.idle_because = Some(format!(
                            "the grid of epoch {} is not a BSP layout: {e}",
                            current.epoch()
                        ))
                    });
                    return Ok(Outcome::Done);
                }
            },
        };
        let reports = self.store.loads().await?;
        let nodes = self.store.nodes().await?;
        // Cells with no area count: a cell just added, or one retiring, is no spare.
        let in_tree = current.members();
        // A spare is a live node with no cell whose game reports (it could take one now).
        let spares: Vec<NodeId> = nodes
            .iter()
            .filter(|n| n.live && n.record.is_some())
            .map(|n| n.lease.node)
            .filter(|n| !in_tree.contains(n) && reports.contains_key(n))
            .collect();
        let shape = *current.shape();
        let now_ms = self.started.elapsed().as_millis() as u64;
        let round = self.balancer.round(
            now_ms,
            current.epoch(),
            &tree,
            (shape.chunks_x(), shape.chunks_y()),
            &reports,
            &spares,
        );

        let at = unix_ms();
        let loads: BTreeMap<NodeId, f64> = in_tree
            .iter()
            .map(|n| (*n, reports.get(n).map_or(0.0, |r| r.load)))
            .collect();
        let view = RoundView {
            at_unix_ms: at,
            epoch: current.epoch(),
            avg_load: round.avg_load,
            max_load: loads.values().copied().fold(0.0, f64::max),
            safety_bound: round.safety_bound,
            loads,
            spares,
        };
        let m = &self.shared.metrics;
        m.rounds.inc();
        m.partition_epoch.set(current.epoch() as i64);
        m.avg_load.set(view.avg_load);
        m.max_load.set(view.max_load);
        m.safety_bound.set(view.safety_bound);
        for d in &round.decisions {
            m.decision(d);
        }
        let logged: Vec<Decision> = round
            .decisions
            .iter()
            .filter(|d| self.worth_logging(d))
            .cloned()
            .collect();
        self.shared.with(|s| {
            s.rounds += 1;
            s.idle_because = None;
            s.partition_epoch = current.epoch();
            s.last_round = Some(view);
            for d in &round.decisions {
                match d {
                    Decision::RetireStarted { .. } => s.retires_started += 1,
                    Decision::RetireCancelled { .. } => s.retires_cancelled += 1,
                    _ => {}
                }
            }
            for decision in logged {
                s.decisions.push_back(DecisionRecord {
                    at_unix_ms: at,
                    epoch: current.epoch(),
                    decision,
                });
            }
            while s.decisions.len() > self.shared.decisions_kept {
                s.decisions.pop_front();
            }
        });

        let Some(layout) = round.layout else {
            return Ok(Outcome::Done);
        };
        let next = self.next_partition(&current, &layout)?;
        let moved: i64 = current.diff(&next)?.iter().map(|t| t.area.area()).sum();
        match self
            .store
            .commit_partition_as(lease, current.epoch(), &next)
            .await?
        {
            Commit::Committed => {
                tracing::info!(
                    epoch = next.epoch(),
                    chunks_moved = moved,
                    "committed a balanced layout"
                );
                self.committed(&next, moved, &round.decisions, at);
                Ok(Outcome::Done)
            }
            Commit::Stale { current_epoch } => {
                // Someone (an operator's re-plan) committed first: the next round reads it.
                tracing::info!(current_epoch, "a newer partition was committed meanwhile");
                self.shared.metrics.refused("stale");
                self.shared.with(|s| s.commits_stale += 1);
                Ok(Outcome::Done)
            }
            Commit::Fenced { director } => {
                self.shared.metrics.refused("fenced");
                self.shared.with(|s| s.commits_fenced += 1);
                Ok(Outcome::Fenced(director))
            }
        }
    }

    fn next_partition(&self, current: &Partition, layout: &BspTree) -> anyhow::Result<Partition> {
        let bsp = Bsp::new(current.shape(), layout).context("the balancer's layout")?;
        Ok(current.successor(Layout::Bsp(bsp))?)
    }

    fn committed(&mut self, next: &Partition, moved: i64, decisions: &[Decision], at: u64) {
        let m = &self.shared.metrics;
        m.epochs_committed.inc();
        m.partition_epoch.set(next.epoch() as i64);
        m.chunks_moved.inc_by(moved.max(0) as u64);
        let made: Vec<Decision> = decisions
            .iter()
            .filter(|d| !matches!(d, Decision::Line { line, .. } if line.by == 0))
            .cloned()
            .collect();
        self.shared.with(|s| {
            s.epochs_committed += 1;
            s.partition_epoch = next.epoch();
            s.chunks_moved += moved.max(0) as u64;
            for d in &made {
                match d {
                    Decision::Line { .. } => s.balance_moves += 1,
                    Decision::CellAdded { .. } => s.cells_added += 1,
                    Decision::CellDeleted { .. } => s.cells_retired += 1,
                    Decision::CellReassigned { .. } => s.cells_reassigned += 1,
                    Decision::RetireStarted { .. } | Decision::RetireCancelled { .. } => {}
                }
            }
            s.epochs.push_back(EpochRecord {
                epoch: next.epoch(),
                at_unix_ms: at,
                chunks_moved: moved,
                decisions: made,
            });
            while s.epochs.len() > EPOCHS_KEPT {
                s.epochs.pop_front();
            }
        });
    }

    /// Moves and cell changes always; a held line only when its reason changed.
    fn worth_logging(&mut self, d: &Decision) -> bool {
        match d {
            Decision::Line { path, line, .. } => {
                let changed =
                    self.last_reason.insert(path.clone(), line.reason) != Some(line.reason);
                line.by > 0 || changed
            }
            _ => true,
        }
    }
}
