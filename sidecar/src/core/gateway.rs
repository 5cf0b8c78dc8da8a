//! Gateway sessions (docs/mesh.md#sessions-the-gateway-role): the client sessions proxies attach to this node over mesh links.
//!
//! Attach registers the account in the session directory (a new, higher session epoch), displaces
//! an older session of the same account, loads the player record and tells the game
//! `PlayerJoin`. Detach tells the game `PlayerLeave`, saves the player record and releases the
//! directory entry. The directory and record calls run off the node task; their results come
//! back as events, checked against what happened meanwhile.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;

use cellmesh_proto::batch::Encoded;
use cellmesh_proto::edge::KickReason;
use cellmesh_proto::mesh::{self, mesh_message, MeshMessage};
use cellmesh_stores::PlayerRecord;
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::NodeId;

use super::avatars::AvatarAt;
use super::*;
use crate::config::SidecarConfig;
use crate::model::entities::{EntityUpdate, TickChanges};
use crate::model::fold::Clients;
use crate::model::interest::InterestShape;

/// A node-local handle of a session (proxies number their sessions per link).
pub type SessionKey = u64;

pub(crate) struct Session {
    pub key: SessionKey,
    pub link: LinkId,
    pub session_id: u64,
    pub account: String,
    pub remote_addr: String,
    /// Set once the directory registered the session; `None` while attaching.
    pub epoch: Option<u64>,
    /// Where the player's avatar was last seen (record, or the last game), for `PlayerJoin`.
    pub last_position: Option<[f64; 3]>,
    pub home_geo: Option<String>,
    /// Proxy-measured (p50, min) round-trip time in milliseconds.
    pub rtt: Option<(f32, f32)>,
    /// When the proxy handed the session over to another geo (wall-clock ms).
    pub handed_over_at: Option<u64>,
    /// The session was handed over to this geo from another.
    pub handed_over_in: bool,
    /// This gateway gave the session a new avatar (it found none, or waited for one in vain):
    /// an older avatar that anchors the session later (a cut kept its node from the news) is
    /// told to go.
    pub new_avatar: bool,
}

/// The gateway side of the node: the client sessions proxies attached here, their views, and
/// where each one's avatar is simulated.
pub(crate) struct Gateway {
    pub sessions: Sessions,
    pub clients: Clients,
    /// The node simulating each local session's avatar.
    pub master_owner: HashMap<String, NodeId>,
    /// The epoch of each local session's master, from its owner's anchors.
    pub master_epoch: HashMap<String, u64>,
    /// The last known position of avatars simulated elsewhere.
    pub anchor_pos: HashMap<String, [f64; 3]>,
    /// When the attached players' records are saved next (monotonic ms).
    pub next_records_ms: u64,
    /// Render ghosts' changes already sent to clients this tick: the tick's other consumers
    /// still get them, merged with the rest, at its end.
    pub ghost_changes_sent: TickChanges,
    /// Peer frames changed render ghosts since they were last folded for clients.
    pub ghosts_due: bool,
    /// What each session's proxy was last told of where its avatar is simulated: geo, region,
    /// and when (monotonic ms).
    pub where_sent: HashMap<SessionKey, (String, u64, u64)>,
    /// The geo of every peer node seen, from its link's hello (kept when the link drops).
    pub node_geo: HashMap<NodeId, String>,
    /// A batch of session renewals is with the store.
    pub renewing: bool,
    /// Sessions whose lost directory entry is being registered again.
    pub reregistering: BTreeSet<SessionKey>,
    /// The keys an `Attach`'s attestation must be signed under.
    pub attest: cellmesh_proto::keys::KeyRing,
}

/// A session's proxy hears where its avatar is simulated at least this often, and at once when
/// it crosses into another region.
pub(crate) const WHERE_EVERY_MS: u64 = 5_000;

impl Gateway {
    pub fn new(cfg: &SidecarConfig) -> Self {
        let shape = InterestShape::new(cfg.view_radius_chunks, cfg.release_margin_chunks);
        Self {
            sessions: Sessions::default(),
            clients: Clients::new(cfg.world, shape),
            master_owner: HashMap::default(),
            master_epoch: HashMap::default(),
            anchor_pos: HashMap::default(),
            next_records_ms: cfg.player_record_every_ms,
            ghost_changes_sent: TickChanges::new(),
            ghosts_due: false,
            where_sent: HashMap::default(),
            node_geo: HashMap::default(),
            renewing: false,
            reregistering: BTreeSet::new(),
            attest: cfg
                .attest_ring()
                .expect("attest_keys are checked by SidecarConfig::validate"),
        }
    }

    /// `account`'s session attached here.
    pub(crate) fn local_session(&self, account: &str) -> Option<&Session> {
        self.sessions.get(self.clients.key_of(account)?)
    }

    /// The key and epoch of `account`'s session here, if it is attached.
    pub(crate) fn session_epoch(&self, account: &str) -> Option<(SessionKey, u64)> {
        let s = self.local_session(account)?;
        Some((s.key, s.epoch?))
    }

    /// Whether the local session of `account` was given a new avatar that this node writes, and
    /// `entity` is another one.
    fn avatar_spawned_here_for(&self, table: &EntityTable, account: &str, entity: u64) -> bool {
        self.local_session(account).is_some_and(|s| s.new_avatar)
            && table
                .master_of(account)
                .is_some_and(|e| e.origin.is_none() && e.id != entity)
    }

    /// An owner's word of where `a.account`'s avatar is: the session's view follows it. Returns
    /// whether the avatar anchored the session (it no longer waits for one).
    pub(crate) fn on_anchor(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        mesh: &Mesh,
        node: NodeId,
        a: mesh::Anchor,
    ) -> bool {
        match self.session_epoch(&a.account) {
            Some((_, epoch)) if epoch == a.session_epoch => {}
            _ => {
                cx.metrics.drop_msg("stale_session", 1);
                return false;
            }
        }
        if self
            .master_epoch
            .get(&a.account)
            .is_some_and(|e| *e > a.entity_epoch)
        {
            // A late word from a previous owner of the master.
            cx.metrics.drop_msg("stale_anchor", 1);
            return false;
        }
        let Some(p) = a.position.as_ref().map(wire::position) else {
            return false;
        };
        if node == cx.config.node_id {
            return false;
        }
        if self.avatar_spawned_here_for(table, &a.account, a.entity_id) {
            // This gateway gave the session a new avatar, here, after waiting in vain for the
            // one `node` simulates (a cut kept them apart): of two avatars the older goes.
            tracing::info!(account = %a.account, peer = node, entity = a.entity_id, "an older avatar anchored a session that has a new one: it leaves");
            cx.metrics.drop_msg("older_avatar", 1);
            mesh.send(
                cx,
                node,
                mesh_message::Body::PlayerLeave(mesh::PeerPlayerLeave {
                    account: a.account.clone(),
                    session_epoch: a.session_epoch,
                    reason: "new_avatar_elsewhere".into(),
                }),
            );
            return false;
        }
        self.master_epoch.insert(a.account.clone(), a.entity_epoch);
        let chunk = cx.config.world.chunk_of(Pos { x: p.x, y: p.y });
        self.clients.set_remote_anchor(&a.account, Some(chunk));
        self.master_owner.insert(a.account.clone(), node);
        // The view follows the anchor: a render ghost of the master left behind (stale through
        // an outage, or not refreshed yet by its new owner) moves with it, so the client never
        // sees its own avatar leave its view.
        let behind = table
            .get(a.entity_id)
            .filter(|e| e.origin.is_some() && e.epoch <= a.entity_epoch && e.position != p)
            .is_some();
        if behind {
            let _ = table.update(EntityUpdate {
                id: a.entity_id,
                position: Some(p),
                ..Default::default()
            });
        }
        self.anchor_pos.insert(a.account, [p.x, p.y, p.z]);
        true
    }

    /// Pieces an owner routed to this gateway's sessions.
    pub(crate) fn on_routed(&mut self, cx: &Context, r: mesh::Routed) {
        for piece in r.pieces {
            let part = wire::part_of(piece.kind);
            for to in &piece.recipients {
                match self.session_epoch(&to.account) {
                    Some((key, epoch)) if epoch == to.session_epoch => {
                        self.clients
                            .inject(key, part, Encoded(piece.encoded.clone()));
                    }
                    // A late message for an older session, or for a session that left.
                    _ => cx.metrics.drop_msg("stale_session", 1),
                }
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct Sessions {
    next_key: SessionKey,
    all: BTreeMap<SessionKey, Session>,
    by_link: HashMap<(LinkId, u64), SessionKey>,
    /// The attached session of each account.
    by_account: HashMap<String, SessionKey>,
}

impl Sessions {
    pub(crate) fn begin(
        &mut self,
        link: LinkId,
        session_id: u64,
        account: String,
        remote_addr: String,
    ) -> SessionKey {
        self.next_key += 1;
        let key = self.next_key;
        self.by_link.insert((link, session_id), key);
        self.all.insert(
            key,
            Session {
                key,
                link,
                session_id,
                account,
                remote_addr,
                epoch: None,
                last_position: None,
                home_geo: None,
                rtt: None,
                handed_over_at: None,
                handed_over_in: false,
                new_avatar: false,
            },
        );
        key
    }

    pub fn get(&self, key: SessionKey) -> Option<&Session> {
        self.all.get(&key)
    }

    pub(crate) fn get_mut(&mut self, key: SessionKey) -> Option<&mut Session> {
        self.all.get_mut(&key)
    }

    pub(crate) fn find(&self, link: LinkId, session_id: u64) -> Option<SessionKey> {
        self.by_link.get(&(link, session_id)).copied()
    }

    pub(crate) fn remove(&mut self, key: SessionKey) -> Option<Session> {
        let s = self.all.remove(&key)?;
        self.by_link.remove(&(s.link, s.session_id));
        if self.by_account.get(&s.account) == Some(&key) {
            self.by_account.remove(&s.account);
        }
        Some(s)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Session> {
        self.all.values()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Session> {
        self.all.values_mut()
    }

    pub fn attached(&self) -> usize {
        self.by_account.len()
    }

    /// Sessions attached or attaching.
    pub fn len(&self) -> usize {
        self.all.len()
    }
}

fn kick_name(reason: u32) -> String {
    KickReason::try_from(reason as i32)
        .map(|k| k.as_str_name().to_ascii_lowercase())
        .unwrap_or_else(|_| format!("kick reason {reason}"))
}

fn detach(session_id: u64, reason: KickReason, detail: impl Into<String>) -> mesh_message::Body {
    mesh_message::Body::Detach(mesh::Detach {
        session_id,
        kick_reason: reason as u32,
        detail: detail.into(),
        retry_after_ms: 0,
    })
}

impl Core {
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
            Some(B::Detach(d)) => match self.gateway.sessions.find(link, d.session_id) {
                Some(key) => {
                    if d.kick_reason == KickReason::Transferred as u32 {
                        let now = self.cx.now.unix_ms;
                        if let Some(s) = self.gateway.sessions.all.get_mut(&key) {
                            s.handed_over_at = Some(now);
                        }
                    }
                    let reason = match d.detail.as_str() {
                        "" => kick_name(d.kick_reason),
                        detail => format!("{}: {detail}", kick_name(d.kick_reason)),
                    };
                    self.end_session(key, &reason);
                }
                None => self.cx.metrics.drop_msg("unknown_session", 1),
            },
            Some(B::Input(i)) => self.on_input(link, i),
            Some(B::Rtt(r)) => {
                if let Some(key) = self.gateway.sessions.find(link, r.session_id) {
                    if let Some(s) = self.gateway.sessions.all.get_mut(&key) {
                        s.rtt = Some((r.rtt_ms_p50, r.rtt_ms_min));
                    }
                }
            }
            Some(B::Heartbeat(_)) => {}
            Some(other) => {
                self.cx.metrics.error("unexpected_message");
                tracing::warn!(link, message = ?other, "proxy sent a message only a sidecar sends; ignored");
            }
            None => {}
        }
    }

    pub(crate) fn on_attach(&mut self, link: LinkId, a: mesh::Attach) {
        if a.account.is_empty() {
            self.cx.metrics.error("bad_attach");
            return self.cx.queue_for_link(
                link,
                detach(
                    a.session_id,
                    KickReason::GatewayUnavailable,
                    "attach without an account",
                ),
            );
        }
        // Only a proxy holding an attest key admitted this account: a mesh peer's word is not
        // enough, or anyone who reaches the mesh listener could attach any account.
        if let Err(e) = cellmesh_proto::attest::verify(
            &self.gateway.attest,
            &a.attestation,
            &a.account,
            a.session_id,
            self.cx.now.unix_ms,
        ) {
            self.cx
                .metrics
                .attaches_refused
                .get_or_create(&crate::metrics::KindLabel { kind: e.kind() })
                .inc();
            tracing::info!(
                link,
                account = %a.account,
                session_id = a.session_id,
                error = %e,
                "attach refused"
            );
            return self.cx.queue_for_link(
                link,
                detach(
                    a.session_id,
                    KickReason::GatewayUnavailable,
                    format!("attach refused: {e}"),
                ),
            );
        }
        if self.gateway.sessions.find(link, a.session_id).is_some() {
            // The proxy numbers sessions uniquely per link; a repeat is its bug, not a new client.
            self.cx.metrics.error("duplicate_session_id");
            tracing::warn!(
                link,
                session_id = a.session_id,
                "attach for a session id already in use; ignored"
            );
            return;
        }
        // A session that moves here was admitted already; a new one only while the node admits.
        if !a.moved && !self.admit_login() {
            return self
                .cx
                .queue_for_link(link, self.admission_refusal(a.session_id));
        }
        let key = self
            .gateway
            .sessions
            .begin(link, a.session_id, a.account.clone(), a.remote_addr);
        self.mesh.add_session(link, key);
        // Handed over from another geo: the hint stands in for the player record.
        let handed_over_from = a.handover.map(|h| {
            let kind = if h.source == "cookie" {
                "cookie"
            } else {
                "hint"
            };
            self.cx
                .metrics
                .login_hints
                .get_or_create(&crate::metrics::KindLabel { kind })
                .inc();
            if let Some(s) = self.gateway.sessions.all.get_mut(&key) {
                s.last_position = h.last_position.map(|p| [p.x, p.y, p.z]);
                s.handed_over_in = true;
            }
            h.session_epoch
        });
        self.cx.store(StoreRequest::Register {
            session: key,
            account: a.account,
            node: self.cx.config.node_id,
            lease_ms: self.cx.config.session_lease_ms,
            handed_over_from,
            moved_from: (a.moved && a.moved_from_epoch > 0).then_some(a.moved_from_epoch),
        });
    }

    /// A session moving here from a lost gateway found a newer login of its account registered
    /// meanwhile: it ends, displaced, and the newer one keeps the avatar.
    pub(crate) fn on_superseded(&mut self, key: SessionKey, account: &str) {
        let Some(s) = self.gateway.sessions.get(key) else {
            return;
        };
        tracing::debug!(%account, "a moved session was superseded by a newer login");
        self.cx.queue_for_link(
            s.link,
            detach(
                s.session_id,
                KickReason::Displaced,
                "the account logged in again",
            ),
        );
        self.forget_session(key);
    }

    pub(crate) fn on_registered(
        &mut self,
        key: SessionKey,
        account: String,
        result: Result<Registration, String>,
    ) {
        let Some(s) = self.gateway.sessions.get(key) else {
            // Detached while registering: undo the registration.
            if let Ok(r) = result {
                self.release(account, r.epoch);
            }
            return;
        };
        let (link, session_id) = (s.link, s.session_id);
        let reg = match result {
            Ok(r) => r,
            Err(e) => {
                self.cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "attach failed");
                self.cx.queue_for_link(
                    link,
                    detach(
                        session_id,
                        KickReason::GatewayUnavailable,
                        format!("session directory: {e}"),
                    ),
                );
                self.forget_session(key);
                return;
            }
        };
        // Two logins raced and the newer one won, here or on another gateway that told this
        // node first: this one is displaced before it began (its avatar is never spawned).
        let me = self.cx.config.node_id;
        let local = self.gateway.sessions.by_account.get(&account).copied();
        let newer_here = local
            .and_then(|o| self.gateway.sessions.get(o)?.epoch)
            .is_some_and(|e| e > reg.epoch);
        let newer_elsewhere = self
            .routing
            .route(&account)
            .is_some_and(|r| r.gateway_node != me && r.session_epoch > reg.epoch);
        if newer_here || newer_elsewhere {
            self.cx.queue_for_link(
                link,
                detach(
                    session_id,
                    KickReason::Displaced,
                    "a newer login of this account exists",
                ),
            );
            self.forget_session(key);
            return;
        }
        if let Some(other) = local {
            // The older session goes without a PlayerLeave: the game sees a new PlayerJoin.
            if let Some(o) = self.gateway.sessions.get(other) {
                let (olink, osid) = (o.link, o.session_id);
                self.cx.queue_for_link(
                    olink,
                    detach(osid, KickReason::Displaced, "the account logged in again"),
                );
            }
            self.forget_session(other);
        }
        let w = self.cx.config.world;
        // Internal: found at the top; `other` is the account's attached session, never `key`
        // (registered once, by this node's own store call, and attached only below).
        let s = self
            .gateway
            .sessions
            .all
            .get_mut(&key)
            .expect("checked above");
        s.epoch = Some(reg.epoch);
        if let Some(r) = reg.record {
            if s.handed_over_in {
                // The store found the hint older than the record: the record stands.
                s.handed_over_in = false;
                self.cx.metrics.login_hints_stale.inc();
                tracing::info!(%account, record_epoch = r.session_epoch, "handover hint older than the player record; the record is used");
            }
            s.last_position = r.last_position;
            s.home_geo = Some(r.home_geo);
        }
        let last_position = s.last_position;
        self.gateway
            .sessions
            .by_account
            .insert(account.clone(), key);
        self.gateway.clients.add(key, &account);
        self.cx
            .metrics
            .sessions
            .set(self.gateway.sessions.attached() as i64);
        // An avatar already simulated for this account (a session displaced here, or one the
        // directory's master record names) keeps being simulated where it is: its game sees a
        // new PlayerJoin. With none, one is spawned.
        let at = match self.gateway.master_owner.get(&account).copied() {
            Some(owner) if owner == me => AvatarAt::Here,
            Some(owner) => AvatarAt::Peer(owner),
            None => {
                // A new session learns its master's epoch from the master's owner.
                self.gateway.master_epoch.remove(&account);
                self.avatar_at(&account, reg.master)
            }
        };
        let handed_over_in = self
            .gateway
            .sessions
            .get(key)
            .is_some_and(|s| s.handed_over_in);
        // Handed over from another geo: its avatar lives on, and its master record is in the
        // directory of whichever geo its owner is in (this geo's may hold none, or an older
        // owner's). Unless this node writes it, the owner hears of this newer session, joins it
        // and anchors it here; only if none does in time is one spawned.
        let wait_for_owner = handed_over_in && at != AvatarAt::Here;
        if wait_for_owner {
            self.announce_session(&account, reg.epoch, false);
            self.await_handed_over_avatar(&account);
        } else {
            self.announce_session(&account, reg.epoch, at == AvatarAt::Nowhere);
        }
        match at {
            _ if wait_for_owner => {}
            AvatarAt::Here => self.join_here(&account, reg.epoch, last_position),
            AvatarAt::Peer(owner) => {
                if self.send_join(owner, &account, reg.epoch, last_position) {
                    self.gateway.master_owner.insert(account.clone(), owner);
                } else {
                    self.await_avatar(&account, reg.master);
                }
            }
            AvatarAt::Restoring => self.await_avatar(&account, reg.master),
            AvatarAt::Nowhere => self.spawn_avatar(&account, reg.epoch, last_position),
        }
        self.cx.queue_for_link(
            link,
            mesh_message::Body::Attached(mesh::Attached {
                session_id,
                session_epoch: reg.epoch,
                gateway_node: self.cx.config.node_id,
                world_width: w.width,
                world_height: w.height,
                chunk_size: w.chunk_size,
            }),
        );
        tracing::debug!(%account, epoch = reg.epoch, "session attached");
    }

    pub(crate) fn on_input(&mut self, link: LinkId, i: mesh::SessionInput) {
        self.cx.metrics.inputs_from_proxies.inc();
        let Some(s) = self
            .gateway
            .sessions
            .find(link, i.session_id)
            .and_then(|k| self.gateway.sessions.get(k))
        else {
            return self.cx.metrics.drop_input("unknown_session");
        };
        let Some(epoch) = s.epoch else {
            return self.cx.metrics.drop_input("session_attaching");
        };
        if self.avatars.is_waiting(&s.account) {
            return self.cx.metrics.drop_input("input_avatar_restoring");
        }
        let owner = self
            .gateway
            .master_owner
            .get(&s.account)
            .copied()
            .unwrap_or(self.cx.config.node_id);
        let forward = mesh::ForwardInput {
            account: s.account.clone(),
            session_epoch: epoch,
            seq: i.seq,
            payload: i.payload,
            entity_epoch: self
                .gateway
                .master_epoch
                .get(&s.account)
                .copied()
                .unwrap_or(0),
            hops: 0,
            entity_id: 0,
        };
        if owner != self.cx.config.node_id {
            if self.try_send_peer(owner, mesh_message::Body::ForwardInput(forward)) {
                self.cx.metrics.inputs_forwarded.inc();
            } else {
                self.cx.metrics.drop_input("input_peer_down");
            }
            return;
        }
        self.input_for_master(forward);
    }

    /// The client is gone: the game hears `PlayerLeave`, the record is saved, the directory
    /// entry released.
    pub(crate) fn end_session(&mut self, key: SessionKey, reason: &str) {
        let Some(s) = self.forget_session(key) else {
            return;
        };
        let Some(epoch) = s.epoch else {
            // Still registering: `on_registered` undoes the registration when it lands.
            return;
        };
        self.release_avatar(&s.account, epoch, reason);
        self.announce_session_end(&s.account, epoch);
        let record = self.player_record(&s);
        self.gateway.anchor_pos.remove(&s.account);
        let hold_ms = if s.handed_over_at.is_some() {
            super::avatars::TRANSFER_GRACE_MS
        } else {
            0
        };
        self.cx.store(StoreRequest::EndSession {
            record,
            epoch,
            hold_ms,
        });
        tracing::debug!(account = %s.account, epoch, %reason, "session ended");
    }

    /// What the world remembers of a session's player: where its avatar stands (here, as its
    /// owner last anchored it, or as the record said at login).
    fn player_record(&self, s: &Session) -> PlayerRecord {
        let last_position = self
            .table
            .master_of(&s.account)
            .map(|e| [e.position.x, e.position.y, e.position.z])
            .or(self.gateway.anchor_pos.get(&s.account).copied())
            .or(s.last_position);
        PlayerRecord {
            account: s.account.clone(),
            last_position,
            home_geo: s
                .home_geo
                .clone()
                .unwrap_or_else(|| self.cx.config.geo.clone()),
            updated_unix_ms: self.cx.now.unix_ms,
            gateway_geo: self.cx.config.geo.clone(),
            session_epoch: s.epoch.unwrap_or(0),
            last_handover_unix_ms: s.handed_over_at,
        }
    }

    /// Tells each session's proxy where its avatar is simulated (the home geo of that node, the
    /// region, the position) when that changes region or node, and every [`WHERE_EVERY_MS`]:
    /// the proxy's handover policy decides from it.
    pub(crate) fn report_whereabouts(&mut self) {
        let now = self.cx.now.mono_ms;
        let me = self.cx.config.node_id;
        let mut reports = Vec::new();
        for s in self.gateway.sessions.iter() {
            if s.epoch.is_none() {
                continue;
            }
            let owner = self
                .gateway
                .master_owner
                .get(&s.account)
                .copied()
                .unwrap_or(me);
            let pos = if owner == me {
                self.table
                    .master_of(&s.account)
                    .map(|e| [e.position.x, e.position.y, e.position.z])
            } else {
                self.gateway.anchor_pos.get(&s.account).copied()
            };
            let Some(pos) = pos else { continue };
            // Borrowed: most passes send nothing, and a string per session every 100 ms adds up.
            let geo = if owner == me {
                self.cx.config.geo.as_str()
            } else {
                match self.gateway.node_geo.get(&owner) {
                    Some(g) => g.as_str(),
                    None => continue,
                }
            };
            let w = &self.cx.config.world;
            let r = w.region_of(cellmesh_world::geometry::Pos {
                x: pos[0],
                y: pos[1],
            });
            let region = (r.y * w.regions_x() + r.x) as u64;
            let due = match self.gateway.where_sent.get(&s.key) {
                Some((g, reg, at)) => g != geo || *reg != region || now >= at + WHERE_EVERY_MS,
                None => true,
            };
            if due {
                reports.push((s.key, s.link, s.session_id, geo.to_string(), region, pos));
            }
        }
        for (key, link, session_id, geo, region, [x, y, z]) in reports {
            self.gateway
                .where_sent
                .insert(key, (geo.clone(), region, now));
            self.cx.queue_for_link(
                link,
                mesh_message::Body::Where(mesh::SessionWhere {
                    session_id,
                    geo,
                    region,
                    position: Some(mesh::MeshVec3 { x, y, z }),
                }),
            );
        }
    }

    /// Saves the records of the attached players every `player_record_every_ms`, so a crash
    /// of the gateway loses at most that much of where they were.
    pub(crate) fn save_player_records(&mut self) {
        let every = self.cx.config.player_record_every_ms;
        if every == 0 || self.cx.now.mono_ms < self.gateway.next_records_ms {
            return;
        }
        self.gateway.next_records_ms = self.cx.now.mono_ms + every;
        let records: Vec<PlayerRecord> = self
            .gateway
            .sessions
            .iter()
            .filter(|s| s.epoch.is_some())
            .map(|s| self.player_record(s))
            .filter(|r| r.last_position.is_some())
            .collect();
        if !records.is_empty() {
            self.cx.store(StoreRequest::SaveRecords { records });
        }
    }

    /// Tells the game simulating `account`'s avatar (this node's or a peer's) that the session
    /// `epoch` is over.
    pub(crate) fn release_avatar(&mut self, account: &str, epoch: u64, reason: &str) {
        let owner = self
            .gateway
            .master_owner
            .remove(account)
            .unwrap_or(self.cx.config.node_id);
        self.gateway.master_epoch.remove(account);
        self.gateway.clients.set_remote_anchor(account, None);
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
            self.defer_leave(account, epoch, reason);
        } else if self.game.slot.is_some() {
            self.leave_game(account, epoch, reason);
        }
    }

    /// A newer login of the account on another gateway won: the client is kicked and its
    /// avatar released (the new session's join respawns or keeps it), with no record saved.
    pub(crate) fn displace(&mut self, key: SessionKey, detail: &str) {
        let Some(s) = self.gateway.sessions.get(key) else {
            return;
        };
        let (link, session_id, account, epoch) = (s.link, s.session_id, s.account.clone(), s.epoch);
        self.cx
            .queue_for_link(link, detach(session_id, KickReason::Displaced, detail));
        if let Some(epoch) = epoch {
            self.release_avatar(&account, epoch, "displaced");
        }
        self.gateway.anchor_pos.remove(&account);
        self.forget_session(key);
    }

    /// Drops every trace of a session on this node, telling nobody.
    pub(crate) fn forget_session(&mut self, key: SessionKey) -> Option<Session> {
        let s = self.gateway.sessions.remove(key)?;
        self.gateway.where_sent.remove(&key);
        self.mesh.remove_session(s.link, key);
        self.gateway.clients.remove(key);
        self.cx
            .metrics
            .sessions
            .set(self.gateway.sessions.attached() as i64);
        Some(s)
    }

    pub(crate) fn release(&mut self, account: String, epoch: u64) {
        self.cx.store(StoreRequest::Release { account, epoch });
    }

    /// Renews the directory lease of every attached session, off the node task. One batch at a
    /// time: a store that answers late gets no second batch on top of the first.
    pub(crate) fn renew_leases(&mut self) {
        if self.gateway.renewing {
            return;
        }
        let due: Vec<(SessionKey, String, u64)> = self
            .gateway
            .sessions
            .iter()
            .filter_map(|s| Some((s.key, s.account.clone(), s.epoch?)))
            .collect();
        if due.is_empty() {
            return;
        }
        self.gateway.renewing = true;
        self.cx.store(StoreRequest::Renew {
            sessions: due,
            lease_ms: self.cx.config.session_lease_ms,
        });
    }

    pub(crate) fn on_renewed(&mut self, results: Vec<(SessionKey, u64, Result<bool, String>)>) {
        self.gateway.renewing = false;
        for (key, epoch, r) in results {
            let Some(s) = self
                .gateway
                .sessions
                .get(key)
                .filter(|s| s.epoch == Some(epoch))
            else {
                continue;
            };
            match r {
                Ok(true) => {}
                Ok(false) => {
                    // Either a newer login holds the account, or the directory lost the entry
                    // (restarted, or unreachable for longer than the lease). Only the store can
                    // tell which: the session registers again above its epoch unless a newer
                    // one exists, and is kicked only then.
                    let account = s.account.clone();
                    if self.gateway.reregistering.insert(key) {
                        self.cx.store(StoreRequest::Reregister {
                            session: key,
                            account,
                            node: self.cx.config.node_id,
                            lease_ms: self.cx.config.session_lease_ms,
                            held: epoch,
                        });
                    }
                }
                Err(e) => {
                    self.cx.metrics.error("store");
                    tracing::warn!(account = %s.account, error = %e, "renewing the session lease failed");
                }
            }
        }
    }

    /// The store's word on a session whose entry was gone: it goes on under a new epoch (its
    /// avatar's game and the peers learn it as after a reconnect), or it is over because a newer
    /// login of the account registered meanwhile.
    pub(crate) fn on_reregistered(
        &mut self,
        key: SessionKey,
        account: String,
        held: u64,
        result: Result<Option<u64>, String>,
    ) {
        self.gateway.reregistering.remove(&key);
        let Some(s) = self
            .gateway
            .sessions
            .get(key)
            .filter(|s| s.epoch == Some(held))
        else {
            // Ended or displaced meanwhile: undo the registration.
            if let Ok(Some(epoch)) = result {
                self.release(account, epoch);
            }
            return;
        };
        let (link, session_id, last) = (s.link, s.session_id, s.last_position);
        match result {
            Ok(Some(epoch)) => {
                tracing::info!(%account, held, epoch, "the session directory had lost this session: registered again");
                self.cx.metrics.sessions_reregistered.inc();
                if let Some(s) = self.gateway.sessions.all.get_mut(&key) {
                    s.epoch = Some(epoch);
                }
                self.announce_session(&account, epoch, false);
                match self.gateway.master_owner.get(&account).copied() {
                    Some(owner) if owner == self.cx.config.node_id => {
                        self.join_here(&account, epoch, last)
                    }
                    Some(owner) => {
                        self.send_join(owner, &account, epoch, last);
                    }
                    // The avatar is on its way (restoring, handed over): its join names the
                    // session's epoch as it is then.
                    None => {}
                }
            }
            Ok(None) => {
                self.cx.queue_for_link(
                    link,
                    detach(
                        session_id,
                        KickReason::Displaced,
                        "the account logged in again",
                    ),
                );
                self.end_session(key, "displaced");
            }
            Err(e) => {
                // The next renewal finds the entry gone again and asks once more.
                self.cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "registering a lost session again failed");
            }
        }
    }
}
