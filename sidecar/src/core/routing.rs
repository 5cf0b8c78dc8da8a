//! Routing by account (docs/mesh.md#routing-by-account): what an owner sends the gateways of the accounts its
//! entities address, where avatars are, and what a gateway does with what it is routed.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::batch::{encode_delta, encode_event, encode_message, Encoded};
use cellmesh_proto::edge::{AccountMessage, ComponentData, DeltaKind, EntityDelta, EventData};
use cellmesh_proto::local::{self, sidecar_message, AudienceKind};
use cellmesh_proto::mesh::{self, mesh_message, PieceKind};
use cellmesh_stores::SessionEntry;
use cellmesh_world::geometry::{ChunkPos, Pos};
use cellmesh_world::partition::NodeId;

use super::gateway::Session;
use super::wire::*;
use super::*;
use crate::model::entities::{EntityChange, EntityUpdate, TickChanges};
use crate::model::fold::{TickEvent, TickSend};
use crate::model::route::{self, Addressed, Target};

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
    pub routes: HashMap<String, SessionEntry>,
    /// Players whose avatar this node's game simulates for another gateway.
    pub remote_players: HashMap<String, SessionEntry>,
    /// Owner side: the chunk last told to each remote player's gateway.
    pub anchor_sent: HashMap<String, ChunkPos>,
    /// Owner side: accounts whose session newly attached to another gateway since the tick began.
    pub newly_attached: BTreeSet<String>,
    pub parked: Vec<(String, Addressed)>,
    pub looking_up: HashSet<String>,
    /// Accounts the directory did not know, until (monotonic ms).
    pub unknown_until: HashMap<String, u64>,
}

impl Core {
    // ------------------------------------------------------------------ owner: routing

    /// Where `account`'s session is, as this node knows it.
    pub(crate) fn target(&self, account: &str) -> Target {
        if self.gateway.clients.key_of(account).is_some() {
            return Target::Local;
        }
        match self.routing.routes.get(account) {
            Some(r) if r.gateway_node != self.cx.config.node_id => Target::Remote {
                gateway: r.gateway_node,
                session_epoch: r.session_epoch,
            },
            _ => Target::Unknown,
        }
    }

    /// Routes this tick's non-public component changes and events of local entities, and the
    /// game's `Send`s, to the gateways of the accounts they name. Returns the sends for the local
    /// fold, narrowed to accounts with a session here.
    pub(crate) fn route_tick(
        &mut self,
        changes: &TickChanges,
        events: &[TickEvent],
        sends: Vec<TickSend>,
    ) -> Vec<TickSend> {
        let mut pieces: Vec<Addressed> = Vec::new();
        // A client that newly sees an entity (its gateway just got it in full, or its session
        // just attached there) is owed the entity's current non-public state, not only changes.
        let newly_held = self.replication.take_newly_held();
        let newly_attached = std::mem::take(&mut self.routing.newly_attached);
        let whole = EntityChange {
            spawned: true,
            ..Default::default()
        };
        let mut ids: BTreeSet<u64> = changes.keys().chain(newly_held.keys()).copied().collect();
        if !newly_attached.is_empty() {
            ids.extend(
                self.table
                    .iter()
                    .filter(|e| e.origin.is_none())
                    .map(|e| e.id),
            );
        }
        let no_change = EntityChange::default();
        for id in ids {
            let Some(e) = self.table.get_local(id) else {
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
                    || match self.target(&account) {
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
                if self.gateway.clients.key_of(&account).is_some() {
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
        for ev in events {
            if ev.audience.is_public() || self.table.get_local(ev.entity_id).is_none() {
                continue;
            }
            let accounts: Vec<String> = ev
                .audience
                .named_accounts(&ev.owner_account)
                .filter(|a| self.gateway.clients.key_of(a).is_none())
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
                .partition(|a| self.gateway.clients.key_of(a).is_some());
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
        let resolved = route::resolve(&pieces, |a| self.target(a));
        for (gateway, routed) in resolved.per_gateway {
            self.send_routed(gateway, routed);
        }
        for (account, index) in resolved.unknown {
            self.park(account, pieces[index].clone());
        }
        local_sends
    }

    pub(crate) fn send_routed(&mut self, gateway: NodeId, routed: mesh::Routed) {
        let kinds: BTreeSet<u32> = routed.pieces.iter().map(|p| p.audience).collect();
        if self.send_peer(gateway, mesh_message::Body::Routed(routed)) {
            self.cx.metrics.routed_messages.inc();
            for k in kinds {
                self.cx
                    .metrics
                    .routed
                    .get_or_create(&crate::metrics::AudienceLabel {
                        audience: audience_label(k),
                    })
                    .inc();
            }
        }
    }

    /// Holds a piece for an account with no known route, and looks the account up.
    pub(crate) fn park(&mut self, account: String, piece: Addressed) {
        if self
            .routing
            .unknown_until
            .get(&account)
            .is_some_and(|t| *t > self.cx.now.mono_ms)
            || self.routing.parked.len() >= MAX_PARKED
        {
            self.cx.metrics.dropped_unknown_account.inc();
            self.cx.metrics.drop_msg("unknown_account", 1);
            return;
        }
        if self.routing.looking_up.insert(account.clone()) {
            self.cx.store(StoreRequest::Lookup {
                account: account.clone(),
            });
        }
        self.routing.parked.push((account, piece));
    }

    pub(crate) fn on_looked_up(
        &mut self,
        account: String,
        result: Result<Option<SessionEntry>, String>,
    ) {
        self.routing.looking_up.remove(&account);
        if let Ok(entry) = &result {
            self.on_orphan_looked_up(&account, *entry);
        }
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.routing.parked)
            .into_iter()
            .partition(|(a, _)| *a == account);
        self.routing.parked = rest;
        let entry = match result {
            Ok(Some(entry)) => {
                let newer = self
                    .routing
                    .routes
                    .get(&account)
                    .is_none_or(|r| r.session_epoch <= entry.session_epoch);
                if newer {
                    self.routing.routes.insert(account.clone(), entry);
                }
                Some(entry)
            }
            Ok(None) => {
                self.routing
                    .unknown_until
                    .insert(account.clone(), self.cx.now.mono_ms + NEGATIVE_TTL_MS);
                None
            }
            Err(e) => {
                self.cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "looking up a session failed");
                None
            }
        };
        for (_, piece) in mine {
            match entry {
                Some(r) if r.gateway_node != self.cx.config.node_id => {
                    let routed = mesh::Routed {
                        pieces: vec![route::piece(
                            &piece,
                            vec![mesh::Recipient {
                                account: account.clone(),
                                session_epoch: r.session_epoch,
                            }],
                        )],
                    };
                    self.send_routed(r.gateway_node, routed);
                }
                _ => match self.gateway.clients.key_of(&account) {
                    Some(key) => self.gateway.clients.inject(
                        key,
                        part_of(piece.kind as i32),
                        Encoded(piece.encoded),
                    ),
                    None => {
                        self.cx.metrics.dropped_unknown_account.inc();
                        self.cx.metrics.drop_msg("unknown_account", 1);
                    }
                },
            }
        }
    }

    /// Tells remote gateways where their players' avatars are when they spawn or change chunk.
    pub(crate) fn send_anchors(&mut self, changes: &TickChanges) {
        let mut due = Vec::new();
        for &id in changes.keys() {
            let Some(e) = self.table.get_local(id).filter(|e| e.is_master) else {
                continue;
            };
            let Some(r) = self.routing.remote_players.get(&e.owner_account) else {
                continue;
            };
            if self.routing.anchor_sent.get(&e.owner_account) != Some(&e.chunk) {
                due.push((e.owner_account.clone(), *r));
            }
        }
        for (account, r) in due {
            self.send_anchor(r.gateway_node, &account, r.session_epoch);
        }
    }

    /// Tells `gateway` where `account`'s master is, if this node writes it, and remembers the
    /// chunk told. The anchor carries the master's epoch, so a late one from a previous owner
    /// loses against it.
    pub(crate) fn send_anchor(&mut self, gateway: NodeId, account: &str, session_epoch: u64) {
        let Some(e) = self.table.master_of(account).filter(|e| e.origin.is_none()) else {
            return;
        };
        let (id, pos, chunk, epoch) = (e.id, e.position, e.chunk, e.epoch);
        let anchor = mesh_message::Body::Anchor(mesh::Anchor {
            account: account.to_string(),
            session_epoch,
            entity_id: id,
            position: Some(vec3(pos)),
            entity_epoch: epoch,
        });
        if self.send_peer(gateway, anchor) {
            self.routing.anchor_sent.insert(account.to_string(), chunk);
        }
    }

    // ------------------------------------------------------------------ owner: remote players

    pub(crate) fn on_peer_player_join(&mut self, from: NodeId, mut j: mesh::PeerPlayerJoin) {
        let gateway = match j.gateway_node {
            0 => from,
            g => g,
        };
        // The avatar was handed on before the gateway heard: the join follows it, or the game
        // here would spawn the account a second avatar.
        let me = self.cx.config.node_id;
        let elsewhere = self
            .table
            .master_of(&j.account)
            .and_then(|e| e.origin)
            .or_else(|| self.departed_owner(&j.account))
            .filter(|owner| *owner != me && j.gateway_node == 0);
        if let Some(owner) = elsewhere {
            j.gateway_node = gateway;
            self.send_peer(owner, mesh_message::Body::PlayerJoin(j));
            return;
        }
        let entry = SessionEntry {
            gateway_node: gateway,
            session_epoch: j.session_epoch,
        };
        if self
            .routing
            .remote_players
            .get(&j.account)
            .is_some_and(|r| r.session_epoch > j.session_epoch)
        {
            return self.cx.metrics.drop_msg("stale_session", 1);
        }
        self.routing.remote_players.insert(j.account.clone(), entry);
        self.routing.routes.insert(j.account.clone(), entry);
        self.routing.anchor_sent.remove(&j.account);
        let join = local::PlayerJoin {
            account: j.account.clone(),
            session_epoch: j.session_epoch,
            last_position: j.last_position.map(|v| local::Vec3 {
                x: v.x,
                y: v.y,
                z: v.z,
            }),
        };
        if self.game.slot.is_some() {
            self.cx
                .out
                .to_game
                .push(sidecar_message::Body::PlayerJoin(join).into());
        }
        // An avatar that already exists (a new login) anchors the new session at once.
        self.send_anchor(gateway, &j.account, j.session_epoch);
    }

    pub(crate) fn on_peer_player_leave(&mut self, l: mesh::PeerPlayerLeave) {
        if let Some(r) = self.routing.remote_players.get(&l.account) {
            if r.session_epoch > l.session_epoch {
                return self.cx.metrics.drop_msg("stale_session", 1);
            }
        } else {
            // The avatar was handed on before the gateway heard: the leave follows it.
            let owner = self
                .table
                .master_of(&l.account)
                .and_then(|e| e.origin)
                .or_else(|| self.departed_owner(&l.account));
            if let Some(owner) = owner {
                return self.send_leave_on(owner, l);
            }
            if self.table.master_of(&l.account).is_none() {
                return;
            }
            // Written here with no session known: adopted under a session that a newer login
            // had displaced (the adopt leaves the route to the newer one); this is that
            // session's leave, sent on by the source once acked. The game drops a leave older
            // than its avatar's session.
        }
        self.routing.remote_players.remove(&l.account);
        self.routing.anchor_sent.remove(&l.account);
        if Self::leave_waits(&l.reason) {
            return self.defer_leave(&l.account, l.session_epoch, &l.reason);
        }
        self.leave_game(&l.account, l.session_epoch, &l.reason);
    }

    /// Whether the local session of `account` was given a new avatar that this node writes, and
    /// `entity` is another one.
    fn avatar_spawned_here_for(&self, account: &str, entity: u64) -> bool {
        self.local_session(account).is_some_and(|s| s.new_avatar)
            && self
                .table
                .master_of(account)
                .is_some_and(|e| e.origin.is_none() && e.id != entity)
    }

    /// Sends the leave of a session on to `owner`, the node the avatar went to, unless a newer
    /// session wants the avatar: that gateway's join or announcement reaches the owner, and an
    /// old leave must not overtake it.
    pub(crate) fn send_leave_on(&mut self, owner: NodeId, l: mesh::PeerPlayerLeave) {
        if self.newer_route(&l.account, l.session_epoch) {
            return self.cx.metrics.drop_msg("stale_session", 1);
        }
        self.send_peer(owner, mesh_message::Body::PlayerLeave(l));
    }

    /// Whether this node serves a session of `account` newer than `epoch` with the avatar it
    /// writes, or has one attached here.
    pub(crate) fn serves_newer_session(&self, account: &str, epoch: u64) -> bool {
        self.routing
            .remote_players
            .get(account)
            .is_some_and(|r| r.session_epoch > epoch)
            || self.session_epoch(account).is_some_and(|(_, e)| e > epoch)
    }

    /// Whether a gateway announced a session of `account` newer than `epoch`.
    pub(crate) fn newer_route(&self, account: &str, epoch: u64) -> bool {
        self.routing
            .routes
            .get(account)
            .is_some_and(|r| r.session_epoch > epoch)
    }

    // ------------------------------------------------------------------ gateway side

    /// `account`'s session attached here.
    pub(crate) fn local_session(&self, account: &str) -> Option<&Session> {
        self.gateway
            .sessions
            .get(self.gateway.clients.key_of(account)?)
    }

    /// The epoch of `account`'s session here, if it is attached.
    pub(crate) fn session_epoch(&self, account: &str) -> Option<(u64, u64)> {
        let s = self.local_session(account)?;
        Some((s.key, s.epoch?))
    }

    pub(crate) fn on_anchor(&mut self, node: NodeId, a: mesh::Anchor) {
        match self.session_epoch(&a.account) {
            Some((_, epoch)) if epoch == a.session_epoch => {}
            _ => return self.cx.metrics.drop_msg("stale_session", 1),
        }
        if self
            .gateway
            .master_epoch
            .get(&a.account)
            .is_some_and(|e| *e > a.entity_epoch)
        {
            // A late word from a previous owner of the master.
            return self.cx.metrics.drop_msg("stale_anchor", 1);
        }
        let Some(p) = a.position.as_ref().map(position) else {
            return;
        };
        if node == self.cx.config.node_id {
            return;
        }
        if self.avatar_spawned_here_for(&a.account, a.entity_id) {
            // This gateway gave the session a new avatar, here, after waiting in vain for the
            // one `node` simulates (a cut kept them apart): of two avatars the older goes.
            tracing::info!(account = %a.account, peer = node, entity = a.entity_id, "an older avatar anchored a session that has a new one: it leaves");
            self.cx.metrics.drop_msg("older_avatar", 1);
            self.send_peer(
                node,
                mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
                    account: a.account.clone(),
                    session_epoch: a.session_epoch,
                    reason: "new_avatar_elsewhere".into(),
                }),
            );
            return;
        }
        self.gateway
            .master_epoch
            .insert(a.account.clone(), a.entity_epoch);
        self.avatars.stop_waiting(&a.account);
        let chunk = self.cx.config.world.chunk_of(Pos { x: p.x, y: p.y });
        self.gateway
            .clients
            .set_remote_anchor(&a.account, Some(chunk));
        self.gateway.master_owner.insert(a.account.clone(), node);
        // The view follows the anchor: a render ghost of the master left behind (stale through
        // an outage, or not refreshed yet by its new owner) moves with it, so the client never
        // sees its own avatar leave its view.
        let behind = self
            .table
            .get(a.entity_id)
            .filter(|e| e.origin.is_some() && e.epoch <= a.entity_epoch && e.position != p)
            .is_some();
        if behind {
            let _ = self.table.update(EntityUpdate {
                id: a.entity_id,
                position: Some(p),
                ..Default::default()
            });
        }
        self.gateway.anchor_pos.insert(a.account, [p.x, p.y, p.z]);
    }

    pub(crate) fn on_routed(&mut self, r: mesh::Routed) {
        for piece in r.pieces {
            let part = part_of(piece.kind);
            for to in &piece.recipients {
                match self.session_epoch(&to.account) {
                    Some((key, epoch)) if epoch == to.session_epoch => {
                        self.gateway
                            .clients
                            .inject(key, part, Encoded(piece.encoded.clone()));
                    }
                    // A late message for an older session, or for a session that left.
                    _ => self.cx.metrics.drop_msg("stale_session", 1),
                }
            }
        }
    }

    /// Another gateway holds `account` now: routes follow it, and an older session here is
    /// displaced (its avatar is released where it is simulated).
    pub(crate) fn on_session_moved(&mut self, m: mesh::SessionMoved) {
        let entry = SessionEntry {
            gateway_node: m.gateway_node,
            session_epoch: m.session_epoch,
        };
        match self.routing.routes.get(&m.account) {
            Some(r) if r.session_epoch > m.session_epoch => {}
            Some(r) if *r == entry => {}
            _ => {
                self.routing.routes.insert(m.account.clone(), entry);
                if m.gateway_node != self.cx.config.node_id && self.game.slot.is_some() {
                    self.routing.newly_attached.insert(m.account.clone());
                }
            }
        }
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
}
