//! Routing by account (docs/mesh.md#routing-by-account): what an owner sends the gateways of the accounts its
//! entities address, where avatars are, and what a gateway does with what it is routed.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::batch::{encode_delta, encode_event, encode_message};
use cellmesh_proto::edge::{AccountMessage, ComponentData, DeltaKind, EntityDelta, EventData};
use cellmesh_proto::local::{self, sidecar_message, AudienceKind};
use cellmesh_proto::mesh::{self, mesh_message, PieceKind};
use cellmesh_stores::SessionEntry;
use cellmesh_world::geometry::ChunkPos;
use cellmesh_world::partition::NodeId;

use super::context::Context;
use super::peers::Mesh;
use super::wire::*;
use super::StoreRequest;
use crate::model::entities::{EntityChange, EntityTable, TickChanges};
use crate::model::fold::{Clients, TickEvent, TickSend};
use crate::model::route::{self, Addressed, Target};

/// Nodes a player's join may be passed on through, following its avatar's handoffs.
pub(crate) const MAX_JOIN_HOPS: u32 = 8;

/// Pieces waiting for a directory lookup, at most; beyond, new ones are dropped (counted).
const MAX_PARKED: usize = 10_000;
/// An account the directory did not know is not looked up again for this long.
const NEGATIVE_TTL_MS: u64 = 1_000;

/// Accounts grouped by what they may see of one entity change: (types sent, types removed) ->
/// (audience kind, accounts).
type SameView = BTreeMap<(Vec<u32>, Vec<u32>), (AudienceKind, Vec<String>)>;

/// Where accounts' sessions are, as this node knows it, and what waits for an answer.
#[derive(Default)]
pub(crate) struct Routing {
    /// Route cache: account -> its gateway and session epoch.
    routes: HashMap<String, SessionEntry>,
    /// Sessions whose gateway announced it spawns a new avatar: account -> session epoch.
    new_avatars: HashMap<String, u64>,
    /// Players whose avatar this node's game simulates for another gateway.
    remote_players: HashMap<String, SessionEntry>,
    /// Owner side: the chunk last told to each remote player's gateway.
    anchor_sent: HashMap<String, ChunkPos>,
    /// Owner side: accounts whose session newly attached to another gateway since the tick began.
    newly_attached: BTreeSet<String>,
    parked: Vec<(String, Addressed)>,
    looking_up: HashSet<String>,
    /// Accounts the directory did not know, until (monotonic ms).
    unknown_until: HashMap<String, u64>,
}

impl Routing {
    // ------------------------------------------------------------------ what others read and tell

    /// The session of another gateway whose avatar this node's game simulates for `account`.
    pub(crate) fn remote_player(&self, account: &str) -> Option<SessionEntry> {
        self.remote_players.get(account).copied()
    }

    /// Every remote player: account, and the session at its gateway.
    pub(crate) fn remote_players(&self) -> impl Iterator<Item = (&String, &SessionEntry)> {
        self.remote_players.iter()
    }

    /// Where `account`'s session is, as the route cache has it.
    pub(crate) fn route(&self, account: &str) -> Option<SessionEntry> {
        self.routes.get(account).copied()
    }

    /// Whether the gateway of session `epoch` of `account` announced it spawns a new avatar
    /// for it: any older avatar of the account is the one that goes.
    pub(crate) fn spawns_new_avatar(&self, account: &str, epoch: u64) -> bool {
        self.new_avatars.get(account) == Some(&epoch)
    }

    pub(crate) fn is_remote_player(&self, account: &str) -> bool {
        self.remote_players.contains_key(account)
    }

    /// This node's game no longer simulates `account`'s avatar for another gateway: the session
    /// it did, if any.
    pub(crate) fn remove_remote_player(&mut self, account: &str) -> Option<SessionEntry> {
        self.anchor_sent.remove(account);
        self.remote_players.remove(account)
    }

    /// The avatar this node writes serves `account`'s session `entry` at another gateway; the
    /// gateway is anchored afresh.
    pub(crate) fn serve(&mut self, account: &str, entry: SessionEntry) {
        self.routes.insert(account.to_string(), entry);
        self.remote_players.insert(account.to_string(), entry);
        self.anchor_sent.remove(account);
    }

    /// A new game: every remote player's gateway is anchored afresh.
    pub(crate) fn forget_anchors(&mut self) {
        self.anchor_sent.clear();
    }

    /// Whether `account` should be looked up now (no lookup of it is under way).
    pub(crate) fn start_lookup(&mut self, account: &str) -> bool {
        self.looking_up.insert(account.to_string())
    }

    /// Whether a gateway announced a session of `account` newer than `epoch`.
    pub(crate) fn newer_route(&self, account: &str, epoch: u64) -> bool {
        self.routes
            .get(account)
            .is_some_and(|r| r.session_epoch > epoch)
    }

    /// Whether this node's game simulates `account`'s avatar for a session newer than `epoch`.
    pub(crate) fn serves_newer_remote(&self, account: &str, epoch: u64) -> bool {
        self.remote_players
            .get(account)
            .is_some_and(|r| r.session_epoch > epoch)
    }

    // ------------------------------------------------------------------ owner: routing

    /// Where `account`'s session is, as this node knows it.
    fn target(&self, cx: &Context, clients: &Clients, account: &str) -> Target {
        if clients.key_of(account).is_some() {
            return Target::Local;
        }
        match self.routes.get(account) {
            Some(r) if r.gateway_node != cx.config.node_id => Target::Remote {
                gateway: r.gateway_node,
                session_epoch: r.session_epoch,
            },
            _ => Target::Unknown,
        }
    }

    /// Routes this tick's non-public component changes and events of local entities, and the
    /// game's `Send`s, to the gateways of the accounts they name. `newly_held`: the local
    /// entities that went in full to nodes not holding them since the tick began. Returns the
    /// sends for the local fold, narrowed to accounts with a session here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn route_tick(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        clients: &Clients,
        mesh: &Mesh,
        newly_held: BTreeMap<u64, BTreeSet<NodeId>>,
        changes: &TickChanges,
        events: &[TickEvent],
        sends: Vec<TickSend>,
    ) -> Vec<TickSend> {
        let mut pieces = self.change_pieces(cx, table, clients, newly_held, changes);
        for ev in events {
            if ev.audience.is_public() || table.get_local(ev.entity_id).is_none() {
                continue;
            }
            let accounts: Vec<String> = ev
                .audience
                .named_accounts(&ev.owner_account)
                .filter(|a| clients.key_of(a).is_none())
                .map(str::to_string)
                .collect();
            if accounts.is_empty() {
                continue;
            }
            let encoded = encode_event(&EventData {
                entity_id: ev.entity_id,
                r#type: ev.r#type,
                payload: ev.payload.clone(),
            });
            pieces.push(Addressed {
                kind: PieceKind::PieceEvent,
                audience: route::kind_of(&ev.audience),
                encoded: encoded.0,
                accounts,
            });
        }
        let mut local_sends = Vec::with_capacity(sends.len());
        for send in sends {
            let (local, remote): (Vec<String>, Vec<String>) = send
                .accounts
                .into_iter()
                .partition(|a| clients.key_of(a).is_some());
            if !remote.is_empty() {
                let encoded = encode_message(&AccountMessage {
                    r#type: send.r#type,
                    payload: send.payload.clone(),
                });
                pieces.push(Addressed {
                    kind: PieceKind::PieceMessage,
                    audience: AudienceKind::Accounts,
                    encoded: encoded.0,
                    accounts: remote,
                });
            }
            if !local.is_empty() {
                local_sends.push(TickSend {
                    accounts: local,
                    r#type: send.r#type,
                    payload: send.payload,
                });
            }
        }
        if pieces.is_empty() {
            return local_sends;
        }
        let resolved = route::resolve(&pieces, |a| self.target(cx, clients, a));
        for (gateway, routed) in resolved.per_gateway {
            send_routed(cx, mesh, gateway, routed);
        }
        for (account, index) in resolved.unknown {
            self.park(cx, account, pieces[index].clone());
        }
        local_sends
    }

    /// The pieces of this tick's non-public component changes of local entities, for accounts
    /// with no session here.
    fn change_pieces(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        clients: &Clients,
        newly_held: BTreeMap<u64, BTreeSet<NodeId>>,
        changes: &TickChanges,
    ) -> Vec<Addressed> {
        let mut pieces: Vec<Addressed> = Vec::new();
        // A client that newly sees an entity (its gateway just got it in full, or its session
        // just attached there) is owed the entity's current non-public state, not only changes.
        let newly_attached = std::mem::take(&mut self.newly_attached);
        let whole = EntityChange {
            spawned: true,
            ..Default::default()
        };
        let mut ids: BTreeSet<u64> = changes.keys().chain(newly_held.keys()).copied().collect();
        if !newly_attached.is_empty() {
            ids.extend(table.iter().filter(|e| e.origin().is_none()).map(|e| e.id));
        }
        let no_change = EntityChange::default();
        for id in ids {
            let Some(e) = table.get_local(id) else {
                continue;
            };
            let mut views = route::account_views(e, changes.get(&id).unwrap_or(&no_change));
            let held_by = newly_held.get(&id);
            // The whole entity's views matter only to a client that newly sees it.
            let owed_whole = held_by.is_some() || !newly_attached.is_empty();
            let whole_views = if owed_whole {
                route::account_views(e, &whole)
            } else {
                Default::default()
            };
            for (account, view) in whole_views {
                let fresh = newly_attached.contains(&account)
                    || match self.target(cx, clients, &account) {
                        Target::Remote { gateway, .. } => {
                            held_by.is_some_and(|n| n.contains(&gateway))
                        }
                        _ => false,
                    };
                if fresh {
                    views.insert(account, view);
                }
            }
            // Accounts that see the same thing share one encoded delta.
            let mut groups: SameView = BTreeMap::new();
            for (account, (send, removed, kind)) in views {
                if clients.key_of(&account).is_some() {
                    continue;
                }
                groups
                    .entry((send, removed))
                    .or_insert((kind, Vec::new()))
                    .1
                    .push(account);
            }
            for ((send, removed), (kind, accounts)) in groups {
                let delta = EntityDelta {
                    entity_id: id,
                    kind: DeltaKind::Update as i32,
                    components: send
                        .iter()
                        .filter_map(|t| {
                            e.components.get(t).map(|c| ComponentData {
                                r#type: *t,
                                payload: c.payload.clone(),
                            })
                        })
                        .collect(),
                    removed_types: removed,
                    ..Default::default()
                };
                pieces.push(Addressed {
                    kind: PieceKind::PieceDelta,
                    audience: kind,
                    encoded: encode_delta(&delta).0,
                    accounts,
                });
            }
        }
        pieces
    }

    /// Holds a piece for an account with no known route, and looks the account up.
    fn park(&mut self, cx: &mut Context, account: String, piece: Addressed) {
        if self
            .unknown_until
            .get(&account)
            .is_some_and(|t| *t > cx.now.mono_ms)
            || self.parked.len() >= MAX_PARKED
        {
            cx.metrics.dropped_unknown_account.inc();
            cx.metrics.drop_msg("unknown_account", 1);
            return;
        }
        if self.looking_up.insert(account.clone()) {
            cx.store(StoreRequest::Lookup {
                account: account.clone(),
            });
        }
        self.parked.push((account, piece));
    }

    /// The directory's answer to a lookup of `account` is in: no lookup of it is under way.
    pub(crate) fn lookup_answered(&mut self, account: &str) {
        self.looking_up.remove(account);
    }

    /// The directory's answer to a lookup of `account`: what was parked for it goes to its
    /// gateway. Returns the pieces for this node's own session of it, if any.
    pub(crate) fn on_looked_up(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        account: &str,
        result: Result<Option<SessionEntry>, String>,
    ) -> Vec<Addressed> {
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|(a, _)| *a == account);
        self.parked = rest;
        let entry = match result {
            Ok(Some(entry)) => {
                let newer = self
                    .routes
                    .get(account)
                    .is_none_or(|r| r.session_epoch <= entry.session_epoch);
                if newer {
                    self.routes.insert(account.to_string(), entry);
                }
                Some(entry)
            }
            Ok(None) => {
                self.unknown_until
                    .insert(account.to_string(), cx.now.mono_ms + NEGATIVE_TTL_MS);
                None
            }
            Err(e) => {
                cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "looking up a session failed");
                None
            }
        };
        let mut here = Vec::new();
        for (_, piece) in mine {
            match entry {
                Some(r) if r.gateway_node != cx.config.node_id => {
                    let routed = mesh::Routed {
                        pieces: vec![route::piece(
                            &piece,
                            vec![mesh::Recipient {
                                account: account.to_string(),
                                session_epoch: r.session_epoch,
                            }],
                        )],
                    };
                    send_routed(cx, mesh, r.gateway_node, routed);
                }
                _ => here.push(piece),
            }
        }
        here
    }

    /// Tells remote gateways where their players' avatars are when they spawn or change chunk.
    pub(crate) fn send_anchors(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        mesh: &Mesh,
        changes: &TickChanges,
    ) {
        let mut due = Vec::new();
        for &id in changes.keys() {
            let Some(e) = table.get_local(id).filter(|e| e.is_master) else {
                continue;
            };
            let Some(r) = self.remote_players.get(&*e.owner_account) else {
                continue;
            };
            if self.anchor_sent.get(&*e.owner_account) != Some(&e.chunk) {
                due.push((e.owner_account.clone(), *r));
            }
        }
        for (account, r) in due {
            self.send_anchor(cx, table, mesh, r.gateway_node, &account, r.session_epoch);
        }
    }

    /// Tells `gateway` where `account`'s master is, if this node writes it, and remembers the
    /// chunk told. The anchor carries the master's epoch, so a late one from a previous owner
    /// loses against it.
    pub(crate) fn send_anchor(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        mesh: &Mesh,
        gateway: NodeId,
        account: &str,
        session_epoch: u64,
    ) {
        let Some(e) = table.master_of(account).filter(|e| e.origin().is_none()) else {
            return;
        };
        let anchor = mesh_message::Body::Anchor(mesh::Anchor {
            account: account.to_string(),
            session_epoch,
            entity_id: e.id,
            position: Some(vec3(e.position)),
            entity_epoch: e.epoch,
        });
        if mesh.send(cx, gateway, anchor) {
            self.anchor_sent.insert(account.to_string(), e.chunk);
        }
    }

    /// The link to `node` is back: the remote players whose gateway it is, to anchor again
    /// (those sent while the link was down were lost).
    pub(crate) fn peer_up(&mut self, node: NodeId) -> Vec<(String, u64)> {
        let remote_players = &self.remote_players;
        self.anchor_sent.retain(|account, _| {
            remote_players
                .get(account)
                .is_none_or(|r| r.gateway_node != node)
        });
        let mut players: Vec<(String, u64)> = self
            .remote_players
            .iter()
            .filter(|(_, r)| r.gateway_node == node)
            .map(|(account, r)| (account.clone(), r.session_epoch))
            .collect();
        players.sort();
        players
    }

    // ------------------------------------------------------------------ owner: remote players

    /// A gateway's `PlayerJoin` (from `from`): the game here joins the avatar to the session,
    /// or the join follows the avatar to `departed`, the node it was handed on to.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_peer_player_join(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        mesh: &Mesh,
        game_connected: bool,
        departed: Option<NodeId>,
        from: NodeId,
        mut j: mesh::PeerPlayerJoin,
    ) {
        let gateway = match j.gateway_node {
            0 => from,
            g => g,
        };
        // The avatar was handed on before the gateway heard: the join follows it, node by
        // node (each knows where it handed it), or the game here would spawn the account a
        // second avatar.
        let me = cx.config.node_id;
        let elsewhere = table
            .master_of(&j.account)
            .and_then(|e| e.origin())
            .or(departed)
            .filter(|owner| *owner != me);
        if let Some(owner) = elsewhere {
            if j.hops >= MAX_JOIN_HOPS {
                // Passed around more than handoffs explain: dropped rather than spawned twice
                // (the gateway's wait for the avatar's owner to anchor the session decides).
                return cx.metrics.drop_msg("join_forward_loop", 1);
            }
            j.gateway_node = gateway;
            j.hops += 1;
            mesh.send(cx, owner, mesh_message::Body::PlayerJoin(j));
            return;
        }
        let entry = SessionEntry {
            gateway_node: gateway,
            session_epoch: j.session_epoch,
        };
        if self
            .remote_players
            .get(&j.account)
            .is_some_and(|r| r.session_epoch > j.session_epoch)
        {
            return cx.metrics.drop_msg("stale_session", 1);
        }
        self.remote_players.insert(j.account.clone(), entry);
        self.routes.insert(j.account.clone(), entry);
        self.anchor_sent.remove(&j.account);
        let join = local::PlayerJoin {
            account: j.account.clone(),
            session_epoch: j.session_epoch,
            last_position: j.last_position.map(|v| local::Vec3 {
                x: v.x,
                y: v.y,
                z: v.z,
            }),
        };
        if game_connected {
            cx.out
                .to_game
                .push(sidecar_message::Body::PlayerJoin(join).into());
        }
        // An avatar that already exists (a new login) anchors the new session at once.
        self.send_anchor(cx, table, mesh, gateway, &j.account, j.session_epoch);
    }

    /// A gateway's `PlayerLeave`: stale, or sent on to where the avatar went (`departed`, the
    /// node it was handed on to, when the table does not say). Returns the leave when the
    /// avatar written here leaves (now, or once a newer session had its chance).
    pub(crate) fn on_peer_player_leave(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        mesh: &Mesh,
        departed: Option<NodeId>,
        l: mesh::PeerPlayerLeave,
    ) -> Option<mesh::PeerPlayerLeave> {
        if let Some(r) = self.remote_players.get(&l.account) {
            if r.session_epoch > l.session_epoch {
                cx.metrics.drop_msg("stale_session", 1);
                return None;
            }
        } else {
            // The avatar was handed on before the gateway heard: the leave follows it.
            let owner = table
                .master_of(&l.account)
                .and_then(|e| e.origin())
                .or(departed);
            if let Some(owner) = owner {
                self.send_leave_on(cx, mesh, owner, l);
                return None;
            }
            table.master_of(&l.account)?;
            // Written here with no session known: adopted under a session that a newer login
            // had displaced (the adopt leaves the route to the newer one); this is that
            // session's leave, sent on by the source once acked. The game drops a leave older
            // than its avatar's session.
        }
        self.remote_players.remove(&l.account);
        self.anchor_sent.remove(&l.account);
        Some(l)
    }

    /// Sends the leave of a session on to `owner`, the node the avatar went to, unless a newer
    /// session wants the avatar: that gateway's join or announcement reaches the owner, and an
    /// old leave must not overtake it.
    pub(crate) fn send_leave_on(
        &self,
        cx: &mut Context,
        mesh: &Mesh,
        owner: NodeId,
        l: mesh::PeerPlayerLeave,
    ) {
        if self.newer_route(&l.account, l.session_epoch) {
            return cx.metrics.drop_msg("stale_session", 1);
        }
        mesh.send(cx, owner, mesh_message::Body::PlayerLeave(l));
    }

    /// Another gateway holds `account` now: routes follow it.
    pub(crate) fn on_session_moved(
        &mut self,
        cx: &Context,
        game_connected: bool,
        m: &mesh::SessionMoved,
    ) {
        let entry = SessionEntry {
            gateway_node: m.gateway_node,
            session_epoch: m.session_epoch,
        };
        match self.new_avatars.get(&m.account) {
            Some(&n) if n >= m.session_epoch => {}
            _ if m.new_avatar => {
                self.new_avatars.insert(m.account.clone(), m.session_epoch);
            }
            // A newer session that keeps the avatar it finds.
            Some(_) => {
                self.new_avatars.remove(&m.account);
            }
            None => {}
        }
        match self.routes.get(&m.account) {
            Some(r) if r.session_epoch > m.session_epoch => {}
            Some(r) if *r == entry => {}
            _ => {
                self.routes.insert(m.account.clone(), entry);
                if m.gateway_node != cx.config.node_id && game_connected {
                    self.newly_attached.insert(m.account.clone());
                }
            }
        }
    }

    /// A remote gateway's session ended: its route goes. Returns whether the avatar this node
    /// simulates for it, if any, is let go.
    pub(crate) fn on_session_ended(&mut self, e: &mesh::SessionEnded) -> bool {
        if self
            .routes
            .get(&e.account)
            .is_some_and(|r| r.session_epoch == e.session_epoch)
        {
            self.routes.remove(&e.account);
        }
        if self
            .new_avatars
            .get(&e.account)
            .is_some_and(|&n| n <= e.session_epoch)
        {
            self.new_avatars.remove(&e.account);
        }
        self.remote_players
            .get(&e.account)
            .is_some_and(|r| r.session_epoch <= e.session_epoch)
    }
}

/// Queues `routed` for `gateway`, counted by audience when a link to it is up.
fn send_routed(cx: &mut Context, mesh: &Mesh, gateway: NodeId, routed: mesh::Routed) {
    let kinds: BTreeSet<u32> = routed.pieces.iter().map(|p| p.audience).collect();
    if mesh.send(cx, gateway, mesh_message::Body::Routed(routed)) {
        cx.metrics.routed_messages.inc();
        for k in kinds {
            cx.metrics
                .routed
                .get_or_create(&crate::metrics::AudienceLabel {
                    audience: audience_label(k),
                })
                .inc();
        }
    }
}
