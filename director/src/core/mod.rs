//! The director's decisions, with no I/O: the sans-IO shape of the sidecar's and the proxy's
//! cores (and of quinn-proto). The driver feeds it what happened with
//! [`DirectorCore::handle`]`(now, input)` (a timer is due, the store answered, stop), takes what to
//! do from [`DirectorCore::poll_output`] (a store call, readiness, an event to log) and wakes it at
//! [`DirectorCore::poll_timeout`]. There is no socket, clock, task or lock in here: one sequence
//! of inputs makes one run, in the driver, the simulator and the tests alike.
//!
//! - [`lease`]: the director's lease: asked for while standing by, renewed while active, lost
//!   when the store says so or when it may have lapsed unrenewed, given back on stop.
//! - [`round`]: one balance round over what the store holds, and the one commit path: the next
//!   epoch asked of the store under the lease, and its answer (committed, stale, fenced).
//! - [`stats`]: what the director keeps of what it did.
//!
//! The core asks the store one thing at a time, as the loop it replaced did: a round's reads, its
//! commit and a renewal never overtake one another.

mod bubbles;
mod lease;
mod round;
pub mod stats;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

use cellmesh_stores::topology::{
    renew_every_ms, Commit, DirectorAcquire, DirectorLease, NodeEntry, PlayerSample, TopologyError,
};
use cellmesh_world::balance::{Balancer, CellReport, Decision, Reason};
use cellmesh_world::partition::{BspTree, NodeId, Partition};

use crate::config::DirectorConfig;
use crate::metrics::Metrics;
use stats::{DirectorStats, Role};

/// How long a stopping director waits for the store: for a call in flight to end, then for the
/// lease to be taken back.
pub const RELEASE_WAIT_MS: u64 = 2_000;

/// The time as the driver reads it: a monotonic offset from the core's start (the lease's
/// deadlines, the balancer's clock) and the wall clock (what `/state` shows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Now {
    pub mono: Duration,
    pub unix_ms: u64,
}

impl Now {
    /// The monotonic time in milliseconds, as the core's deadlines are kept.
    pub fn ms(&self) -> u64 {
        self.mono.as_millis() as u64
    }
}

/// What the world tells the director's core.
#[derive(Debug)]
pub enum Input {
    /// The time the core asked to be woken at (or any later one) has come.
    Timer,
    /// The store's answer to the call the core asked for last.
    Store(StoreReply),
    /// Stop: the lease goes back to the store, so that a standby takes over at once.
    Stop,
}

/// A call on the topology store; its answer comes back as [`Input::Store`].
#[derive(Debug, Clone)]
pub enum StoreRequest {
    /// `acquire_director`.
    Acquire { holder: String, ttl: Duration },
    /// `renew_director`.
    Renew { lease: DirectorLease, ttl: Duration },
    /// What a round balances: `partition`, then `loads` and `nodes`, and the gateways'
    /// `players` when bubbles are placed.
    Read { players: bool },
    /// `commit_partition_as`: `next` (epoch `expected_epoch + 1`) under `lease`.
    Commit {
        lease: DirectorLease,
        expected_epoch: u64,
        next: Box<Partition>,
    },
    /// `release_director`.
    Release { lease: DirectorLease },
}

/// What a round reads from the store.
#[derive(Debug, Clone)]
pub struct WorldRead {
    pub partition: Option<Partition>,
    /// The latest load report of every node whose lease is live.
    pub loads: BTreeMap<NodeId, CellReport>,
    pub nodes: Vec<NodeEntry>,
    /// The players every live gateway published (read only when bubbles are placed).
    pub players: BTreeMap<NodeId, Vec<PlayerSample>>,
}

/// The store's answer to a [`StoreRequest`], of the same kind.
#[derive(Debug)]
pub enum StoreReply {
    Acquired(Result<DirectorAcquire, TopologyError>),
    Renewed(Result<Option<DirectorLease>, TopologyError>),
    Read(Result<Box<WorldRead>, TopologyError>),
    Committed(Result<Commit, TopologyError>),
    Released(Result<bool, TopologyError>),
}

/// What the core asks the driver to do.
#[derive(Debug)]
pub enum Output {
    /// Call the store; answer with [`Input::Store`].
    Store(StoreRequest),
    /// Whether `/ready` says ready: once the store answered a lease request.
    Ready(bool),
    /// Something that happened, for the log (and for the simulator's figures).
    Event(Event),
    /// The director stopped (its lease given back, or the store silent past the wait).
    Stopped,
}

/// What happened, as the driver logs it.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    LeaseGranted {
        epoch: u64,
    },
    /// The lease is gone (`lapsed`: it may have run out unrenewed; `fenced`: the store refused a
    /// commit under it): the director stands by.
    LeaseLost {
        why: &'static str,
    },
    /// The lease was given back on stop (`false`: it was no longer this director's).
    LeaseReleased {
        released: bool,
    },
    /// The store did not answer a stopping director within [`RELEASE_WAIT_MS`].
    StopUnanswered,
    /// A store call failed; the core tries again at its next turn.
    StoreFailed {
        call: &'static str,
        error: String,
    },
    /// A round ran the balancer over the layout of `epoch`: every decision, with its reason.
    Round {
        epoch: u64,
        decisions: Vec<Decision>,
    },
    /// The balancer's layout could not be made the next epoch (no valid BSP of the world).
    LayoutRefused {
        epoch: u64,
        layout: BspTree,
        error: String,
    },
    /// The store committed the round's layout as `epoch`.
    Committed {
        epoch: u64,
        chunks_moved: i64,
        decisions: Vec<Decision>,
    },
    /// A bubble placement ran: the decisions that move a bubble or change its membership.
    Placed {
        epoch: u64,
        players: usize,
        decisions: Vec<cellmesh_world::bubbles::Decision>,
    },
    /// The placement could not run (bad input from the store): nothing moved.
    PlacementFailed {
        error: String,
    },
    /// The store committed, as `epoch`, a grid whose regions follow the bubbles.
    RegionsCommitted {
        epoch: u64,
        chunks_moved: i64,
        moves: Vec<cellmesh_world::bubbles::RegionMove>,
    },
    /// Someone committed first (an operator's re-plan): the next round reads their epoch.
    CommitStale {
        current_epoch: u64,
    },
}

/// Where the director is in its life.
#[derive(Debug)]
enum Phase {
    /// Not holding the lease: asks for it at `ask_at`.
    Standby {
        ask_at: u64,
    },
    Active(Active),
    /// Stopped: nothing more to do.
    Stopped,
}

/// The director while it holds the lease (monotonic ms).
#[derive(Debug)]
struct Active {
    lease: DirectorLease,
    /// Past this the lease may have lapsed at the store: no commit, and stand by unless renewed.
    valid_until: u64,
    renew_at: u64,
    round_at: u64,
}

/// The store call in flight.
#[derive(Debug)]
enum Asked {
    /// Asked at `at`: a grant or renewal counts from when it was asked.
    Acquire {
        at: u64,
    },
    Renew {
        at: u64,
    },
    Read,
    Commit(PendingCommit),
    Release,
}

/// A commit asked of the store, and what the round decided for it.
#[derive(Debug)]
struct PendingCommit {
    epoch: u64,
    chunks_moved: i64,
    decisions: Vec<Decision>,
    /// The regions a bubble placement moves (none for a balance commit).
    regions: Vec<cellmesh_world::bubbles::RegionMove>,
    at_unix_ms: u64,
}

/// The director: its lease, its rounds and its commits.
pub struct DirectorCore {
    cfg: DirectorConfig,
    holder: String,
    balancer: Balancer,
    /// Set when the director places bubbles across geos instead of balancing load.
    bubbles: Option<bubbles::Bubbles>,
    phase: Phase,
    asked: Option<Asked>,
    /// Set by [`Input::Stop`]: stop by then (monotonic ms).
    stop_by: Option<u64>,
    ready: bool,
    /// Each line's last logged reason.
    last_reason: HashMap<String, Reason>,
    stats: DirectorStats,
    metrics: Metrics,
    out: VecDeque<Output>,
}

impl DirectorCore {
    /// A director named `holder` in the lease; it asks for the lease at once. `metrics` are its
    /// counters (the driver registers them on the admin port).
    /// A configuration that does not validate is the caller's bug: bubbles are then off.
    pub fn new(cfg: DirectorConfig, holder: String, metrics: Metrics) -> Self {
        Self {
            balancer: Balancer::new(cfg.balance.clone()),
            bubbles: cfg.bubbles.as_ref().and_then(bubbles::Bubbles::new),
            cfg,
            stats: DirectorStats {
                holder: holder.clone(),
                ..DirectorStats::default()
            },
            holder,
            phase: Phase::Standby { ask_at: 0 },
            asked: None,
            stop_by: None,
            ready: false,
            last_reason: HashMap::new(),
            metrics,
            out: VecDeque::new(),
        }
    }

    pub fn handle(&mut self, now: Now, input: Input) {
        match input {
            Input::Timer => {}
            Input::Stop => {
                if self.stop_by.is_none() {
                    self.stop_by = Some(now.ms() + RELEASE_WAIT_MS);
                }
            }
            Input::Store(reply) => self.answered(now, reply),
        }
        self.drive(now);
    }

    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// When to wake the core next (monotonic ms); `None` while it waits for the store alone, or
    /// once stopped.
    pub fn poll_timeout(&self) -> Option<u64> {
        if let Some(by) = self.stop_by {
            return (!matches!(self.phase, Phase::Stopped)).then_some(by);
        }
        if self.asked.is_some() {
            return None;
        }
        match &self.phase {
            Phase::Standby { ask_at } => Some(*ask_at),
            Phase::Active(a) => Some(a.renew_at.min(a.round_at)),
            Phase::Stopped => None,
        }
    }

    pub fn stats(&self) -> &DirectorStats {
        &self.stats
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn is_stopped(&self) -> bool {
        matches!(self.phase, Phase::Stopped)
    }

    /// The round period: a round every this many ms while active (the placement's evaluation
    /// period when bubbles are placed).
    pub fn period_ms(&self) -> u64 {
        match &self.cfg.bubbles {
            Some(b) if self.bubbles.is_some() => b.params.evaluate_every_ms,
            _ => self.cfg.balance.balance_period_ms,
        }
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(self.cfg.lease_ms)
    }

    fn renew_every(&self) -> u64 {
        renew_every_ms(self.cfg.lease_ms)
    }

    fn ask(&mut self, asked: Asked, request: StoreRequest) {
        self.asked = Some(asked);
        self.out.push_back(Output::Store(request));
    }

    fn event(&mut self, event: Event) {
        self.out.push_back(Output::Event(event));
    }

    fn set_ready(&mut self) {
        if !self.ready {
            self.ready = true;
            self.out.push_back(Output::Ready(true));
        }
    }

    /// The store answered: the call in flight decides what the answer means.
    fn answered(&mut self, now: Now, reply: StoreReply) {
        let t = now.ms();
        match (self.asked.take(), reply) {
            (Some(Asked::Acquire { at }), StoreReply::Acquired(r)) => self.acquired(t, at, r),
            (Some(Asked::Renew { at }), StoreReply::Renewed(r)) => self.renewed(t, at, r),
            (Some(Asked::Read), StoreReply::Read(r)) => match r {
                Ok(world) => self.round(now, *world),
                Err(e) => self.failed("round", "round", e),
            },
            (Some(Asked::Commit(pending)), StoreReply::Committed(r)) => {
                self.committed(t, pending, r)
            }
            (Some(Asked::Release), StoreReply::Released(r)) => self.released(r),
            // An answer to no call of ours: the one in flight is still awaited.
            (asked, _) => self.asked = asked,
        }
    }

    /// A failed call, logged and counted as `kind`.
    fn failed(&mut self, call: &'static str, kind: &'static str, error: TopologyError) {
        self.metrics.error(kind);
        self.event(Event::StoreFailed {
            call,
            error: error.to_string(),
        });
    }

    /// Asks the store for what is due now, if nothing is in flight.
    fn drive(&mut self, now: Now) {
        let t = now.ms();
        if let Some(by) = self.stop_by {
            return self.drive_stop(t, by);
        }
        if self.asked.is_some() {
            return;
        }
        let period = self.period_ms();
        match &mut self.phase {
            Phase::Standby { ask_at } if t >= *ask_at => {
                let request = StoreRequest::Acquire {
                    holder: self.holder.clone(),
                    ttl: self.ttl(),
                };
                self.ask(Asked::Acquire { at: t }, request);
            }
            Phase::Active(a) if t >= a.renew_at => {
                let request = StoreRequest::Renew {
                    lease: a.lease.clone(),
                    ttl: self.ttl(),
                };
                self.ask(Asked::Renew { at: t }, request);
            }
            Phase::Active(a) if t >= a.round_at => {
                // A round that ran late does not make the next come sooner.
                a.round_at = (a.round_at + period).max(t);
                let players = self.bubbles.is_some();
                self.ask(Asked::Read, StoreRequest::Read { players });
            }
            _ => {}
        }
    }

    /// Stopping: once nothing is in flight, the lease goes back; past `by`, stop anyway.
    fn drive_stop(&mut self, t: u64, by: u64) {
        if matches!(self.phase, Phase::Stopped) {
            return;
        }
        match (&self.asked, &self.phase) {
            (None, Phase::Active(a)) => {
                let lease = a.lease.clone();
                self.stop_by = Some(t + RELEASE_WAIT_MS);
                self.ask(Asked::Release, StoreRequest::Release { lease });
            }
            (None, _) => self.finish(),
            (Some(_), _) if t >= by => {
                self.event(Event::StopUnanswered);
                self.finish();
            }
            (Some(_), _) => {}
        }
    }

    fn finish(&mut self) {
        self.asked = None;
        self.phase = Phase::Stopped;
        self.metrics.active.set(0);
        self.stats.role = Role::Standby;
        self.stats.lease = None;
        self.out.push_back(Output::Stopped);
    }
}
