//! The node's state and decisions, with no I/O (the sans-IO shape of quinn-proto).
//!
//! The driver (`crate::io`) feeds the core what happened with [`Core::handle`]`(now, Input)`,
//! then carries out what the core wants done, taken from [`Core::poll_output`], and wakes it at
//! [`Core::poll_timeout`]. A handler never sends, spawns, sleeps or reads a clock: it queues an
//! [`Output`] (a frame, a store request, a dial), and the answer comes back as an [`Input`]. So
//! the same core runs over real sockets and in the cluster simulator, in virtual time.
//!
//! The state is split by concern, each part in its own file with the handlers that own it:
//! [`game`] (the local game and its ticks), [`gateway`] (client sessions), [`peers`] (links to
//! proxies and other sidecars), [`replication`] (subscriptions, render and simulation ghosts),
//! [`routing`] (routing by account, anchors), [`handoff`] (moving reals, the epoch fence, inputs)
//! [`avatars`] (one avatar per account, found through the directory's master record)
//! [`authority`] (lease, partition, drain), [`restore`] (checkpoints to the store, a dead
//! process's world restored) and [`admission`] (whether new sessions are taken).
//! [`wire`] holds the one copy of each conversion between the model and the wire.
//!
//! A part's handlers borrow the shared [`context`] (the time, the configuration, the metrics
//! and the outbox) beside their own state; [`admission`], [`authority`], [`avatars`], [`balance`],
//! [`claims`], [`commands`], [`game`], [`gateway`], [`handoff`], [`peers`], [`replication`],
//! [`restore`], [`routing`] and [`spawners`] keep theirs private and are told by the core what
//! they need of the other parts.
//! The core's periodic checks are named deadlines ([`timers`]).

pub(crate) mod admission;
pub(crate) mod authority;
pub(crate) mod avatars;
pub(crate) mod balance;
#[cfg(test)]
mod claim_home_tests;
pub(crate) mod claim_homes;
#[cfg(test)]
mod claim_tests;
pub mod claims;
#[cfg(test)]
mod command_tests;
pub(crate) mod commands;
pub(crate) mod context;
pub(crate) mod game;
pub(crate) mod gateway;
pub(crate) mod handoff;
#[cfg(test)]
mod pair_tests;
pub(crate) mod peers;
pub(crate) mod replication;
pub(crate) mod restore;
pub(crate) mod routing;
#[cfg(test)]
mod scripted_tests;
#[cfg(test)]
mod spawner_tests;
mod spawners;
pub(crate) mod timers;
pub(crate) mod wire;

use std::sync::Arc;

use cellmesh_proto::edge::KickReason;
use cellmesh_proto::local::{self, GameMessage, SidecarFrame};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage};
use cellmesh_stores::claims::{ClaimGrant, ClaimHolder, ClaimOutcome};
use cellmesh_stores::topology::{Fence, Lease};
use cellmesh_stores::{MasterEntry, PlayerRecord, SessionEntry};
use cellmesh_world::geometry::ChunkPos;
use cellmesh_world::partition::{NodeId, Partition};
use prost::Message;
use serde_json::json;

use crate::config::SidecarConfig;
use crate::metrics::Metrics;
use crate::model;
use crate::model::entities::EntityTable;

pub use gateway::SessionKey;
pub use peers::PeerInfo;
pub use restore::Restored;

use authority::Authority;
use context::Context;
use game::LocalGame;
use gateway::Gateway;
use handoff::Handoffs;
use peers::Mesh;
use replication::Replication;
use routing::Routing;
use timers::{Timer, Timers};

/// A game connection, numbered by the driver.
pub type ConnId = u64;
/// A mesh link (to a proxy or a peer sidecar), numbered by the driver.
pub type LinkId = u64;

/// The time, as the driver (or the simulator) tells it: one value with both clocks, so the two
/// never disagree within a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Now {
    /// Monotonic milliseconds since an arbitrary start: every duration and deadline.
    pub mono_ms: u64,
    /// Wall-clock milliseconds since the Unix epoch: ids and player records.
    pub unix_ms: u64,
}

/// What the world tells the node.
#[derive(Debug)]
pub enum Input {
    /// A game said a valid `Hello`; `rest` is what followed it in the same frame.
    GameHello {
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
    },
    GameFrame {
        conn: ConnId,
        messages: Vec<GameMessage>,
    },
    GameClosed {
        conn: ConnId,
        reason: String,
    },
    /// The game's outbox is full: it is not reading (the driver has already cut it).
    GameStalled {
        conn: ConnId,
    },
    /// A proxy or a peer completed the link handshake.
    LinkUp {
        link: LinkId,
        hello: mesh::LinkHello,
        remote: String,
        rest: Vec<MeshMessage>,
    },
    LinkFrame {
        link: LinkId,
        messages: Vec<MeshMessage>,
    },
    LinkClosed {
        link: LinkId,
        reason: String,
    },
    /// The link's outbox is full: the other end is not reading (the driver has already cut it).
    LinkStalled {
        link: LinkId,
    },
    /// The link's outbox holds `frames` frames: the driver says so while it holds at least
    /// `admission.outbox_high_frames` (at most every [`BACKLOG_REPORT_EVERY_MS`] per link).
    LinkBacklog {
        link: LinkId,
        frames: usize,
    },
    /// A store request came back.
    Store(StoreReply),
    /// The peers with a live lease, from the topology store.
    Peers(Vec<PeerInfo>),
    /// Peers' lease epochs (their incarnations) from the topology store: those live, and those
    /// lapsed but not replaced by another grant (their holder may still take them back).
    PeerLeases {
        live: Vec<(NodeId, u64)>,
        lapsed: Vec<(NodeId, u64)>,
    },
    /// Another grant replaced the node lease (a new process, or a restore's fence): this node
    /// must never write again. (A lease past its deadline with no answer only lapses: the node
    /// freezes until it takes the lease back; see [`Input::LeaseRenewed`].)
    LeaseLost,
    /// The node lease was renewed: ids may be minted until its new expiry, and writing goes on
    /// until the new deadline.
    LeaseRenewed(LeaseTerms),
    /// A newer partition was committed.
    Partition(Box<Partition>),
    /// SIGTERM: stop accepting handoffs, hand away what the partition gives to others, exit.
    Drain,
    /// The time asked for by [`Core::poll_timeout`] has come.
    Timer,
    /// The sidecar stops: sessions are told, every connection is let go.
    Shutdown,
}

/// What the node wants done.
#[derive(Debug)]
pub enum Output {
    /// A frame for the game.
    ToGame { conn: ConnId, frame: SidecarFrame },
    /// Write this error to the game connection, then close it.
    GameFatal { conn: ConnId, error: local::Error },
    /// Close the game connection at once, dropping what is queued (it stopped reading).
    KillGame { conn: ConnId },
    /// Close the game connection once what is queued is written.
    ReleaseGame { conn: ConnId },
    /// A frame for a link.
    ToLink { link: LinkId, frame: MeshFrame },
    /// Close a link at once.
    KillLink { link: LinkId },
    /// Close a link once what is queued is written.
    ReleaseLink { link: LinkId },
    /// Keep a link to peer `node` at `addr` (this node has the lower id), replacing any dialler.
    Dial { node: NodeId, addr: String },
    /// Stop dialling peer `node`.
    StopDial { node: NodeId },
    /// Run a store call; its answer comes back as [`Input::Store`].
    Store(StoreRequest),
    /// Readiness for traffic changed.
    Ready(bool),
    /// This node's report to the balancer (see `balance`): the driver publishes the latest.
    LoadReport(Box<cellmesh_world::balance::CellReport>),
    /// The players attached here, for the geo-aware director's bubble placement (only in a
    /// world of several geos): the driver publishes the latest.
    Players(Vec<cellmesh_stores::topology::PlayerSample>),
    /// The state changed since it was last published: read [`Core::state`] and
    /// [`Core::reals`] now.
    Publish,
    /// The drain is over: the driver shuts the sidecar down.
    Stop,
    /// The node cannot go on (its lease was lost, everything it wrote is frozen): the driver
    /// shuts the sidecar down and the process exits with this error, so that its supervisor
    /// starts it afresh. Comes after everything queued before it.
    Exit { reason: String },
}

/// A store call the node asks for. Each is run with a timeout; failures come back as errors.
#[derive(Debug, Clone)]
pub enum StoreRequest {
    /// Loads the player record (unless a handover hint stands in for it) and registers the
    /// session in the directory, with a new epoch above the record's (or the hint's).
    Register {
        session: SessionKey,
        account: String,
        node: NodeId,
        lease_ms: u64,
        /// The epoch of the session handed over from another geo, when the login came with its
        /// hint: the record is not read and the new epoch goes above this one. `None`: the
        /// record is read and the new epoch goes above the one it names.
        handed_over_from: Option<u64>,
        /// A session moving here from a lost gateway: the epoch it held there. It registers
        /// only if no login of the account registered since ([`StoreReply::Superseded`]).
        moved_from: Option<u64>,
    },
    /// Renews the directory leases of attached sessions.
    Renew {
        sessions: Vec<(SessionKey, String, u64)>,
        lease_ms: u64,
    },
    /// Registers again a session whose directory entry is gone (the directory lost it: a
    /// restart, an outage longer than the lease), above the epoch it `held`, unless a login of
    /// the account registered since ([`StoreReply::Reregistered`] with `None`).
    Reregister {
        session: SessionKey,
        account: String,
        node: NodeId,
        lease_ms: u64,
        held: u64,
    },
    /// Where an account's session is.
    Lookup { account: String },
    /// A session ended: saves the player record, then releases the directory entry, or, when
    /// `hold_ms` is not 0, leaves it for that long (a session handed over to another geo stays
    /// known while the player reconnects there, so its avatar's owner keeps the avatar).
    EndSession {
        record: PlayerRecord,
        epoch: u64,
        hold_ms: u64,
    },
    /// Saves the records of players still attached (their last position so far).
    SaveRecords { records: Vec<PlayerRecord> },
    /// Releases a directory entry (a registration nobody wants any more).
    Release { account: String, epoch: u64 },
    /// Records where this node simulates avatars (`set`), and forgets those it no longer does
    /// (`clear`: account, entity, entity epoch), in the directory's master records.
    WriteMasters {
        set: Vec<(String, MasterEntry)>,
        clear: Vec<(String, u64, u64)>,
    },
    /// Writes checkpoints of this process (`node` under `lease_epoch`) and removes those of
    /// entities it no longer writes. Each is a successor offer a restore can make as it is.
    PutCheckpoints {
        node: NodeId,
        lease_epoch: u64,
        put: Vec<mesh::HandoffOffer>,
        remove: Vec<u64>,
    },
    /// Every checkpoint a dead process left: in this geo's store, or (`copy_of`: a geo none
    /// of whose nodes lives, asked by the core geo's decider) in the copy of that geo's
    /// checkpoints kept in this geo's store.
    LoadCheckpoints {
        node: NodeId,
        lease_epoch: u64,
        copy_of: Option<String>,
    },
    /// A dead process's checkpoints, once its world is restored: the process is marked
    /// restored for good in the topology first (so neither its geo's store nor a copy of it is
    /// ever restored again), then its checkpoints are dropped (and their copy in the core).
    DropCheckpoints {
        node: NodeId,
        lease_epoch: u64,
        copy_of: Option<String>,
    },
    /// Every process with checkpoints in the store (or in the copy of `copy_of`'s).
    ListCheckpointed { copy_of: Option<String> },

    /// Commits `partition` if the store's current epoch is the one before it.
    CommitPartition { partition: Box<Partition> },
    /// Claims `key` for `holder` with a lease of `ttl_ms`; answered under `token`.
    Claim {
        token: u64,
        key: String,
        holder: ClaimHolder,
        ttl_ms: u64,
    },
    /// Extends each claim's lease, if its grant still holds it.
    RenewClaims { claims: Vec<(ClaimGrant, u64)> },
    /// A claim carried in by a handoff: held under `entity_epoch` from now on (which fences the
    /// previous owner out), its lease renewed to `ttl_ms`.
    RebindClaim {
        grant: ClaimGrant,
        entity_epoch: u64,
        ttl_ms: u64,
    },
    /// Frees a claim if `grant` still holds it (no answer: a lease lapses anyway).
    ReleaseClaim { grant: ClaimGrant },
    /// A claim call run on this geo's store for a node of another geo (this geo is the key's
    /// home): its answer goes back on `link` under the peer's `call` id.
    ClaimForPeer {
        link: LinkId,
        call: u64,
        request: Box<StoreRequest>,
    },
    /// Fences the lapsed lease `epoch` of `node` before its world is restored (see
    /// `cellmesh_stores::topology::fence_lease`).
    FenceLease { node: NodeId, epoch: u64 },
}

/// The answers of store calls that have one.
#[derive(Debug)]
pub enum StoreReply {
    Registered {
        session: SessionKey,
        account: String,
        result: Result<Registration, String>,
    },
    /// A session that moved here was not registered: a newer login of its account was.
    Superseded {
        session: SessionKey,
        account: String,
    },
    /// Lease renewals: (session, epoch, still current?).
    Renewed {
        results: Vec<(SessionKey, u64, Result<bool, String>)>,
    },
    /// A session registered again after its entry was lost: its new epoch, or `None` when a
    /// newer login holds the account.
    Reregistered {
        session: SessionKey,
        account: String,
        held: u64,
        result: Result<Option<u64>, String>,
    },
    LookedUp {
        account: String,
        result: Result<Option<SessionEntry>, String>,
    },
    CheckpointsLoaded {
        node: NodeId,
        lease_epoch: u64,
        result: Result<Vec<mesh::HandoffOffer>, String>,
    },
    PartitionCommitted {
        epoch: u64,
        result: Result<(), String>,
    },
    LeaseFenced {
        node: NodeId,
        epoch: u64,
        result: Result<Fence, String>,
    },
    /// The processes with checkpoints in the store (or the copy of `copy_of`'s): (node,
    /// lease epoch); `restored`: those of them marked restored already.
    Checkpointed {
        copy_of: Option<String>,
        result: Result<Vec<(NodeId, u64)>, String>,
        restored: Vec<(NodeId, u64)>,
    },
    /// A `PutCheckpoints` the store refused: the entities of both lists go in the next write.
    CheckpointsNotWritten {
        lease_epoch: u64,
        put: Vec<u64>,
        remove: Vec<u64>,
    },
    /// A `WriteMasters` the store refused: these accounts' records are written again.
    MastersNotWritten { accounts: Vec<String> },
    Claimed {
        token: u64,
        result: Result<ClaimOutcome, String>,
    },
    /// Renewals: (grant, still held?).
    ClaimsRenewed {
        results: Vec<(ClaimGrant, Result<bool, String>)>,
    },
    /// A rebind of `old`: the grant under the new epoch, or `None` if `old` no longer holds it.
    ClaimRebound {
        old: ClaimGrant,
        result: Result<Option<ClaimGrant>, String>,
    },
    /// The answer of a [`StoreRequest::ClaimForPeer`], for that peer.
    ClaimForPeer {
        link: LinkId,
        call: u64,
        reply: Box<StoreReply>,
    },
}

#[derive(Debug, Clone)]
pub struct Registration {
    pub epoch: u64,
    pub record: Option<cellmesh_stores::PlayerRecord>,
    /// Where the account's avatar is simulated, if it has one.
    pub master: Option<MasterEntry>,
}

/// Frames the epoch fence holds for one entity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldFrames {
    pub entity: u64,
    /// The epoch they wait for.
    pub waits_for: u64,
    pub frames: usize,
    /// The epoch and owner the fence follows for the entity now.
    pub follows: Option<(u64, NodeId)>,
}

/// Room for the frame, message and `ToClient` headers around one client batch.
pub(crate) const TO_CLIENT_OVERHEAD: usize = 64;
/// How often, at most, the driver reports the backlog of one link's outbox.
pub const BACKLOG_REPORT_EVERY_MS: u64 = 100;

/// One sidecar's node: everything it knows and decides.
pub struct Core {
    /// The configuration, as the driver reads it (the parts read the context's).
    pub(crate) cfg: Arc<SidecarConfig>,
    /// The time, the configuration, the metrics and the outbox every part shares.
    pub(crate) cx: Context,
    /// Every entity the node holds: its reals and its render ghosts.
    pub(crate) table: EntityTable,
    pub(crate) game: LocalGame,
    pub(crate) gateway: Gateway,
    pub(crate) mesh: Mesh,
    pub(crate) replication: Replication,
    pub(crate) routing: Routing,
    pub(crate) handoff: Handoffs,
    pub(crate) authority: Authority,
    pub(crate) restore: restore::Restore,
    pub(crate) avatars: avatars::Avatars,
    pub(crate) commands: commands::Commands,
    pub(crate) claims: claims::Claims,
    /// Claim calls for keys homed in other geos: sent there, and run here for them.
    pub(crate) claim_homes: claim_homes::ClaimHomes,
    pub(crate) spawners: spawners::Spawners,
    /// Whether the node takes new sessions, and the game's smoothed load.
    pub(crate) admission: admission::Admission,
    shutting_down: bool,
    /// The periodic checks' deadlines.
    timers: Timers,
    load_reports: balance::LoadReports,
}

/// The node lease as the core holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTerms {
    pub lease: Lease,
    /// When this node stops writing unless a renewal lands first (monotonic ms, the core's
    /// clock): the driver sets it a lease's length after it *sent* the granted request.
    pub until_ms: u64,
}

impl Core {
    /// A node serving `partition` as `cfg.node_id`; `clustered` when it has peers to link to
    /// (a lone node owns the whole world and never hands anything off).
    /// Ids are minted, and the node writes, under `lease` when it holds one.
    pub fn new(
        cfg: Arc<SidecarConfig>,
        metrics: Metrics,
        partition: Arc<Partition>,
        clustered: bool,
        lease: Option<LeaseTerms>,
        now: Now,
    ) -> Self {
        let cx = Context::new(cfg.clone(), metrics, now);
        let authority = Authority::new(&cfg, partition.clone(), lease.as_ref().map(|l| l.until_ms));
        Self {
            table: EntityTable::new(cfg.world),
            game: LocalGame::new(&cfg, lease.as_ref().map(|l| &l.lease)),
            gateway: Gateway::new(&cfg),
            mesh: Mesh::new(clustered),
            replication: Replication::new(&cfg, &partition),
            routing: Routing::default(),
            handoff: Handoffs::default(),
            authority,
            restore: restore::Restore::new(lease.as_ref().map_or(0, |l| l.lease.epoch)),
            avatars: avatars::Avatars::default(),
            commands: commands::Commands::default(),
            claims: Default::default(),
            claim_homes: claim_homes::ClaimHomes::new(&cfg),
            spawners: Default::default(),
            admission: admission::Admission::new(&cx),
            load_reports: balance::LoadReports::new(&cx),
            shutting_down: false,
            timers: Timers::new(&cfg, now.mono_ms),
            cx,
            cfg,
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.cx.metrics
    }

    /// Names this process's incarnation (its lease epoch) where no lease is passed to
    /// [`Core::new`] (the simulator's stores have none): checkpoints go to the store under it.
    pub fn set_incarnation(&mut self, lease_epoch: u64) {
        self.restore.set_incarnation(lease_epoch);
    }

    /// Entities this process spawned whose first checkpoint has not reached the store yet: if
    /// the process died now, nothing could restore them (what it adopted, its source can).
    pub fn unpersisted(&self) -> Vec<u64> {
        self.table
            .iter()
            .filter(|e| e.origin().is_none() && e.epoch == game::FIRST_EPOCH)
            .filter(|e| !self.game.checkpoints().is_stored(e.id))
            .map(|e| e.id)
            .collect()
    }

    /// Dead processes whose world this node has not seen restored yet.
    pub fn restores_pending(&self) -> usize {
        self.restore.pending()
    }

    /// Every entity the node holds, reals and render ghosts (read-only).
    pub fn entities(&self) -> &EntityTable {
        &self.table
    }

    /// Handoffs this node has begun as the source and not finished.
    pub fn handoffs_in_flight(&self) -> usize {
        self.handoff.outgoing().in_flight()
    }

    /// Frames held by the epoch fence for entities whose epoch change is not seen yet.
    pub fn held_frames(&self) -> usize {
        self.handoff.fence().held()
    }

    /// Reals written here, unfrozen, that lack the checkpoint they should have by now: none
    /// kept under their epoch, and none asked for or due within `slack_ms`.
    pub fn checkpoints_missing(&self, slack_ms: u64) -> Vec<u64> {
        let now = self.cx.now.mono_ms;
        self.table
            .iter()
            .filter(|e| e.origin().is_none() && !self.handoff.outgoing().is_frozen(e.id))
            .filter(|e| {
                self.game
                    .checkpoints()
                    .missing(e.id, e.epoch, now, slack_ms)
            })
            .map(|e| e.id)
            .collect()
    }

    /// Entities despawned since the last call because their game went away before any
    /// checkpoint of them came back (for a census of the world).
    pub fn take_unrestorable(&mut self) -> Vec<u64> {
        self.game.take_unrestorable()
    }

    /// Client inputs held here now (see `Metrics::inputs_held`).
    pub fn inputs_held(&self) -> usize {
        self.handoff
            .outgoing()
            .held_inputs(handoff::Routed::is_input)
            + self
                .handoff
                .fence()
                .held_where(|f| matches!(f, handoff::Fenced::Input(_)))
                .count()
            + self.handoff.input_order().held()
            + self.authority.held_inputs().len()
    }

    /// The restores this node decided and saw acked since the last call.
    pub fn take_restored(&mut self) -> Vec<Restored> {
        self.restore.take_log()
    }

    /// Client inputs held here that no other node has a copy of, lost if this process died
    /// now, with the copies offered to nodes `dead` says died (which a simulator knows before
    /// this node hears of it): `(account, seq)` of each.
    /// A copy the dead target delivered before it died was delivered after all, which only the
    /// caller can tell.
    pub fn inputs_only_here_if(&self, dead: impl Fn(NodeId) -> bool) -> Vec<(String, u64)> {
        let outgoing = self.handoff.outgoing();
        let routed = outgoing
            .inputs_offered_to(
                |n| dead(n) || self.restore.in_doubt_to_dead_node(n),
                handoff::Routed::is_input,
            )
            .chain(outgoing.inputs_not_forwarded(handoff::Routed::is_input))
            .filter_map(|r| match r {
                handoff::Routed::Input(i) => Some((i.account.clone(), i.seq)),
                handoff::Routed::Command(_) => None,
            });
        let fenced = self
            .handoff
            .fence()
            .held_where(|_| true)
            .filter_map(|f| match f {
                handoff::Fenced::Input(i) => Some((i.account.clone(), i.seq)),
                _ => None,
            });
        let local = (self.handoff.input_order().pending())
            .chain(self.authority.held_inputs())
            .map(|i| (i.account.clone(), i.seq));
        routed.chain(fenced).chain(local).collect()
    }

    /// What the epoch fence holds, entity by entity.
    pub fn held_detail(&self) -> Vec<HeldFrames> {
        self.handoff
            .fence()
            .held_by_epoch()
            .into_iter()
            .map(|(entity, waits_for, frames)| HeldFrames {
                entity,
                waits_for,
                frames,
                follows: self.handoff.fence().current(&self.table, entity),
            })
            .collect()
    }

    /// Handles one input at time `now` (which never goes backwards).
    pub fn handle(&mut self, now: Now, input: Input) {
        self.cx.now = now.max(self.cx.now);
        self.check_lease_deadline();
        if !matches!(input, Input::Timer) {
            self.cx.dirty = true;
        }
        let link = match &input {
            Input::LinkFrame { link, .. } | Input::LinkUp { link, .. } => Some(*link),
            _ => None,
        };
        match input {
            Input::GameHello { conn, hello, rest } => self.on_game_hello(conn, hello, rest),
            Input::GameFrame { conn, messages } => self.on_game_frame(conn, messages),
            Input::GameClosed { conn, reason } => self.on_game_closed(conn, &reason),
            Input::GameStalled { conn } => self.on_game_stalled(conn),
            Input::LinkUp {
                link,
                hello,
                remote,
                rest,
            } => {
                self.on_link_up(link, hello, remote);
                for m in rest {
                    self.on_link_message(link, m);
                }
            }
            Input::LinkFrame { link, messages } => {
                for m in messages {
                    self.on_link_message(link, m);
                }
            }
            Input::LinkClosed { link, reason } => self.close_link(link, &reason),
            Input::LinkStalled { link } => self.on_link_stalled(link),
            Input::LinkBacklog { link, frames } => self.on_link_backlog(link, frames),
            Input::Store(StoreReply::Registered {
                session,
                account,
                result,
            }) => self.on_registered(session, account, result),
            Input::Store(StoreReply::Superseded { session, account }) => self
                .gateway
                .on_superseded(&mut self.cx, &mut self.mesh, session, &account),
            Input::Store(StoreReply::Renewed { results }) => {
                self.gateway.on_renewed(&mut self.cx, results)
            }
            Input::Store(StoreReply::Reregistered {
                session,
                account,
                held,
                result,
            }) => self.on_reregistered(session, account, held, result),
            Input::Store(StoreReply::LookedUp { account, result }) => {
                self.on_looked_up(account, result)
            }
            Input::Store(StoreReply::CheckpointsLoaded {
                node,
                lease_epoch,
                result,
            }) => self
                .restore
                .on_checkpoints_loaded(&self.cx, node, lease_epoch, result),
            Input::Store(StoreReply::PartitionCommitted { epoch, result }) => {
                self.restore.on_partition_committed(epoch, result)
            }
            Input::Store(StoreReply::Checkpointed {
                copy_of,
                result,
                restored,
            }) => self.on_checkpointed(copy_of, result, restored),
            Input::Store(StoreReply::CheckpointsNotWritten {
                lease_epoch,
                put,
                remove,
            }) => self.on_checkpoints_not_written(lease_epoch, put, remove),
            Input::Store(StoreReply::Claimed { token, result }) => self.on_claimed(token, result),
            Input::Store(StoreReply::ClaimsRenewed { results }) => self.on_claims_renewed(results),
            Input::Store(StoreReply::ClaimRebound { old, result }) => {
                self.on_claim_rebound(old, result)
            }
            Input::Store(StoreReply::ClaimForPeer { link, call, reply }) => {
                self.claim_homes.on_served(&mut self.cx, link, call, *reply)
            }
            Input::Store(StoreReply::MastersNotWritten { accounts }) => {
                self.on_masters_not_written(accounts)
            }
            Input::Store(StoreReply::LeaseFenced {
                node,
                epoch,
                result,
            }) => self.on_lease_fenced(node, epoch, result),
            Input::Peers(peers) => self.on_peers(peers),
            Input::PeerLeases { live, lapsed } => self.note_leases(&live, &lapsed),
            Input::LeaseLost => self.on_lease_lost(),
            Input::LeaseRenewed(terms) => self.on_lease_renewed(terms),
            Input::Partition(p) => self.apply_partition(*p),
            Input::Drain => self.authority.begin_drain(&mut self.cx),
            Input::Timer => self.on_timer(),
            Input::Shutdown => self.shutdown(),
        }
        // Only a peer sidecar's frames write ghosts: a proxy's inputs skip the scan. Their
        // changes are folded for clients once the driver asks for output, once for all the peer
        // frames it handled meanwhile.
        let from_peer = link
            .and_then(|l| self.mesh.link(l))
            .is_some_and(|l| l.peer.is_some());
        if from_peer {
            self.gateway.ghosts_changed();
            self.set_table_gauges();
        }
        self.flush_checkpoints();
        self.sync_master_records();
        self.count_fence_discards();
        self.route_claim_calls();
    }

    /// Held inputs the fence let go of are counted, never lost silently.
    pub(crate) fn count_fence_discards(&mut self) {
        self.handoff.count_discards(&self.cx);
    }

    /// The next thing to do, if any. Messages queued by the handlers are packed here into as
    /// few frames as fit, one batch per connection.
    ///
    /// Render ghosts' changes are folded for clients here, not per peer frame: a node that falls
    /// behind handles a backlog of peer frames in one go, and folding each would queue one batch
    /// per frame for every client (work and bytes growing with the backlog, each batch waiting
    /// behind the last, and clients cut as slow consumers). Folded together, each client gets at
    /// most one batch for all of them, with each entity's newest state.
    pub fn poll_output(&mut self) -> Option<Output> {
        if !self.cx.out.claim_calls.is_empty() {
            self.route_claim_calls();
        }
        if self.cx.out.pending.is_empty() {
            self.gateway
                .send_ghost_changes(&mut self.cx, &mut self.table, self.game.last_tick());
            self.pack_outboxes();
        }
        self.cx.out.pending.pop_front().or_else(|| {
            self.cx
                .out
                .exit
                .take()
                .map(|reason| Output::Exit { reason })
        })
    }

    /// When the node wants [`Input::Timer`], at the latest.
    pub fn poll_timeout(&self) -> Option<u64> {
        let inputs = self
            .handoff
            .input_order()
            .next_due()
            .into_iter()
            .chain(self.commands.next_due(|id| self.handoff.frozen(id)))
            .min()
            .unwrap_or(u64::MAX);
        let lease = self.authority.deadline().unwrap_or(u64::MAX);
        Some(self.timers.next_due().min(inputs).min(lease))
    }

    fn on_timer(&mut self) {
        self.deliver_due_inputs();
        self.deliver_due_commands();
        for timer in self.timers.take_due(&self.cx.config, self.cx.now.mono_ms) {
            self.run_timer(timer);
        }
    }

    /// Runs one periodic check.
    fn run_timer(&mut self, timer: Timer) {
        match timer {
            Timer::RenewSessions => self.gateway.renew_leases(&mut self.cx),
            Timer::StaleGhosts => self.sweep_stale_ghosts(),
            Timer::OverdueFrames => self.release_overdue_frames(),
            Timer::AskCheckpoints => self.game.ask_for_checkpoints(
                &mut self.cx,
                &self.table,
                self.authority.lease_live(),
            ),
            Timer::GameGrace => self.expire_game_grace(),
            Timer::FlushCheckpoints => self.flush_checkpoints(),
            Timer::SentOffers => self.prune_sent_offers(),
            Timer::Restore => self.restore_step(),
            Timer::Avatars => self.avatars_step(),
            Timer::Commands => self.commands_step(),
            Timer::Claims => self.claims_step(),
            Timer::Spawners => self.spawners_step(),
            Timer::PlayerRecords => self.gateway.save_player_records(&mut self.cx, &self.table),
            Timer::Whereabouts => self.gateway.report_whereabouts(&mut self.cx, &self.table),
            Timer::Admission => {
                let change = self.admission.evaluate(&self.cx);
                self.admission_changed(change);
            }
            Timer::Publish => {
                self.cx.metrics.inputs_held.set(self.inputs_held() as i64);
                if self.cx.dirty {
                    self.cx.dirty = false;
                    self.cx.out.pending.push_back(Output::Publish);
                }
                if self.drained() {
                    tracing::info!("drained: shutting down");
                    self.cx.out.pending.push_back(Output::Stop);
                }
            }
        }
    }

    // ------------------------------------------------------------------ game

    /// Whether a game is connected now (it said `Hello`).
    pub fn game_connected(&self) -> bool {
        self.game.connected()
    }

    /// A game's `Hello`: once it is welcomed (and handed back what it wrote, if it returns
    /// within its grace), it hears about every player it simulates and every adoption it owes,
    /// then what followed its `Hello` in the frame is handled.
    pub(crate) fn on_game_hello(
        &mut self,
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
    ) {
        let hello = self.game.on_hello(
            &mut self.cx,
            &mut self.table,
            &self.authority,
            self.shutting_down,
            conn,
            hello,
        );
        if hello == game::Hello::Refused {
            return;
        }
        // Sessions outlive a game restart: the new game hears about every attached player whose
        // avatar this node simulates (one simulated elsewhere stays there: a join here would
        // spawn a second avatar).
        let joins = self.gateway.joins_for_game(self.cx.config.node_id);
        self.cx.out.to_game.extend(joins);
        let remote: Vec<local::SidecarMessage> = self
            .routing
            .remote_players()
            .map(|(account, r)| {
                local::sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.clone(),
                    session_epoch: r.session_epoch,
                    last_position: None,
                })
                .into()
            })
            .collect();
        self.cx.out.to_game.extend(remote);
        let table = &self.table;
        let respawning = self
            .cx
            .out
            .to_game
            .iter()
            .filter_map(|m| match &m.body {
                Some(local::sidecar_message::Body::PlayerJoin(j)) => Some(j.account.clone()),
                _ => None,
            })
            .filter(|account| table.master_of(account).is_none());
        self.avatars.await_respawns(respawning);
        self.routing.forget_anchors();
        // Adopts the previous game never answered: the new game gets them again.
        let pending = self.handoff.pending_adopts();
        for adopt in pending {
            self.cx
                .out
                .to_game
                .push(local::sidecar_message::Body::Adopt(adopt).into());
        }
        self.cx
            .set_ready(self.authority.lease_live() && !self.authority.draining());
        for m in rest {
            if let Some(body) = m.body {
                self.on_game_message(body);
            }
        }
    }

    pub(crate) fn on_game_frame(&mut self, conn: ConnId, messages: Vec<GameMessage>) {
        if !self.game.is_conn(conn) {
            return;
        }
        for m in messages {
            if let Some(body) = m.body {
                self.on_game_message(body);
            }
        }
    }

    /// A message of the game, to the part it is for.
    pub(crate) fn on_game_message(&mut self, body: local::game_message::Body) {
        use local::game_message::Body as B;
        use local::ErrorCode;
        match body {
            B::Hello(_) => game::error(
                &mut self.cx,
                ErrorCode::UnexpectedMessage,
                "Hello was already received on this connection".into(),
                0,
            ),
            B::Spawn(s) => self.on_spawn(s),
            B::Update(u) => {
                let refused = self.write_refusal(u.entity_id);
                self.game
                    .on_update(&mut self.cx, &mut self.table, refused, u);
            }
            B::Despawn(d) => self.on_despawn(d),
            B::Event(e) => {
                let refused = self.write_refusal(e.entity_id);
                self.game.on_event(&mut self.cx, &self.table, refused, e);
            }
            B::Send(s) => self.game.on_send(s),
            B::ReserveIds(r) => self.game.reserve_ids(&mut self.cx, r),
            B::TickEnd(t) => {
                self.game.on_tick_end(&self.cx);
                self.end_tick(t.tick)
            }
            B::Load(l) => {
                self.on_game_load(&l);
                self.game.on_load(l);
            }
            B::Health(h) => self.game.on_health(h),
            // Chunk events travel to peers and the journal, which a single node does not have yet.
            B::ChunkEvent(_) => self.cx.metrics.drop_msg("chunk_event_unsupported", 1),
            B::Snapshot(s) => self.on_snapshot(s),
            B::Adopted(a) => self.on_adopted(a),
            B::CheckpointState(c) => {
                let lease_live = self.authority.lease_live();
                self.game
                    .on_checkpoint_state(&self.cx, &self.table, lease_live, c)
            }
            B::Release(r) => self.on_release(r),
            B::Command(c) => self.on_command(c),
            B::CommandReply(r) => self.on_command_reply(r),
            B::Claim(c) => self.on_claim(c),
            B::ClaimRelease(r) => self.on_claim_release(r),
            B::DeclareSpawners(d) => self.on_declare_spawners(d),
        }
    }

    /// The game's `Spawn`: a spawn point's stock is counted, and one born while the lease is
    /// lapsed is frozen with the rest until it is back.
    pub(crate) fn on_spawn(&mut self, s: local::Spawn) {
        let spawners = &self.spawners;
        let spawned = self.game.on_spawn(
            &mut self.cx,
            &mut self.table,
            |id| spawners.check_spawned_id(id),
            s,
        );
        let Some(id) = spawned else {
            return;
        };
        self.spawners.spawned(id);
        if !self.authority.lease_live() && !self.authority.lost() {
            self.authority.freeze_newborn(id);
            self.freeze_in_game(id);
        }
    }

    /// The game's `Despawn`: commands and claims lose their target, and a unit frozen for a
    /// handoff goes on without it.
    pub(crate) fn on_despawn(&mut self, d: local::Despawn) {
        let refused = self.write_refusal(d.entity_id);
        let Some(gone) = self
            .game
            .on_despawn(&mut self.cx, &mut self.table, refused, d)
        else {
            return;
        };
        self.command_target_gone(gone.id);
        self.claims_holder_gone(gone.id);
        self.despawned_while_frozen(&[gone]);
    }

    /// Folds the tick into one batch per client and queues them on their links.
    pub(crate) fn end_tick(&mut self, tick: u64) {
        let lease_live = self.authority.lease_live();
        let game::TickWork { events, sends } =
            self.game
                .end_tick(&mut self.cx, &self.table, lease_live, tick);
        // Clients already got the ghosts' changes sent on arrival; the rest of the tick's work
        // sees the whole tick.
        let fresh = self.table.take_changes();
        let sent = self.gateway.take_ghost_changes_sent();
        let changes = if sent.is_empty() {
            None
        } else {
            let mut all = sent;
            model::entities::merge_changes(&mut all, &fresh);
            Some(all)
        };
        let changes = changes.as_ref().unwrap_or(&fresh);
        self.offer_releases();
        self.route_after_tick();
        // Other nodes first: public changes to subscribers, the rest to gateways by account.
        self.replicate(changes);
        self.replicate_events(&events);
        let sends = self.route_tick(changes, &events, sends);
        self.send_anchors(changes);
        let budget = self.cx.config.max_frame_bytes - TO_CLIENT_OVERHEAD;
        let out = self
            .gateway
            .fold_tick(tick, &self.table, &fresh, &events, &sends, budget);
        self.settle_partition();
        self.update_subscriptions();
        self.step_sim_ghosts(changes, self.cx.now.mono_ms);
        self.check_handoffs(changes);
        self.cx.metrics.ticks.inc();
        self.cx.metrics.deltas_sent.inc_by(out.deltas);
        self.cx.metrics.deltas_encoded.inc_by(out.deltas_encoded);
        self.cx.metrics.updates_held_back.inc_by(out.held_back);
        self.cx
            .metrics
            .drop_msg("unknown_account", out.unknown_accounts);
        self.set_table_gauges();
        self.maybe_report_load();
        self.gateway
            .send_to_clients(&mut self.cx, out.frames, budget);
    }

    /// The gauges of what the node holds: at every tick, and after every peer frame (which
    /// subscribes, unsubscribes and writes ghosts between ticks).
    pub(crate) fn set_table_gauges(&self) {
        self.cx
            .metrics
            .subscribers
            .set(self.replication.subscriber_count() as i64);
        let ghosts = self.table.ghost_count();
        self.cx
            .metrics
            .entities
            .set(self.table.len().saturating_sub(ghosts) as i64);
        self.cx.metrics.ghosts_render.set(ghosts as i64);
    }

    /// The game stopped reading: it is disconnected (the driver already cut the connection).
    pub(crate) fn on_game_stalled(&mut self, conn: ConnId) {
        if self.game.stalled(&self.cx, conn) {
            self.on_game_closed(conn, "outbox full: the game is not reading");
        }
    }

    /// The game went away: the avatars' positions are remembered for the next game's joins,
    /// and what the game was doing for the other parts ends. Its entities are kept for its
    /// return (clients see them stand still) or go with it.
    pub(crate) fn on_game_closed(&mut self, conn: ConnId, reason: &str) {
        let lease_live = self.authority.lease_live();
        let gone = self.game.on_closed(&mut self.cx, lease_live, conn, reason);
        if gone == game::Gone::NotConnected {
            return;
        }
        // Remember where the avatars were, for the PlayerJoin of the next game.
        self.gateway.remember_avatar_positions(&self.table);
        self.replication.clear_sim_ghosts();
        // What the gone game was handed is not handed on: the next one starts from checkpoints.
        self.handoff.game_gone();
        self.commands_game_gone();
        self.claims_game_gone();
        if gone == game::Gone::Kept {
            // A handoff still waiting for a snapshot will not get one: those units are abandoned
            // (thawed, kept here).
            self.abandon_freezing("the game went away before its snapshot");
            self.cx.out.to_game.clear();
            self.end_tick(self.game.last_tick() + 1);
            return;
        }
        self.cx.out.to_game.clear();
        self.drop_game_entities();
    }

    /// The game's entities go with it; clients see them vanish. Ghosts stay: their owners still
    /// send them.
    pub(crate) fn drop_game_entities(&mut self) {
        let gone = self.game.drop_entities(&mut self.table);
        self.despawned_while_frozen(&gone);
        self.end_tick(self.game.last_tick() + 1);
    }

    /// A game that did not come back within its grace: its entities are despawned.
    pub(crate) fn expire_game_grace(&mut self) {
        if self.game.grace_expired(&self.cx) {
            self.drop_game_entities();
        }
    }

    // ------------------------------------------------------------------ authority

    /// A renewal landed: minting and writing go on until its terms. After a lapse it is the
    /// lease taken back, still under its epoch (nobody was granted the id meanwhile): what the
    /// lapse froze thaws, and the inputs held meanwhile reach the game.
    pub(crate) fn on_lease_renewed(&mut self, terms: LeaseTerms) {
        let renewal = self.authority.on_lease_renewed(&self.cx, terms.until_ms);
        if renewal == authority::Renewal::Ignored {
            return;
        }
        // A lease of another node id would be a driver bug; minting then stays bounded.
        self.game.lease_renewed(&terms.lease);
        if renewal == authority::Renewal::TakenBack {
            for i in self.authority.resume(&mut self.cx, &self.table) {
                self.deliver_input(i);
            }
            let ready = self.game.connected() && !self.authority.draining();
            self.cx.set_ready(ready);
        }
    }

    /// No renewal landed before the lease's deadline: stop writing now, before the store could
    /// grant the id to anyone else.
    pub(crate) fn check_lease_deadline(&mut self) {
        if self.authority.deadline_passed(&self.cx) {
            self.on_lease_lapsed();
        }
    }

    /// Whether this process may still write at `mono_ms` of its own clock: its lease is neither
    /// lapsed, lost nor past its deadline. (The simulator checks it whenever the store grants
    /// this node's id to another process.)
    pub fn writes_at(&self, mono_ms: u64) -> bool {
        self.authority.writes_at(mono_ms)
    }

    /// The lease was lost for good: this process writes nothing ever again and should exit, so
    /// that its supervisor starts it afresh.
    pub fn lease_lost(&self) -> bool {
        self.authority.lost()
    }

    /// The lease lapsed: the store did not answer in time (a MongoDB election, a paused or
    /// unreachable store). Everything this node owns is frozen and nothing is written, as if
    /// the lease were lost, but the process stays: the driver keeps asking for the lease under
    /// its epoch, and gets it back unless a restore fenced it meanwhile (then it is lost).
    pub(crate) fn on_lease_lapsed(&mut self) {
        if !self.authority.lapse(&mut self.cx) {
            return;
        }
        // Released this tick and not offered yet: frozen already (the game released them).
        let released = self.handoff.take_released();
        for (root, r) in released {
            self.authority.keep_frozen(root);
            for a in &r.attachments {
                self.authority.keep_frozen(a.entity_id);
            }
            // A released avatar's inputs its game did not apply: held with the rest.
            for i in r.avatar.into_iter().flat_map(|a| a.inputs) {
                self.hold_input_during_lapse(i);
            }
        }
        // Frozen for a handoff whose offer has not left: its snapshot would be offered under
        // a lease that may be gone, so the handoff is given up (the entities stay frozen, by
        // the lapse now, and are offered again once the lease is back). Offers that left stand.
        for (root, to, thawed) in self
            .handoff
            .outgoing_mut()
            .abandon_freezing(self.cx.now.mono_ms)
        {
            self.cx
                .metrics
                .handoff(self.cx.config.node_id, to, "abandoned");
            self.thaw(root, thawed, "the node lease lapsed before the snapshot");
        }
        let outgoing = self.handoff.outgoing();
        let freeze = self
            .authority
            .freeze_owned(&self.table, |id| outgoing.is_frozen(id));
        for id in freeze {
            self.freeze_in_game(id);
        }
    }

    /// Whether the lease is lapsed (not lost): what would thaw stays frozen until it is back.
    pub(crate) fn lease_lapsed(&self) -> bool {
        self.authority.lapsed()
    }

    /// An input for the game while the lease is lapsed: held until it is back.
    pub(crate) fn hold_input_during_lapse(&mut self, i: local::Input) {
        self.authority.hold_input(&self.cx, i);
    }

    /// Another grant replaced this node's lease (a new process, or a restore's fence): this
    /// process never writes again, and exits.
    pub(crate) fn on_lease_lost(&mut self) {
        for id in self.authority.on_lease_lost(&mut self.cx, &self.table) {
            self.freeze_in_game(id);
        }
    }

    /// A newer partition: the game learns its area, peers learn this node applied it, and every
    /// entity standing where the partition gave the area to another node is handed over.
    pub(crate) fn apply_partition(&mut self, p: Partition) {
        let Some(applied) = self.authority.apply_partition(&self.cx, p) else {
            return;
        };
        self.replication
            .partition_changed(&self.cx.config, self.authority.partition());
        let epoch = self.authority.partition().epoch();
        let owned_area = game::owned_area(&self.cx, &self.authority);
        if self.game.connected() {
            self.cx.out.to_game.push(
                local::sidecar_message::Body::PartitionChanged(local::PartitionChanged {
                    partition_epoch: epoch,
                    owned_area,
                })
                .into(),
            );
        }
        let ack = mesh_message::Body::PartitionAck(mesh::PartitionAck {
            partition_epoch: epoch,
        });
        self.broadcast(ack);
        let gone = self.authority.given_away(&self.cx, &self.table);
        self.handoff.given_away(gone);
        self.spawners
            .replanned(&mut self.cx, self.authority.partition());
        if applied.retired {
            self.authority.retired(&mut self.cx);
        }
    }

    /// Whether a drain is over (see [`Authority::drained`]).
    pub(crate) fn drained(&self) -> bool {
        self.authority.drained(
            &self.cx,
            &self.table,
            self.game.connected(),
            &self.mesh,
            self.handoff.outgoing().in_flight(),
        )
    }

    /// Forgets the previous partitions once the change settled (see [`Authority::settle`]).
    pub(crate) fn settle_partition(&mut self) {
        if self.authority.settle(&self.cx, &self.table, &self.mesh) {
            self.replication.partitions_settled();
        }
    }

    /// This node's part of the live map: its reals (every k-th past `max`, by id) and its
    /// handoffs of the last second.
    pub fn node_map(&mut self, max: usize) -> cellmesh_world::world_map::NodeMap {
        let handoffs = self.handoff.recent(self.cx.now.mono_ms);
        self.authority
            .node_map(&self.cx, &self.table, max, handoffs)
    }

    /// Every real of this node, for a census.
    pub fn reals(&self) -> Vec<authority::Real> {
        let outgoing = self.handoff.outgoing();
        self.authority
            .reals(&self.table, |id| outgoing.is_frozen(id))
    }

    // ------------------------------------------------------------------ restore

    /// The store's word on who is alive (see [`restore::Restore::note_leases`]).
    pub(crate) fn note_leases(&mut self, live: &[(NodeId, u64)], lapsed: &[(NodeId, u64)]) {
        for inc in self.restore.note_leases(&self.cx, live, lapsed) {
            self.mark_dead(inc);
        }
    }

    /// The store's answer to a fence: a fenced (or replaced) lease's process is dead.
    pub(crate) fn on_lease_fenced(
        &mut self,
        node: NodeId,
        epoch: u64,
        result: Result<Fence, String>,
    ) {
        if let Some(inc) = self.restore.on_lease_fenced(&self.cx, node, epoch, result) {
            self.mark_dead(inc);
        }
    }

    /// Nothing more is taken from process `inc`.
    pub(crate) fn mark_dead(&mut self, inc: restore::Incarnation) {
        if let Some(dead) = self.restore.mark_dead(&self.cx, &self.table, inc) {
            self.process_died(dead);
        }
    }

    /// A process this node has just taken for dead: its link goes if no process holds its node
    /// id, handoffs towards it that never left thaw, and those in doubt wait for the decider.
    fn process_died(&mut self, dead: restore::Dead) {
        let (node, _) = dead.inc;
        if dead.departed {
            if let Some(link) = self.mesh.peer_link(node) {
                self.close_link(link, "its process is dead");
            }
        }
        for (root, _, thawed) in self
            .handoff
            .outgoing_mut()
            .abandon_freezing_towards(node, self.cx.now.mono_ms)
        {
            self.cx
                .metrics
                .handoff(self.cx.config.node_id, node, "abandoned");
            self.thaw(root, thawed, "the target died before the offer left");
            self.handoff.forget_retry(root);
        }
        let in_doubt = self
            .handoff
            .outgoing()
            .in_doubt()
            .filter(|(_, to, _)| *to == node)
            .map(|(root, _, _)| root)
            .collect();
        self.restore.in_doubt_to(dead.inc, in_doubt);
    }

    /// The decider asks what this node holds of the dead process's world.
    pub(crate) fn on_restore_query(&mut self, from: NodeId, q: mesh::RestoreQuery) {
        self.mark_dead((q.node, q.lease_epoch));
        let holdings = self.handoff.holdings(&self.table);
        self.restore
            .report(&mut self.cx, &self.mesh, &holdings, from, q);
    }

    /// The decider's word on an offer this node made to a dead process.
    pub(crate) fn on_restore_resolved(&mut self, r: mesh::RestoreResolved) {
        let id = r.entity_id;
        let now = self.cx.now.mono_ms;
        self.ghost_follows_resolved(&r);
        match self.restore.on_resolved(&self.cx, &r) {
            restore::Resolution::Repeat => {}
            restore::Resolution::Returned { dead } => {
                let Some((to, offered)) = self.handoff.outgoing().target_of(id) else {
                    return;
                };
                let returned = self.handoff.outgoing_mut().returned(
                    id,
                    offered,
                    to,
                    now,
                    handoff::Routed::is_input,
                );
                if let Ok(thawed) = returned {
                    let members = thawed.members.clone();
                    self.cx
                        .metrics
                        .handoff(self.cx.config.node_id, dead, "returned");
                    self.cx
                        .metrics
                        .inputs_abandoned_with_target
                        .inc_by(thawed.abandoned);
                    self.thaw(
                        id,
                        thawed,
                        "its target died; this node owns its position now",
                    );
                    // Ghosts elsewhere may have followed the dead target's frames: they get
                    // the unit's state as it stands here again.
                    for m in members {
                        self.replication
                            .announce(&mut self.cx, &mut self.table, &self.mesh, m);
                    }
                }
            }
            restore::Resolution::Settle => {
                match self
                    .handoff
                    .outgoing_mut()
                    .resolve(id, r.owner_node, r.entity_epoch, now)
                {
                    Ok(done) => self.complete_handoff(done),
                    Err(e) => tracing::debug!(entity = id, error = %e, "restore word on no offer"),
                }
            }
            restore::Resolution::Redirect => {
                self.handoff
                    .outgoing_mut()
                    .redirect_departed(id, r.owner_node, r.entity_epoch);
            }
        }
    }

    /// A render ghost held here of an entity the restore found written elsewhere follows its
    /// writer, as on the old owner's `EntityMoved`: the old owner's word may have been lost (a
    /// cut kept it from here, and the old owner died before it healed), and without it the
    /// restore's end would take the ghost for one nobody took over.
    fn ghost_follows_resolved(&mut self, r: &mesh::RestoreResolved) {
        let me = self.cx.config.node_id;
        let ghost_of_the_dead = self
            .table
            .get(r.entity_id)
            .and_then(|e| e.origin())
            .is_some_and(|o| o != r.owner_node && self.restore.is_dead_node(o));
        if r.owner_node != me && ghost_of_the_dead && r.entity_epoch == 0 {
            self.ghost_returned(r.entity_id, r.owner_node);
            return;
        }
        let newer = self
            .handoff
            .fenced(&self.table, r.entity_id)
            .is_none_or(|(known, _)| r.entity_epoch > known);
        if r.owner_node == me || !ghost_of_the_dead || !newer {
            return;
        }
        // The decider's word, as it would send it for an entity it restored.
        self.on_entity_moved(
            r.owner_node,
            mesh::EntityMoved {
                entity_id: r.entity_id,
                entity_epoch: r.entity_epoch,
                owner_node: r.owner_node,
                holders: vec![],
            },
        );
    }

    /// The unit of ghost `id` went back to `owner`, which offered it to a dead process that
    /// never checkpointed it: `owner` writes it under the epoch it had, older than the one the
    /// ghost followed the dead target's frames under (that epoch is void now). The ghost
    /// follows `owner` again, and its next full state (asked for now) sets the epoch.
    fn ghost_returned(&mut self, id: u64, owner: NodeId) {
        let Some(chunk) = self.table.get(id).map(|e| e.chunk) else {
            return;
        };
        if self.replication.subscribes(chunk, owner) || self.follow(chunk, owner) {
            self.handoff.void_fenced(&mut self.table, id);
            tracing::debug!(
                me = self.cx.config.node_id,
                entity = id,
                owner,
                "ghost of a dead process back with the node that offered it"
            );
            self.table.set_origin(id, owner, 0);
            self.replication.restart_stale(id, self.cx.now.mono_ms);
            self.resync(chunk, owner);
        } else {
            let _ = self.table.despawn(id);
            self.handoff.forget_fenced(&mut self.table, id);
        }
    }

    /// The dead process's world is restored: its ghosts nobody took over are gone. Unless a
    /// new process holds its node id and this node is cut off from it: that process may have
    /// restored them (a restart in place takes its predecessor's world back), and nothing it
    /// wrote could get here. They stay, stale, until the link is back and the snapshot burst
    /// says (see `sweep_stale_ghosts`), as the ghosts of any live writer cut off.
    pub(crate) fn on_restore_done(&mut self, d: mesh::RestoreDone) {
        let inc = (d.node, d.lease_epoch);
        let ghosts = self.restore.on_done(inc);
        self.avatars_restored();
        let successor_cut_off = self
            .restore
            .lease_of(d.node)
            .is_some_and(|l| l != d.lease_epoch)
            && !self.mesh.is_up(d.node);
        for (id, epoch) in ghosts {
            if self.restore.left_over(&self.table, d.node, id, epoch) && !self.ghost_orphaned(id) {
                if successor_cut_off {
                    self.replication.mark_stale(id, self.cx.now.mono_ms);
                    continue;
                }
                tracing::debug!(
                    me = self.cx.config.node_id,
                    entity = id,
                    "ghost of a dead process dropped: not restored"
                );
                self.replication.forget_stale(id);
                self.drop_ghost(id);
            }
        }
    }

    /// Writes the checkpoints taken (and forgets those let go) since the last flush, when one
    /// is due (see [`restore::Restore::flush_due`]).
    pub(crate) fn flush_checkpoints(&mut self) {
        let fresh = self.game.checkpoints().fresh();
        if !self
            .restore
            .flush_due(&self.cx, self.mesh.clustered(), fresh)
        {
            return;
        }
        let (taken, forgotten) = self.game.checkpoints_mut().take_changes();
        let put: Vec<mesh::HandoffOffer> = taken
            .into_iter()
            .filter_map(|id| self.checkpoint_record(id))
            .collect();
        if put.is_empty() && forgotten.is_empty() {
            return;
        }
        let ids: Vec<u64> = put.iter().map(|c| c.entity_id).collect();
        self.game.checkpoints_mut().written(&ids, &forgotten);
        self.restore.write_checkpoints(&mut self.cx, put, forgotten);
    }

    /// A checkpoint write the store refused: what it carried is written again at the next flush
    /// (what changed since goes with it), so the store never keeps less than it was sent.
    pub(crate) fn on_checkpoints_not_written(
        &mut self,
        lease_epoch: u64,
        put: Vec<u64>,
        remove: Vec<u64>,
    ) {
        if lease_epoch != self.restore.incarnation() {
            return;
        }
        for id in put.into_iter().chain(remove) {
            self.game.checkpoints_mut().unflushed(id);
        }
    }

    /// The checkpoint of `id` as the store keeps it: an offer a successor could adopt.
    fn checkpoint_record(&self, id: u64) -> Option<mesh::HandoffOffer> {
        let e = self.table.get_local(id)?;
        let kept = self.game.checkpoints().latest(id)?;
        let age = self.cx.now.mono_ms.saturating_sub(kept.at_ms);
        Some(mesh::HandoffOffer {
            successor: true,
            state_unix_ms: self.cx.now.unix_ms.saturating_sub(age),
            ..self.offer_of(e, kept.epoch, kept.state.clone())
        })
    }

    /// Forgets offers settled long enough ago that their targets have checkpointed them.
    pub(crate) fn prune_sent_offers(&mut self) {
        let outgoing = self.handoff.outgoing();
        self.restore
            .prune_sent(&self.cx, |root| outgoing.is_frozen(root));
    }

    /// Moves every round this node decides one step on: the questions and the offers made
    /// again first, then, once every restore offer is answered, the rounds decided before are
    /// finished and those ready decided.
    pub(crate) fn restore_step(&mut self) {
        let Some((prepared, acts)) =
            self.restore
                .prepare_step(&mut self.cx, &self.mesh, &self.authority)
        else {
            return;
        };
        self.restore_acts(acts);
        let Some((decided, undecided)) = self.restore.rounds_of(&prepared) else {
            return;
        };
        for inc in decided {
            let done = self.restore.finish_round(inc);
            self.broadcast(mesh_message::Body::RestoreDone(done));
            self.on_restore_done(done);
            self.cx.store(StoreRequest::DropCheckpoints {
                node: done.node,
                lease_epoch: done.lease_epoch,
                copy_of: self.restore.copy_of(&self.cx, done.node),
            });
        }
        let partition = self.authority.partition();
        if !self
            .restore
            .decides_now(&self.cx, &self.mesh, partition, &prepared, &undecided)
        {
            return;
        }
        let holdings = self.handoff.holdings(&self.table);
        let acts = self
            .restore
            .decide_rounds(&self.cx, &holdings, partition, &undecided);
        self.restore_acts(acts);
    }

    /// The processes with checkpoints in the store (see [`restore::Restore::on_checkpointed`]).
    pub(crate) fn on_checkpointed(
        &mut self,
        copy_of: Option<String>,
        result: Result<Vec<(NodeId, u64)>, String>,
        restored: Vec<(NodeId, u64)>,
    ) {
        let acts = self
            .restore
            .on_checkpointed(&self.cx, &self.table, copy_of, result, &restored);
        self.restore_acts(acts);
    }

    /// A target's answer to a restore offer; false when it answers no restore of this node.
    pub(crate) fn on_restore_answer(
        &mut self,
        from: NodeId,
        id: u64,
        epoch: u64,
        refused: Option<&str>,
    ) -> bool {
        let answer = self
            .restore
            .on_answer(&self.cx, &self.mesh, from, id, epoch, refused);
        let Some(acts) = answer else {
            return false;
        };
        self.restore_acts(acts);
        true
    }

    /// Carries out what a death or a decision of the restore part comes to, in its order.
    fn restore_acts(&mut self, acts: Vec<restore::Act>) {
        use restore::Act;
        let me = self.cx.config.node_id;
        for act in acts {
            match act {
                Act::Send(node, body) => {
                    self.send_peer(node, body);
                }
                Act::Store(request) => self.cx.store(request),
                Act::Died(dead) => self.process_died(dead),
                Act::OfferHere(offer) => self.on_handoff_offer(me, offer),
                Act::ResolvedHere(r) => self.on_restore_resolved(r),
                Act::MovedHere(from, moved) => self.on_entity_moved(from, moved),
            }
        }
    }

    // ------------------------------------------------------------------ outboxes

    /// Turns everything queued into frames, one batch per link and one for the game.
    fn pack_outboxes(&mut self) {
        let max = self.cx.config.max_frame_bytes;
        for (link, messages) in std::mem::take(&mut self.cx.out.to_links) {
            if self.mesh.link(link).is_none() {
                // The link closed while these waited: the inputs among them are never written.
                self.cx
                    .metrics
                    .inputs_lost_in_links
                    .inc_by(wire::forwarded_inputs(&messages));
                continue;
            }
            let (frames, oversize) = pack(messages, max);
            self.cx.metrics.drop_msg("message_too_large", oversize);
            for frame in frames {
                self.cx.out.pending.push_back(Output::ToLink {
                    link,
                    frame: MeshFrame { messages: frame },
                });
            }
        }
        let messages = std::mem::take(&mut self.cx.out.to_game);
        if messages.is_empty() {
            return;
        }
        let Some(conn) = self.game.conn() else {
            self.cx.metrics.drop_msg("no_game", messages.len() as u64);
            return;
        };
        let (frames, oversize) = pack(messages, max);
        self.cx.metrics.drop_msg("message_too_large", oversize);
        for frame in frames {
            self.cx.out.pending.push_back(Output::ToGame {
                conn,
                frame: SidecarFrame { messages: frame },
            });
        }
    }

    /// A link whose outbox filled: a slow peer is cut (it redials and resynchronises); the node
    /// never waits.
    fn on_link_stalled(&mut self, link: LinkId) {
        let Some(l) = self.mesh.link(link) else {
            return;
        };
        self.cx.metrics.error("link_outbox_full");
        self.cx.metrics.drop_msg("link_outbox_full", 1);
        tracing::warn!(link, "mesh link outbox full: closing the link");
        let why = match l.peer {
            Some(node) => {
                let label = self.cx.metrics.peer(node);
                self.cx.metrics.peer_outbox_full.get_or_create(&label).inc();
                "outbox full: the peer is not reading"
            }
            None => {
                // Pressure past all doubt: this node's client batches could not get out.
                self.on_link_backlog(link, self.cx.config.link_outbox_frames);
                "outbox full: the proxy is not reading"
            }
        };
        self.close_link(link, why);
    }

    // ------------------------------------------------------------------ links and peers

    fn on_link_up(&mut self, link: LinkId, hello: mesh::LinkHello, remote: String) {
        if self.shutting_down {
            self.cx.emit(Output::ReleaseLink { link });
            return;
        }
        if hello.role == mesh::PeerRole::Sidecar as i32 && !hello.geo.is_empty() {
            // Kept when the link drops: where an avatar is simulated is reported by geo.
            self.gateway.note_geo(hello.node_id, hello.geo.clone());
        }
        match self.mesh.on_link_up(link, hello, remote) {
            Some(node) => self.on_peer_up(link, node),
            None => self.admission.tell(&mut self.cx, link),
        }
    }

    /// A link is gone (closed by the proxy, dead, or too slow): its sessions are detached.
    pub(crate) fn close_link(&mut self, link: LinkId, reason: &str) {
        let Some(l) = self.mesh.close(&mut self.cx, link) else {
            return;
        };
        if let Some(node) = l.peer {
            return self.peer_down(node, link, reason);
        }
        tracing::info!(link, proxy = %l.hello.id, %reason, "proxy link closed");
        for key in l.sessions {
            self.end_session(key, &format!("{}: {reason}", avatars::PROXY_LINK_LOST));
        }
    }

    /// The peers with a live lease now.
    fn on_peers(&mut self, peers: Vec<PeerInfo>) {
        for p in &peers {
            if !p.geo.is_empty() {
                // Kept after the peer dies: its geo's decider restores it.
                self.restore.note_geo(p.node, p.geo.clone());
            }
        }
        let live = peers.into_iter().map(|p| (p.node, p.mesh_addr)).collect();
        self.mesh.on_peers(&mut self.cx, live);
    }

    /// A link to peer `node` is up (dialled or accepted): the newest link of a pair wins, and
    /// what was lost with the last link is sent again.
    fn on_peer_up(&mut self, link: LinkId, node: NodeId) {
        if let Some(old) = self.mesh.peer_link(node) {
            if old != link {
                self.close_link(old, "replaced by a newer link from the same peer");
            }
        }
        let epoch = self.authority.partition().epoch();
        self.mesh.on_peer_up(&mut self.cx, link, node, epoch);
        self.restore
            .resend_resolutions(&mut self.cx, &self.mesh, node);
        // The owner forgot this node's subscriptions with the last link: ask again, for a fresh
        // snapshot burst.
        self.replication.resubscribe(&mut self.cx, &self.mesh, node);
        // Gateways learn where the sessions of this node are, and owners who simulates whom.
        for m in self.gateway.session_announcements(self.cx.config.node_id) {
            self.send_peer(node, m);
        }
        let players = self.routing.peer_up(node);
        // Anchors sent while the link was down were lost, so that gateway's views still stand
        // where its players' avatars were then (or where a previous owner last saw them). They
        // are re-anchored now, not at the avatar's next change: a frozen or idle avatar has none,
        // and a moving one's comes after this node has told the gateway that the ghosts outside
        // the stale view are gone (the avatar itself included).
        for (account, session_epoch) in players {
            self.send_anchor(node, &account, session_epoch);
        }
        // Offers in doubt towards it get their answer now.
        self.resume_offers(node);
    }

    /// The link to `node` is gone: its subscriptions here are forgotten, and its render ghosts go
    /// stale until the link is back.
    fn peer_down(&mut self, node: NodeId, link: LinkId, reason: &str) {
        if !self.mesh.on_peer_down(&mut self.cx, node, link, reason) {
            return;
        }
        for reply in self.claim_homes.peer_down(node, link) {
            self.on_claim_reply(reply);
        }
        // Its render ghosts stay, stale, so clients see no vanish: the subscriptions renewed when
        // the link is back refresh them (see `sweep_stale_ghosts`).
        let now = self.cx.now.mono_ms;
        for id in self.table.ghosts_of(node) {
            if !self.ghost_orphaned(id) {
                self.replication.mark_stale(id, now);
            }
        }
        self.replication.peer_down(&self.cx, &mut self.table, node);
    }

    /// Queues `body` for peer `node`; false (and counted) when no link to it is up.
    pub(crate) fn send_peer(&mut self, node: NodeId, body: mesh_message::Body) -> bool {
        self.mesh.send(&mut self.cx, node, body)
    }

    pub(crate) fn broadcast(&mut self, body: mesh_message::Body) {
        self.mesh.broadcast(&mut self.cx, body);
    }

    /// A peer's message, to the part it is for.
    pub(crate) fn on_peer_message(&mut self, node: NodeId, body: mesh_message::Body) {
        use mesh_message::Body as B;
        self.cx.metrics.peer_message(node, "in");
        match body {
            B::Heartbeat(_) => {}
            B::Subscribe(s) => self.on_subscribe(node, s.chunks),
            B::Unsubscribe(u) => self.on_unsubscribe(node, u.chunks),
            B::EntityState(s) => self.fence_entity_state(node, s),
            B::EntityGone(g) => self.fence_entity_gone(node, g),
            B::EntityMoved(m) => self.on_entity_moved(node, m),
            B::HandoffOffer(o) => self.on_handoff_offer(node, o),
            B::HandoffAck(a) => self.on_handoff_ack(node, a),
            B::HandoffRefused(r) => self.on_handoff_refused(node, r),
            B::PartitionAck(a) => self.mesh.on_partition_ack(node, a.partition_epoch),
            B::EntityEvent(ev) => self.on_peer_entity_event(node, ev),
            B::RestoreQuery(q) => self.on_restore_query(node, q),
            B::RestoreReport(r) => self.restore.on_report(node, r),
            B::RestoreResolved(r) => self.on_restore_resolved(r),
            B::RestoreDone(d) => self.on_restore_done(d),
            B::PlayerJoin(j) => self.on_peer_player_join(node, j),
            B::PlayerLeave(l) => self.on_peer_player_leave(node, l),
            B::ForwardInput(i) => {
                self.cx.metrics.inputs_from_peers.inc();
                self.input_for_master(i)
            }
            B::Anchor(a) => self.on_anchor(node, a),
            B::EntityCommand(c) => self.route_command(c),
            B::EntityCommandResult(r) => self.on_command_result(r),
            B::Locate(l) => self.on_locate(node, l),
            B::Located(l) => self.on_located(node, l),
            B::ClaimCall(c) => {
                if let Some(link) = self.mesh.peer_link(node) {
                    self.claim_homes.on_call(&mut self.cx, link, c);
                }
            }
            B::ClaimAnswer(a) => {
                if let Some(reply) = self.claim_homes.on_answer(node, a) {
                    self.on_claim_reply(reply);
                }
            }
            B::Routed(r) => self.on_routed(r),
            B::SessionMoved(m) => self.on_session_moved(m),
            B::SessionEnded(e) => self.on_session_ended(node, e),
            other => {
                self.cx.metrics.error("unexpected_message");
                tracing::warn!(peer = node, message = ?other, "a peer sent a message only a proxy sends; ignored");
            }
        }
    }

    /// An event of a render ghost, from the peer that writes it: the game hears it at the tick.
    fn on_peer_entity_event(&mut self, node: NodeId, ev: mesh::EntityEvent) {
        if let Some(e) = self
            .table
            .get(ev.entity_id)
            .filter(|e| e.origin() == Some(node))
        {
            self.game.hear_event(model::fold::TickEvent {
                entity_id: e.id,
                chunk: e.chunk,
                owner_account: e.owner_account.to_string(),
                audience: model::audience::Audience::PublicInRange,
                r#type: ev.r#type,
                payload: ev.payload,
            });
        }
    }

    /// A remote gateway's session ended: its route goes, and the avatar of it is let go.
    fn on_session_ended(&mut self, gateway: NodeId, e: mesh::SessionEnded) {
        // The avatar of a session that ended is released even if the gateway's leave
        // never comes (it went to an owner the gateway was still waiting for), unless a
        // newer session joins it meanwhile (the proxy moved the session).
        if self.routing.on_session_ended(&e) {
            self.defer_leave(&e.account, e.session_epoch, "session_ended", Some(gateway));
        }
    }

    // ------------------------------------------------------------------ handoffs

    /// After the tick's moves: the handoffs due now begin.
    pub(crate) fn check_handoffs(&mut self, changes: &model::entities::TickChanges) {
        if !self.game.connected() || !self.authority.lease_live() || !self.mesh.clustered() {
            return;
        }
        let view = handoff::TargetView {
            table: &self.table,
            authority: &self.authority,
            replication: &self.replication,
            mesh: &self.mesh,
            restore: &self.restore,
        };
        // A game that takes `Offload` releases at its next tick's end: waited for three ticks.
        let offload_wait_ms = (self.cx.config.handoff_offload && self.game.hands_over_by_release())
            .then(|| self.game.tick_ms().map_or(150, |t| (3.0 * t).ceil() as u64));
        self.handoff
            .check(&mut self.cx, &view, changes, offload_wait_ms);
    }

    /// Tells the game to stop writing `id` under its current epoch (it answers with its
    /// snapshot).
    pub(crate) fn freeze_in_game(&mut self, id: u64) {
        handoff::freeze_in_game(&mut self.cx, &self.table, id);
    }

    /// At the tick's end, before its state goes out: offers what the game released in it, so
    /// the offer leads the tick's traffic on the link and its target's game gets the `Adopt` as
    /// early as it can. (The target holds the ghost already: an offer waits for that.)
    pub(crate) fn offer_releases(&mut self) {
        let released = self.handoff.take_released();
        if released.is_empty() {
            return;
        }
        let alone = if !self.game.connected() {
            Some("the game went away")
        } else if !self.authority.lease_live() {
            Some("this node's lease lapsed or was lost")
        } else if !self.mesh.clustered() {
            Some("this node is alone in the world")
        } else {
            None
        };
        for (root, r) in released {
            match alone {
                Some(reason) => self.keep_released(root, r, reason),
                None => self.offer_released(root, r),
            }
        }
    }

    /// A unit the game released: offered now if it is due and its target ready, else thawed.
    fn offer_released(&mut self, root: u64, r: handoff::Released) {
        let view = handoff::TargetView {
            table: &self.table,
            authority: &self.authority,
            replication: &self.replication,
            mesh: &self.mesh,
            restore: &self.restore,
        };
        match self.handoff.offer_released(&mut self.cx, &view, root, r) {
            handoff::ReleasedNext::Kept(r, reason) => self.keep_released(root, r, reason),
            handoff::ReleasedNext::Begun {
                checkpoints,
                offer,
                unsnapshotted,
            } => {
                let now = self.cx.now.mono_ms;
                for (id, epoch, state) in checkpoints {
                    self.game.checkpoints_mut().taken(id, epoch, state, now);
                }
                match offer {
                    Some(offer) => self.send_offer(offer, false),
                    None => {
                        for m in unsnapshotted {
                            self.freeze_in_game(m);
                        }
                    }
                }
            }
        }
    }

    /// A released unit stays here: the game resumes it, and a released avatar gets the inputs
    /// it did not apply again, after the `Thaw`.
    fn keep_released(&mut self, root: u64, r: handoff::Released, reason: &str) {
        tracing::debug!(entity = root, reason, "released entity kept");
        let members = std::iter::once(root).chain(r.attachments.iter().map(|a| a.entity_id));
        for id in members.collect::<Vec<_>>() {
            self.thaw_released(id, reason);
        }
        if let Some(a) = r.avatar {
            self.handoff.released_avatar_kept(&a.account);
            for i in a.inputs {
                self.input_to_game(i);
            }
        }
    }

    /// `Release` from the game: checked now, offered at the tick's end. Every release is answered
    /// by an `Evict` or a `Thaw` (after an `Error` if it was wrong), so the game never holds an
    /// entity frozen for nothing.
    pub(crate) fn on_release(&mut self, r: local::Release) {
        use local::ErrorCode;
        let id = r.entity_id;
        let (input_session_epoch, last_input_seq) = (r.input_session_epoch, r.last_input_seq);
        let r = match self.handoff.check_release(&self.table, r) {
            handoff::ReleaseCheck::Unknown => {
                game::entity_error(&mut self.cx, model::entities::EntityError::Unknown(id));
                return self.thaw_released(id, "the sidecar holds no such entity of this game");
            }
            handoff::ReleaseCheck::WrongEpoch(detail) => {
                game::error(&mut self.cx, ErrorCode::InvalidValue, detail.clone(), id);
                self.thaw_released(id, &detail);
                return self.release_not_taken(id, input_session_epoch, last_input_seq);
            }
            handoff::ReleaseCheck::Snapshots(snapshots) => {
                // It crossed our `Freeze`: its snapshots answer it.
                if self.game.hands_over_by_release() {
                    self.handoff.release_crossed_freeze(
                        &mut self.cx,
                        &self.table,
                        id,
                        input_session_epoch,
                        last_input_seq,
                    );
                }
                for s in snapshots {
                    self.on_snapshot(s);
                }
                return;
            }
            handoff::ReleaseCheck::Twice => {
                // The first release is answered; this one is not.
                return game::error(
                    &mut self.cx,
                    ErrorCode::UnexpectedMessage,
                    format!("entity {id} was released already in this tick"),
                    id,
                );
            }
            handoff::ReleaseCheck::Writable(r) => r,
        };
        if !self.may_write(id) {
            self.thaw_released(id, "this node may not hand it over now");
            return self.release_not_taken(id, input_session_epoch, last_input_seq);
        }
        let releases_avatars = self.game.hands_over_by_release();
        match self
            .handoff
            .record_release(&mut self.cx, &self.table, r, releases_avatars)
        {
            Ok(()) => return,
            Err(handoff::KeptBecause::Reason(reason)) => self.thaw_released(id, reason),
            Err(handoff::KeptBecause::Error(detail)) => {
                game::error(&mut self.cx, ErrorCode::InvalidValue, detail.clone(), id);
                self.thaw_released(id, &detail);
            }
        }
        self.release_not_taken(id, input_session_epoch, last_input_seq);
    }

    /// A `Release` answered by a `Thaw` at once: a released avatar's game dropped the inputs it
    /// got after the last one it applied, so they go to it again, after the `Thaw`.
    fn release_not_taken(&mut self, id: u64, input_session_epoch: u64, last_input_seq: u64) {
        if !self.game.hands_over_by_release() {
            return;
        }
        let inputs = self.handoff.release_not_taken(
            &mut self.cx,
            &self.table,
            id,
            input_session_epoch,
            last_input_seq,
        );
        for i in inputs {
            self.input_to_game(i);
        }
    }

    /// Why the game may not write `id` now (its lease, or a handoff), if it may not.
    pub(crate) fn write_refusal(&self, id: u64) -> Option<String> {
        if !self.authority.lease_live() {
            return Some(format!(
                "entity {id}: this node's lease lapsed or was lost; everything it owns is frozen"
            ));
        }
        self.handoff.unwritable(id)
    }

    /// Whether the game may write `id` now; if not, it is told why (and nothing changes).
    pub(crate) fn may_write(&mut self, id: u64) -> bool {
        match self.write_refusal(id) {
            Some(detail) => {
                game::error(&mut self.cx, local::ErrorCode::NotOwner, detail, id);
                false
            }
            None => true,
        }
    }

    /// The game's `Snapshot` of an entity frozen for a handoff (or for a lapsed lease).
    pub(crate) fn on_snapshot(&mut self, s: local::Snapshot) {
        if !self.authority.lease_live() {
            // Frozen by a lapsed or lost lease: nothing is offered; the snapshot is not needed.
            self.authority.snapshot_while_not_live(s.entity_id);
            return;
        }
        if self.authority.take_owed_snapshot(s.entity_id) && !self.handoff.is_frozen(s.entity_id) {
            // The answer to a lapse's Freeze, come after the lease was back and the Thaw sent.
            return;
        }
        if let Err((code, detail)) = self.handoff.check_snapshot(&self.table, &s) {
            return game::error(&mut self.cx, code, detail, s.entity_id);
        }
        // A handoff's snapshot is the freshest checkpoint there is (if it is refused, the entity
        // stays here with exactly this state).
        self.game.checkpoints_mut().taken(
            s.entity_id,
            s.entity_epoch,
            s.state.clone(),
            self.cx.now.mono_ms,
        );
        match self.handoff.snapshot(s.entity_id, s.state) {
            Ok(Some(offer)) => self.send_offer(offer, false),
            Ok(None) => {}
            Err(e) => game::error(
                &mut self.cx,
                local::ErrorCode::UnexpectedMessage,
                e,
                s.entity_id,
            ),
        }
    }

    /// Where `account`'s session is: (gateway node, session epoch).
    pub(crate) fn session_of(&self, account: &str) -> Option<(NodeId, u64)> {
        if let Some((_, epoch)) = self.gateway.session_epoch(account) {
            return Some((self.cx.config.node_id, epoch));
        }
        self.routing
            .remote_player(account)
            .map(|r| (r.gateway_node, r.session_epoch))
    }

    /// An offer of `e` under `epoch` with its game's `state`, as a target adopts it (a
    /// handoff's offer and a checkpoint in the store alike).
    pub(crate) fn offer_of(
        &self,
        e: &model::entities::Entity,
        epoch: u64,
        state: bytes::Bytes,
    ) -> mesh::HandoffOffer {
        let session = (e.is_master && !e.owner_account.is_empty())
            .then(|| self.session_of(&e.owner_account))
            .flatten();
        let claims = self.claims.of([e.id]);
        self.handoff
            .offer_of(&self.cx, e, epoch, state, session, claims)
    }

    /// Sends `offer` to its target, with what the other parts know of its unit, and what its
    /// unit held behind it; an offer that cannot leave thaws its unit.
    pub(crate) fn send_offer(
        &mut self,
        offer: model::handoff::Offer<handoff::Routed>,
        successor: bool,
    ) {
        let root = offer.root;
        let session = self
            .table
            .get_local(root)
            .filter(|e| e.is_master && !e.owner_account.is_empty())
            .and_then(|e| self.session_of(&e.owner_account));
        let carried = handoff::Carried {
            command_cursors: offer
                .parts
                .iter()
                .flat_map(|(id, _)| self.command_cursors(*id))
                .collect(),
            claims: self.claims.of(offer.parts.iter().map(|(id, _)| *id)),
            session,
        };
        let Some(msg) = self.handoff.offer_message(
            &self.cx,
            &self.table,
            &self.authority,
            &offer,
            successor,
            carried,
        ) else {
            return;
        };
        tracing::debug!(
            entity = root,
            to = offer.to,
            epoch = offer.epoch,
            successor,
            claims = ?msg.claims.iter().map(|c| &c.key).collect::<Vec<_>>(),
            "offer sent"
        );
        let (to, kept) = (offer.to, msg.clone());
        if !self.send_peer(to, mesh_message::Body::HandoffOffer(msg)) {
            // It never left: the unit may thaw (a link lost after sending leaves it in doubt).
            if let Some(thawed) = self.handoff.unsent(&self.cx, root, to) {
                self.thaw(root, thawed, "the target was unreachable");
            }
            return;
        }
        let now = self.cx.now.mono_ms;
        let last_tick = self.game.last_tick_end_ms().unwrap_or(0);
        self.handoff.offer_sent(&self.cx, root, last_tick);
        // Kept until the target has surely checkpointed it (see `restore`).
        let to_lease = self.restore.lease_of(to).unwrap_or(0);
        self.restore.offer_sent(
            root,
            restore::SentOffer {
                at_ms: now,
                to,
                to_lease,
                offer: kept,
            },
        );
        for (k, held) in offer.inputs.into_iter().enumerate() {
            match held {
                handoff::Routed::Input(i) => {
                    self.handoff
                        .forward_held(&mut self.cx, &self.mesh, to, root, offer.epoch, k, i)
                }
                // A copy stays with the unit: applied here if the offer is refused.
                handoff::Routed::Command(c) => self.forward_command(to, offer.epoch, *c, true),
            }
        }
        self.handoff.count_in_doubt(&self.cx);
    }

    /// The target owns the unit: the game evicts it, this node keeps it as a render ghost (no
    /// vanish), its holders learn the new owner, and so does the player's gateway.
    pub(crate) fn complete_handoff(&mut self, done: model::handoff::Completed) {
        self.handoff.completed(&self.cx, &done);
        for &id in &done.members {
            self.handoff.evict(&mut self.cx, &self.table, &done, id);
            self.game.checkpoints_mut().forget(id);
            self.handoff.handed_away(id);
            let holders = self.replication.handed_away(&mut self.table, id);
            // A chunk a client here views, or one this node subscribes to at the new owner
            // anyway, keeps the entity here as its ghost, with no vanish. The new owner counts
            // this node among the holders: its frames refresh the ghost, and its gone drops it
            // once the entity leaves what this node subscribes to.
            let at = self.table.get_local(id).map(|e| e.chunk);
            let kept = at.is_some_and(|chunk| {
                self.replication.subscribes(chunk, done.to) || self.follow(chunk, done.to)
            });
            handoff::tell_holders(&mut self.cx, &self.mesh, &done, id, &holders, kept);
            // Commands held here for a gap in their order follow it (its new writer orders them
            // from the cursors the offer carried).
            for c in self.commands.forget(id) {
                self.forward_command(done.to, done.epoch, c, false);
            }
            self.claims_handed_away(id);
            let Some(e) = self.table.get_local(id) else {
                continue;
            };
            let (chunk, pos, master) = (
                e.chunk,
                e.position,
                (e.is_master && !e.owner_account.is_empty()).then(|| e.owner_account.clone()),
            );
            if kept {
                self.table.to_ghost(id, done.to, done.epoch);
                for f in self
                    .handoff
                    .advance(&mut self.table, id, done.epoch, done.to)
                {
                    self.apply_fenced(f);
                }
            } else {
                // Nobody here looks there: no client can see it go, and nothing is fenced.
                let _ = self.table.despawn(id);
                self.handoff.forget_fenced(&mut self.table, id);
            }
            if let Some(account) = master {
                self.master_handed_away(&done, id, account.into(), chunk, [pos.x, pos.y, pos.z]);
            }
        }
        self.handoff.count_in_doubt(&self.cx);
    }

    /// `account`'s master `id` went with the unit of `done`, from `chunk` at `pos`: its late
    /// inputs, its leave and a newer session's join follow it, and as its gateway this node
    /// routes its input to the new owner.
    fn master_handed_away(
        &mut self,
        done: &model::handoff::Completed,
        id: u64,
        account: String,
        chunk: ChunkPos,
        pos: [f64; 3],
    ) {
        // Late inputs follow it even when no ghost of it stays here; so do those still
        // held here for a gap in their order (the new owner orders them from here on).
        let (held, leave) = self.handoff.master_departed(&account, id);
        for i in held {
            self.forward_routed(id, done.to, done.epoch, i, 0);
        }
        if let Some(leave) = leave {
            self.send_peer(done.to, mesh_message::Body::PlayerLeave(leave));
        }
        // A newer session joined while the offer was out: its join follows the avatar
        // (the offer carries the session it was made under).
        let offered = self
            .restore
            .sent_offer(id)
            .map_or(0, |s| s.offer.session_epoch);
        if let Some(r) = self.routing.remote_player(&account) {
            if r.session_epoch > offered && r.gateway_node != done.to {
                self.send_peer(
                    done.to,
                    mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                        account: account.clone(),
                        session_epoch: r.session_epoch,
                        last_position: None,
                        gateway_node: r.gateway_node,
                        hops: 1,
                    }),
                );
            }
        }
        self.routing.remove_remote_player(&account);
        // If this node is the player's gateway, its input goes to the new owner now.
        self.gateway
            .avatar_handed_on(&account, done.to, id, done.epoch, chunk, pos);
    }

    /// A unit whose handoff is over while it stays here thaws; what it held is applied here.
    pub(crate) fn thaw(
        &mut self,
        root: u64,
        thawed: model::handoff::Thawed<handoff::Routed>,
        reason: &str,
    ) {
        let lapsed = self.lease_lapsed();
        let game = self.game.conn();
        let lapse = lapsed.then_some(&mut self.authority);
        let held = self.handoff.thaw(
            &mut self.cx,
            &self.table,
            &mut self.claims,
            game,
            lapse,
            thawed,
            reason,
        );
        for held in held {
            match held {
                handoff::Routed::Input(i) => self.input_to_game(i),
                handoff::Routed::Command(c) => self.route_command(*c),
            }
        }
        self.handoff.thawed(&self.cx, root);
    }

    /// A unit the game released stays here.
    pub(crate) fn thaw_released(&mut self, id: u64, reason: &str) {
        let lapse = self.lease_lapsed().then_some(&mut self.authority);
        handoff::thaw_released(&mut self.cx, lapse, id, reason);
    }

    pub(crate) fn on_handoff_ack(&mut self, from: NodeId, a: mesh::HandoffAck) {
        if self.on_restore_answer(from, a.entity_id, a.entity_epoch, None) {
            return;
        }
        let tick_ms = self.game.tick_ms();
        if let Some(done) = self.handoff.acked(&mut self.cx, from, &a, tick_ms) {
            self.complete_handoff(done);
        }
    }

    pub(crate) fn on_handoff_refused(&mut self, from: NodeId, r: mesh::HandoffRefused) {
        if self.on_restore_answer(from, r.entity_id, r.entity_epoch, Some(&r.reason)) {
            return;
        }
        if let Some(thawed) = self.handoff.refused(&mut self.cx, from, &r) {
            self.restore.forget_sent(r.entity_id);
            self.thaw(r.entity_id, thawed, &r.reason);
        }
    }

    /// Every unit still waiting for a snapshot is thawed: its game went away (its entities kept
    /// for its return), so no snapshot will come.
    pub(crate) fn abandon_freezing(&mut self, reason: &str) {
        for (root, thawed) in self.handoff.abandon_freezing(&self.cx) {
            self.thaw(root, thawed, reason);
            self.handoff.forget_retry(root);
        }
    }

    /// The game despawned `gone` (or went away with them): the rest of a unit frozen for a
    /// handoff is offered, or thawed if its root went.
    pub(crate) fn despawned_while_frozen(&mut self, gone: &[model::entities::Entity]) {
        for after in self.handoff.despawned(&self.cx, gone) {
            match after {
                model::handoff::AfterDespawn::Offer(offer) => self.send_offer(offer, false),
                model::handoff::AfterDespawn::Abandoned { root, thawed, .. } => {
                    self.thaw(root, thawed, "the entity was despawned before its snapshot");
                    self.handoff.forget_retry(root);
                }
            }
        }
    }

    /// `account` left: if its master is frozen in a handoff, the leave is kept for the new owner.
    pub(crate) fn leave_follows_handoff(&mut self, account: &str, epoch: u64, reason: &str) {
        self.handoff
            .leave_follows(&self.table, account, epoch, reason);
    }

    /// The link to `node` is up again: offers in doubt towards it are repeated (a target that
    /// adopted answers with another ack), or re-made under a new epoch if a new process holds
    /// its id (it never saw the old offer; it adopts from the snapshot).
    pub(crate) fn resume_offers(&mut self, node: NodeId) {
        for root in self.handoff.offered_to(node) {
            if self.restore.offered_to_dead(root) {
                // Made to a process that died: the restore of its world settles it.
                continue;
            }
            if let Some(offer) = self.handoff.repeat(root) {
                self.send_offer(offer, false);
            }
        }
    }

    /// A peer's offer (or this node's own restore of a dead process's entity).
    pub(crate) fn on_handoff_offer(&mut self, from: NodeId, o: mesh::HandoffOffer) {
        // This node's own offer of it, in doubt (its ack lost with a cut link), was taken: the
        // unit comes back from a live writer. That handoff completes first, its real here
        // evicted. (A restore's offer settles offers in doubt its own way.)
        let from_writer = !o.successor && from != self.cx.config.node_id;
        if let Some(done) = from_writer
            .then(|| self.handoff.taken(&self.cx, o.entity_id, o.entity_epoch))
            .flatten()
        {
            self.complete_handoff(done);
        }
        if o.successor && self.avatar_superseded(&o) {
            tracing::info!(account = %o.owner_account, entity = o.entity_id, "the restore of an avatar whose player has a newer one: refused");
            self.cx.metrics.drop_msg("older_avatar", 1);
            let refused = mesh::HandoffRefused {
                entity_id: o.entity_id,
                entity_epoch: o.entity_epoch,
                reason: restore::SUPERSEDED.into(),
            };
            return self.answer_offer(from, mesh_message::Body::HandoffRefused(refused));
        }
        let from_dead = !self.restore.is_live(from)
            && from != self.cx.config.node_id
            && self.restore.is_dead_node(from);
        let game_connected = self.game.connected();
        let answer = self.handoff.on_offer(
            &mut self.cx,
            &self.table,
            &self.authority,
            &mut self.replication,
            game_connected,
            from_dead,
            from,
            o,
        );
        if let Some(answer) = answer {
            self.answer_offer(from, answer);
        }
    }

    /// The game's `Adopted`: a returning game's own entity, or an offer adopted, whose unit
    /// the other parts take up (its checkpoints, its player's session, its commands and
    /// claims, the frames the fence held for it) before its source hears the ack.
    pub(crate) fn on_adopted(&mut self, a: local::Adopted) {
        if self.game.took_back(&self.cx, &self.table, &a) {
            return;
        }
        let adoption = match self.handoff.adopted(&self.cx, &mut self.table, &a) {
            Ok(adoption) => adoption,
            Err(detail) => {
                return game::error(
                    &mut self.cx,
                    local::ErrorCode::UnexpectedMessage,
                    detail,
                    a.entity_id,
                )
            }
        };
        let o = adoption.offer;
        let (me, epoch) = (self.cx.config.node_id, o.entity_epoch);
        for (id, state) in adoption.checkpoints {
            self.game
                .checkpoints_mut()
                .taken(id, epoch, state, self.cx.now.mono_ms);
        }
        if o.is_master && !o.owner_account.is_empty() {
            self.adopted_master_session(&o);
        }
        self.resume_command_cursors(&o.command_cursors);
        self.claims_adopted(&o.claims);
        for m in std::iter::once(o.entity_id).chain(o.attachments.iter().map(|a| a.entity_id)) {
            for f in self.handoff.advance(&mut self.table, m, epoch, me) {
                self.apply_fenced(f);
            }
        }
        self.cx.metrics.handoff(adoption.source, me, "adopted");
        self.answer_offer(
            adoption.source,
            mesh_message::Body::HandoffAck(mesh::HandoffAck {
                entity_id: o.entity_id,
                entity_epoch: epoch,
                adopt_timing: adoption.adopt_timing,
            }),
        );
    }

    /// Whether the avatar `o` offers is older than one its player has: this node writes another
    /// avatar of the account, or the account's newer session was given a new one. Of two avatars
    /// the older goes; a game is never handed a second avatar of one player.
    fn avatar_superseded(&self, o: &mesh::HandoffOffer) -> bool {
        if !o.is_master || o.owner_account.is_empty() {
            return false;
        }
        let account = o.owner_account.as_str();
        let written = self
            .table
            .master_of(account)
            .is_some_and(|e| e.origin().is_none() && e.id != o.entity_id);
        written || self.new_avatar_since(account, o.session_epoch).is_some()
    }

    /// A session of `account` newer than `epoch`, on another gateway, whose gateway announced it
    /// spawns a new avatar.
    fn new_avatar_since(&self, account: &str, epoch: u64) -> Option<SessionEntry> {
        let me = self.cx.config.node_id;
        self.routing
            .route(account)
            .filter(|r| r.gateway_node != me && r.session_epoch > epoch)
            .filter(|r| self.routing.spawns_new_avatar(account, r.session_epoch))
    }

    /// An adopted master's route: the session the avatar serves is the one the offer carries,
    /// or a newer one that logged in meanwhile (on any gateway, after the old one died, say)
    /// and waits for this avatar instead of spawning another.
    fn adopted_master_session(&mut self, o: &mesh::HandoffOffer) {
        let me = self.cx.config.node_id;
        let account = o.owner_account.clone();
        let local = self.session_epoch(&account).map(|(_, e)| e);
        let newer_remote = self
            .routing
            .route(&account)
            .filter(|r| r.gateway_node != me && r.session_epoch > o.session_epoch)
            .filter(|r| local.is_none_or(|l| r.session_epoch > l));
        if let Some(entry) = newer_remote {
            if self
                .routing
                .spawns_new_avatar(&account, entry.session_epoch)
            {
                // That session's gateway gave it a new avatar (it waited in vain for this
                // one, restored late): of two avatars the older goes, and never anchors it.
                tracing::info!(%account, entity = o.entity_id, "an older avatar adopted after its session got a new one: it leaves");
                self.cx.metrics.drop_msg("older_avatar", 1);
                return self.leave_game(&account, entry.session_epoch - 1, "new_avatar_elsewhere");
            }
            self.join_session(&account, entry);
        } else if o.gateway_node == me && local.is_none() {
            // The session was this node id's, but of a process that died: nothing here
            // routes for it, and a later login must not take the avatar for this node's.
        } else if o.gateway_node == me || local.is_some_and(|l| l > o.session_epoch) {
            // Gateway side only: the epoch its inputs are stamped with.
            self.gateway
                .avatar_written_here(&account, o.entity_id, o.entity_epoch);
            self.gateway.set_master_owner(&account, me);
            if let Some(l) = local.filter(|l| *l > o.session_epoch) {
                self.join_here(&account, l, None);
            }
        } else if o.gateway_node != 0 {
            let entry = SessionEntry {
                gateway_node: o.gateway_node,
                session_epoch: o.session_epoch,
            };
            self.routing.serve(&account, entry);
            self.send_anchor(o.gateway_node, &account, o.session_epoch);
        }
    }

    /// The answer to an offer: to its source, or to this node's own restore of a dead
    /// process's entity.
    fn answer_offer(&mut self, source: NodeId, body: mesh_message::Body) {
        if source != self.cx.config.node_id {
            self.send_peer(source, body);
            return;
        }
        match body {
            mesh_message::Body::HandoffAck(a) => self.on_handoff_ack(source, a),
            mesh_message::Body::HandoffRefused(r) => self.on_handoff_refused(source, r),
            _ => {}
        }
    }

    /// A frame about a foreign entity, through the fence.
    pub(crate) fn fence_entity_state(&mut self, node: NodeId, s: mesh::EntityState) {
        if let Some(done) = self.handoff.observed(&self.cx, node, &s) {
            // The target writes under the offered epoch: it adopted, the ack was lost.
            self.complete_handoff(done);
        }
        let s =
            match self
                .handoff
                .state_ahead(&self.cx, &mut self.table, &self.replication, node, s)
            {
                handoff::StateAhead::Unheld(s) => return self.on_entity_state(node, s),
                handoff::StateAhead::Resync(at) => {
                    if let Some(chunk) = at {
                        self.resync(chunk, node);
                    }
                    return;
                }
                handoff::StateAhead::Admit(due, s) => {
                    for f in due {
                        self.apply_fenced(f);
                    }
                    s
                }
            };
        if let Some(f) = self
            .handoff
            .admit_state(&mut self.cx, &mut self.table, node, s)
        {
            self.apply_fenced(f);
        }
        self.handoff.count_held(&self.cx);
    }

    /// `EntityGone` from its owner, through the fence.
    pub(crate) fn fence_entity_gone(&mut self, node: NodeId, g: mesh::EntityGone) {
        if let Some(f) = self
            .handoff
            .admit_gone(&mut self.cx, &mut self.table, node, g)
        {
            self.apply_fenced(f);
        }
    }

    /// A frame the fence let through, to the part it is for.
    pub(crate) fn apply_fenced(&mut self, f: handoff::Fenced) {
        match f {
            handoff::Fenced::State(node, s) => self.on_entity_state(node, s),
            handoff::Fenced::Gone(node, g) => self.on_entity_gone(node, g),
            handoff::Fenced::Input(i) => self.input_for_master(i),
            handoff::Fenced::Command(c) => self.route_command(*c),
        }
    }

    /// `EntityGone` past the fence: the ghost of `node`'s entity goes, unless a client here
    /// still views where it went.
    fn on_entity_gone(&mut self, node: NodeId, g: mesh::EntityGone) {
        let at = g.position.as_ref().map(|p| {
            self.cx
                .config
                .world
                .chunk_of(cellmesh_world::geometry::Pos { x: p.x, y: p.y })
        });
        if at.is_some_and(|c| self.replication.subscribes(c, node)) {
            // This node subscribes there: its subscription has not reached the owner
            // yet, and the snapshot burst that answers it refreshes the ghost.
            return;
        }
        let ghost = self
            .table
            .get(g.entity_id)
            .is_some_and(|e| e.origin() == Some(node));
        if ghost && at.is_some_and(|c| self.follow(c, node)) {
            // It walked into a viewed chunk this node does not subscribe to at its
            // owner: subscribed now, and kept meanwhile, stale (the owner no longer
            // counts this node among its holders, so it will not say if it moves on).
            let now = self.cx.now.mono_ms;
            self.replication.mark_stale(g.entity_id, now);
            return;
        }
        if self
            .table
            .get(g.entity_id)
            .is_some_and(|e| e.origin() == Some(node))
        {
            tracing::debug!(
                me = self.cx.config.node_id,
                entity = g.entity_id,
                node,
                epoch = g.entity_epoch,
                "ghost dropped: gone"
            );
            let _ = self.table.despawn(g.entity_id);
            self.handoff.forget_fenced(&mut self.table, g.entity_id);
        }
    }

    /// `EntityMoved` from the old owner: the ghost follows the new one; frames held for its
    /// epoch are due.
    pub(crate) fn on_entity_moved(&mut self, node: NodeId, m: mesh::EntityMoved) {
        let me = self.cx.config.node_id;
        if m.owner_node == me {
            // The old owner's holders are this node's replicas now: the next frame keeps them in
            // step, or tells those no longer subscribed that it is gone.
            let local = self
                .table
                .get_local(m.entity_id)
                .is_some_and(|e| e.epoch == m.entity_epoch);
            if local && !m.holders.is_empty() {
                self.replication.add_holders(
                    &mut self.table,
                    m.entity_id,
                    m.holders.iter().copied().filter(|n| *n != me),
                );
            }
            return;
        }
        let held = self.table.get(m.entity_id).map(|e| (e.origin(), e.chunk));
        if matches!(held, Some((None, _))) {
            // This node's own entity: its epoch is the node's to decide.
            return;
        }
        let due = self
            .handoff
            .advance(&mut self.table, m.entity_id, m.entity_epoch, m.owner_node);
        // A ghost of the sender follows the new owner (if this node subscribes there); so does
        // a ghost of a dead process, on the word of the node that restored it.
        let from_writer = |origin: Option<NodeId>| {
            origin.is_some_and(|o| o == node || self.restore.is_dead_node(o))
        };
        if let Some((_, chunk)) = held.filter(|h| from_writer(h.0)) {
            if self.replication.subscribes(chunk, m.owner_node) || self.follow(chunk, m.owner_node)
            {
                self.table
                    .set_origin(m.entity_id, m.owner_node, m.entity_epoch);
                // A stale ghost waits for its new writer from now on (a restored owner may be
                // a process that has only just started, not linked here yet).
                self.replication
                    .restart_stale(m.entity_id, self.cx.now.mono_ms);
            } else {
                tracing::debug!(
                    me,
                    entity = m.entity_id,
                    owner = m.owner_node,
                    "ghost dropped: moved to a node not subscribed"
                );
                let _ = self.table.despawn(m.entity_id);
                self.handoff.forget_fenced(&mut self.table, m.entity_id);
            }
        }
        for f in due {
            self.apply_fenced(f);
        }
        self.handoff.count_held(&self.cx);
    }

    /// Ghosts whose newer owner's frames waited too long for the old owner's word follow the
    /// newer owner.
    pub(crate) fn release_overdue_frames(&mut self) {
        for id in self.handoff.overdue_frames(&self.cx) {
            if !self.ghost_orphaned(id) {
                // Inputs only: the entity is not held here; let them go (counted).
                self.handoff.forget_fenced(&mut self.table, id);
            }
        }
        self.handoff.count_held(&self.cx);
    }

    /// A ghost of a peer whose link closed: if frames of a newer owner are held for it, it
    /// follows that owner instead of vanishing.
    pub(crate) fn ghost_orphaned(&mut self, id: u64) -> bool {
        let Some((epoch, owner, due)) = self.handoff.follow_newest(&mut self.table, id) else {
            return false;
        };
        self.table.set_origin(id, owner, epoch);
        for f in due {
            self.apply_fenced(f);
        }
        true
    }

    /// An input for `i.account`'s master: through the fence and the handoff machine, then to
    /// where they send it.
    pub(crate) fn input_for_master(&mut self, i: mesh::ForwardInput) {
        match self
            .handoff
            .input_for_master(&mut self.cx, &mut self.table, i)
        {
            handoff::InputNext::Done => {}
            handoff::InputNext::Route {
                id,
                route,
                hops,
                owner,
            } => self.follow_route(id, route, hops, owner),
            handoff::InputNext::ToGame(input) => self.input_to_game(input),
        }
    }

    /// Sends an input on to the node that writes its master (counted as dropped if it cannot).
    pub(crate) fn forward_input(
        &mut self,
        to: NodeId,
        entity: u64,
        epoch: u64,
        i: local::Input,
        hops: u32,
    ) {
        handoff::forward_input(&mut self.cx, &self.mesh, to, entity, epoch, i, hops);
    }

    /// An input the handoff machine routed for `id` to `to`.
    pub(crate) fn forward_routed(
        &mut self,
        id: u64,
        to: NodeId,
        epoch: u64,
        i: local::Input,
        hops: u32,
    ) {
        self.handoff
            .forward_routed(&mut self.cx, &self.mesh, id, to, epoch, i, hops);
    }

    /// Whether `epoch` is the session of `account` this node serves now (as its gateway, or as
    /// the writer of its avatar for another gateway).
    fn session_current(&self, account: &str, epoch: u64) -> bool {
        let local = self.gateway.session_epoch(account).map(|(_, e)| e) == Some(epoch);
        local
            || self
                .routing
                .remote_player(account)
                .is_some_and(|r| r.session_epoch == epoch)
    }

    /// Delivers an input to the game if its session is current here, in its session's order.
    pub(crate) fn input_to_game(&mut self, i: local::Input) {
        if !self.session_current(&i.account, i.session_epoch) {
            return self.cx.metrics.drop_input("input_stale_session");
        }
        if !self.game.connected() {
            return self.cx.metrics.drop_input("no_game");
        }
        let table = &self.table;
        let spawned = || table.master_of(&i.account).is_some();
        if self.avatars.awaits_respawn(&i.account, spawned) {
            // The game waits for ids to spawn it, and would ignore the input.
            return self.cx.metrics.drop_input("input_avatar_respawning");
        }
        for i in self.handoff.order_input(&mut self.cx, i) {
            self.deliver_input(i);
        }
    }

    /// Inputs held for a gap that did not fill in time: delivered in order.
    pub(crate) fn deliver_due_inputs(&mut self) {
        for i in self.handoff.due_inputs(self.cx.now.mono_ms) {
            self.deliver_input(i);
        }
    }

    pub(crate) fn deliver_input(&mut self, i: local::Input) {
        if !self.game.connected() {
            return self.cx.metrics.drop_input("no_game");
        }
        if !self.authority.lease_live() && !self.authority.lost() {
            return self.hold_input_during_lapse(i);
        }
        // Held for a gap while a newer session began (a handover, a second login): the game
        // would ignore it.
        if !self.session_current(&i.account, i.session_epoch) {
            return self.cx.metrics.drop_input("input_stale_session");
        }
        // Its avatar was released in the tick under way: the input waits for the tick's end.
        let Some(i) = self.handoff.park_input(i) else {
            return;
        };
        if self.game.hands_over_by_release() {
            self.handoff.delivered_input(&i);
        }
        self.cx
            .out
            .to_game
            .push(local::sidecar_message::Body::Input(i).into());
        self.cx.metrics.inputs_delivered.inc();
    }

    // ------------------------------------------------------------------ replication

    fn on_subscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        self.replication
            .on_subscribe(&mut self.cx, &mut self.table, &self.mesh, node, chunks);
    }

    fn on_unsubscribe(&mut self, node: NodeId, chunks: Vec<mesh::ChunkRef>) {
        self.replication
            .on_unsubscribe(&self.cx, &mut self.table, node, chunks);
    }

    /// This tick's public changes of local entities, to the nodes subscribed to them.
    pub(crate) fn replicate(&mut self, changes: &model::entities::TickChanges) {
        self.replication
            .replicate(&mut self.cx, &mut self.table, &self.mesh, changes);
    }

    /// This tick's public events of local entities, to the nodes holding their ghosts.
    pub(crate) fn replicate_events(&mut self, events: &[model::fold::TickEvent]) {
        self.replication
            .replicate_events(&mut self.cx, &self.table, &self.mesh, events);
    }

    /// A ghost in `chunk` is now written by `owner`, where this node does not subscribe: whether
    /// it is followed there (a client here views the chunk).
    pub(crate) fn follow(&mut self, chunk: ChunkPos, owner: NodeId) -> bool {
        let follow = self
            .replication
            .follow(&self.cx, self.gateway.clients(), chunk, owner);
        if follow == replication::Follow::Started {
            self.update_subscriptions();
        }
        follow.followed()
    }

    /// Drops the stale ghosts nobody refreshed (a dead process's wait for their restore).
    pub(crate) fn sweep_stale_ghosts(&mut self) {
        let stale = self.replication.stale_ids();
        if stale.is_empty() {
            return;
        }
        let awaiting_restore = stale
            .into_iter()
            .filter(|id| self.restore.awaits_restore(&self.table, *id))
            .collect();
        let restore = &self.restore;
        let dropped = self.replication.sweep_stale(
            &self.cx,
            &self.table,
            &self.authority,
            &self.mesh,
            &awaiting_restore,
            |node| restore.is_live(node),
        );
        for id in dropped {
            self.drop_ghost(id);
        }
    }

    /// A peer's `EntityState`, past the fence.
    pub(crate) fn on_entity_state(&mut self, node: NodeId, s: mesh::EntityState) {
        let dropped =
            self.replication
                .on_entity_state(&mut self.cx, &mut self.table, &self.mesh, node, s);
        if let Some(id) = dropped {
            self.drop_ghost(id);
        }
    }

    /// Asks `owner` for a fresh snapshot of `chunk`.
    pub(crate) fn resync(&mut self, chunk: ChunkPos, owner: NodeId) {
        self.replication
            .resync(&mut self.cx, &self.mesh, chunk, owner);
    }

    /// Brings the subscriptions to what the clients' views and the interaction band need.
    pub(crate) fn update_subscriptions(&mut self) {
        let flipped = self.gateway.take_flipped_chunks();
        let dropped = self.replication.update_subscriptions(
            &mut self.cx,
            flipped,
            self.gateway.clients(),
            &self.authority,
            &self.table,
            &self.mesh,
        );
        for id in dropped {
            self.drop_ghost(id);
        }
    }

    /// The game's simulation ghosts after this tick's `changes`.
    pub(crate) fn step_sim_ghosts(&mut self, changes: &model::entities::TickChanges, now_ms: u64) {
        let game_connected = self.game.connected();
        let handoff = &self.handoff;
        self.replication.step_sim_ghosts(
            &mut self.cx,
            &self.table,
            self.authority.area(),
            game_connected,
            |id| handoff.adopting(id),
            changes,
            now_ms,
        );
    }

    /// The nodes that may own an entity in `chunk`.
    #[cfg(test)]
    pub(crate) fn owners_near(&mut self, chunk: ChunkPos) -> Vec<NodeId> {
        self.replication
            .owners_near(&self.cx, &self.authority, chunk)
    }

    /// A render ghost let go of: gone from the table, and the fence forgets it.
    fn drop_ghost(&mut self, id: u64) {
        let _ = self.table.despawn(id);
        self.handoff.forget_fenced(&mut self.table, id);
    }

    // ------------------------------------------------------------------ routing

    /// Routes this tick's changes, events and sends to other gateways; returns the sends for
    /// the local fold.
    pub(crate) fn route_tick(
        &mut self,
        changes: &model::entities::TickChanges,
        events: &[model::fold::TickEvent],
        sends: Vec<model::fold::TickSend>,
    ) -> Vec<model::fold::TickSend> {
        let newly_held = self.replication.take_newly_held();
        self.routing.route_tick(
            &mut self.cx,
            &self.table,
            self.gateway.clients(),
            &self.mesh,
            newly_held,
            changes,
            events,
            sends,
        )
    }

    /// Tells remote gateways where their players' avatars are, where they changed.
    pub(crate) fn send_anchors(&mut self, changes: &model::entities::TickChanges) {
        self.routing
            .send_anchors(&mut self.cx, &self.table, &self.mesh, changes);
    }

    /// Tells `gateway` where `account`'s master is, if this node writes it.
    pub(crate) fn send_anchor(&mut self, gateway: NodeId, account: &str, session_epoch: u64) {
        self.routing.send_anchor(
            &mut self.cx,
            &self.table,
            &self.mesh,
            gateway,
            account,
            session_epoch,
        );
    }

    /// The directory's answer to a lookup: an orphaned avatar's check, and what was parked.
    fn on_looked_up(&mut self, account: String, result: Result<Option<SessionEntry>, String>) {
        self.routing.lookup_answered(&account);
        if let Ok(entry) = &result {
            self.on_orphan_looked_up(&account, *entry);
        }
        let here = self
            .routing
            .on_looked_up(&mut self.cx, &self.mesh, &account, result);
        for piece in here {
            self.gateway.deliver(
                &self.cx,
                &account,
                wire::part_of(piece.kind as i32),
                cellmesh_proto::batch::Encoded(piece.encoded),
            );
        }
    }

    fn on_peer_player_join(&mut self, from: NodeId, j: mesh::PeerPlayerJoin) {
        let departed = self.departed_owner(&j.account);
        let game_connected = self.game.connected();
        self.routing.on_peer_player_join(
            &mut self.cx,
            &self.table,
            &self.mesh,
            game_connected,
            departed,
            from,
            j,
        );
    }

    fn on_peer_player_leave(&mut self, gateway: NodeId, l: mesh::PeerPlayerLeave) {
        let departed = self.departed_owner(&l.account);
        let leave =
            self.routing
                .on_peer_player_leave(&mut self.cx, &self.table, &self.mesh, departed, l);
        let Some(l) = leave else {
            return;
        };
        if Self::leave_waits(&l.reason) {
            return self.defer_leave(&l.account, l.session_epoch, &l.reason, Some(gateway));
        }
        self.leave_game(&l.account, l.session_epoch, &l.reason);
    }

    /// Sends the leave of a session on to `owner`, unless a newer session wants the avatar.
    pub(crate) fn send_leave_on(&mut self, owner: NodeId, l: mesh::PeerPlayerLeave) {
        self.routing
            .send_leave_on(&mut self.cx, &self.mesh, owner, l);
    }

    /// Whether this node serves a session of `account` newer than `epoch` with the avatar it
    /// writes, or has one attached here.
    pub(crate) fn serves_newer_session(&self, account: &str, epoch: u64) -> bool {
        self.routing.serves_newer_remote(account, epoch)
            || self.session_epoch(account).is_some_and(|(_, e)| e > epoch)
    }

    /// The key and epoch of `account`'s session here, if it is attached.
    pub(crate) fn session_epoch(&self, account: &str) -> Option<(SessionKey, u64)> {
        self.gateway.session_epoch(account)
    }

    fn on_anchor(&mut self, node: NodeId, a: mesh::Anchor) {
        let account = a.account.clone();
        let anchored = self
            .gateway
            .on_anchor(&mut self.cx, &mut self.table, &self.mesh, node, a);
        if anchored {
            self.avatars.stop_waiting(&account);
        }
    }

    fn on_routed(&mut self, r: mesh::Routed) {
        self.gateway.on_routed(&self.cx, r);
    }

    /// Another gateway holds `account` now: routes follow it, and an older session here is
    /// displaced (its avatar is released where it is simulated).
    fn on_session_moved(&mut self, m: mesh::SessionMoved) {
        let game_connected = self.game.connected();
        self.routing.on_session_moved(&self.cx, game_connected, &m);
        if let Some((key, epoch)) = self.session_epoch(&m.account) {
            if epoch < m.session_epoch {
                self.displace(key, "the account logged in on another gateway");
            }
        }
        self.avatar_meets_session(&m);
    }

    /// Tells every peer that `account` now has a session here, and whether its gateway spawns
    /// the avatar anew.
    pub(crate) fn announce_session(&mut self, account: &str, epoch: u64, new_avatar: bool) {
        self.broadcast(mesh_message::Body::SessionMoved(mesh::SessionMoved {
            account: account.to_string(),
            session_epoch: epoch,
            gateway_node: self.cx.config.node_id,
            new_avatar,
        }));
    }

    pub(crate) fn announce_session_end(&mut self, account: &str, epoch: u64) {
        self.broadcast(mesh_message::Body::SessionEnded(mesh::SessionEnded {
            account: account.to_string(),
            session_epoch: epoch,
        }));
    }

    /// The answer to an attach refused for admission.
    pub(crate) fn admission_refusal(&self, session_id: u64) -> mesh_message::Body {
        self.admission.refusal(&self.cx, session_id)
    }

    // ------------------------------------------------------------------ gateway

    /// A message on a mesh link: a peer's goes to the part it is for, a proxy's to the gateway.
    pub(crate) fn on_link_message(&mut self, link: LinkId, m: MeshMessage) {
        let Some(l) = self.mesh.link(link) else {
            return;
        };
        if let Some(node) = l.peer {
            if let Some(body) = m.body {
                self.on_peer_message(node, body);
            }
            return;
        }
        use mesh_message::Body as B;
        match m.body {
            Some(B::Attach(a)) => self.on_attach(link, a),
            Some(B::Detach(d)) => {
                if let Some((key, reason)) = self.gateway.on_detach(&self.cx, link, d) {
                    self.end_session(key, &reason);
                }
            }
            Some(B::Input(i)) => self.on_input(link, i),
            Some(B::Rtt(r)) => self.gateway.on_rtt(link, r),
            Some(B::Heartbeat(_)) => {}
            Some(other) => {
                self.cx.metrics.error("unexpected_message");
                tracing::warn!(link, message = ?other, "proxy sent a message only a sidecar sends; ignored");
            }
            None => {}
        }
    }

    /// A proxy attaches a client: the gateway checks it, admission decides for a new session.
    fn on_attach(&mut self, link: LinkId, a: mesh::Attach) {
        if !self.gateway.attach_acceptable(&mut self.cx, link, &a) {
            return;
        }
        // A session that moves here was admitted already; a new one only while the node admits.
        if !a.moved && !self.admit_login() {
            return self
                .cx
                .queue_for_link(link, self.admission_refusal(a.session_id));
        }
        self.gateway
            .begin_attach(&mut self.cx, &mut self.mesh, link, a);
    }

    /// The directory registered a session: its avatar goes on where it is simulated, is waited
    /// for, or is spawned; then the proxy hears the session attached.
    fn on_registered(
        &mut self,
        key: SessionKey,
        account: String,
        result: Result<Registration, String>,
    ) {
        use avatars::AvatarAt;
        let Some(new) = self.gateway.on_registered(
            &mut self.cx,
            &mut self.mesh,
            &self.routing,
            key,
            &account,
            result,
        ) else {
            return;
        };
        // An avatar already simulated for this account (a session displaced here, or one the
        // directory's master record names) keeps being simulated where it is: its game sees a
        // new PlayerJoin. With none, one is spawned.
        let me = self.cx.config.node_id;
        let at = match new.owner {
            Some(owner) if owner == me => AvatarAt::Here,
            Some(owner) => AvatarAt::Peer(owner),
            None => self.avatar_at(&account, new.master),
        };
        // Handed over from another geo: its avatar lives on, and its master record is in the
        // directory of whichever geo its owner is in (this geo's may hold none, or an older
        // owner's). Unless this node writes it, the owner hears of this newer session, joins it
        // and anchors it here; only if none does in time is one spawned.
        let wait_for_owner = new.handed_over_in && at != AvatarAt::Here;
        if wait_for_owner {
            self.announce_session(&account, new.epoch, false);
            self.await_handed_over_avatar(&account);
        } else {
            self.announce_session(&account, new.epoch, at == AvatarAt::Nowhere);
        }
        match at {
            _ if wait_for_owner => {}
            AvatarAt::Here => self.join_here(&account, new.epoch, new.last_position),
            AvatarAt::Peer(owner) => {
                if self.send_join(owner, &account, new.epoch, new.last_position) {
                    self.gateway.set_master_owner(&account, owner);
                } else {
                    self.await_avatar(&account, new.master);
                }
            }
            AvatarAt::Restoring => self.await_avatar(&account, new.master),
            AvatarAt::Nowhere => self.spawn_avatar(&account, new.epoch, new.last_position),
        }
        self.gateway.confirm_attach(&mut self.cx, &account, &new);
    }

    /// A session registered again after its directory entry was lost: its avatar's game and the
    /// peers learn its new epoch, or it ends if a newer login holds the account.
    fn on_reregistered(
        &mut self,
        key: SessionKey,
        account: String,
        held: u64,
        result: Result<Option<u64>, String>,
    ) {
        let outcome =
            self.gateway
                .on_reregistered(&mut self.cx, key, account.clone(), held, result);
        match outcome {
            gateway::Reregistered::Nothing => {}
            gateway::Reregistered::Again {
                epoch,
                last_position,
            } => {
                self.announce_session(&account, epoch, false);
                match self.gateway.master_owner(&account) {
                    Some(owner) if owner == self.cx.config.node_id => {
                        self.join_here(&account, epoch, last_position)
                    }
                    Some(owner) => {
                        self.send_join(owner, &account, epoch, last_position);
                    }
                    // The avatar is on its way (restoring, handed over): its join names the
                    // session's epoch as it is then.
                    None => {}
                }
            }
            gateway::Reregistered::Displaced => self.end_session(key, "displaced"),
        }
    }

    /// A client's input, to the game writing its avatar (forwarded there by the gateway when
    /// that is a peer's).
    fn on_input(&mut self, link: LinkId, i: mesh::SessionInput) {
        let avatars = &self.avatars;
        let forward = self
            .gateway
            .on_input(&mut self.cx, &self.mesh, link, i, |a| avatars.is_waiting(a));
        if let Some(forward) = forward {
            self.input_for_master(forward);
        }
    }

    /// The client is gone: the game hears `PlayerLeave`, the record is saved, the directory
    /// entry released.
    pub(crate) fn end_session(&mut self, key: SessionKey, reason: &str) {
        let Some(s) = self.gateway.forget_session(&self.cx, &mut self.mesh, key) else {
            return;
        };
        let Some(epoch) = s.epoch else {
            // Still registering: `on_registered` undoes the registration when it lands.
            return;
        };
        self.release_avatar(&s.account, epoch, reason);
        self.announce_session_end(&s.account, epoch);
        self.gateway
            .session_ended(&mut self.cx, &self.table, &s, epoch, reason);
    }

    /// Tells the game simulating `account`'s avatar (this node's or a peer's) that the session
    /// `epoch` is over.
    fn release_avatar(&mut self, account: &str, epoch: u64, reason: &str) {
        let owner = self.gateway.release_avatar(&self.cx, account);
        self.avatars.stop_waiting(account);
        if owner != self.cx.config.node_id {
            self.send_peer(
                owner,
                mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
                    account: account.to_string(),
                    session_epoch: epoch,
                    reason: reason.to_string(),
                }),
            );
        } else if Self::leave_waits(reason) {
            self.defer_leave(account, epoch, reason, None);
        } else if self.game.connected() {
            self.leave_game(account, epoch, reason);
        }
    }

    /// A newer login of the account on another gateway won: the client is kicked and its
    /// avatar released (the new session's join respawns or keeps it), with no record saved.
    fn displace(&mut self, key: SessionKey, detail: &str) {
        let Some(s) = self.gateway.session(key) else {
            return;
        };
        let (account, epoch) = (s.account.clone(), s.epoch);
        self.gateway
            .kick(&mut self.cx, key, KickReason::Displaced, detail);
        if let Some(epoch) = epoch {
            self.release_avatar(&account, epoch, "displaced");
        }
        self.gateway.forget_avatar_position(&account);
        self.gateway.forget_session(&self.cx, &mut self.mesh, key);
    }

    // ------------------------------------------------------------------ admission and load

    /// Reals the node holds (not render ghosts).
    fn real_count(&self) -> usize {
        self.table.len() - self.table.ghost_count()
    }

    /// The game's `Load` report.
    pub(crate) fn on_game_load(&mut self, l: &local::Load) {
        let (reals, attached) = (self.real_count(), self.gateway.attached());
        let change = self
            .admission
            .on_game_load(&mut self.cx, l, reals, attached);
        self.admission_changed(change);
    }

    /// A link's outbox holds `frames` frames. Only proxy links count: they carry this node's
    /// client batches.
    fn on_link_backlog(&mut self, link: LinkId, frames: usize) {
        if self.mesh.link(link).is_none_or(|l| l.peer.is_some()) {
            return;
        }
        let attached = self.gateway.attached();
        let change = self
            .admission
            .on_proxy_backlog(&mut self.cx, link, frames, attached);
        self.admission_changed(change);
    }

    /// Whether a new session may attach.
    pub(crate) fn admit_login(&mut self) -> bool {
        // Those still attaching count: they are about to be held.
        let sessions = self.gateway.session_count();
        let (admitted, change) = self.admission.admit_login(&mut self.cx, sessions);
        self.admission_changed(change);
        admitted
    }

    fn admission_changed(&mut self, change: Option<admission::Change>) {
        self.admission
            .announce(&mut self.cx, change, self.mesh.proxy_links());
    }

    /// Queues a load report for the balancer when one is due (on the game's tick).
    pub(crate) fn maybe_report_load(&mut self) {
        if self.load_reports.due(&self.cx) {
            let report = self.cell_report();
            self.cx.emit(Output::LoadReport(Box::new(report)));
            if self.cx.config.geos.len() > 1 {
                let mesh = &self.mesh;
                let proxy_geo = |link| mesh.link(link).map(|l| l.hello.geo.as_str());
                let players = self
                    .gateway
                    .player_samples(&self.cx, &self.table, proxy_geo);
                self.cx.emit(Output::Players(players));
            }
        }
    }

    /// The report for the balancer now.
    pub fn cell_report(&mut self) -> cellmesh_world::balance::CellReport {
        let reals = self.real_count();
        let load = self.admission.refresh_load(&mut self.cx, reals);
        balance::cell_report(&self.cx, load, &self.table, self.authority.partition())
    }

    // ------------------------------------------------------------------ claims

    /// The game's `Claim`.
    pub(crate) fn on_claim(&mut self, c: local::Claim) {
        let game = self.game.conn();
        let (table, handoff, lease_live) =
            (&self.table, &self.handoff, self.authority.lease_live());
        self.claims.on_claim(&mut self.cx, c, game, |id| {
            claim_holder(table, handoff, lease_live, id)
        });
    }

    /// The game's `ClaimRelease`.
    pub(crate) fn on_claim_release(&mut self, r: local::ClaimRelease) {
        match self.claims.on_release(&self.cx, &r) {
            claims::Release::Nothing => {}
            claims::Release::Refused { detail, entity } => {
                game::error(&mut self.cx, local::ErrorCode::InvalidValue, detail, entity)
            }
            claims::Release::Free { key, holder, guard } => {
                if guard.is_some_and(|h| !self.may_write(h)) {
                    return;
                }
                self.claims.free(&mut self.cx, &key, holder);
            }
        }
    }

    /// The store's answer to a `Claim`: the game's, or a spawn point's.
    fn on_claimed(&mut self, token: u64, result: Result<ClaimOutcome, String>) {
        let Some(p) = self.claims.answered(token) else {
            return;
        };
        tracing::debug!(key = %p.key, holder = p.holder.entity, released = p.released, ?result, "claim answered");
        let game = self.game.conn();
        let lease_live = self.authority.lease_live();
        if p.spawner {
            let book = self.claims.book_mut();
            return self
                .spawners
                .on_claimed(&mut self.cx, book, game, lease_live, p, result);
        }
        // Still the holder's, under the epoch asked with, and not frozen for a handoff?
        let entity = p.holder.entity;
        let still_held = !self.handoff.outgoing().is_frozen(entity)
            && claim_holder(&self.table, &self.handoff, lease_live, entity)
                .is_ok_and(|h| h == p.holder);
        self.claims
            .on_claimed(&mut self.cx, p, result, game, still_held);
    }

    /// A claim call's answer, from this geo's store or the key's home.
    fn on_claim_reply(&mut self, reply: StoreReply) {
        match reply {
            StoreReply::Claimed { token, result } => self.on_claimed(token, result),
            StoreReply::ClaimsRenewed { results } => self.on_claims_renewed(results),
            StoreReply::ClaimRebound { old, result } => self.on_claim_rebound(old, result),
            _ => {}
        }
    }

    /// Sends the claim calls the parts asked for to the stores of their keys' homes. A call no
    /// home can take is answered at once, and that answer may ask again (bounded: a failed
    /// call is retried on a timer, not at once).
    fn route_claim_calls(&mut self) {
        for _ in 0..4 {
            let calls = std::mem::take(&mut self.cx.out.claim_calls);
            if calls.is_empty() {
                return;
            }
            let mut replies = Vec::new();
            for call in calls {
                replies.extend(self.claim_homes.route(&mut self.cx, &self.mesh, call));
            }
            for reply in replies {
                self.on_claim_reply(reply);
            }
        }
    }

    fn on_claims_renewed(&mut self, results: Vec<(ClaimGrant, Result<bool, String>)>) {
        let game = self.game.conn();
        let handoff = &self.handoff;
        self.claims.on_renewed(&mut self.cx, results, game, |id| {
            !handoff.outgoing().writable(id) || handoff.is_released(id)
        });
    }

    fn on_claim_rebound(&mut self, old: ClaimGrant, result: Result<Option<ClaimGrant>, String>) {
        let game = self.game.conn();
        self.claims.on_rebound(&mut self.cx, old, result, game);
    }

    /// An offer was adopted here: its claims come with it.
    pub(crate) fn claims_adopted(&mut self, claims: &[mesh::HeldClaim]) {
        self.claims.adopted(&self.cx, claims);
        if !claims.is_empty() {
            self.claims_step();
        }
    }

    pub(crate) fn claims_handed_away(&mut self, id: u64) {
        self.claims.handed_away(&mut self.cx, id);
    }

    pub(crate) fn claims_holder_gone(&mut self, id: u64) {
        self.claims.holder_gone(&mut self.cx, id);
    }

    /// The game went away: its claims are freed, and the stocks it never spawned given up.
    pub(crate) fn claims_game_gone(&mut self) {
        self.claims.game_gone(&mut self.cx);
        self.spawners
            .game_gone(&mut self.cx, self.claims.book_mut());
    }

    /// Renewals and rebinds due, lapsed leases, and holders that left the table.
    fn claims_step(&mut self) {
        let game = self.game.conn();
        let spawners = &self.spawners;
        self.claims.step(&mut self.cx, &self.table, game, |id| {
            spawners.is_awaited(id)
        });
    }

    /// The claims this node believes held at `mono_ms` (its own clock): (key, holder entity,
    /// the node's end of the lease). For the cluster simulator's check that no key has two
    /// holders.
    pub fn claims_believed(&self, mono_ms: u64) -> Vec<(String, u64, u64)> {
        self.claims.believed(mono_ms)
    }

    // ------------------------------------------------------------------ spawners

    /// The game's `DeclareSpawners`.
    pub(crate) fn on_declare_spawners(&mut self, d: local::DeclareSpawners) {
        let declared = self
            .spawners
            .on_declare(&mut self.cx, d, self.authority.partition());
        if let Err(detail) = declared {
            return game::error(&mut self.cx, local::ErrorCode::InvalidValue, detail, 0);
        }
        self.spawners_step();
    }

    /// Claims due for this node's points.
    fn spawners_step(&mut self) {
        let game = self.game.conn();
        let lease_live = self.authority.lease_live();
        self.spawners
            .step(&mut self.cx, self.claims.book_mut(), game, lease_live);
    }

    // ------------------------------------------------------------------ commands

    /// The game's `Command`.
    pub(crate) fn on_command(&mut self, c: local::Command) {
        let from_account = self
            .table
            .get_local(c.from_entity)
            .map(|e| e.owner_account.to_string())
            .unwrap_or_default();
        let incarnation = self.restore.incarnation();
        match self
            .commands
            .on_game_command(&mut self.cx, c, from_account, incarnation)
        {
            Ok(command) => self.route_command(command),
            Err((detail, entity)) => {
                game::error(&mut self.cx, local::ErrorCode::InvalidValue, detail, entity)
            }
        }
    }

    /// The game's answer to a `CommandIn`: to the command's origin, once.
    pub(crate) fn on_command_reply(&mut self, r: local::CommandReply) {
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        self.commands.on_reply(&mut self.cx, &path, r);
    }

    /// Routes a command to the writer of its target: from this node's game, from a peer, or
    /// let go by the fence or a thaw.
    pub(crate) fn route_command(&mut self, c: mesh::EntityCommand) {
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        let next = self
            .commands
            .route(&mut self.cx, &path, &self.table, &self.handoff, c);
        match next {
            commands::Next::Done => {}
            commands::Next::Hold(id, c) => self.hold_command(id, c),
            commands::Next::Route { id, owner, command } => {
                let route = self
                    .handoff
                    .outgoing_mut()
                    .route_input(id, handoff::Routed::Command(Box::new(command)));
                self.follow_route(id, route, 0, owner);
            }
        }
    }

    /// A command under an epoch of its target not seen here yet: held by the fence until the
    /// epoch change is.
    fn hold_command(&mut self, id: u64, c: mesh::EntityCommand) {
        let epoch = c.entity_epoch;
        let admitted = self.handoff.fence_command(&mut self.table, id, epoch, c);
        let burnt = self.handoff.fence().is_burnt(id, epoch);
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        self.commands
            .fenced(&mut self.cx, &path, id, epoch, admitted, burnt);
    }

    /// Carries out the handoff machine's route for an input or command of entity `id`. One not
    /// in a handoff goes to the game, or to `owner` (the writer of the ghost this node holds)
    /// under its epoch.
    pub(crate) fn follow_route(
        &mut self,
        id: u64,
        route: model::handoff::InputRoute<handoff::Routed>,
        hops: u32,
        owner: Option<(NodeId, u64)>,
    ) {
        use handoff::Routed;
        use model::handoff::InputRoute;
        match route {
            InputRoute::Held => {}
            InputRoute::Local(Routed::Input(input)) => match owner {
                Some((owner, epoch)) => self.forward_input(owner, id, epoch, input, hops),
                None => self.input_to_game(input),
            },
            InputRoute::Forward {
                to,
                epoch,
                input: Routed::Input(input),
            } => self.forward_routed(id, to, epoch, input, hops),
            InputRoute::Local(Routed::Command(c)) => match owner {
                Some((owner, epoch)) => {
                    self.cx.metrics.command_forwarded("owner");
                    self.forward_command(owner, epoch, *c, false);
                }
                None => {
                    let game_connected = self.game.connected();
                    let path = commands::ResultPath {
                        mesh: &self.mesh,
                        incarnation: self.restore.incarnation(),
                    };
                    self.commands
                        .for_game(&mut self.cx, &path, *c, game_connected);
                }
            },
            InputRoute::Forward {
                to,
                epoch,
                input: Routed::Command(c),
            } => {
                // Behind an offer in flight a copy stays with the unit; after it, none does.
                let copy_kept = self.handoff.outgoing().is_frozen(id);
                self.cx.metrics.command_forwarded("handoff");
                self.forward_command(to, epoch, *c, copy_kept);
            }
        }
    }

    /// Sends a command on to `to`, which writes (or is adopting) its target under `epoch`.
    /// One that cannot be sent is answered, unless a copy of it stays here.
    pub(crate) fn forward_command(
        &mut self,
        to: NodeId,
        epoch: u64,
        mut c: mesh::EntityCommand,
        copy_kept: bool,
    ) {
        c.entity_epoch = epoch;
        c.hops += 1;
        if to == self.cx.config.node_id {
            return self.route_command(c);
        }
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        self.commands.send_on(&mut self.cx, &path, to, c, copy_kept);
    }

    /// Commands for entities released in the tick that just ended: their unit is offered (or
    /// kept) now.
    pub(crate) fn route_after_tick(&mut self) {
        for c in self.commands.take_after_tick() {
            self.route_command(c);
        }
    }

    /// Commands whose predecessor did not come in time: delivered in order all the same (those
    /// of frozen entities wait: they follow the unit if it goes).
    pub(crate) fn deliver_due_commands(&mut self) {
        let handoff = &self.handoff;
        self.commands
            .deliver_due(&mut self.cx, |id| handoff.frozen(id));
    }

    /// The order each stream to `id` got to, for the offer that hands it on.
    pub(crate) fn command_cursors(&self, id: u64) -> Vec<mesh::CommandCursor> {
        self.commands.cursors(id)
    }

    /// An adopted unit's cursors: its commands go on in order here.
    pub(crate) fn resume_command_cursors(&mut self, cursors: &[mesh::CommandCursor]) {
        self.commands.resume_cursors(&self.cx, cursors);
    }

    /// The game despawned `id`: commands held for it find no target.
    pub(crate) fn command_target_gone(&mut self, id: u64) {
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        self.commands.target_gone(&mut self.cx, &path, id);
    }

    /// A peer asks where `l.entity` is written.
    pub(crate) fn on_locate(&mut self, from: NodeId, l: mesh::Locate) {
        let found = commands::whereabouts(&self.cx, &self.table, &self.handoff, l.entity);
        self.send_peer(
            from,
            mesh_message::Body::Located(mesh::Located {
                entity: l.entity,
                found: found.is_some(),
                owner: found.map_or(0, |f| f.0),
                entity_epoch: found.map_or(0, |f| f.1),
            }),
        );
    }

    /// A peer says where an entity commands wait for is written.
    pub(crate) fn on_located(&mut self, from: NodeId, l: mesh::Located) {
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        let forward = self.commands.on_located(&mut self.cx, &path, from, l);
        for (owner, epoch, c) in forward {
            self.forward_command(owner, epoch, c, false);
        }
    }

    /// A result from the writer (or a node that dropped the command): to the game, once.
    pub(crate) fn on_command_result(&mut self, r: mesh::EntityCommandResult) {
        let incarnation = self.restore.incarnation();
        self.commands.on_result(&mut self.cx, incarnation, r);
    }

    /// Requests past their deadline are answered `TIMEOUT`; what waits too long is let go.
    pub(crate) fn commands_step(&mut self) {
        let path = commands::ResultPath {
            mesh: &self.mesh,
            incarnation: self.restore.incarnation(),
        };
        self.commands.step(&mut self.cx, &path);
    }

    /// The game went away: the results it waited for and the replies it owed go with it.
    pub(crate) fn commands_game_gone(&mut self) {
        self.commands.game_gone(&mut self.cx);
    }

    // ------------------------------------------------------------------ avatars

    pub(crate) fn avatars_step(&mut self) {
        self.apply_deferred_leaves();
        self.join_live_writers();
        self.expire_avatar_waits();
        self.check_orphans();
    }

    /// Writes the master records of avatars this node now writes, and clears those of avatars
    /// it despawned (see [`avatars::Avatars::sync_master_records`]).
    pub(crate) fn sync_master_records(&mut self) {
        let incarnation = self.restore.incarnation();
        let writable = incarnation != 0 && self.authority.lease_live() && self.mesh.clustered();
        self.avatars
            .sync_master_records(&mut self.cx, &self.table, incarnation, writable);
    }

    /// Whether a leave for `reason` waits for a newer session.
    pub(crate) fn leave_waits(reason: &str) -> bool {
        avatars::leave_waits(reason)
    }

    /// The leave of a session a newer login displaced, or whose proxy link broke, waits for
    /// the newer session's join.
    /// `gateway` is the peer whose session it was (`None`: this node's own).
    pub(crate) fn defer_leave(
        &mut self,
        account: &str,
        epoch: u64,
        reason: &str,
        gateway: Option<NodeId>,
    ) {
        self.avatars
            .defer_leave(&self.cx, account, epoch, reason, gateway);
    }

    /// Another gateway announced a session of `account` (`m`): if this node writes the
    /// account's avatar and serves an older session with it, the avatar serves the new one (its
    /// gateway may be waiting for it, or have sent its join elsewhere), or, when that gateway
    /// spawns a new avatar, this one leaves at once: never two.
    pub(crate) fn avatar_meets_session(&mut self, m: &mesh::SessionMoved) {
        if m.gateway_node == self.cx.config.node_id || !self.writes_master(&m.account) {
            return;
        }
        let served = self
            .routing
            .remote_player(&m.account)
            .map(|r| r.session_epoch)
            .or_else(|| self.session_epoch(&m.account).map(|(_, e)| e))
            .unwrap_or(0);
        if m.session_epoch <= served {
            return;
        }
        if !m.new_avatar {
            let entry = SessionEntry {
                gateway_node: m.gateway_node,
                session_epoch: m.session_epoch,
            };
            return self.join_session(&m.account, entry);
        }
        tracing::debug!(account = %m.account, "a newer session spawns a new avatar: this one leaves");
        self.avatars.take_leave(&m.account);
        self.routing.remove_remote_player(&m.account);
        // Every session before the new one is over.
        self.leave_game(&m.account, m.session_epoch - 1, "new_avatar_elsewhere");
    }

    /// The game hears session `epoch` of `account` leave (after the handoff of a frozen avatar,
    /// if one is in flight).
    pub(crate) fn leave_game(&mut self, account: &str, epoch: u64, reason: &str) {
        self.leave_follows_handoff(account, epoch, reason);
        if self.game.connected() {
            self.cx.out.to_game.push(
                local::sidecar_message::Body::PlayerLeave(local::PlayerLeave {
                    account: account.to_string(),
                    session_epoch: epoch,
                    reason: reason.to_string(),
                })
                .into(),
            );
        }
    }

    fn apply_deferred_leaves(&mut self) {
        // A newer session's join cannot come from a gateway cut off from this node (a live one,
        // whose sessions go on): its leaves wait for the link's return.
        let cut_off: Vec<NodeId> = self
            .avatars
            .leave_gateways()
            .filter(|&g| {
                !self.peer_link_up(g)
                    && (self.restore.is_live(g) || self.gateway_elsewhere_lives(g))
            })
            .collect();
        self.avatars.hold_leaves(&self.cx, |g| cut_off.contains(&g));
        for account in self.avatars.leaves_due(&self.cx) {
            if self.gateway.registering(&account) {
                // A login here is registering (its epoch, newer than any leave, unknown yet):
                // the master record it reads may name this node's avatar. The leave waits
                // for its registration to find it, or to fail.
                continue;
            }
            let Some((epoch, reason)) = self.avatars.take_leave(&account) else {
                continue;
            };
            if self.serves_newer_session(&account, epoch) {
                continue;
            }
            if !self.writes_master(&account) {
                // Handed on meanwhile: the leave follows it (no second wait there).
                let owner = self.departed_owner(&account);
                if let Some(owner) = owner.filter(|o| *o != self.cx.config.node_id) {
                    self.send_leave_on(
                        owner,
                        mesh::PeerPlayerLeave {
                            account: account.clone(),
                            session_epoch: epoch,
                            reason: "session_over".into(),
                        },
                    );
                    continue;
                }
            }
            if self
                .routing
                .remote_player(&account)
                .is_some_and(|r| r.session_epoch <= epoch)
            {
                self.routing.remove_remote_player(&account);
            }
            self.leave_game(&account, epoch, &reason);
        }
    }

    /// The store refused a write of master records: they are written again at the next sync.
    pub(crate) fn on_masters_not_written(&mut self, accounts: Vec<String>) {
        self.avatars.on_masters_not_written(accounts);
    }

    /// Players whose avatar this node writes and whose gateway link is down: their session may
    /// have moved (a gateway that died) or ended for good.
    fn check_orphans(&mut self) {
        let orphans: Vec<String> = self
            .routing
            .remote_players()
            .filter(|(account, r)| {
                !self.peer_link_up(r.gateway_node) && self.writes_master(account)
            })
            .map(|(a, _)| a.clone())
            .collect();
        let routing = &self.routing;
        let due = self
            .avatars
            .orphans_due(&self.cx, orphans, |a| routing.is_remote_player(a));
        for account in due {
            if self.routing.start_lookup(&account) {
                self.cx.store(StoreRequest::Lookup { account });
            }
        }
    }

    /// The node this node handed `account`'s avatar to, while it remembers.
    pub(crate) fn departed_owner(&self, account: &str) -> Option<NodeId> {
        let id = self.handoff.departed_master(account)?;
        Some(self.handoff.outgoing().departed_to(id)?.0)
    }

    /// Whether this node writes `account`'s avatar.
    pub(crate) fn writes_master(&self, account: &str) -> bool {
        self.table
            .master_of(account)
            .is_some_and(|e| e.origin().is_none())
    }

    fn peer_link_up(&self, node: NodeId) -> bool {
        node == self.cx.config.node_id || self.mesh.is_up(node)
    }

    /// The directory's word on the session of a player whose gateway link is down.
    pub(crate) fn on_orphan_looked_up(&mut self, account: &str, entry: Option<SessionEntry>) {
        let Some(r) = self.routing.remote_player(account) else {
            return;
        };
        if self.peer_link_up(r.gateway_node) || !self.writes_master(account) {
            return;
        }
        match entry {
            None if self.gateway_elsewhere_lives(r.gateway_node) => {
                // Without a core geo homing the directory, that gateway registers its sessions
                // in its own geo's directory, not in the one this node reads: a miss here says
                // nothing (with one, the lease below still covers a directory late to answer). While its lease holds (or has
                // only lapsed: a cut between the geos), the session may well go on; its link's
                // return brings the gateway's sessions (`SessionMoved`), and its death moves them
                // to another gateway of its geo, which announces them.
            }
            None => {
                // The session is gone for good: so is its avatar.
                tracing::debug!(%account, gateway = r.gateway_node, "the player's session ended with its gateway: avatar released");
                self.release_remote_player(account, "gateway_gone");
            }
            Some(e)
                if e.session_epoch > r.session_epoch
                    && e.gateway_node != self.cx.config.node_id =>
            {
                self.join_session(account, e);
            }
            _ => {}
        }
    }

    /// Whether `gateway` is a node of another geo (whose sessions this node's directory does not
    /// hold) that has not died: its lease is live or lapsed, as this node last heard.
    fn gateway_elsewhere_lives(&self, gateway: NodeId) -> bool {
        let elsewhere = self
            .restore
            .geo_of(gateway)
            .is_some_and(|g| g != self.cx.config.geo);
        elsewhere && (self.restore.is_live(gateway) || self.restore.is_lapsed(gateway))
    }

    /// The session of a player whose avatar this node simulates for another gateway ended.
    pub(crate) fn release_remote_player(&mut self, account: &str, reason: &str) {
        let Some(r) = self.routing.remove_remote_player(account) else {
            return;
        };
        self.avatars.forget_orphan(account);
        if !self.writes_master(account) {
            return;
        }
        self.leave_game(account, r.session_epoch, reason);
    }

    /// The avatar this node writes serves the newer session `entry` of another gateway.
    pub(crate) fn join_session(&mut self, account: &str, entry: SessionEntry) {
        self.routing.serve(account, entry);
        if self.game.connected() {
            self.cx.out.to_game.push(
                local::sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.to_string(),
                    session_epoch: entry.session_epoch,
                    last_position: None,
                })
                .into(),
            );
        }
        self.send_anchor(entry.gateway_node, account, entry.session_epoch);
    }

    /// Where a login of `account` finds its avatar: here if this node writes it, else from the
    /// directory's record.
    pub(crate) fn avatar_at(
        &self,
        account: &str,
        master: Option<MasterEntry>,
    ) -> avatars::AvatarAt {
        use avatars::AvatarAt;
        // The record may lag the avatar (its writes wait out a store outage): a join sent where
        // it names can end on a node the avatar has left, whose game spawns a second one.
        if self.writes_master(account) {
            return AvatarAt::Here;
        }
        let Some(m) = master else {
            return AvatarAt::Nowhere;
        };
        let me = self.cx.config.node_id;
        if m.node == me && m.lease_epoch == self.restore.incarnation() {
            return match self.departed_owner(account) {
                Some(owner) if owner != me => AvatarAt::Peer(owner),
                // Despawned since (the record is cleared soon).
                _ => AvatarAt::Nowhere,
            };
        }
        if self.restore.is_fenced((m.node, m.lease_epoch)) {
            return AvatarAt::Restoring;
        }
        match self.restore.lease_of(m.node) {
            Some(l) if l == m.lease_epoch => AvatarAt::Peer(m.node),
            // A newer process holds the id, or the lease lapsed: the writer is dead.
            Some(_) => AvatarAt::Restoring,
            None if self.restore.knows_no_live_peer() => AvatarAt::Peer(m.node),
            None => AvatarAt::Restoring,
        }
    }

    /// A session whose avatar is being restored waits for the restored owner's anchor.
    pub(crate) fn await_avatar(&mut self, account: &str, master: Option<MasterEntry>) {
        let dead = master.map(|m| (m.node, m.lease_epoch));
        // The record may name the process that wrote the avatar a moment before it went to
        // another that died too: while any restore is under way, it may bring the avatar.
        let restored =
            dead.is_some_and(|inc| self.restore.is_restored(inc)) && self.restore.pending() == 0;
        self.avatars.await_avatar(&self.cx, account, dead, restored);
        self.gateway.forget_master_owner(account);
    }

    /// A session handed over from another geo waits for its avatar's owner to anchor it, then
    /// spawns one.
    pub(crate) fn await_handed_over_avatar(&mut self, account: &str) {
        self.avatars.await_handed_over_avatar(&self.cx, account);
        self.gateway.forget_master_owner(account);
    }

    /// A dead process's world is restored: once no other restore is under way, a session still
    /// waiting for an avatar a restored process wrote waits only a little longer (the restore
    /// had no checkpoint of it). An avatar its record names as one process's may have gone to
    /// another that died with it (the record lags a handoff), whose restore brings it.
    pub(crate) fn avatars_restored(&mut self) {
        if self.restore.pending() > 0 {
            return;
        }
        let restore = &self.restore;
        self.avatars
            .restored(&self.cx, |inc| restore.is_restored(inc));
    }

    /// A session that registered while the link to its avatar's writer was down waits as if
    /// the writer were being restored; a writer whose lease is still its own was not dead, and
    /// no restore will anchor the session: the join goes to it once the link is back (its game
    /// spawns the avatar again if it let the old one go meanwhile). The link must be to that
    /// very process: a node restarted in place restores its predecessor's world, avatar
    /// included, and a join there would spawn a second one.
    fn join_live_writers(&mut self) {
        let restore = &self.restore;
        let mesh = &self.mesh;
        let waiting = self.avatars.waiting_on_live(|(node, epoch)| {
            restore.lease_of(node) == Some(epoch)
                && !restore.is_fenced((node, epoch))
                && mesh.linked_lease(node) == Some(epoch)
        });
        for (account, writer) in waiting {
            let Some((key, epoch)) = self.session_epoch(&account) else {
                continue;
            };
            let last = self.gateway.last_position(key);
            if self.send_join(writer, &account, epoch, last) {
                tracing::info!(%account, writer, "the link to the avatar's writer is back: joined there");
                self.avatars.stop_waiting(&account);
                self.gateway.set_master_owner(&account, writer);
            }
        }
    }

    /// Sessions that waited too long for a restored avatar get a new one (the restore found no
    /// checkpoint of it).
    fn expire_avatar_waits(&mut self) {
        for account in self.avatars.waits_due(&self.cx) {
            self.avatars.stop_waiting(&account);
            let Some((key, epoch)) = self.session_epoch(&account) else {
                continue;
            };
            if self.gateway.master_owner(&account).is_some() {
                continue;
            }
            tracing::warn!(%account, "no restored avatar anchored the session in time: spawning one");
            self.cx.metrics.error("avatar_not_restored");
            let last = self.gateway.last_position(key);
            self.announce_session(&account, epoch, true);
            self.spawn_avatar(&account, epoch, last);
        }
    }

    /// The avatar is spawned by the game of the node owning where it stands (the player's last
    /// position); a player with none starts in this node's world.
    pub(crate) fn spawn_avatar(&mut self, account: &str, epoch: u64, last: Option<[f64; 3]>) {
        // Remembered: an older avatar that anchors this session later is told to go.
        self.gateway.mark_new_avatar(account, epoch);
        let me = self.cx.config.node_id;
        let owner = last
            .and_then(|[x, y, _]| {
                let at = cellmesh_world::geometry::Pos { x, y };
                self.authority.partition().owner_of(at).ok()
            })
            .unwrap_or(me);
        if owner != me && self.send_join(owner, account, epoch, last) {
            self.gateway.set_master_owner(account, owner);
            return;
        }
        self.join_here(account, epoch, last);
    }

    /// The game here simulates (or spawns) the avatar of the local session `epoch`.
    pub(crate) fn join_here(&mut self, account: &str, epoch: u64, last: Option<[f64; 3]>) {
        let me = self.cx.config.node_id;
        self.gateway.set_master_owner(account, me);
        self.avatars.stop_waiting(account);
        // An avatar simulated here for another gateway serves this session now.
        self.routing.remove_remote_player(account);
        if let Some(e) = self
            .table
            .master_of(account)
            .filter(|e| e.origin().is_none())
        {
            let (id, epoch) = (e.id, e.epoch);
            self.gateway.avatar_written_here(account, id, epoch);
        }
        if self.game.connected() {
            self.cx.out.to_game.push(
                local::sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.to_string(),
                    session_epoch: epoch,
                    last_position: last.map(|[x, y, z]| local::Vec3 { x, y, z }),
                })
                .into(),
            );
        }
    }

    /// Asks `owner`'s game to simulate the avatar of this gateway's session `epoch`.
    pub(crate) fn send_join(
        &mut self,
        owner: NodeId,
        account: &str,
        epoch: u64,
        last: Option<[f64; 3]>,
    ) -> bool {
        self.send_peer(
            owner,
            mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                account: account.to_string(),
                session_epoch: epoch,
                last_position: last.map(|[x, y, z]| mesh::MeshVec3 { x, y, z }),
                gateway_node: 0,
                hops: 0,
            }),
        )
    }

    // ------------------------------------------------------------------ state

    /// The JSON view of the node for `/state`.
    pub fn state(&self) -> serde_json::Value {
        let game = self.game.state();
        let sessions = self.gateway.sessions_state(&self.table);
        let (links, peers) = self.mesh.state();
        json!({
            "node_id": self.cx.config.node_id,
            "geo": self.cx.config.geo,
            "ready": self.cx.out.ready,
            "game_connected": self.game.connected(),
            "game": game,
            "last_tick": self.game.last_tick(),
            "entities": self.table.len(),
            "sessions": sessions,
            "links": links,
            "peers": peers,
            "partition_epoch": self.authority.partition().epoch(),
            "ghosts_render": self.table.ghost_count(),
            "reals": self.table.len() - self.table.ghost_count(),
            "load": self.admission.load_state(),
            "ghosts_sim": self.replication.sim_ghost_count(),
            "subscriptions": self.replication.subscription_count(),
            "subscribers": self.replication.subscriber_count(),
            // The accounts whose avatar this node writes.
            "masters": self
                .table
                .masters()
                .filter(|(_, id)| self.table.get_local(*id).is_some())
                .map(|(account, _)| account)
                .collect::<Vec<_>>(),
            "inputs_held": self.inputs_held(),
            "handoffs_in_flight": self.handoff.outgoing().in_flight(),
            "handoffs_in_doubt": self.handoff.outgoing().in_doubt().map(|(id, to, epoch)| json!({"entity": id, "to": to, "epoch": epoch})).collect::<Vec<_>>(),
            "adopting": self.handoff.adopting_count(),
            "held_frames": self.handoff.fence().held(),
            "lease_live": self.authority.lease_live(),
            "lease_lost": self.authority.lost(),
            "draining": self.authority.draining(),
            "admission": self.admission.state(&self.cx),
        })
    }

    /// The sidecar stops: every session is told, then every connection is let go (each writes
    /// what is queued for it, then closes).
    fn shutdown(&mut self) {
        self.shutting_down = true;
        self.cx.set_ready(false);
        for key in self.gateway.session_keys() {
            self.gateway.kick(
                &mut self.cx,
                key,
                KickReason::Shutdown,
                "the node is shutting down",
            );
            self.end_session(key, "shutdown");
        }
        self.pack_outboxes();
        self.game.release(&mut self.cx);
        for link in self.mesh.take_links() {
            self.cx.emit(Output::ReleaseLink { link });
        }
        self.cx.emit(Output::Publish);
    }
}

/// The holder a claim may name: an entity this node writes, not frozen for a handoff, while its
/// lease is live.
fn claim_holder(
    table: &EntityTable,
    handoff: &Handoffs,
    lease_live: bool,
    id: u64,
) -> Result<ClaimHolder, String> {
    let Some(e) = table.get_local(id).filter(|e| e.origin().is_none()) else {
        return Err(format!(
            "entity {id} is not written here: only the node writing an entity claims for it"
        ));
    };
    if !handoff.outgoing().writable(id) || handoff.is_released(id) {
        return Err(format!(
            "entity {id} is frozen for a handoff: claim again once it is written"
        ));
    }
    if !lease_live {
        return Err("this node's lease lapsed or was lost".into());
    }
    Ok(ClaimHolder {
        entity: id,
        entity_epoch: e.epoch,
    })
}

/// Packs messages into frames of at most `max` bytes, in order. Returns the frames and how many
/// messages were dropped for being too large for any frame.
fn pack<M: Message>(messages: Vec<M>, max: usize) -> (Vec<Vec<M>>, u64) {
    // A repeated field costs its key (1 byte here) and a length varint beside the message.
    let cost = |m: &M| {
        let len = m.encoded_len();
        len + 1 + prost::length_delimiter_len(len)
    };
    let mut frames = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    let mut oversize = 0;
    for m in messages {
        let c = cost(&m);
        if c > max {
            oversize += 1;
            continue;
        }
        if size + c > max && !current.is_empty() {
            frames.push(std::mem::take(&mut current));
            size = 0;
        }
        size += c;
        current.push(m);
    }
    if !current.is_empty() {
        frames.push(current);
    }
    (frames, oversize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use cellmesh_proto::local::{sidecar_message, SidecarMessage};

    #[test]
    fn pack_splits_in_order_and_drops_the_impossible() {
        let msg = |n: usize| -> SidecarMessage {
            sidecar_message::Body::Input(local::Input {
                payload: Bytes::from(vec![0u8; n]),
                ..Default::default()
            })
            .into()
        };
        let (frames, oversize) = pack(vec![msg(40), msg(40), msg(500), msg(40)], 100);
        assert_eq!(oversize, 1);
        assert_eq!(frames.iter().map(Vec::len).collect::<Vec<_>>(), [2, 1]);
        for f in &frames {
            assert!(
                SidecarFrame {
                    messages: f.clone()
                }
                .encoded_len()
                    <= 100
            );
        }
    }
}
