//! Gateway sessions (docs/mesh.md#sessions-the-gateway-role): the client sessions proxies attach to this node over mesh links.
//!
//! Attach registers the account in the session directory (a new, higher session epoch), displaces
//! an older session of the same account, loads the player record and tells the game
//! `PlayerJoin`. Detach tells the game `PlayerLeave`, saves the player record and releases the
//! directory entry. The directory and record calls run off the node task; their results come
//! back as events, checked against what happened meanwhile.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::batch::Encoded;
use cellmesh_proto::edge::KickReason;
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_stores::PlayerRecord;
use cellmesh_world::geometry::{ChunkPos, Pos};
use cellmesh_world::partition::NodeId;

use super::*;
use crate::config::SidecarConfig;
use crate::model::entities::{merge_changes, EntityUpdate, TickChanges};
use crate::model::fold::{Clients, FoldOutput, Part, TickEvent, TickSend};
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
    /// Other geos' proxies' median RTT to this client, by geo, in milliseconds.
    pub far_rtt: BTreeMap<String, f32>,
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
    sessions: Sessions,
    clients: Clients,
    /// The node simulating each local session's avatar.
    master_owner: HashMap<String, NodeId>,
    /// Each local session's master and its epoch, from its owner's anchors (the entity too: a
    /// new avatar numbers its epochs from 1 again).
    master_epoch: HashMap<String, (u64, u64)>,
    /// The last known position of avatars simulated elsewhere.
    anchor_pos: HashMap<String, [f64; 3]>,
    /// When the attached players' records are saved next (monotonic ms).
    next_records_ms: u64,
    /// Render ghosts' changes already sent to clients this tick: the tick's other consumers
    /// still get them, merged with the rest, at its end.
    ghost_changes_sent: TickChanges,
    /// Peer frames changed render ghosts since they were last folded for clients.
    ghosts_due: bool,
    /// What each session's proxy was last told of where its avatar is simulated: geo, region,
    /// and when (monotonic ms).
    where_sent: HashMap<SessionKey, (String, u64, u64)>,
    /// Where each session's avatar was last seen to move at a player sample, when (monotonic
    /// ms), and the speed measured then: an avatar simulated elsewhere is only re-anchored every
    /// chunk it crosses, so its speed is measured between two changes, not two samples.
    sampled: HashMap<SessionKey, ([f64; 2], u64, f64)>,
    /// The geo of every peer node seen, from its link's hello (kept when the link drops).
    node_geo: HashMap<NodeId, String>,
    /// A batch of session renewals is with the store.
    renewing: bool,
    /// Sessions whose lost directory entry is being registered again.
    reregistering: BTreeSet<SessionKey>,
    /// The keys an `Attach`'s attestation must be signed under.
    attest: cellmesh_proto::keys::KeyRing,
}

/// A session's proxy hears where its avatar is simulated at least this often, and at once when
/// it crosses into another region.
pub(crate) const WHERE_EVERY_MS: u64 = 5_000;
/// How long an avatar seen at the same place keeps its last measured speed in the players'
/// samples: longer than a walker takes to cross a chunk, which is when an avatar simulated
/// elsewhere is re-anchored.
const SPEED_HOLD_MS: u64 = 10_000;

impl Gateway {
    pub fn new(cfg: &SidecarConfig) -> Self {
        let shape = InterestShape::new(cfg.view_radius_chunks, cfg.release_margin_chunks);
        Self {
            sessions: Sessions::default(),
            clients: Clients::new(cfg.world, shape).with_update_budget(cfg.client_updates_per_tick),
            master_owner: HashMap::default(),
            master_epoch: HashMap::default(),
            anchor_pos: HashMap::default(),
            next_records_ms: cfg.player_record_every_ms,
            ghost_changes_sent: TickChanges::new(),
            ghosts_due: false,
            where_sent: HashMap::default(),
            sampled: HashMap::default(),
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

    /// Whether a session of `account` attached here waits for the directory's registration.
    pub(crate) fn registering(&self, account: &str) -> bool {
        self.sessions
            .iter()
            .any(|s| s.account == account && s.epoch.is_none())
    }

    /// Whether the local session of `account` was given a new avatar that this node writes, and
    /// `entity` is another one.
    fn avatar_spawned_here_for(&self, table: &EntityTable, account: &str, entity: u64) -> bool {
        self.local_session(account).is_some_and(|s| s.new_avatar)
            && table
                .master_of(account)
                .is_some_and(|e| e.origin().is_none() && e.id != entity)
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
            .is_some_and(|&(id, e)| id == a.entity_id && e > a.entity_epoch)
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
        self.master_epoch
            .insert(a.account.clone(), (a.entity_id, a.entity_epoch));
        let chunk = cx.config.world.chunk_of(Pos { x: p.x, y: p.y });
        self.clients.set_remote_anchor(&a.account, Some(chunk));
        self.master_owner.insert(a.account.clone(), node);
        // The view follows the anchor: a render ghost of the master left behind (stale through
        // an outage, or not refreshed yet by its new owner) moves with it, so the client never
        // sees its own avatar leave its view.
        let behind = table
            .get(a.entity_id)
            .filter(|e| e.origin().is_some() && e.epoch <= a.entity_epoch && e.position != p)
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
                far_rtt: BTreeMap::new(),
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

/// Queues the release of a registration nobody wants any more.
fn release(cx: &mut Context, account: String, epoch: u64) {
    cx.store(StoreRequest::Release { account, epoch });
}

/// A registration that attached its session: what the core needs to find its avatar, wait for
/// it or spawn one.
pub(crate) struct NewSession {
    pub link: LinkId,
    pub session_id: u64,
    pub epoch: u64,
    pub last_position: Option<[f64; 3]>,
    /// Handed over from another geo, and the player record did not overrule the hint.
    pub handed_over_in: bool,
    /// The node already simulating the account's avatar for this gateway (a session displaced
    /// here), if any.
    pub owner: Option<NodeId>,
    /// Where the directory's master record says the avatar is simulated.
    pub master: Option<MasterEntry>,
}

/// What became of a session registered again after its directory entry was lost.
pub(crate) enum Reregistered {
    /// Nothing more to do: it ended meanwhile, or the store failed (the next renewal asks
    /// again).
    Nothing,
    /// It goes on under `epoch`: its avatar's game and the peers learn it.
    Again {
        epoch: u64,
        last_position: Option<[f64; 3]>,
    },
    /// A newer login holds the account: the client was told, and the session ends.
    Displaced,
}

impl Gateway {
    /// The session `key`, attached or attaching.
    pub(crate) fn session(&self, key: SessionKey) -> Option<&Session> {
        self.sessions.get(key)
    }

    /// Every session here, attached or attaching.
    pub(crate) fn session_keys(&self) -> Vec<SessionKey> {
        self.sessions.iter().map(|s| s.key).collect()
    }

    /// Sessions attached.
    pub(crate) fn attached(&self) -> usize {
        self.sessions.attached()
    }

    /// Sessions attached or attaching.
    pub(crate) fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// The clients' views and batches.
    pub(crate) fn clients(&self) -> &Clients {
        &self.clients
    }

    /// The chunks that came into some client's view or left the last one since the last call.
    pub(crate) fn take_flipped_chunks(&mut self) -> HashSet<ChunkPos> {
        self.clients.take_flipped_chunks()
    }

    /// The node simulating the avatar of `account`'s session here, as far as it is known.
    pub(crate) fn master_owner(&self, account: &str) -> Option<NodeId> {
        self.master_owner.get(account).copied()
    }

    pub(crate) fn set_master_owner(&mut self, account: &str, node: NodeId) {
        self.master_owner.insert(account.to_string(), node);
    }

    /// The avatar is not simulated anywhere this gateway knows of (it waits for one).
    pub(crate) fn forget_master_owner(&mut self, account: &str) {
        self.master_owner.remove(account);
    }

    /// Where the player of session `key` was last seen.
    pub(crate) fn last_position(&self, key: SessionKey) -> Option<[f64; 3]> {
        self.sessions.get(key).and_then(|s| s.last_position)
    }

    /// Peer `node` is in `geo` (from its link's hello; kept when the link drops).
    pub(crate) fn note_geo(&mut self, node: NodeId, geo: String) {
        self.node_geo.insert(node, geo);
    }

    /// Peer frames changed render ghosts: they are folded for clients at the next output.
    pub(crate) fn ghosts_changed(&mut self) {
        self.ghosts_due = true;
    }

    /// The render ghosts' changes already sent to clients this tick.
    pub(crate) fn take_ghost_changes_sent(&mut self) -> TickChanges {
        std::mem::take(&mut self.ghost_changes_sent)
    }

    /// The session `epoch` of `account` is given a new avatar: an older one that anchors the
    /// session later is told to go.
    pub(crate) fn mark_new_avatar(&mut self, account: &str, epoch: u64) {
        if let Some(s) = self
            .clients
            .key_of(account)
            .and_then(|k| self.sessions.get_mut(k))
            .filter(|s| s.epoch == Some(epoch))
        {
            s.new_avatar = true;
        }
    }

    /// This node writes `account`'s avatar under `entity_epoch`: its inputs are stamped with
    /// it, and the view no longer follows an owner's anchors.
    pub(crate) fn avatar_written_here(&mut self, account: &str, id: u64, entity_epoch: u64) {
        self.master_epoch
            .insert(account.to_string(), (id, entity_epoch));
        self.clients.set_remote_anchor(account, None);
        self.anchor_pos.remove(account);
    }

    /// This node handed `account`'s avatar to `to` under `entity_epoch`, standing at `chunk`
    /// and `pos`: if the player's session is here, its input goes to the new owner now.
    pub(crate) fn avatar_handed_on(
        &mut self,
        account: &str,
        to: NodeId,
        id: u64,
        entity_epoch: u64,
        chunk: ChunkPos,
        pos: [f64; 3],
    ) {
        if self.clients.key_of(account).is_none() {
            return;
        }
        // An anchor the new owner sent first (the ack was lost and a later frame proved it)
        // says where the avatar is now; the frozen copy's place is old.
        let anchored = self.master_owner.get(account) == Some(&to)
            && self
                .master_epoch
                .get(account)
                .is_some_and(|&(anchored, e)| anchored == id && e >= entity_epoch);
        self.master_owner.insert(account.to_string(), to);
        if !anchored {
            self.master_epoch
                .insert(account.to_string(), (id, entity_epoch));
            self.clients.set_remote_anchor(account, Some(chunk));
            self.anchor_pos.insert(account.to_string(), pos);
        }
    }

    /// A piece for `account`'s client, if it is this node's.
    pub(crate) fn deliver(&mut self, cx: &Context, account: &str, part: Part, encoded: Encoded) {
        match self.clients.key_of(account) {
            Some(key) => self.clients.inject(key, part, encoded),
            None => {
                cx.metrics.dropped_unknown_account.inc();
                cx.metrics.drop_msg("unknown_account", 1);
            }
        }
    }

    /// Where the attached sessions are, for a peer whose link came up.
    pub(crate) fn session_announcements(&self, me: NodeId) -> Vec<mesh_message::Body> {
        self.sessions
            .iter()
            .filter_map(|s| {
                Some(mesh_message::Body::SessionMoved(mesh::SessionMoved {
                    account: s.account.clone(),
                    session_epoch: s.epoch?,
                    gateway_node: me,
                    new_avatar: false,
                }))
            })
            .collect()
    }

    /// The sessions as `/state` shows them.
    pub(crate) fn sessions_state(&self, table: &EntityTable) -> Vec<serde_json::Value> {
        self.sessions
            .iter()
            .map(|s| {
                json!({
                    "account": s.account,
                    "session_id": s.session_id,
                    "epoch": s.epoch,
                    "attached": s.epoch.is_some(),
                    "link": s.link,
                    "remote_addr": s.remote_addr,
                    "master_id": table.master_of(&s.account).map(|e| e.id),
                    "view_chunks": self.clients.view_len(s.key),
                    "rtt_ms_p50": s.rtt.map(|r| r.0),
                    "rtt_ms_min": s.rtt.map(|r| r.1),
                    "far_rtt_ms": s.far_rtt,
                })
            })
            .collect()
    }

    /// The `PlayerJoin` of every attached player whose avatar this node (`me`) simulates, for a
    /// game that connected (one simulated elsewhere stays there: a join here would spawn a
    /// second avatar).
    pub(crate) fn joins_for_game(&self, me: NodeId) -> Vec<local::SidecarMessage> {
        self.sessions
            .iter()
            .filter(|s| {
                self.master_owner
                    .get(&s.account)
                    .is_none_or(|owner| *owner == me)
            })
            .filter_map(|s| {
                let epoch = s.epoch?;
                Some(
                    local::sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                        account: s.account.clone(),
                        session_epoch: epoch,
                        last_position: s.last_position.map(|[x, y, z]| local::Vec3 { x, y, z }),
                    })
                    .into(),
                )
            })
            .collect()
    }

    /// The game went away: where the avatars it wrote were is kept for the next game's
    /// `PlayerJoin`.
    pub(crate) fn remember_avatar_positions(&mut self, table: &EntityTable) {
        for s in self.sessions.iter_mut() {
            if let Some(e) = table.master_of(&s.account) {
                s.last_position = Some([e.position.x, e.position.y, e.position.z]);
            }
        }
    }

    /// Folds one tick for this node's clients.
    pub(crate) fn fold_tick(
        &mut self,
        tick: u64,
        table: &EntityTable,
        changes: &TickChanges,
        events: &[TickEvent],
        sends: &[TickSend],
        budget: usize,
    ) -> FoldOutput {
        self.clients
            .fold(tick, table, changes, events, sends, budget)
    }

    /// Render ghosts' changes reach the clients that see them as they arrive from their owner,
    /// not at this node's next tick: a neighbour's update would otherwise wait up to a whole tick
    /// here (every tick, with games ticking in phase). The changes stay for the tick's other
    /// work, which sees them merged with the rest at its end. Only when peer frames changed
    /// ghosts since the last fold.
    pub(crate) fn send_ghost_changes(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        last_tick: u64,
    ) {
        if !std::mem::take(&mut self.ghosts_due) || self.clients.is_empty() {
            return;
        }
        let changes = table.take_ghost_changes();
        if changes.is_empty() {
            return;
        }
        let budget = cx.config.max_frame_bytes - TO_CLIENT_OVERHEAD;
        let out = self
            .clients
            .fold(last_tick, table, &changes, &[], &[], budget);
        cx.metrics.deltas_sent.inc_by(out.deltas);
        cx.metrics.deltas_encoded.inc_by(out.deltas_encoded);
        cx.metrics.updates_held_back.inc_by(out.held_back);
        self.send_to_clients(cx, out.frames, budget);
        merge_changes(&mut self.ghost_changes_sent, &changes);
    }

    /// Each client's batch, to its proxy.
    pub(crate) fn send_to_clients(
        &self,
        cx: &mut Context,
        frames: Vec<(SessionKey, bytes::Bytes)>,
        budget: usize,
    ) {
        for (key, server_frame) in frames {
            let Some(s) = self.sessions.get(key) else {
                continue;
            };
            if server_frame.len() > budget {
                // One piece alone outgrew a frame; the client cannot be sent it.
                cx.metrics.drop_msg("batch_too_large", 1);
                continue;
            }
            cx.queue_for_link(
                s.link,
                mesh_message::Body::ToClient(mesh::ToClient {
                    session_id: s.session_id,
                    server_frame,
                }),
            );
            cx.metrics.batches_sent.inc();
        }
    }

    /// A proxy's `Detach`: returns the session it ends and why.
    pub(crate) fn on_detach(
        &mut self,
        cx: &Context,
        link: LinkId,
        d: mesh::Detach,
    ) -> Option<(SessionKey, String)> {
        let Some(key) = self.sessions.find(link, d.session_id) else {
            cx.metrics.drop_msg("unknown_session", 1);
            return None;
        };
        if d.kick_reason == KickReason::Transferred as u32 {
            if let Some(s) = self.sessions.all.get_mut(&key) {
                s.handed_over_at = Some(cx.now.unix_ms);
            }
        }
        let reason = match d.detail.as_str() {
            "" => kick_name(d.kick_reason),
            detail => format!("{}: {detail}", kick_name(d.kick_reason)),
        };
        Some((key, reason))
    }

    /// A proxy's measure of a session's round trip.
    pub(crate) fn on_rtt(&mut self, link: LinkId, r: mesh::SessionRtt) {
        if let Some(key) = self.sessions.find(link, r.session_id) {
            if let Some(s) = self.sessions.all.get_mut(&key) {
                s.rtt = Some((r.rtt_ms_p50, r.rtt_ms_min));
                // A figure that is no duration cannot place anyone: dropped, not clamped.
                s.far_rtt = r
                    .far
                    .into_iter()
                    .filter(|f| f.rtt_ms_p50.is_finite() && f.rtt_ms_p50 >= 0.0)
                    .map(|f| (f.geo, f.rtt_ms_p50))
                    .collect();
            }
        }
    }

    /// Whether an `Attach` may begin a session: it names an account, a proxy holding an attest
    /// key admitted it, and its session id is new on the link. One refused is answered here.
    pub(crate) fn attach_acceptable(
        &self,
        cx: &mut Context,
        link: LinkId,
        a: &mesh::Attach,
    ) -> bool {
        if a.account.is_empty() {
            cx.metrics.error("bad_attach");
            cx.queue_for_link(
                link,
                detach(
                    a.session_id,
                    KickReason::GatewayUnavailable,
                    "attach without an account",
                ),
            );
            return false;
        }
        // Only a proxy holding an attest key admitted this account: a mesh peer's word is not
        // enough, or anyone who reaches the mesh listener could attach any account.
        if let Err(e) = cellmesh_proto::attest::verify(
            &self.attest,
            &a.attestation,
            &a.account,
            a.session_id,
            cx.now.unix_ms,
        ) {
            cx.metrics
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
            cx.queue_for_link(
                link,
                detach(
                    a.session_id,
                    KickReason::GatewayUnavailable,
                    format!("attach refused: {e}"),
                ),
            );
            return false;
        }
        if self.sessions.find(link, a.session_id).is_some() {
            // The proxy numbers sessions uniquely per link; a repeat is its bug, not a new client.
            cx.metrics.error("duplicate_session_id");
            tracing::warn!(
                link,
                session_id = a.session_id,
                "attach for a session id already in use; ignored"
            );
            return false;
        }
        true
    }

    /// An admitted `Attach` begins a session: the directory registers it.
    pub(crate) fn begin_attach(
        &mut self,
        cx: &mut Context,
        mesh: &mut Mesh,
        link: LinkId,
        a: mesh::Attach,
    ) {
        let key = self
            .sessions
            .begin(link, a.session_id, a.account.clone(), a.remote_addr);
        mesh.add_session(link, key);
        // Handed over from another geo: the hint stands in for the player record.
        let handed_over_from = a.handover.map(|h| {
            let kind = if h.source == "cookie" {
                "cookie"
            } else {
                "hint"
            };
            cx.metrics
                .login_hints
                .get_or_create(&crate::metrics::KindLabel { kind })
                .inc();
            if let Some(s) = self.sessions.all.get_mut(&key) {
                s.last_position = h.last_position.map(|p| [p.x, p.y, p.z]);
                s.handed_over_in = true;
            }
            h.session_epoch
        });
        cx.store(StoreRequest::Register {
            session: key,
            account: a.account,
            node: cx.config.node_id,
            lease_ms: cx.config.session_lease_ms,
            handed_over_from,
            moved_from: (a.moved && a.moved_from_epoch > 0).then_some(a.moved_from_epoch),
        });
    }

    /// A session moving here from a lost gateway found a newer login of its account registered
    /// meanwhile: it ends, displaced, and the newer one keeps the avatar.
    pub(crate) fn on_superseded(
        &mut self,
        cx: &mut Context,
        mesh: &mut Mesh,
        key: SessionKey,
        account: &str,
    ) {
        if self.sessions.get(key).is_none() {
            return;
        }
        tracing::debug!(%account, "a moved session was superseded by a newer login");
        self.kick(
            cx,
            key,
            KickReason::Displaced,
            "the account logged in again",
        );
        self.forget_session(cx, mesh, key);
    }

    /// The directory's answer to a session's registration: the session attached, or `None`
    /// when it did not (it left meanwhile, the store failed, or a newer login won).
    pub(crate) fn on_registered(
        &mut self,
        cx: &mut Context,
        mesh: &mut Mesh,
        routing: &Routing,
        key: SessionKey,
        account: &str,
        result: Result<Registration, String>,
    ) -> Option<NewSession> {
        let Some(s) = self.sessions.get(key) else {
            // Detached while registering: undo the registration.
            if let Ok(r) = result {
                release(cx, account.to_string(), r.epoch);
            }
            return None;
        };
        let (link, session_id) = (s.link, s.session_id);
        let reg = match result {
            Ok(r) => r,
            Err(e) => {
                cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "attach failed");
                cx.queue_for_link(
                    link,
                    detach(
                        session_id,
                        KickReason::GatewayUnavailable,
                        format!("session directory: {e}"),
                    ),
                );
                self.forget_session(cx, mesh, key);
                return None;
            }
        };
        // Two logins raced and the newer one won, here or on another gateway that told this
        // node first: this one is displaced before it began (its avatar is never spawned).
        let me = cx.config.node_id;
        let local = self.sessions.by_account.get(account).copied();
        let newer_here = local
            .and_then(|o| self.sessions.get(o)?.epoch)
            .is_some_and(|e| e > reg.epoch);
        let newer_elsewhere = routing
            .route(account)
            .is_some_and(|r| r.gateway_node != me && r.session_epoch > reg.epoch);
        if newer_here || newer_elsewhere {
            cx.queue_for_link(
                link,
                detach(
                    session_id,
                    KickReason::Displaced,
                    "a newer login of this account exists",
                ),
            );
            self.forget_session(cx, mesh, key);
            return None;
        }
        if let Some(other) = local {
            // The older session goes without a PlayerLeave: the game sees a new PlayerJoin.
            self.kick(
                cx,
                other,
                KickReason::Displaced,
                "the account logged in again",
            );
            self.forget_session(cx, mesh, other);
        }
        // Internal: found at the top; `other` is the account's attached session, never `key`
        // (registered once, by this node's own store call, and attached only below).
        let s = self.sessions.all.get_mut(&key).expect("checked above");
        s.epoch = Some(reg.epoch);
        if let Some(r) = reg.record {
            if s.handed_over_in {
                // The store found the hint older than the record: the record stands.
                s.handed_over_in = false;
                cx.metrics.login_hints_stale.inc();
                tracing::info!(%account, record_epoch = r.session_epoch, "handover hint older than the player record; the record is used");
            }
            s.last_position = r.last_position;
            s.home_geo = Some(r.home_geo);
        }
        let (last_position, handed_over_in) = (s.last_position, s.handed_over_in);
        self.sessions.by_account.insert(account.to_string(), key);
        self.clients.add(key, account);
        cx.metrics.sessions.set(self.sessions.attached() as i64);
        let owner = self.master_owner.get(account).copied();
        if owner.is_none() {
            // A new session learns its master's epoch from the master's owner.
            self.master_epoch.remove(account);
        }
        Some(NewSession {
            link,
            session_id,
            epoch: reg.epoch,
            last_position,
            handed_over_in,
            owner,
            master: reg.master,
        })
    }

    /// The proxy hears that `new` is attached.
    pub(crate) fn confirm_attach(&self, cx: &mut Context, account: &str, new: &NewSession) {
        let w = cx.config.world;
        cx.queue_for_link(
            new.link,
            mesh_message::Body::Attached(mesh::Attached {
                session_id: new.session_id,
                session_epoch: new.epoch,
                gateway_node: cx.config.node_id,
                world_width: w.width,
                world_height: w.height,
                chunk_size: w.chunk_size,
            }),
        );
        tracing::debug!(%account, epoch = new.epoch, "session attached");
    }

    /// A client's input: forwarded to the peer simulating its avatar, or returned for the
    /// avatar this node writes. `avatar_waits`: whether an account's session waits for its
    /// avatar (being restored), whose input has nowhere to go yet.
    pub(crate) fn on_input(
        &self,
        cx: &mut Context,
        mesh: &Mesh,
        link: LinkId,
        i: mesh::SessionInput,
        avatar_waits: impl Fn(&str) -> bool,
    ) -> Option<mesh::ForwardInput> {
        cx.metrics.inputs_from_proxies.inc();
        let Some(s) = self
            .sessions
            .find(link, i.session_id)
            .and_then(|k| self.sessions.get(k))
        else {
            cx.metrics.drop_input("unknown_session");
            return None;
        };
        let Some(epoch) = s.epoch else {
            cx.metrics.drop_input("session_attaching");
            return None;
        };
        if avatar_waits(&s.account) {
            cx.metrics.drop_input("input_avatar_restoring");
            return None;
        }
        let me = cx.config.node_id;
        let owner = self.master_owner.get(&s.account).copied().unwrap_or(me);
        let forward = mesh::ForwardInput {
            account: s.account.clone(),
            session_epoch: epoch,
            seq: i.seq,
            payload: i.payload,
            entity_epoch: self.master_epoch.get(&s.account).map_or(0, |&(_, e)| e),
            hops: 0,
            entity_id: 0,
        };
        if owner == me {
            return Some(forward);
        }
        if mesh.try_send(cx, owner, mesh_message::Body::ForwardInput(forward)) {
            cx.metrics.inputs_forwarded.inc();
        } else {
            cx.metrics.drop_input("input_peer_down");
        }
        None
    }

    /// A session ended (its avatar released, the peers told): the player record is saved and
    /// the directory entry released (or held a while for a session handed over to another
    /// geo).
    pub(crate) fn session_ended(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        s: &Session,
        epoch: u64,
        reason: &str,
    ) {
        let record = self.player_record(cx, table, s);
        self.anchor_pos.remove(&s.account);
        let hold_ms = if s.handed_over_at.is_some() {
            super::avatars::TRANSFER_GRACE_MS
        } else {
            0
        };
        cx.store(StoreRequest::EndSession {
            record,
            epoch,
            hold_ms,
        });
        tracing::debug!(account = %s.account, epoch, %reason, "session ended");
    }

    /// What the world remembers of a session's player: where its avatar stands (here, as its
    /// owner last anchored it, or as the record said at login).
    fn player_record(&self, cx: &Context, table: &EntityTable, s: &Session) -> PlayerRecord {
        let last_position = table
            .master_of(&s.account)
            .map(|e| [e.position.x, e.position.y, e.position.z])
            .or(self.anchor_pos.get(&s.account).copied())
            .or(s.last_position);
        PlayerRecord {
            account: s.account.clone(),
            last_position,
            home_geo: s.home_geo.clone().unwrap_or_else(|| cx.config.geo.clone()),
            updated_unix_ms: cx.now.unix_ms,
            gateway_geo: cx.config.geo.clone(),
            session_epoch: s.epoch.unwrap_or(0),
            last_handover_unix_ms: s.handed_over_at,
        }
    }

    /// Tells each session's proxy where its avatar is simulated (the home geo of that node, the
    /// region, the position) when that changes region or node, and every [`WHERE_EVERY_MS`]:
    /// the proxy's handover policy decides from it.
    pub(crate) fn report_whereabouts(&mut self, cx: &mut Context, table: &EntityTable) {
        let now = cx.now.mono_ms;
        let me = cx.config.node_id;
        let mut reports = Vec::new();
        for s in self.sessions.iter() {
            if s.epoch.is_none() {
                continue;
            }
            let owner = self.owner_of_avatar(me, s);
            let Some(pos) = self.avatar_position(owner == me, table, s) else {
                continue;
            };
            // Borrowed: most passes send nothing, and a string per session every 100 ms adds up.
            let geo = if owner == me {
                cx.config.geo.as_str()
            } else {
                match self.node_geo.get(&owner) {
                    Some(g) => g.as_str(),
                    None => continue,
                }
            };
            let w = &cx.config.world;
            let r = w.region_of(Pos {
                x: pos[0],
                y: pos[1],
            });
            let region = (r.y * w.regions_x() + r.x) as u64;
            let due = match self.where_sent.get(&s.key) {
                Some((g, reg, at)) => g != geo || *reg != region || now >= at + WHERE_EVERY_MS,
                None => true,
            };
            if due {
                reports.push((s.key, s.link, s.session_id, geo.to_string(), region, pos));
            }
        }
        for (key, link, session_id, geo, region, [x, y, z]) in reports {
            self.where_sent.insert(key, (geo.clone(), region, now));
            cx.queue_for_link(
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

    /// The node simulating `s`'s avatar (this one, `me`, when no other is known).
    fn owner_of_avatar(&self, me: NodeId, s: &Session) -> NodeId {
        self.master_owner.get(&s.account).copied().unwrap_or(me)
    }

    /// Where `s`'s avatar is: here (`local`), or as its owner last anchored it.
    fn avatar_position(&self, local: bool, table: &EntityTable, s: &Session) -> Option<[f64; 3]> {
        if local {
            table
                .master_of(&s.account)
                .map(|e| [e.position.x, e.position.y, e.position.z])
        } else {
            self.anchor_pos.get(&s.account).copied()
        }
    }

    /// The attached players as the geo-aware director places them: where each avatar is, how
    /// fast it went between the last two places it was seen, and the RTTs the proxies measured
    /// to it by geo (its own proxy's under the proxy's geo). A session still registering, or
    /// whose avatar is nowhere yet, is left out; so is any past [`MAX_PLAYER_SAMPLES`].
    pub(crate) fn player_samples<'m>(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        proxy_geo: impl Fn(LinkId) -> Option<&'m str>,
    ) -> Vec<cellmesh_stores::topology::PlayerSample> {
        use cellmesh_stores::topology::{PlayerSample, MAX_PLAYER_SAMPLES};
        let now = cx.now.mono_ms;
        let me = cx.config.node_id;
        let mut samples = Vec::new();
        let mut sampled = HashMap::default();
        for s in self.sessions.iter() {
            let Some(epoch) = s.epoch else { continue };
            let local = self.owner_of_avatar(me, s) == me;
            let Some([x, y, _]) = self.avatar_position(local, table, s) else {
                continue;
            };
            if samples.len() == MAX_PLAYER_SAMPLES {
                break;
            }
            let last = match self.sampled.get(&s.key) {
                Some(&(p, at, speed)) if p == [x, y] => {
                    // Still, or not re-anchored yet: the last speed holds for a while.
                    let speed = if now.saturating_sub(at) > SPEED_HOLD_MS {
                        0.0
                    } else {
                        speed
                    };
                    (p, at, speed)
                }
                Some(&([px, py], at, _)) if now > at => {
                    let (dx, dy) = cx.config.world.delta(Pos { x: px, y: py }, Pos { x, y });
                    ([x, y], now, dx.hypot(dy) * 1_000.0 / (now - at) as f64)
                }
                _ => ([x, y], now, 0.0),
            };
            let speed_mps = last.2;
            sampled.insert(s.key, last);
            let mut rtt_ms: BTreeMap<String, f32> = s
                .far_rtt
                .iter()
                .filter(|(_, ms)| ms.is_finite() && **ms >= 0.0)
                .map(|(g, ms)| (g.clone(), *ms))
                .collect();
            // The proxy's own figure is toward the proxy's geo: another geo's proxy attaches
            // here while its own geo has no gateway up.
            if let Some((p50, _)) = s.rtt.filter(|(p50, _)| p50.is_finite() && *p50 >= 0.0) {
                let geo = proxy_geo(s.link)
                    .filter(|g| !g.is_empty())
                    .unwrap_or(&cx.config.geo);
                rtt_ms.insert(geo.to_string(), p50);
            }
            samples.push(PlayerSample {
                account: s.account.clone(),
                session_id: epoch,
                pos: Pos { x, y },
                speed_mps,
                rtt_ms,
            });
        }
        self.sampled = sampled;
        samples
    }

    /// Saves the records of the attached players every `player_record_every_ms`, so a crash
    /// of the gateway loses at most that much of where they were.
    pub(crate) fn save_player_records(&mut self, cx: &mut Context, table: &EntityTable) {
        let every = cx.config.player_record_every_ms;
        if every == 0 || cx.now.mono_ms < self.next_records_ms {
            return;
        }
        self.next_records_ms = cx.now.mono_ms + every;
        let records: Vec<PlayerRecord> = self
            .sessions
            .iter()
            .filter(|s| s.epoch.is_some())
            .map(|s| self.player_record(cx, table, s))
            .filter(|r| r.last_position.is_some())
            .collect();
        if !records.is_empty() {
            cx.store(StoreRequest::SaveRecords { records });
        }
    }

    /// `account`'s session is over: where its avatar is simulated is forgotten. Returns the node
    /// that simulates it (this one when no other is known), whose game hears the leave.
    pub(crate) fn release_avatar(&mut self, cx: &Context, account: &str) -> NodeId {
        let owner = self
            .master_owner
            .remove(account)
            .unwrap_or(cx.config.node_id);
        self.master_epoch.remove(account);
        self.clients.set_remote_anchor(account, None);
        owner
    }

    /// Where `account`'s avatar was last anchored is forgotten.
    pub(crate) fn forget_avatar_position(&mut self, account: &str) {
        self.anchor_pos.remove(account);
    }

    /// Tells the proxy of session `key`, if it is here, that the session is detached.
    pub(crate) fn kick(&self, cx: &mut Context, key: SessionKey, reason: KickReason, detail: &str) {
        if let Some(s) = self.sessions.get(key) {
            cx.queue_for_link(s.link, detach(s.session_id, reason, detail));
        }
    }

    /// Drops every trace of a session on this node, telling nobody.
    pub(crate) fn forget_session(
        &mut self,
        cx: &Context,
        mesh: &mut Mesh,
        key: SessionKey,
    ) -> Option<Session> {
        let s = self.sessions.remove(key)?;
        self.where_sent.remove(&key);
        mesh.remove_session(s.link, key);
        self.clients.remove(key);
        cx.metrics.sessions.set(self.sessions.attached() as i64);
        Some(s)
    }

    /// Renews the directory lease of every attached session, off the node task. One batch at a
    /// time: a store that answers late gets no second batch on top of the first.
    pub(crate) fn renew_leases(&mut self, cx: &mut Context) {
        if self.renewing {
            return;
        }
        let due: Vec<(SessionKey, String, u64)> = self
            .sessions
            .iter()
            .filter_map(|s| Some((s.key, s.account.clone(), s.epoch?)))
            .collect();
        if due.is_empty() {
            return;
        }
        self.renewing = true;
        cx.store(StoreRequest::Renew {
            sessions: due,
            lease_ms: cx.config.session_lease_ms,
        });
    }

    pub(crate) fn on_renewed(
        &mut self,
        cx: &mut Context,
        results: Vec<(SessionKey, u64, Result<bool, String>)>,
    ) {
        self.renewing = false;
        for (key, epoch, r) in results {
            let Some(s) = self.sessions.get(key).filter(|s| s.epoch == Some(epoch)) else {
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
                    if self.reregistering.insert(key) {
                        cx.store(StoreRequest::Reregister {
                            session: key,
                            account,
                            node: cx.config.node_id,
                            lease_ms: cx.config.session_lease_ms,
                            held: epoch,
                        });
                    }
                }
                Err(e) => {
                    cx.metrics.error("store");
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
        cx: &mut Context,
        key: SessionKey,
        account: String,
        held: u64,
        result: Result<Option<u64>, String>,
    ) -> Reregistered {
        self.reregistering.remove(&key);
        let Some(s) = self.sessions.get(key).filter(|s| s.epoch == Some(held)) else {
            // Ended or displaced meanwhile: undo the registration.
            if let Ok(Some(epoch)) = result {
                release(cx, account, epoch);
            }
            return Reregistered::Nothing;
        };
        let last_position = s.last_position;
        match result {
            Ok(Some(epoch)) => {
                tracing::info!(%account, held, epoch, "the session directory had lost this session: registered again");
                cx.metrics.sessions_reregistered.inc();
                if let Some(s) = self.sessions.all.get_mut(&key) {
                    s.epoch = Some(epoch);
                }
                Reregistered::Again {
                    epoch,
                    last_position,
                }
            }
            Ok(None) => {
                self.kick(
                    cx,
                    key,
                    KickReason::Displaced,
                    "the account logged in again",
                );
                Reregistered::Displaced
            }
            Err(e) => {
                // The next renewal finds the entry gone again and asks once more.
                cx.metrics.error("store");
                tracing::warn!(%account, error = %e, "registering a lost session again failed");
                Reregistered::Nothing
            }
        }
    }
}
