//! Membership: how this node joins the cluster and keeps its place in it.
//!
//! - [`join`] reads the committed partition from the topology store and takes the lease of this
//!   node's id (the fence on its area) under a holder name no other process shares. With a
//!   `state_dir`, it first locks the node there (one live process per node and host), and takes
//!   over at once the grant a crashed predecessor recorded there (see [`super::state_dir`]).
//!   With `node_id_auto` it takes the lowest node id at or above `node_id` that is free instead,
//!   after the one its state dir recorded last (a restart in place).
//! - [`keep_lease`] renews that lease every half second (at least four times a lease), in a task
//!   of its own so nothing else can delay it. The store judges lapse by its own clock; this
//!   process stops writing at a deadline of its own monotonic clock, a lease's length less 1%
//!   (`topology::writable_ms`) after it *sent* the last request the store granted. That instant
//!   passes no later than the store's expiry even on a clock running up to 1% slow, so a node
//!   cut off from the store stops before another can be granted its id. The node then freezes
//!   what it owns and keeps asking: it takes the lease back under its epoch when the store
//!   answers (an election, a pause), unless another grant replaced it meanwhile (a restore's
//!   fence, a new process): then it exits (see `Input::LeaseLost`) and its supervisor starts it
//!   afresh.
//! - [`membership`] publishes where the mesh listener is and tells the node which peers hold a
//!   live lease and where they listen, their lease epochs, and any newer partition.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_stores::topology::{self, Acquire, Lease, NodeRecord, TopologyStore, MAX_NODE_ID};
use cellmesh_world::partition::{NodeId, Partition};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::state_dir::StateDir;
use super::Event;
use crate::config::SidecarConfig;
use crate::core::{Input, PeerInfo};

const MEMBERSHIP_EVERY: Duration = Duration::from_millis(500);
/// Tries at the node lease before giving up on a store slower than the lease.
const LEASE_ATTEMPTS: usize = 5;

/// A lease as this process holds it.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub lease: Lease,
    /// Stop writing here unless a renewal lands first.
    pub deadline: Instant,
}

/// Locks this node's state dir (if any), reads the partition and takes this node's lease: over
/// from the grant the state dir recorded, if that is still the store's, else as a new one. With
/// `node_id_auto`, the node is the first that can be taken (see [`take_free`]); the lease names
/// it. The lock must be kept as long as the node runs.
pub(crate) async fn join(
    topology: &dyn TopologyStore,
    cfg: &SidecarConfig,
) -> anyhow::Result<(Partition, Held, Option<StateDir>)> {
    let dir = match cfg.state_dir.as_str() {
        "" => None,
        dir => Some(Path::new(dir)),
    };
    // A node of a fixed id is refused by the lock before it asks the store for anything.
    let state = match (dir, cfg.node_id_auto) {
        (Some(dir), false) => Some(StateDir::lock(dir, cfg.node_id)?),
        _ => None,
    };
    let partition = topology
        .partition()
        .await
        .context("reading the partition")?
        .context(
            "no partition is committed in the topology store: commit one before starting nodes",
        )?;
    anyhow::ensure!(
        *partition.shape() == cfg.world,
        "the committed partition is for world {:?}, this node is configured for {:?}",
        partition.shape(),
        cfg.world
    );
    if cfg.node_id_auto {
        let (held, state) = take_free(topology, cfg, dir).await?;
        let node = held.lease.node;
        tracing::info!(
            node,
            floor = cfg.node_id,
            epoch = held.lease.epoch,
            in_partition = partition.members().contains(&node),
            "took node id {node} from the topology store"
        );
        return Ok((partition, held, state));
    }
    match take(topology, cfg, cfg.node_id, state.as_ref()).await? {
        Ok(held) => Ok((partition, held, state)),
        Err(other) => anyhow::bail!(
            "node id {} is leased by {:?} until {} ms (the store's clock): another sidecar runs as this node",
            cfg.node_id,
            other.holder,
            other.expires_unix_ms
        ),
    }
}

/// With `node_id_auto`: the lease of the first node id that can be taken, at or above
/// `node_id`, with its state dir locked. First the ids this host's state dir recorded a grant
/// for, the latest first (a process restarted in place takes its predecessor's id back, at once
/// if the grant is still the store's); then, in order, every id whose lease was not live when
/// the nodes were listed. The list only saves asking for ids surely taken: the store's grant
/// decides, and an id another node won meanwhile (or another process of this host holds the
/// lock of) is passed over for the next.
async fn take_free(
    topology: &dyn TopologyStore,
    cfg: &SidecarConfig,
    dir: Option<&Path>,
) -> anyhow::Result<(Held, Option<StateDir>)> {
    let ids = cfg.node_id..=MAX_NODE_ID;
    let mut tried = BTreeSet::new();
    if let Some(dir) = dir {
        for node in StateDir::recorded(dir, ids.clone()) {
            tried.insert(node);
            let Some(state) = StateDir::try_lock(dir, node)? else {
                continue;
            };
            if let Ok(held) = take(topology, cfg, node, Some(&state)).await? {
                return Ok((held, Some(state)));
            }
        }
    }
    let live: BTreeSet<NodeId> = topology
        .nodes()
        .await
        .context("listing the nodes")?
        .into_iter()
        .filter(|e| e.live)
        .map(|e| e.lease.node)
        .collect();
    for node in ids {
        if tried.contains(&node) || live.contains(&node) {
            continue;
        }
        let state = match dir {
            None => None,
            Some(dir) => match StateDir::try_lock(dir, node)? {
                Some(state) => Some(state),
                None => continue,
            },
        };
        match take(topology, cfg, node, state.as_ref()).await? {
            Ok(held) => return Ok((held, state)),
            Err(other) => tracing::debug!(
                node,
                holder = %other.holder,
                "node id taken meanwhile; trying the next"
            ),
        }
    }
    anyhow::bail!(
        "no node id is free from node_id {} up to {MAX_NODE_ID}: every one is leased by a live node",
        cfg.node_id
    )
}

/// Takes the lease of `node`, over from the grant `state` recorded if that is still the store's;
/// `Err` with the lease of whoever holds it live.
async fn take(
    topology: &dyn TopologyStore,
    cfg: &SidecarConfig,
    node: NodeId,
    state: Option<&StateDir>,
) -> anyhow::Result<Result<Held, Lease>> {
    let holder = topology::process_holder(&format!("sidecar-{node}"));
    let ttl = Duration::from_millis(cfg.node_lease_ms);
    let writable = Duration::from_millis(topology::writable_ms(cfg.node_lease_ms));
    // Holding the lock, this process is the only one of this host that may have been granted
    // the recorded lease since: whoever was is dead, and need not be waited out.
    let mut previous = state.and_then(StateDir::last_lease);
    // A grant that came back after its deadline (the store answered slower than the lease) is
    // taken again; the node never starts on a dead lease.
    for _ in 0..LEASE_ATTEMPTS {
        let sent = Instant::now();
        let answer = match previous.take() {
            Some(previous) => {
                let answer = topology
                    .take_over_lease(&previous, &holder, ttl)
                    .await
                    .context("taking the node lease over")?;
                match &answer {
                    Acquire::Granted(lease) if lease.epoch == previous.epoch + 1 => {
                        tracing::info!(
                            node,
                            "took the node lease over from this node's previous process, epoch {} -> {}",
                            previous.epoch,
                            lease.epoch
                        )
                    }
                    _ => {}
                }
                answer
            }
            None => topology
                .acquire_lease(node, &holder, ttl)
                .await
                .context("taking the node lease")?,
        };
        if let (Acquire::Granted(lease), Some(state)) = (&answer, state) {
            if let Err(e) = state.record(lease) {
                tracing::warn!(node, error = %e, "recording the node lease in state_dir failed: a restart will wait out this lease");
            }
        }
        match answer {
            Acquire::Granted(lease) if Instant::now() < sent + writable => {
                return Ok(Ok(Held {
                    lease,
                    deadline: sent + writable,
                }))
            }
            Acquire::Granted(lease) => tracing::warn!(
                node,
                epoch = lease.epoch,
                "the node lease lapsed before the store answered; taking it again"
            ),
            Acquire::Held(other) => return Ok(Err(other)),
        }
    }
    anyhow::bail!(
        "the topology store answers slower than node_lease_ms ({} ms): every grant lapsed before it arrived",
        cfg.node_lease_ms
    )
}

/// Renews the lease until `shutdown`, then gives it up. Each grant moves the deadline to a
/// lease's length after its request was sent, and is handed to the node (through `renewed` too,
/// for the record's publisher). Renewals take the lease back even once lapsed
/// ([`TopologyStore::reclaim_lease`]): past its deadline the node has frozen everything on its
/// own clock, and a grant that comes back (the store was slow, paused, electing a primary)
/// thaws it. Only a store that says another grant replaced the lease ends the task: the node
/// is told it lost the lease, and exits.
pub(crate) async fn keep_lease(
    topology: Arc<dyn TopologyStore>,
    mut held: Held,
    ttl: Duration,
    node: mpsc::Sender<Event>,
    renewed: watch::Sender<Lease>,
    shutdown: CancellationToken,
) {
    let me = held.lease.node;
    let writable = Duration::from_millis(topology::writable_ms(ttl.as_millis() as u64));
    let mut every = tokio::time::interval(Duration::from_millis(topology::renew_every_ms(
        ttl.as_millis() as u64,
    )));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Warned once per lapse, not once per attempt.
    let mut lapse_told = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        let sent = Instant::now();
        // One request at a time, never longer than a lease: a store that does not answer is
        // asked again.
        let call = tokio::time::timeout(ttl, topology.reclaim_lease(&held.lease, ttl)).await;
        match call {
            Ok(Ok(Some(lease))) => {
                if lapse_told {
                    tracing::warn!(
                        node = me,
                        epoch = lease.epoch,
                        "took the lapsed node lease back"
                    );
                    lapse_told = false;
                }
                held = Held {
                    lease,
                    deadline: sent + writable,
                };
                renewed.send_replace(held.lease.clone());
                let event = Event::LeaseRenewed {
                    lease: held.lease.clone(),
                    deadline: held.deadline,
                };
                // A node too busy to take it this round gets the next one; its own deadline
                // only comes earlier meanwhile, never later.
                if tokio::time::timeout(MEMBERSHIP_EVERY, node.send(event))
                    .await
                    .is_ok_and(|r| r.is_err())
                {
                    break;
                }
            }
            Ok(Ok(None)) => {
                return lost(&node, me, "another grant replaced the node lease").await;
            }
            Ok(Err(e)) if Instant::now() < held.deadline => {
                tracing::warn!(node = me, error = %e, "renewing the node lease failed")
            }
            Err(_) if Instant::now() < held.deadline => {
                tracing::warn!(
                    node = me,
                    "renewing the node lease: no answer within a lease"
                )
            }
            Ok(Err(_)) | Err(_) => {
                if !lapse_told {
                    tracing::error!(
                        node = me,
                        "the node lease lapsed with the store not answering: frozen until it can be taken back"
                    );
                    lapse_told = true;
                }
            }
        }
    }
    let _ = topology.release_lease(&held.lease).await;
}

async fn lost(node: &mpsc::Sender<Event>, me: u32, why: &str) {
    tracing::error!(node = me, "{why}: this node stops writing");
    let _ = node.send(Event::Core(Input::LeaseLost)).await;
}

#[derive(Debug, PartialEq, Eq)]
enum Reported {
    Yes,
    /// The node's inbox stayed full: skipped this round.
    Busy,
    /// The node is gone.
    Gone,
}

/// Hands the node what membership read, waiting at most one round: a busy node's inbox must not
/// stall the reads. What is skipped is read again, fresher, next round.
async fn report(node: &mpsc::Sender<Event>, input: Input) -> Reported {
    match tokio::time::timeout(MEMBERSHIP_EVERY, node.send(Event::Core(input))).await {
        Ok(Ok(())) => Reported::Yes,
        Ok(Err(_)) => Reported::Gone,
        Err(_) => Reported::Busy,
    }
}

/// What the node has for the topology store: its latest load report, and its players.
pub(crate) struct Reports {
    pub(crate) load: watch::Receiver<Option<cellmesh_world::balance::CellReport>>,
    pub(crate) players: watch::Receiver<Option<Vec<cellmesh_stores::topology::PlayerSample>>>,
}

/// Publishes the record, the latest load report and the players under the current lease, and
/// reports the live peers and any newer partition, until `shutdown`.
pub(crate) async fn membership(
    topology: Arc<dyn TopologyStore>,
    lease: watch::Receiver<Lease>,
    record: NodeRecord,
    reports: Reports,
    partition_epoch: u64,
    node: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) {
    let me = record.node;
    let Reports {
        mut load,
        mut players,
    } = reports;
    let mut partition_epoch = partition_epoch;
    let mut every = tokio::time::interval(MEMBERSHIP_EVERY);
    let mut published = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        if !published {
            let current = lease.borrow().clone();
            match topology.publish_node(&current, &record).await {
                Ok(true) => published = true,
                Ok(false) => tracing::warn!(node = me, "publishing the node record was refused"),
                Err(e) => {
                    tracing::warn!(node = me, error = %e, "publishing the node record failed")
                }
            }
        }
        if load.has_changed().unwrap_or(false) {
            let report = load.borrow_and_update().clone();
            if let Some(report) = report {
                let current = lease.borrow().clone();
                match topology.publish_load(&current, &report).await {
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(node = me, "publishing the load was refused"),
                    Err(e) => tracing::warn!(node = me, error = %e, "publishing the load failed"),
                }
            }
        }
        if players.has_changed().unwrap_or(false) {
            let samples = players.borrow_and_update().clone();
            if let Some(samples) = samples {
                let current = lease.borrow().clone();
                match topology.publish_players(&current, &samples).await {
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(node = me, "publishing the players was refused"),
                    Err(e) => {
                        tracing::warn!(node = me, error = %e, "publishing the players failed")
                    }
                }
            }
        }
        match topology.partition().await {
            Ok(Some(p)) if p.epoch() > partition_epoch => {
                let epoch = p.epoch();
                match report(&node, Input::Partition(Box::new(p))).await {
                    Reported::Yes => partition_epoch = epoch,
                    // Read again next round.
                    Reported::Busy => {}
                    Reported::Gone => break,
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(node = me, error = %e, "reading the partition failed"),
        }
        match topology.nodes().await {
            Ok(entries) => {
                // Lapsed but neither released nor replaced: its holder may take it back.
                let lapsed = entries
                    .iter()
                    .filter(|e| e.lease.node != me && !e.live && e.lease.expires_unix_ms > 0)
                    .map(|e| (e.lease.node, e.lease.epoch))
                    .collect();
                let live: Vec<_> = entries
                    .into_iter()
                    .filter(|e| e.lease.node != me && e.live)
                    .collect();
                let leases = live.iter().map(|e| (e.lease.node, e.lease.epoch)).collect();
                let input = Input::PeerLeases {
                    live: leases,
                    lapsed,
                };
                if report(&node, input).await == Reported::Gone {
                    break;
                }
                let peers = live
                    .into_iter()
                    .filter_map(|e| {
                        e.record.map(|r| PeerInfo {
                            node: r.node,
                            mesh_addr: r.mesh_addr,
                            geo: r.geo,
                        })
                    })
                    .collect();
                if report(&node, Input::Peers(peers)).await == Reported::Gone {
                    break;
                }
            }
            Err(e) => tracing::warn!(node = me, error = %e, "listing the nodes failed"),
        }
    }
}
