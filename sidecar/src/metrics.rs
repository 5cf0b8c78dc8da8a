//! The sidecar's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};

use crate::model::handoff::FreezeCost;

/// Every reason a client input is dropped for before it reaches a game (`inputs_dropped`).
pub const INPUT_DROP_REASONS: [&str; 17] = [
    // The proxy named a session this gateway does not have, or one still registering.
    "unknown_session",
    "session_attaching",
    // Stamped with an older epoch of its master than the owner's.
    "stale_epoch_input",
    // For a session that is not the current one of its account here.
    "input_stale_session",
    // The owner's game is not connected.
    "no_game",
    // The node writing the master could not be reached.
    "input_peer_down",
    // Addressed to a master that died with its process (until its restore re-anchors the
    // gateway).
    "input_master_gone",
    // For a session whose avatar is being restored (its owner died): until the restored owner
    // anchors the session.
    "input_avatar_restoring",
    // For a player whose avatar a returning game is to spawn again (it had no checkpoint):
    // until the game spawns it.
    "input_avatar_respawning",
    // Held for an epoch change that never came (the entity left this node's sight).
    "input_held_dropped",
    // The fence follows a newer epoch than the entity table (never seen; counted if it is).
    "input_epoch_conflict",
    // Forwarded between owners more often than a handoff explains.
    "input_forward_loop",
    // Older than an input of its session already handed to the game (it came too late to keep
    // the order).
    "input_late",
    // Held for the game while the node lease was lapsed, past the bound of what is held.
    "lease_lapsed",
    // Held for the game while the node lease was lapsed, and the lease was then lost.
    "lease_lost",
    // Handed to a game that then released the player's avatar before applying it, so long
    // before that no copy was kept to hand on (beyond the last 64 of the player).
    "input_released_unkept",
    // Named by a game's release of an avatar that crossed a Freeze whose offer had left.
    "input_release_after_offer",
];

/// Who is on the other end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Game,
    Proxy,
    Sidecar,
}

impl Peer {
    fn label(self) -> &'static str {
        match self {
            Peer::Game => "game",
            Peer::Proxy => "proxy",
            Peer::Sidecar => "sidecar",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    pub peer: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WireLabel {
    pub direction: &'static str,
    pub peer: &'static str,
}

/// One peer sidecar link, by the peer's node id.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerNodeLabel {
    pub peer: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerTrafficLabel {
    pub peer: String,
    pub direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AudienceLabel {
    pub audience: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

/// One pair of nodes of a handoff, and what became of it.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandoffLabel {
    pub from: String,
    pub to: String,
    pub outcome: &'static str,
}

/// Longest freeze the summary histogram tracks, in milliseconds (ten minutes).
const FREEZE_MAX_MS: u64 = 600_000;

/// A histogram of 0 to [`FREEZE_MAX_MS`] (milliseconds or ticks), three significant digits.
fn freeze_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, FREEZE_MAX_MS, 3)
        .expect("static histogram bounds are valid")
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabel {
    pub why: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// One kind of call of the Agones SDK, and how it went.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgonesCallLabel {
    pub call: &'static str,
    pub result: &'static str,
}

/// Every metric of one sidecar. Cheap to clone (each metric is a shared handle).
#[derive(Clone)]
pub struct Metrics {
    pub connections: Family<PeerLabel, Gauge>,
    pub connections_total: Family<PeerLabel, Counter>,
    pub frames: Family<WireLabel, Counter>,
    pub bytes: Family<WireLabel, Counter>,
    pub errors: Family<KindLabel, Counter>,
    pub dropped: Family<ReasonLabel, Counter>,
    /// Inputs dropped, by reason (each also counts in `dropped`).
    pub inputs_dropped: Family<ReasonLabel, Counter>,
    inputs_dropped_all: Counter,
    pub sessions: Gauge,
    pub entities: Gauge,
    pub game_connected: Gauge,
    pub inputs_delivered: Counter,
    /// Inputs a game dropped because it had released the player's avatar: handed on (each was
    /// counted in `inputs_delivered` when the game got it).
    pub inputs_handed_on: Counter,
    pub batches_sent: Counter,
    pub deltas_sent: Counter,
    pub deltas_encoded: Counter,
    /// Updates the per-client budget held back for a later fold.
    pub updates_held_back: Counter,
    pub ticks: Counter,
    pub peer_up: Family<PeerNodeLabel, Gauge>,
    pub peers_up: Gauge,
    pub peer_links: Family<PeerNodeLabel, Counter>,
    pub peer_messages: Family<PeerTrafficLabel, Counter>,
    pub peer_outbox_full: Family<PeerNodeLabel, Counter>,
    pub routed: Family<AudienceLabel, Counter>,
    pub routed_messages: Counter,
    pub cross_node_updates: Counter,
    pub dropped_unknown_account: Counter,
    pub inputs_forwarded: Counter,
    /// Client inputs from proxies (a gateway's `SessionInput`s).
    pub inputs_from_proxies: Counter,
    /// Client inputs forwarded here by peers (`ForwardInput`s received).
    pub inputs_from_peers: Counter,
    /// Forwarded inputs a peer link never wrote: it was full, gone, or closed with them queued.
    pub inputs_lost_in_links: Counter,
    /// Forwarded inputs written to peer links that have ended since: at most what those links
    /// lost in flight.
    pub inputs_on_ended_links: Counter,
    /// Inputs a source applied after a refusal whose forwarded copies the target dropped (or
    /// the link lost): one input, counted on both sides.
    pub inputs_copies_applied: Counter,
    pub inputs_copies_refused: Counter,
    /// Inputs held for a unit whose offer came back after its target died, and sent to that
    /// target before: it may have applied them, so they are not applied here (at most once).
    pub inputs_abandoned_with_target: Counter,
    /// Commands this node's game sent.
    pub commands_sent: Counter,
    /// Commands handed to this node's game (as the writer of their target).
    pub commands_delivered: Counter,
    /// Commands sent on to another node: `why` is `owner` (the writer a ghost or a lookup
    /// named) or `handoff` (following the target through a handoff).
    pub commands_forwarded: Family<WhyLabel, Counter>,
    /// Results handed to this node's game, by result.
    pub command_results: Family<ResultLabel, Counter>,
    /// Commands dropped before any game saw them, by reason.
    pub commands_dropped: Family<ReasonLabel, Counter>,
    /// Commands of this node's game waiting for their result.
    pub commands_waiting: Gauge,
    /// Answers to the game's claims, by result (`granted`, `held`, `failed`).
    pub claims: Family<ResultLabel, Counter>,
    /// Claims this node's entities lost, by reason.
    pub claims_lost: Family<ReasonLabel, Counter>,
    /// Claims freed in the store: released by the game, or by their holder's despawn.
    pub claims_released: Counter,
    /// Claims carried in by handoffs and rebound under the holder's new epoch.
    pub claims_rebound: Counter,
    /// Claims this node's entities hold now.
    pub claims_held: Gauge,
    /// Claim calls for keys homed in another geo, by result: `asked` (sent to a node of the
    /// home geo), `home_unreachable` (no link to one: refused), `served` (run here for a node of
    /// another geo), `not_home` (a call for a key whose home is not this geo: refused), `busy`
    /// (too many of one link's calls under way: refused).
    pub claim_home_calls: Family<ResultLabel, Counter>,
    /// Spawn points this node stocks now (its partition gives it their chunks).
    pub spawners_owned: Gauge,
    /// Stocks granted to this node's game (`SpawnerOwned`).
    pub spawner_stocks: Counter,
    /// Spawn points this node gave up to another node (`SpawnerReleased`).
    pub spawners_released: Counter,
    pub ghosts_render: Gauge,
    pub ghosts_sim: Gauge,
    pub subscriptions: Gauge,
    pub subscribers: Gauge,
    pub handoffs: Family<HandoffLabel, Counter>,
    /// Handoffs this node completed as the source (the entity left).
    pub handoffs_out: Counter,
    pub handoffs_refused: Counter,
    /// Entities the game released (`Release`) that stayed here, thawed.
    pub releases_kept: Counter,
    pub handoffs_in_doubt: Gauge,
    pub handoff_freeze: Histogram,
    /// Per completed handoff: game ticks in which nobody simulated the unit, and the sidecars'
    /// own share of the freeze (see [`crate::model::handoff::freeze_cost`]).
    pub handoff_ticks_missed: Histogram,
    pub handoff_freeze_sidecars: Histogram,
    pub stale_epoch_drops: Counter,
    pub held_frames: Gauge,
    /// Client inputs this node holds now: for a frozen entity, behind an epoch not seen yet,
    /// or waiting for an older one after an adoption.
    pub inputs_held: Gauge,
    /// 1 while the node admits new sessions; its closings by reason.
    pub admission_open: Gauge,
    /// The game's smoothed load: the share of its tick budget it uses (the balancer's figure).
    pub load: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub admission_closings: Family<ReasonLabel, Counter>,
    /// Checkpoints the game answered, and their bytes.
    pub checkpoints: Counter,
    pub checkpoint_bytes: Counter,
    /// Entities a returning game took back from their checkpoints.
    pub restored: Counter,
    /// Writes of checkpoints to the store, the checkpoints and bytes they carried, and the
    /// checkpoints removed.
    pub checkpoint_writes: Counter,
    /// Player records read at login; a handover hint saves the read.
    pub login_record_reads: Counter,
    /// Sessions registered again after the directory lost their entry.
    pub sessions_reregistered: Counter,
    /// Node leases taken back under their epoch after they lapsed.
    pub leases_reclaimed: Counter,
    /// Peers' lapsed leases fenced by this node before their world was restored.
    pub leases_fenced: Counter,
    /// Logins that came with a handover hint, by source (hint, cookie).
    pub login_hints: Family<KindLabel, Counter>,
    /// Handover hints found older than the player record (a later session saved it): the
    /// record was used.
    pub login_hints_stale: Counter,
    /// `Attach`es refused for their attestation, by kind (missing, expired, bad_signature...).
    pub attaches_refused: Family<KindLabel, Counter>,
    pub checkpoints_stored: Counter,
    pub checkpoint_stored_bytes: Counter,
    pub checkpoints_removed: Counter,
    /// Calls of the Agones SDK server, by call and result (`ok`, `rejected`, `unreachable`).
    pub agones_calls: Family<AgonesCallLabel, Counter>,
    /// Freeze durations for the summary percentiles (prometheus buckets are too coarse).
    pub freeze_ms: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
    /// The same for ticks missed and the sidecars' share of the freeze (ms).
    pub ticks_missed: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
    pub freeze_sidecars_ms: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
    /// Of the handoffs a new partition started (its area given to another node, as a bubble move
    /// does), how long nobody simulated the entity: from its last tick at the source to its first
    /// at the target (see [`FreezeCost::gap_ms`]), for the summary percentiles (ms).
    pub gap_partition_ms: Arc<Mutex<hdrhistogram::Histogram<u64>>>,
    // Totals over every label, for `SidecarStats` (not registered: the families carry them).
    // Errors are kept by kind, as a family cannot be listed; their total is the sum.
    errors_by_kind: Arc<Mutex<std::collections::BTreeMap<&'static str, u64>>>,
    frames_in_all: Counter,
    frames_out_all: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            connections: Default::default(),
            connections_total: Default::default(),
            frames: Default::default(),
            bytes: Default::default(),
            errors: Default::default(),
            dropped: Default::default(),
            inputs_dropped: Default::default(),
            inputs_dropped_all: Default::default(),
            sessions: Default::default(),
            entities: Default::default(),
            game_connected: Default::default(),
            inputs_delivered: Default::default(),
            inputs_handed_on: Default::default(),
            batches_sent: Default::default(),
            deltas_sent: Default::default(),
            deltas_encoded: Default::default(),
            updates_held_back: Default::default(),
            ticks: Default::default(),
            peer_up: Default::default(),
            peers_up: Default::default(),
            peer_links: Default::default(),
            peer_messages: Default::default(),
            peer_outbox_full: Default::default(),
            routed: Default::default(),
            routed_messages: Default::default(),
            cross_node_updates: Default::default(),
            dropped_unknown_account: Default::default(),
            inputs_forwarded: Default::default(),
            inputs_from_proxies: Default::default(),
            inputs_from_peers: Default::default(),
            inputs_lost_in_links: Default::default(),
            inputs_on_ended_links: Default::default(),
            inputs_copies_applied: Default::default(),
            inputs_abandoned_with_target: Default::default(),
            inputs_copies_refused: Default::default(),
            commands_sent: Default::default(),
            commands_delivered: Default::default(),
            commands_forwarded: Default::default(),
            command_results: Default::default(),
            commands_dropped: Default::default(),
            commands_waiting: Default::default(),
            claims: Default::default(),
            claims_lost: Default::default(),
            claim_home_calls: Default::default(),
            claims_released: Default::default(),
            claims_rebound: Default::default(),
            claims_held: Default::default(),
            spawners_owned: Default::default(),
            spawner_stocks: Default::default(),
            spawners_released: Default::default(),
            ghosts_render: Default::default(),
            ghosts_sim: Default::default(),
            subscriptions: Default::default(),
            subscribers: Default::default(),
            handoffs: Default::default(),
            handoffs_out: Default::default(),
            handoffs_refused: Default::default(),
            handoffs_in_doubt: Default::default(),
            releases_kept: Default::default(),
            handoff_freeze: Histogram::new([
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
            ]),
            handoff_ticks_missed: Histogram::new([0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0]),
            handoff_freeze_sidecars: Histogram::new([
                0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
            ]),
            stale_epoch_drops: Default::default(),
            held_frames: Default::default(),
            inputs_held: Default::default(),
            admission_open: Default::default(),
            load: Default::default(),
            admission_closings: Default::default(),
            checkpoints: Default::default(),
            checkpoint_bytes: Default::default(),
            restored: Default::default(),
            checkpoint_writes: Default::default(),
            login_record_reads: Default::default(),
            sessions_reregistered: Default::default(),
            leases_reclaimed: Default::default(),
            leases_fenced: Default::default(),
            login_hints: Default::default(),
            login_hints_stale: Default::default(),
            attaches_refused: Default::default(),
            checkpoints_stored: Default::default(),
            checkpoint_stored_bytes: Default::default(),
            checkpoints_removed: Default::default(),
            agones_calls: Default::default(),
            freeze_ms: Arc::new(Mutex::new(freeze_histogram())),
            ticks_missed: Arc::new(Mutex::new(freeze_histogram())),
            freeze_sidecars_ms: Arc::new(Mutex::new(freeze_histogram())),
            gap_partition_ms: Arc::new(Mutex::new(freeze_histogram())),
            errors_by_kind: Default::default(),
            frames_in_all: Default::default(),
            frames_out_all: Default::default(),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them under the `cellmesh_sidecar` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("cellmesh_sidecar");
        r.register(
            "connections",
            "Open connections by peer kind",
            m.connections.clone(),
        );
        r.register(
            "connections_accepted",
            "Connections accepted by peer kind",
            m.connections_total.clone(),
        );
        r.register(
            "frames",
            "Frames by direction and peer kind",
            m.frames.clone(),
        );
        r.register(
            "bytes",
            "Bytes (length prefixes included) by direction and peer kind",
            m.bytes.clone(),
        );
        r.register("errors", "Errors by kind", m.errors.clone());
        r.register("dropped", "Messages dropped, by reason", m.dropped.clone());
        r.register(
            "inputs_dropped",
            "Client inputs dropped before reaching a game, by reason",
            m.inputs_dropped.clone(),
        );
        r.register("sessions", "Attached client sessions", m.sessions.clone());
        r.register(
            "entities",
            "Entities in the node's table",
            m.entities.clone(),
        );
        r.register(
            "game_connected",
            "1 while a game server is connected",
            m.game_connected.clone(),
        );
        r.register(
            "inputs_delivered",
            "Client inputs delivered to the game",
            m.inputs_delivered.clone(),
        );
        r.register(
            "inputs_handed_on",
            "Client inputs a game dropped after releasing the player's avatar, handed on to be delivered again (each counted in inputs_delivered too)",
            m.inputs_handed_on.clone(),
        );
        r.register(
            "batches_sent",
            "Per-client tick batches sent",
            m.batches_sent.clone(),
        );
        r.register(
            "deltas_sent",
            "Entity deltas sent to clients",
            m.deltas_sent.clone(),
        );
        r.register(
            "deltas_encoded",
            "Entity deltas encoded (the rest were shared)",
            m.deltas_encoded.clone(),
        );
        r.register(
            "updates_held_back",
            "Entity updates the per-client budget (client_updates_per_tick) held back for a later batch, nearest entities first",
            m.updates_held_back.clone(),
        );
        r.register("ticks", "Game ticks folded", m.ticks.clone());
        r.register(
            "peer_link_up",
            "1 while the link to a peer sidecar is up",
            m.peer_up.clone(),
        );
        r.register("peers_up", "Peer sidecar links up", m.peers_up.clone());
        r.register(
            "peer_links_established",
            "Links established with a peer sidecar",
            m.peer_links.clone(),
        );
        r.register(
            "peer_messages",
            "Messages to and from a peer sidecar",
            m.peer_messages.clone(),
        );
        r.register(
            "peer_outbox_full",
            "Peer links closed because the peer did not read",
            m.peer_outbox_full.clone(),
        );
        r.register(
            "routed_by_audience",
            "Node messages routed by account, by audience kind",
            m.routed.clone(),
        );
        r.register(
            "routed_messages",
            "Messages routed by account to other gateways (one per node and tick)",
            m.routed_messages.clone(),
        );
        r.register(
            "cross_node_updates",
            "Entity frames sent to subscribed nodes",
            m.cross_node_updates.clone(),
        );
        r.register(
            "dropped_unknown_account",
            "Messages for accounts with no session anywhere",
            m.dropped_unknown_account.clone(),
        );
        r.register(
            "commands_sent",
            "Entity commands this node's game sent",
            m.commands_sent.clone(),
        );
        r.register(
            "commands_delivered",
            "Entity commands handed to this node's game, the writer of their target",
            m.commands_delivered.clone(),
        );
        r.register(
            "commands_forwarded",
            "Entity commands sent on to another node, to the target's writer or following a handoff",
            m.commands_forwarded.clone(),
        );
        r.register(
            "command_results",
            "Results of entity commands handed to this node's game, by result",
            m.command_results.clone(),
        );
        r.register(
            "commands_dropped",
            "Entity commands dropped before any game saw them, by reason",
            m.commands_dropped.clone(),
        );
        r.register(
            "commands_waiting",
            "Entity commands of this node's game waiting for their result",
            m.commands_waiting.clone(),
        );
        r.register(
            "claims",
            "Answers to the game's claims, by result (granted, held, failed)",
            m.claims.clone(),
        );
        r.register(
            "claims_lost",
            "Claims this node's entities lost (lease lapsed, fenced by the store), by reason",
            m.claims_lost.clone(),
        );
        r.register(
            "claims_released",
            "Claims freed in the store by their game or their holder's despawn",
            m.claims_released.clone(),
        );
        r.register(
            "claims_rebound",
            "Claims carried in by a handoff and rebound under the holder's new epoch",
            m.claims_rebound.clone(),
        );
        r.register(
            "claims_held",
            "Claims this node's entities hold now",
            m.claims_held.clone(),
        );
        r.register(
            "claim_home_calls",
            "Claim calls for keys homed in another geo, by result (asked, home_unreachable, served, not_home, busy)",
            m.claim_home_calls.clone(),
        );
        r.register(
            "spawners_owned",
            "Spawn points this node stocks now",
            m.spawners_owned.clone(),
        );
        r.register(
            "spawner_stocks",
            "Stocks of spawn points granted to this node's game",
            m.spawner_stocks.clone(),
        );
        r.register(
            "spawners_released",
            "Spawn points this node gave up to another node",
            m.spawners_released.clone(),
        );
        r.register(
            "inputs_forwarded",
            "Client inputs forwarded to the node simulating the player",
            m.inputs_forwarded.clone(),
        );
        r.register(
            "inputs_from_proxies",
            "Client inputs received from proxies",
            m.inputs_from_proxies.clone(),
        );
        r.register(
            "inputs_from_peers",
            "Client inputs forwarded here by other nodes",
            m.inputs_from_peers.clone(),
        );
        r.register(
            "inputs_lost_in_links",
            "Forwarded client inputs a peer link never wrote (full, gone, or closed with them queued)",
            m.inputs_lost_in_links.clone(),
        );
        r.register(
            "inputs_on_ended_links",
            "Forwarded client inputs written to peer links that have ended since (at most what they lost in flight)",
            m.inputs_on_ended_links.clone(),
        );
        r.register(
            "inputs_copies_applied",
            "Inputs applied here after a refused handoff, whose copies were forwarded to the target",
            m.inputs_copies_applied.clone(),
        );
        r.register(
            "inputs_copies_refused",
            "Forwarded input copies dropped behind a refused handoff (the source applies the original)",
            m.inputs_copies_refused.clone(),
        );
        r.register(
            "inputs_abandoned_with_target",
            "Inputs sent behind an offer whose target died before checkpointing it: not applied again here (the target may have)",
            m.inputs_abandoned_with_target.clone(),
        );
        r.register(
            "ghosts_render",
            "Render ghosts (replicas of foreign entities)",
            m.ghosts_render.clone(),
        );
        r.register(
            "ghosts_sim",
            "Simulation ghosts pushed to the game",
            m.ghosts_sim.clone(),
        );
        r.register(
            "subscriptions",
            "Foreign chunks this node subscribes to",
            m.subscriptions.clone(),
        );
        r.register(
            "subscribers",
            "(chunk, node) subscriptions to this node's chunks",
            m.subscribers.clone(),
        );
        r.register(
            "handoffs",
            "Handoffs by source node, target node and outcome (started by a Freeze, released by the game, completed, refused, unsent, abandoned)",
            m.handoffs.clone(),
        );
        r.register(
            "handoff_releases_kept",
            "Units the game released that stayed on this node (not past the margin, or no target ready): thawed at once",
            m.releases_kept.clone(),
        );
        r.register(
            "handoffs_in_doubt",
            "Offers sent and not answered: the entity stays frozen",
            m.handoffs_in_doubt.clone(),
        );
        r.register(
            "handoff_freeze_seconds",
            "How long an entity stayed frozen, from Freeze to eviction or thaw, in seconds",
            m.handoff_freeze.clone(),
        );
        r.register(
            "handoff_ticks_missed",
            "Per completed handoff, game ticks in which nobody simulated the entity (the target's first simulated tick minus the source's last, minus one)",
            m.handoff_ticks_missed.clone(),
        );
        r.register(
            "handoff_freeze_sidecars_seconds",
            "Per completed handoff, the freeze less the time the two games took to answer: what the sidecars and the link cost, in seconds",
            m.handoff_freeze_sidecars.clone(),
        );
        r.register(
            "stale_epoch_drops",
            "Entity frames and inputs dropped for an old (or refused) entity epoch",
            m.stale_epoch_drops.clone(),
        );
        r.register(
            "held_frames",
            "Entity frames and inputs held for an entity epoch not seen yet",
            m.held_frames.clone(),
        );
        r.register(
            "checkpoints",
            "Entity checkpoints the game answered (each entity that changed, once per checkpoint_interval_ms)",
            m.checkpoints.clone(),
        );
        r.register(
            "checkpoint_bytes",
            "Bytes of the entity checkpoints the game answered",
            m.checkpoint_bytes.clone(),
        );
        r.register(
            "login_record_reads",
            "Player records read from the global store (MongoDB) at login; a handover hint or cookie saves the read",
            m.login_record_reads.clone(),
        );
        r.register(
            "sessions_reregistered",
            "Sessions registered again under a new epoch after the session directory lost their entry (a Redis restart, an outage longer than the lease) instead of being kicked",
            m.sessions_reregistered.clone(),
        );
        r.register(
            "leases_reclaimed",
            "Times this node took its lease back under the same epoch after it lapsed (the topology store did not answer in time), and thawed what the lapse froze",
            m.leases_reclaimed.clone(),
        );
        r.register(
            "leases_fenced",
            "Lapsed leases of peers this node fenced in the topology store before restoring their world, so that their holders cannot take them back",
            m.leases_fenced.clone(),
        );
        r.register(
            "login_hints",
            "Logins handed over from another geo whose hint (from the geo's Redis or the client's cookie) replaced the player record read",
            m.login_hints.clone(),
        );
        r.register(
            "login_hints_stale",
            "Handover hints older than the player record (a later session saved it since), which the record overruled",
            m.login_hints_stale.clone(),
        );
        r.register(
            "attaches_refused",
            "Attaches a proxy sent without a valid attestation for their account, by kind; each was answered with a Detach",
            m.attaches_refused.clone(),
        );
        r.register(
            "checkpoint_writes",
            "Writes of checkpoints to the geo's store (one atomic write per flush)",
            m.checkpoint_writes.clone(),
        );
        r.register(
            "checkpoints_stored",
            "Entity checkpoints written to the geo's store",
            m.checkpoints_stored.clone(),
        );
        r.register(
            "checkpoint_stored_bytes",
            "Bytes of the entity checkpoints written to the geo's store",
            m.checkpoint_stored_bytes.clone(),
        );
        r.register(
            "checkpoints_removed",
            "Entity checkpoints removed from the geo's store (handed away or despawned)",
            m.checkpoints_removed.clone(),
        );
        r.register(
            "entities_restored",
            "Entities a game that came back within game_grace_ms took back from their checkpoints",
            m.restored.clone(),
        );
        r.register(
            "inputs_held",
            "Client inputs held now: for a frozen entity, for an entity epoch not seen yet, or for an older input after an adoption",
            m.inputs_held.clone(),
        );
        r.register(
            "load",
            "The game's load, smoothed: the share of its tick budget it uses (from its Load reports, or estimated from its entities when it sends none)",
            m.load.clone(),
        );
        r.register(
            "admission_open",
            "1 while the node admits new sessions; 0 while it tells its proxies it is full",
            m.admission_open.clone(),
        );
        r.register(
            "admission_closings",
            "Times the node stopped admitting new sessions, by reason (tick_overrun, outbox_pressure)",
            m.admission_closings.clone(),
        );
        r.register(
            "agones_calls",
            "Calls of the Agones SDK server made on the game's behalf, by call (label, ready, health, shutdown) and result (ok, rejected: an error status, unreachable: no answer)",
            m.agones_calls.clone(),
        );
        m
    }

    /// One call of the Agones SDK server and how it went.
    pub fn agones_call(&self, call: &'static str, result: &'static str) {
        self.agones_calls
            .get_or_create(&AgonesCallLabel { call, result })
            .inc();
    }

    /// One handoff step between `from` and `to`.
    pub fn handoff(&self, from: u32, to: u32, outcome: &'static str) {
        self.handoffs
            .get_or_create(&HandoffLabel {
                from: from.to_string(),
                to: to.to_string(),
                outcome,
            })
            .inc();
    }

    /// A handoff a new partition started is done: how long nobody simulated it.
    pub fn partition_gap(&self, gap_ms: f64) {
        let _ = self
            .gap_partition_ms
            .lock()
            .expect("gap histogram lock poisoned")
            .record((gap_ms.round() as u64).clamp(1, FREEZE_MAX_MS));
    }

    pub fn freeze_done(&self, ms: u64) {
        self.handoff_freeze.observe(ms as f64 / 1000.0);
        let _ = self
            .freeze_ms
            .lock()
            .expect("freeze histogram lock poisoned")
            .record(ms.clamp(1, FREEZE_MAX_MS));
    }

    /// What a completed handoff cost: its ticks missed (if the game's tick rate is known) and
    /// the sidecars' share of its freeze.
    pub fn freeze_cost(&self, cost: &FreezeCost) {
        if let Some(ticks) = cost.ticks_missed {
            self.handoff_ticks_missed.observe(ticks as f64);
            let _ = self
                .ticks_missed
                .lock()
                .expect("ticks missed histogram lock poisoned")
                .record(ticks.min(FREEZE_MAX_MS));
        }
        self.handoff_freeze_sidecars
            .observe(cost.sidecars_ms as f64 / 1000.0);
        let _ = self
            .freeze_sidecars_ms
            .lock()
            .expect("freeze share histogram lock poisoned")
            .record(cost.sidecars_ms.min(FREEZE_MAX_MS));
    }

    /// Counts one message to (`out`) or from (`in`) peer `node`.
    pub fn peer_message(&self, node: u32, direction: &'static str) {
        self.peer_messages
            .get_or_create(&PeerTrafficLabel {
                peer: node.to_string(),
                direction,
            })
            .inc();
    }

    pub fn peer(&self, node: u32) -> PeerNodeLabel {
        PeerNodeLabel {
            peer: node.to_string(),
        }
    }

    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabel { kind }).inc();
        *self
            .errors_by_kind
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(kind)
            .or_insert(0) += 1;
    }

    /// Copies of inputs forwarded behind an offer this node refused (the source applies them).
    /// One checkpoint of `bytes` bytes kept.
    pub fn checkpoint(&self, bytes: usize) {
        self.checkpoints.inc();
        self.checkpoint_bytes.inc_by(bytes as u64);
    }

    pub fn copies_refused(&self, n: u64) {
        self.drop_msg("input_copy_refused", n);
        self.inputs_copies_refused.inc_by(n);
    }

    /// A command dropped for `reason` before any game saw it.
    pub fn drop_command(&self, reason: &'static str) {
        self.commands_dropped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub fn command_forwarded_count(&self, why: &'static str) -> u64 {
        self.commands_forwarded
            .get_or_create(&WhyLabel { why })
            .get()
    }

    pub fn claim(&self, result: &'static str) {
        self.claims.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn claims_for(&self, result: &'static str) -> u64 {
        self.claims.get_or_create(&ResultLabel { result }).get()
    }

    pub fn claim_home_call(&self, result: &'static str) {
        self.claim_home_calls
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn claim_home_calls_for(&self, result: &'static str) -> u64 {
        self.claim_home_calls
            .get_or_create(&ResultLabel { result })
            .get()
    }

    pub fn claim_lost(&self, reason: &'static str) {
        self.claims_lost
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub fn command_results_for(&self, result: &'static str) -> u64 {
        self.command_results
            .get_or_create(&ResultLabel { result })
            .get()
    }

    pub fn command_forwarded(&self, why: &'static str) {
        self.commands_forwarded
            .get_or_create(&WhyLabel { why })
            .inc();
    }

    pub fn command_result(&self, result: &'static str) {
        self.command_results
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    pub fn drop_msg(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.dropped
                .get_or_create(&ReasonLabel { reason })
                .inc_by(n);
        }
    }

    /// A client input dropped for `reason`: counted as an input and as a message.
    pub fn drop_input(&self, reason: &'static str) {
        self.drop_msg(reason, 1);
        self.inputs_dropped
            .get_or_create(&ReasonLabel { reason })
            .inc();
        self.inputs_dropped_all.inc();
    }

    /// Client inputs dropped so far for `reason` (one of [`INPUT_DROP_REASONS`]).
    pub fn inputs_dropped_for(&self, reason: &'static str) -> u64 {
        self.inputs_dropped
            .get_or_create(&ReasonLabel { reason })
            .get()
    }

    /// Client inputs dropped so far, whatever the reason.
    pub fn inputs_dropped_total(&self) -> u64 {
        self.inputs_dropped_all.get()
    }

    /// Messages dropped so far for `reason`.
    pub fn dropped_for(&self, reason: &'static str) -> u64 {
        self.dropped.get_or_create(&ReasonLabel { reason }).get()
    }

    pub fn connected(&self, peer: Peer) {
        let l = PeerLabel { peer: peer.label() };
        self.connections.get_or_create(&l).inc();
        self.connections_total.get_or_create(&l).inc();
    }

    pub fn disconnected(&self, peer: Peer) {
        self.connections
            .get_or_create(&PeerLabel { peer: peer.label() })
            .dec();
    }

    pub fn errors_total(&self) -> u64 {
        self.errors_by_kind().values().sum()
    }

    /// Errors so far by kind; kinds with none left out.
    pub fn errors_by_kind(&self) -> std::collections::BTreeMap<&'static str, u64> {
        self.errors_by_kind
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn frames_in_total(&self) -> u64 {
        self.frames_in_all.get()
    }

    pub fn frames_out_total(&self) -> u64 {
        self.frames_out_all.get()
    }

    pub(crate) fn wire(&self, peer: Peer) -> Wire {
        let get = |f: &Family<WireLabel, Counter>, direction| {
            f.get_or_create(&WireLabel {
                direction,
                peer: peer.label(),
            })
            .clone()
        };
        Wire {
            frames_in: get(&self.frames, "in"),
            bytes_in: get(&self.bytes, "in"),
            frames_out: get(&self.frames, "out"),
            bytes_out: get(&self.bytes, "out"),
            frames_in_all: self.frames_in_all.clone(),
            frames_out_all: self.frames_out_all.clone(),
        }
    }
}

/// The counters of one kind of connection, for the codec that counts frames and bytes.
#[derive(Clone)]
pub(crate) struct Wire {
    pub frames_in: Counter,
    pub bytes_in: Counter,
    pub frames_out: Counter,
    pub bytes_out: Counter,
    pub frames_in_all: Counter,
    pub frames_out_all: Counter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_durations_are_exposed_in_seconds() {
        let mut reg = Registry::default();
        let m = Metrics::register(&mut reg);
        m.freeze_done(250);
        m.freeze_cost(&FreezeCost {
            gap_ms: 40.0,
            ticks_missed: Some(1),
            sidecars_ms: 15,
        });
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for needle in [
            "cellmesh_sidecar_handoff_freeze_seconds_sum 0.25\n",
            "cellmesh_sidecar_handoff_freeze_seconds_bucket{le=\"0.2\"} 0\n",
            "cellmesh_sidecar_handoff_freeze_seconds_bucket{le=\"0.5\"} 1\n",
            "cellmesh_sidecar_handoff_freeze_sidecars_seconds_sum 0.015\n",
            "cellmesh_sidecar_handoff_freeze_sidecars_seconds_bucket{le=\"0.01\"} 0\n",
            "cellmesh_sidecar_handoff_freeze_sidecars_seconds_bucket{le=\"0.02\"} 1\n",
            "cellmesh_sidecar_handoff_ticks_missed_bucket{le=\"1.0\"} 1\n",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        // The summary percentiles stay in milliseconds.
        assert_eq!(m.freeze_ms.lock().unwrap().max(), 250);
    }
}
