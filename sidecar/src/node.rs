//! The node: one task owns the entity table, the client sessions and every outbox, and is fed
//! events by the connection tasks over one channel (actor style: no lock is shared by the
//! connections on the hot path). Store calls run in their own tasks and come back as events, so
//! a slow store never stalls a tick. Sends to connections never wait: a full outbox closes that
//! connection instead.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cellmesh_admin::Admin;
use cellmesh_geo_router::store::{PlayerRecord, Stores};
use cellmesh_proto::local::{
    self, game_message, sidecar_message, ErrorCode, GameMessage, SidecarFrame, SidecarMessage,
};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage};
use prost::Message;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use std::collections::{HashMap, HashSet};

use cellmesh_geo_router::geometry::{ChunkPos, ChunkRect};
use cellmesh_geo_router::partition::{NodeId, Partition};
use cellmesh_geo_router::store::SessionEntry;

use crate::audience::Audience;
use crate::cluster::PeerInfo;
use crate::config::SidecarConfig;
use crate::entities::{Component, EntityError, EntityTable, EntityUpdate, NewEntity, Position};
use crate::fold::{Clients, TickEvent, TickSend};
use crate::gateway::{SessionKey, Sessions};
use crate::ghosts::{GhostRules, SimGhosts};
use crate::handoff::{Fence, HandoffSource, HandoffTarget};
use crate::ids::IdMinter;
use crate::interest::InterestShape;
use crate::mesh::MeshCtx;
use crate::metrics::Metrics;
use crate::peer::PeerState;
use crate::route::Addressed;
use crate::subs::{self, Subscribers, Subscriptions};

pub(crate) type ConnId = u64;
pub(crate) type LinkId = u64;

/// Events the connection and store tasks send to the node.
pub(crate) enum NodeEvent {
    /// A game said a valid `Hello`; `rest` is what followed it in the same frame.
    GameHello {
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
        handle: GameHandle,
    },
    GameFrame {
        conn: ConnId,
        messages: Vec<GameMessage>,
    },
    GameClosed {
        conn: ConnId,
        reason: String,
    },
    /// A proxy completed the link handshake (the reply `LinkHello` is already written).
    LinkUp {
        link: LinkId,
        hello: mesh::LinkHello,
        remote: String,
        handle: LinkHandle,
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
    /// The directory registered a session (or failed to).
    Registered {
        session: SessionKey,
        account: String,
        result: Result<Registration, String>,
    },
    /// Lease renewals: (session, epoch, still current?).
    Renewed {
        results: Vec<(SessionKey, u64, Result<bool, String>)>,
    },
    /// The peers with a live lease, from the topology store.
    Peers {
        peers: Vec<PeerInfo>,
    },
    /// A directory lookup for routing by account came back.
    LookedUp {
        account: String,
        result: Result<Option<SessionEntry>, String>,
    },
    /// The node lease was taken over: this node must stop serving.
    LeaseLost,
    /// A newer partition was committed to the topology store.
    Partition(Box<Partition>),
    /// Peers' lease epochs (their incarnations) from the topology store.
    PeerLeases(Vec<(NodeId, u64)>),
    /// SIGTERM: stop accepting handoffs, hand away what the partition gives to others, exit.
    Drain,
}

pub(crate) struct Registration {
    pub epoch: u64,
    pub record: Option<PlayerRecord>,
}

/// What the node queues for the game connection.
pub(crate) enum GameOut {
    Frame(SidecarFrame),
    /// Write this error, then close.
    Fatal(local::Error),
}

/// The node's end of a game connection. Dropping it closes the connection after its queue.
pub(crate) struct GameHandle {
    pub outbox: mpsc::Sender<GameOut>,
    /// Close at once, dropping the queue (the game stopped reading).
    pub kill: CancellationToken,
}

/// The node's end of a mesh link. Dropping it closes the link after its queue.
pub(crate) struct LinkHandle {
    pub outbox: mpsc::Sender<MeshFrame>,
    pub kill: CancellationToken,
}

pub(crate) struct GameSlot {
    pub conn: ConnId,
    pub hello: local::Hello,
    pub handle: GameHandle,
    pub health: Option<local::Health>,
    pub load: Option<local::Load>,
}

pub(crate) struct Link {
    /// The peer sidecar's node id, for a link to another sidecar (`None`: a proxy).
    pub peer: Option<u32>,
    pub hello: mesh::LinkHello,
    pub remote: String,
    pub handle: LinkHandle,
    pub sessions: BTreeSet<SessionKey>,
}

/// Room for the frame, message and `ToClient` headers around one client batch.
pub(crate) const TO_CLIENT_OVERHEAD: usize = 64;
/// Longest a store call may take before the node gives up on it.
pub(crate) const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most ids one `ReserveIds` may ask for.
const MAX_RESERVE: usize = 65_536;
/// Events handled before the outboxes are flushed, so one burst becomes one frame per peer.
const EVENTS_PER_FLUSH: usize = 64;
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

pub(crate) struct Node {
    pub cfg: Arc<SidecarConfig>,
    pub stores: Stores,
    pub metrics: Metrics,
    pub admin: Arc<Admin>,
    pub published: Arc<Mutex<serde_json::Value>>,
    pub inbox: mpsc::Sender<NodeEvent>,
    pub tasks: TaskTracker,
    pub table: EntityTable,
    pub ids: IdMinter,
    pub clients: Clients,
    pub game: Option<GameSlot>,
    pub links: BTreeMap<LinkId, Link>,
    pub sessions: Sessions,
    pub tick_events: Vec<TickEvent>,
    pub tick_sends: Vec<TickSend>,
    pub last_tick: u64,
    pub to_game: Vec<SidecarMessage>,
    pub to_links: BTreeMap<LinkId, Vec<MeshMessage>>,
    pub shutting_down: bool,
    // ---- the cluster (see `peer`)
    pub partition: Arc<Partition>,
    /// The chunks this node owns.
    pub area: Vec<ChunkRect>,
    /// The (chunk, node) pairs of the interaction band, its keep margin and the handoff reach
    /// inside the area, always subscribed.
    pub band: HashSet<(ChunkPos, NodeId)>,
    /// The partition before the last change, while its owners may still write entities that the
    /// mass handoff has not moved yet (views subscribe to them too).
    pub prev_partition: Option<(Arc<Partition>, std::time::Instant)>,
    /// (chunk, owner) pairs re-subscribed lately to recover a ghost (unix ms).
    pub resynced: HashMap<(ChunkPos, NodeId), u64>,
    /// chunk -> the nodes that may own an entity there (cleared with each partition).
    pub near_cache: HashMap<ChunkPos, Vec<NodeId>>,
    pub subs: Subscriptions,
    pub subs_dirty: bool,
    pub subscribers: Subscribers,
    /// Local entity -> nodes holding its render ghost.
    pub replicas: HashMap<u64, BTreeSet<NodeId>>,
    pub peers: BTreeMap<NodeId, PeerState>,
    /// For dialling peers; `None` for a lone node.
    pub mesh_ctx: Option<MeshCtx>,
    pub sim: SimGhosts,
    /// Route cache: account -> its gateway and session epoch.
    pub routes: HashMap<String, SessionEntry>,
    /// Players whose avatar this node's game simulates for another gateway.
    pub remote_players: HashMap<String, SessionEntry>,
    /// Gateway side: the node simulating each local session's avatar.
    pub master_owner: HashMap<String, NodeId>,
    /// Gateway side: the last known position of avatars simulated elsewhere.
    pub anchor_pos: HashMap<String, [f64; 3]>,
    /// Owner side: the chunk last told to each remote player's gateway.
    pub anchor_sent: HashMap<String, ChunkPos>,
    /// Owner side: local entities that went in full to nodes not holding them, since the tick
    /// began. The accounts those nodes serve get the entity's current non-public state.
    pub newly_held: BTreeMap<u64, BTreeSet<NodeId>>,
    /// Owner side: accounts whose session newly attached to another gateway since the tick began.
    pub newly_attached: BTreeSet<String>,
    pub parked: Vec<(String, Addressed)>,
    pub looking_up: HashSet<String>,
    pub unknown_until: HashMap<String, std::time::Instant>,
    // ---- handoff (see `handoff_node`)
    pub handoff_out: HandoffSource<local::Input>,
    pub handoff_in: HandoffTarget,
    pub fence: Fence<Fenced>,
    /// Offers being adopted by the game: root -> the offer.
    pub adopting: HashMap<u64, mesh::HandoffOffer>,
    /// Entities not offered again before this time (unix ms), after a refusal.
    pub handoff_retry: HashMap<u64, u64>,
    /// Entities to check for a handoff at the next tick even if they did not move.
    pub handoff_recheck: BTreeSet<u64>,
    /// Entities in chunks a new partition gave away: handed over with no margin.
    pub mass_handoff: HashSet<u64>,
    /// The partition epoch each peer acknowledged (BigWorld's `hasBeenCreated`).
    pub peer_partition: HashMap<NodeId, u64>,
    /// Each peer's lease epoch: a new one means a new process holds the node id.
    pub peer_lease: HashMap<NodeId, u64>,
    /// Peers that restarted with offers in doubt towards them: redirected when their link is up.
    pub redirect_to: BTreeSet<NodeId>,
    /// False once the node lease was lost: everything is frozen, nothing is written.
    pub lease_live: bool,
    pub draining: Option<tokio::time::Instant>,
    /// Gateway side: the epoch of each local session's master, from its owner's anchors.
    pub master_epoch: HashMap<String, u64>,
    /// Masters handed away from here, by account, so late input finds them with no ghost left.
    pub departed_masters: HashMap<String, u64>,
    /// Players who left while their master was frozen for a handoff: the leave goes to the new
    /// owner once it acks (the game here drops it on Evict).
    pub leaving: HashMap<String, mesh::PeerPlayerLeave>,
    /// Every real of this node with its epoch, as of the last publish (for a census).
    pub census: Arc<Mutex<Vec<crate::Real>>>,
}

/// The epoch every entity starts with; each handoff adds one.
pub(crate) const FIRST_EPOCH: u64 = 1;

/// A frame the fence may hold until its entity's epoch change is seen.
#[derive(Debug, Clone)]
pub(crate) enum Fenced {
    State(NodeId, mesh::EntityState),
    Gone(NodeId, mesh::EntityGone),
    Input(mesh::ForwardInput),
}

impl Node {
    // The node's wiring, done once by `launch`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<SidecarConfig>,
        stores: Stores,
        metrics: Metrics,
        admin: Arc<Admin>,
        published: Arc<Mutex<serde_json::Value>>,
        inbox: mpsc::Sender<NodeEvent>,
        tasks: TaskTracker,
        partition: Arc<Partition>,
        mesh_ctx: Option<MeshCtx>,
    ) -> Self {
        let shape = InterestShape::new(cfg.view_radius_chunks, cfg.release_margin_chunks);
        let keep = i64::from(cfg.interaction_band_chunks + cfg.ghost_keep_margin_chunks);
        let band = subs::band(&partition, cfg.node_id, keep, cfg.reach_chunks());
        let rules = GhostRules {
            band: i64::from(cfg.interaction_band_chunks),
            keep_margin: i64::from(cfg.ghost_keep_margin_chunks),
            min_lifespan_ms: cfg.ghost_min_lifespan_ms,
        };
        Self {
            area: subs::merge_rects(partition.area_of(cfg.node_id)),
            band,
            near_cache: HashMap::new(),
            resynced: HashMap::new(),
            prev_partition: None,
            handoff_out: HandoffSource::default(),
            handoff_in: HandoffTarget::default(),
            fence: Fence::default(),
            adopting: HashMap::new(),
            handoff_retry: HashMap::new(),
            handoff_recheck: BTreeSet::new(),
            mass_handoff: HashSet::new(),
            peer_partition: HashMap::new(),
            peer_lease: HashMap::new(),
            redirect_to: BTreeSet::new(),
            lease_live: true,
            draining: None,
            master_epoch: HashMap::new(),
            census: Arc::default(),
            leaving: HashMap::new(),
            departed_masters: HashMap::new(),
            partition,
            subs: Subscriptions::default(),
            subs_dirty: true,
            subscribers: Subscribers::default(),
            replicas: HashMap::new(),
            peers: BTreeMap::new(),
            mesh_ctx,
            sim: SimGhosts::new(rules),
            routes: HashMap::new(),
            remote_players: HashMap::new(),
            master_owner: HashMap::new(),
            anchor_pos: HashMap::new(),
            anchor_sent: HashMap::new(),
            newly_held: BTreeMap::new(),
            newly_attached: BTreeSet::new(),
            parked: Vec::new(),
            looking_up: HashSet::new(),
            unknown_until: HashMap::new(),
            table: EntityTable::new(cfg.world),
            ids: IdMinter::new(cfg.node_id),
            clients: Clients::new(cfg.world, shape),
            cfg,
            stores,
            metrics,
            admin,
            published,
            inbox,
            tasks,
            game: None,
            links: BTreeMap::new(),
            sessions: Sessions::default(),
            tick_events: Vec::new(),
            tick_sends: Vec::new(),
            last_tick: 0,
            to_game: Vec::new(),
            to_links: BTreeMap::new(),
            shutting_down: false,
        }
    }

    pub async fn run(mut self, mut inbox: mpsc::Receiver<NodeEvent>, shutdown: CancellationToken) {
        let renew_every = Duration::from_millis(self.cfg.session_lease_ms / 3);
        let mut renew =
            tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut publish = tokio::time::interval(PUBLISH_EVERY);
        let mut dirty = true;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                ev = inbox.recv() => {
                    let Some(ev) = ev else { break };
                    self.handle(ev);
                    for _ in 1..EVENTS_PER_FLUSH {
                        match inbox.try_recv() {
                            Ok(ev) => self.handle(ev),
                            Err(_) => break,
                        }
                    }
                }
                _ = renew.tick() => self.renew_leases(),
                _ = publish.tick() => {
                    if dirty {
                        self.publish_state();
                        dirty = false;
                    }
                    if self.drained() {
                        tracing::info!("drained: shutting down");
                        shutdown.cancel();
                    }
                    continue;
                }
            }
            self.flush();
            dirty = true;
        }
        self.shutdown();
    }

    fn handle(&mut self, ev: NodeEvent) {
        match ev {
            NodeEvent::GameHello {
                conn,
                hello,
                rest,
                handle,
            } => self.on_game_hello(conn, hello, rest, handle),
            NodeEvent::GameFrame { conn, messages } => {
                if self.game.as_ref().is_some_and(|g| g.conn == conn) {
                    for m in messages {
                        if let Some(body) = m.body {
                            self.on_game_message(body);
                        }
                    }
                }
            }
            NodeEvent::GameClosed { conn, reason } => self.on_game_closed(conn, &reason),
            NodeEvent::LinkUp {
                link,
                hello,
                remote,
                handle,
                rest,
            } => {
                self.on_link_up(link, hello, remote, handle);
                for m in rest {
                    self.on_link_message(link, m);
                }
            }
            NodeEvent::LinkFrame { link, messages } => {
                for m in messages {
                    self.on_link_message(link, m);
                }
            }
            NodeEvent::LinkClosed { link, reason } => self.close_link(link, &reason),
            NodeEvent::Registered {
                session,
                account,
                result,
            } => self.on_registered(session, account, result),
            NodeEvent::Renewed { results } => self.on_renewed(results),
            NodeEvent::Peers { peers } => self.on_peers(peers),
            NodeEvent::LookedUp { account, result } => self.on_looked_up(account, result),
            NodeEvent::LeaseLost => self.on_lease_lost(),
            NodeEvent::Partition(p) => self.apply_partition(*p),
            NodeEvent::PeerLeases(leases) => self.on_peer_leases(leases),
            NodeEvent::Drain => self.begin_drain(),
        }
    }

    // ------------------------------------------------------------------ the game

    fn on_game_hello(
        &mut self,
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
        handle: GameHandle,
    ) {
        if let Some(current) = &self.game {
            let detail = format!(
                "a game ({:?}) is already connected to this sidecar; it serves one game at a time",
                current.hello.game
            );
            let err = local::Error {
                code: ErrorCode::AlreadyConnected as i32,
                detail,
                fatal: true,
                entity_id: 0,
            };
            // A fresh outbox always has room; if the task is already gone there is nobody to tell.
            let _ = handle.outbox.try_send(GameOut::Fatal(err));
            return;
        }
        if self.shutting_down {
            return;
        }
        tracing::info!(conn, game = %hello.game, "game connected");
        self.game = Some(GameSlot {
            conn,
            hello,
            handle,
            health: None,
            load: None,
        });
        self.metrics.game_connected.set(1);
        let w = &self.cfg.world;
        self.to_game.push(
            sidecar_message::Body::Welcome(local::Welcome {
                version: Some(local::ProtocolVersion::current()),
                node_id: self.cfg.node_id,
                world: Some(local::WorldShape {
                    width: w.width,
                    height: w.height,
                    chunk_size: w.chunk_size,
                    region_size: w.region_size,
                }),
                owned_area: self.owned_rects(),
                partition_epoch: self.partition.epoch(),
            })
            .into(),
        );
        // Sessions outlive a game restart: the new game hears about every attached player.
        let joins: Vec<SidecarMessage> = self
            .sessions
            .iter()
            .filter_map(|s| {
                let epoch = s.epoch?;
                Some(
                    sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                        account: s.account.clone(),
                        session_epoch: epoch,
                        last_position: s.last_position.map(|[x, y, z]| local::Vec3 { x, y, z }),
                    })
                    .into(),
                )
            })
            .collect();
        self.to_game.extend(joins);
        let remote: Vec<SidecarMessage> = self
            .remote_players
            .iter()
            .map(|(account, r)| {
                sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.clone(),
                    session_epoch: r.session_epoch,
                    last_position: None,
                })
                .into()
            })
            .collect();
        self.to_game.extend(remote);
        self.anchor_sent.clear();
        // Adopts the previous game never answered: the new game gets them again.
        let pending: Vec<local::Adopt> = self
            .adopting
            .values()
            .map(|o| self.adopt_message(o))
            .collect();
        for adopt in pending {
            self.to_game
                .push(sidecar_message::Body::Adopt(adopt).into());
        }
        self.admin
            .set_ready(self.lease_live && self.draining.is_none());
        for m in rest {
            if let Some(body) = m.body {
                self.on_game_message(body);
            }
        }
    }

    /// The node's area in metres, as the game is told it.
    pub(crate) fn owned_rects(&self) -> Vec<local::Rect> {
        let w = &self.cfg.world;
        self.area
            .iter()
            .map(|r| {
                let (x, y, width, height) = w.rect_metres(r);
                local::Rect {
                    x,
                    y,
                    width,
                    height,
                }
            })
            .collect()
    }

    fn on_game_message(&mut self, body: game_message::Body) {
        use game_message::Body as B;
        match body {
            B::Hello(_) => self.game_error(
                ErrorCode::UnexpectedMessage,
                "Hello was already received on this connection".into(),
                0,
            ),
            B::Spawn(s) => self.on_spawn(s),
            B::Update(u) => {
                if self.may_write(u.entity_id) {
                    self.on_update(u)
                }
            }
            B::Despawn(d) => {
                if self.table.get_local(d.entity_id).is_none() {
                    return self.entity_error(EntityError::Unknown(d.entity_id));
                }
                if !self.may_write(d.entity_id) {
                    return;
                }
                if let Err(e) = self.table.despawn(d.entity_id) {
                    self.entity_error(e);
                }
            }
            B::Event(e) => self.on_event(e),
            B::Send(s) => self.tick_sends.push(TickSend {
                accounts: s.accounts,
                r#type: s.r#type,
                payload: s.payload,
            }),
            B::ReserveIds(r) => self.on_reserve_ids(r),
            B::TickEnd(t) => self.end_tick(t.tick),
            B::Load(l) => {
                if let Some(g) = self.game.as_mut() {
                    g.load = Some(l);
                }
            }
            B::Health(h) => {
                if let Some(g) = self.game.as_mut() {
                    g.health = Some(h);
                }
            }
            // Chunk events travel to peers and the journal, which a single node does not have yet.
            B::ChunkEvent(_) => self.metrics.drop_msg("chunk_event_unsupported", 1),
            B::Snapshot(s) => self.on_snapshot(s),
            B::Adopted(a) => self.on_adopted(a),
        }
    }

    fn on_spawn(&mut self, s: local::Spawn) {
        let components = match components(s.entity_id, s.components) {
            Ok(c) => c,
            Err(detail) => return self.game_error(ErrorCode::InvalidValue, detail, s.entity_id),
        };
        let spawn = NewEntity {
            id: s.entity_id,
            position: s.position.map(position).unwrap_or_default(),
            owner_account: s.owner_account,
            is_master: s.is_master,
            parent_id: s.parent_id,
            components,
            origin: None,
            epoch: FIRST_EPOCH,
        };
        if let Err(e) = self.table.spawn(spawn) {
            self.entity_error(e);
        }
    }

    fn on_update(&mut self, u: local::Update) {
        if self.table.get_local(u.entity_id).is_none() {
            // Ghosts are read-only to the game.
            return self.entity_error(EntityError::Unknown(u.entity_id));
        }
        let changed = match components(u.entity_id, u.changed) {
            Ok(c) => c,
            Err(detail) => return self.game_error(ErrorCode::InvalidValue, detail, u.entity_id),
        };
        let update = EntityUpdate {
            id: u.entity_id,
            position: u.position.map(position),
            changed,
            removed: u.removed_types,
        };
        if let Err(e) = self.table.update(update) {
            self.entity_error(e);
        }
    }

    fn on_event(&mut self, e: local::Event) {
        let audience = match Audience::from_proto(e.audience.as_ref()) {
            Ok(a) => a,
            Err(err) => {
                return self.game_error(
                    ErrorCode::InvalidValue,
                    format!("event on entity {}: {err}", e.entity_id),
                    e.entity_id,
                )
            }
        };
        if self.table.get_local(e.entity_id).is_none() {
            return self.entity_error(EntityError::Unknown(e.entity_id));
        }
        if !self.may_write(e.entity_id) {
            return;
        }
        let entity = self.table.get_local(e.entity_id).expect("checked above");
        self.tick_events.push(TickEvent {
            entity_id: e.entity_id,
            chunk: entity.chunk,
            owner_account: entity.owner_account.clone(),
            audience,
            r#type: e.r#type,
            payload: e.payload,
        });
    }

    fn on_reserve_ids(&mut self, r: local::ReserveIds) {
        // Each id costs at most 9 bytes on the wire; the answer must fit one frame.
        let max = MAX_RESERVE.min(self.cfg.max_frame_bytes.saturating_sub(TO_CLIENT_OVERHEAD) / 9);
        let count = r.count as usize;
        if count > max {
            let detail = format!(
                "ReserveIds {} asks for {count} ids; at most {max} per request",
                r.request_id
            );
            return self.game_error(ErrorCode::InvalidValue, detail, 0);
        }
        let ids = self.ids.mint_many(unix_ms(), count);
        self.to_game.push(
            sidecar_message::Body::IdsReserved(local::IdsReserved {
                request_id: r.request_id,
                ids,
            })
            .into(),
        );
    }

    fn entity_error(&mut self, e: EntityError) {
        let code = match e {
            EntityError::Unknown(_) => ErrorCode::UnknownEntity,
            EntityError::Duplicate(_) => ErrorCode::DuplicateEntity,
            EntityError::ZeroId | EntityError::NonFinite { .. } => ErrorCode::InvalidValue,
        };
        self.game_error(code, e.to_string(), e.entity_id());
    }

    /// A non-fatal error about something the game sent: reported, and nothing else changes.
    pub(crate) fn game_error(&mut self, code: ErrorCode, detail: String, entity_id: u64) {
        self.metrics.error(error_kind(code));
        tracing::debug!(?code, %detail, "game error");
        self.to_game.push(
            sidecar_message::Body::Error(local::Error {
                code: code as i32,
                detail,
                fatal: false,
                entity_id,
            })
            .into(),
        );
    }

    /// Folds the tick into one batch per client and queues them on their links.
    fn end_tick(&mut self, tick: u64) {
        self.last_tick = tick;
        let changes = self.table.take_changes();
        let events = std::mem::take(&mut self.tick_events);
        let sends = std::mem::take(&mut self.tick_sends);
        // Other nodes first: public changes to subscribers, the rest to gateways by account.
        self.replicate(&changes);
        self.replicate_events(&events);
        let sends = self.route_tick(&changes, &events, sends);
        self.send_anchors(&changes);
        let budget = self.cfg.max_frame_bytes - TO_CLIENT_OVERHEAD;
        let out = self
            .clients
            .fold(tick, &self.table, &changes, &events, &sends, budget);
        self.settle_partition();
        self.update_subscriptions();
        self.step_sim_ghosts(&changes, unix_ms());
        self.check_handoffs(&changes);
        self.metrics.subscribers.set(self.subscribers.len() as i64);
        self.metrics.ticks.inc();
        self.metrics.deltas_sent.inc_by(out.deltas);
        self.metrics.deltas_encoded.inc_by(out.deltas_encoded);
        self.metrics
            .drop_msg("unknown_account", out.unknown_accounts);
        let ghosts = self.table.ghost_count();
        self.metrics
            .entities
            .set(self.table.len().saturating_sub(ghosts) as i64);
        self.metrics.ghosts_render.set(ghosts as i64);
        for (key, server_frame) in out.frames {
            let Some(s) = self.sessions.get(key) else {
                continue;
            };
            if server_frame.len() > budget {
                // One piece alone outgrew a frame; the client cannot be sent it.
                self.metrics.drop_msg("batch_too_large", 1);
                continue;
            }
            let (link, session_id) = (s.link, s.session_id);
            self.queue_for_link(
                link,
                mesh_message::Body::ToClient(mesh::ToClient {
                    session_id,
                    server_frame,
                }),
            );
            self.metrics.batches_sent.inc();
        }
    }

    fn on_game_closed(&mut self, conn: ConnId, reason: &str) {
        if self.game.as_ref().is_none_or(|g| g.conn != conn) {
            return;
        }
        tracing::info!(conn, %reason, "game disconnected");
        self.game = None;
        self.metrics.game_connected.set(0);
        self.admin.set_ready(false);
        // Remember where the avatars were, for the PlayerJoin of the next game.
        for s in self.sessions.iter_mut() {
            if let Some(e) = self.table.master_of(&s.account) {
                s.last_position = Some([e.position.x, e.position.y, e.position.z]);
            }
        }
        // The game's entities go with it; clients see them vanish at once. Ghosts stay: their
        // owners still send them.
        self.table.clear_local();
        self.sim.clear();
        self.to_game.clear();
        self.end_tick(self.last_tick + 1);
    }

    // ------------------------------------------------------------------ outboxes

    pub(crate) fn queue_for_link(&mut self, link: LinkId, body: mesh_message::Body) {
        self.to_links.entry(link).or_default().push(body.into());
    }

    /// Sends everything queued, one frame per peer where it fits. Never waits.
    fn flush(&mut self) {
        let max = self.cfg.max_frame_bytes;
        // Closing a slow link or game queues messages for the others, hence the loop.
        while !(self.to_links.is_empty() && self.to_game.is_empty()) {
            for (link, messages) in std::mem::take(&mut self.to_links) {
                let Some(l) = self.links.get(&link) else {
                    continue;
                };
                let (frames, oversize) = pack(messages, max);
                self.metrics.drop_msg("message_too_large", oversize);
                let mut full = false;
                for frame in frames {
                    match l.handle.outbox.try_send(MeshFrame { messages: frame }) {
                        Ok(()) => {}
                        Err(TrySendError::Full(_)) => {
                            full = true;
                            break;
                        }
                        Err(TrySendError::Closed(_)) => break,
                    }
                }
                if full {
                    self.metrics.error("link_outbox_full");
                    self.metrics.drop_msg("link_outbox_full", 1);
                    tracing::warn!(link, "mesh link outbox full: closing the link");
                    // A slow peer is cut (it redials and resynchronises); the node never waits.
                    let why = match l.peer {
                        Some(node) => {
                            let label = self.metrics.peer(node);
                            self.metrics.peer_outbox_full.get_or_create(&label).inc();
                            "outbox full: the peer is not reading"
                        }
                        None => "outbox full: the proxy is not reading",
                    };
                    self.close_link(link, why);
                }
            }
            let messages = std::mem::take(&mut self.to_game);
            if messages.is_empty() {
                continue;
            }
            let Some(g) = &self.game else {
                self.metrics.drop_msg("no_game", messages.len() as u64);
                continue;
            };
            let (frames, oversize) = pack(messages, max);
            self.metrics.drop_msg("message_too_large", oversize);
            for frame in frames {
                match g
                    .handle
                    .outbox
                    .try_send(GameOut::Frame(SidecarFrame { messages: frame }))
                {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        self.metrics.error("game_outbox_full");
                        tracing::warn!(conn = g.conn, "game outbox full: disconnecting the game");
                        g.handle.kill.cancel();
                        let conn = g.conn;
                        self.on_game_closed(conn, "outbox full: the game is not reading");
                        break;
                    }
                    Err(TrySendError::Closed(_)) => break,
                }
            }
        }
    }

    // ------------------------------------------------------------------ state

    pub(crate) fn publish_state(&self) {
        let game = self.game.as_ref().map(|g| {
            let v = g.hello.version.unwrap_or_default();
            json!({
                "conn": g.conn,
                "game": g.hello.game,
                "version": format!("{}.{}", v.major, v.minor),
                "tick_rate_hz": g.hello.tick_rate_hz,
                "health": g.health.as_ref().map(|h| json!({"ok": h.ok, "detail": h.detail})),
                "load": g.load.as_ref().map(|l| json!({"tick_ms": l.tick_ms, "budget_ms": l.budget_ms, "entity_count": l.entity_count})),
            })
        });
        let sessions: Vec<serde_json::Value> = self
            .sessions
            .iter()
            .map(|s| {
                json!({
                    "account": s.account,
                    "session_id": s.session_id,
                    "epoch": s.epoch,
                    "attached": s.epoch.is_some(),
                    "link": s.link,
                    "remote_addr": s.remote_addr,
                    "master_id": self.table.master_of(&s.account).map(|e| e.id),
                    "view_chunks": self.clients.view_len(s.key),
                    "rtt_ms_p50": s.rtt.map(|r| r.0),
                    "rtt_ms_min": s.rtt.map(|r| r.1),
                })
            })
            .collect();
        let links: Vec<serde_json::Value> = self
            .links
            .iter()
            .filter(|(_, l)| l.peer.is_none())
            .map(|(id, l)| {
                json!({"link": id, "proxy": l.hello.id, "geo": l.hello.geo, "remote": l.remote, "sessions": l.sessions.len()})
            })
            .collect();
        let peers: Vec<serde_json::Value> = self
            .peers
            .iter()
            .map(|(node, p)| {
                json!({"node": node, "addr": p.addr, "link": p.link, "up": p.link.is_some(), "dialling": p.dialer.is_some()})
            })
            .collect();
        let state = json!({
            "node_id": self.cfg.node_id,
            "geo": self.cfg.geo,
            "ready": self.admin.is_ready(),
            "game_connected": self.game.is_some(),
            "game": game,
            "last_tick": self.last_tick,
            "entities": self.table.len(),
            "sessions": sessions,
            "links": links,
            "peers": peers,
            "partition_epoch": self.partition.epoch(),
            "ghosts_render": self.table.ghost_count(),
            "reals": self.table.len() - self.table.ghost_count(),
            "ghosts_sim": self.sim.len(),
            "subscriptions": self.subs.len(),
            "subscribers": self.subscribers.len(),
            "handoffs_in_flight": self.handoff_out.in_flight(),
            "handoffs_in_doubt": self.handoff_out.in_doubt().map(|(id, to, epoch)| json!({"entity": id, "to": to, "epoch": epoch})).collect::<Vec<_>>(),
            "adopting": self.adopting.len(),
            "held_frames": self.fence.held(),
            "lease_live": self.lease_live,
            "draining": self.draining.is_some(),
        });
        *self.published.lock().expect("state lock poisoned") = state;
        *self.census.lock().expect("census lock poisoned") = self.reals();
    }

    fn shutdown(&mut self) {
        self.shutting_down = true;
        self.admin.set_ready(false);
        let keys: Vec<SessionKey> = self.sessions.iter().map(|s| s.key).collect();
        for key in keys {
            if let Some(s) = self.sessions.get(key) {
                let (link, session_id) = (s.link, s.session_id);
                self.queue_for_link(
                    link,
                    mesh_message::Body::Detach(mesh::Detach {
                        session_id,
                        kick_reason: cellmesh_proto::edge::KickReason::Shutdown as u32,
                        detail: "the node is shutting down".into(),
                    }),
                );
            }
            self.end_session(key, "shutdown");
        }
        self.flush();
        // Dropping the handles lets every connection write what is queued, then close.
        self.game = None;
        self.links.clear();
        self.metrics.game_connected.set(0);
        self.publish_state();
    }

    pub(crate) fn spawn_store<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(fut);
    }
}

fn position(v: local::Vec3) -> Position {
    Position::new(v.x, v.y, v.z)
}

fn components(entity: u64, wire: Vec<local::Component>) -> Result<Vec<(u32, Component)>, String> {
    wire.into_iter()
        .map(|c| {
            let audience = Audience::from_proto(c.audience.as_ref())
                .map_err(|e| format!("entity {entity}, component type {}: {e}", c.r#type))?;
            Ok((
                c.r#type,
                Component {
                    audience,
                    payload: c.payload,
                },
            ))
        })
        .collect()
}

pub(crate) fn error_kind(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::ErrorUnspecified => "unspecified",
        ErrorCode::MalformedFrame => "malformed_frame",
        ErrorCode::FrameTooLarge => "frame_too_large",
        ErrorCode::VersionMismatch => "version_mismatch",
        ErrorCode::UnexpectedMessage => "unexpected_message",
        ErrorCode::UnknownEntity => "unknown_entity",
        ErrorCode::DuplicateEntity => "duplicate_entity",
        ErrorCode::NotOwner => "not_owner",
        ErrorCode::InvalidValue => "invalid_value",
        ErrorCode::AlreadyConnected => "already_connected",
    }
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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
