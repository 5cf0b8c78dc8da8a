//! The nodes' counters summed over the run, killed nodes' included, and their handoff costs.

use std::collections::BTreeMap;

use super::node::NodeRun;

/// The nodes' counters and gauges, added up.
#[derive(Default)]
pub(super) struct NodeTotals {
    pub(super) entities: u64,
    pub(super) inputs_delivered: u64,
    pub(super) inputs_dropped: u64,
    pub(super) errors: u64,
    pub(super) ghosts_render: u64,
    pub(super) ghosts_sim: u64,
    pub(super) subscriptions: u64,
    pub(super) routed_messages: u64,
    pub(super) cross_node_updates: u64,
    pub(super) dropped_unknown_account: u64,
    pub(super) handoffs: u64,
    pub(super) handoffs_refused: u64,
    pub(super) commands_routed: u64,
    pub(super) commands_forwarded_on_handoff: u64,
    pub(super) command_results_ok: u64,
    pub(super) command_results_failed: u64,
    pub(super) claims_granted: u64,
    pub(super) claims_refused: u64,
    pub(super) in_doubt_now: u64,
    pub(super) stale_epoch_drops: u64,
    pub(super) inputs_from_proxies: u64,
    pub(super) inputs_from_peers: u64,
    pub(super) inputs_forwarded: u64,
    pub(super) inputs_lost_in_links: u64,
    pub(super) inputs_on_ended_links: u64,
    pub(super) inputs_copies_applied: u64,
    pub(super) inputs_copies_refused: u64,
    pub(super) inputs_held: u64,
    pub(super) inputs_dropped_by_reason: BTreeMap<&'static str, u64>,
    pub(super) errors_by_kind: BTreeMap<&'static str, u64>,
    pub(super) checkpoint_writes: u64,
    pub(super) login_record_reads: u64,
    pub(super) checkpoints_stored: u64,
    pub(super) checkpoint_stored_bytes: u64,
}

impl NodeTotals {
    /// Adds the counters of `o` (not its gauges): what a killed node counted stays counted.
    pub(super) fn add_counters(&mut self, o: &NodeTotals) {
        self.inputs_delivered += o.inputs_delivered;
        self.inputs_dropped += o.inputs_dropped;
        self.errors += o.errors;
        self.routed_messages += o.routed_messages;
        self.cross_node_updates += o.cross_node_updates;
        self.dropped_unknown_account += o.dropped_unknown_account;
        self.handoffs += o.handoffs;
        self.handoffs_refused += o.handoffs_refused;
        self.commands_routed += o.commands_routed;
        self.commands_forwarded_on_handoff += o.commands_forwarded_on_handoff;
        self.command_results_ok += o.command_results_ok;
        self.command_results_failed += o.command_results_failed;
        self.claims_granted += o.claims_granted;
        self.claims_refused += o.claims_refused;
        self.stale_epoch_drops += o.stale_epoch_drops;
        self.inputs_from_proxies += o.inputs_from_proxies;
        self.inputs_from_peers += o.inputs_from_peers;
        self.inputs_forwarded += o.inputs_forwarded;
        self.inputs_lost_in_links += o.inputs_lost_in_links;
        self.inputs_on_ended_links += o.inputs_on_ended_links;
        self.inputs_copies_applied += o.inputs_copies_applied;
        self.inputs_copies_refused += o.inputs_copies_refused;
        self.checkpoint_writes += o.checkpoint_writes;
        self.login_record_reads += o.login_record_reads;
        self.checkpoints_stored += o.checkpoints_stored;
        self.checkpoint_stored_bytes += o.checkpoint_stored_bytes;
        for (reason, n) in &o.inputs_dropped_by_reason {
            *self.inputs_dropped_by_reason.entry(reason).or_insert(0) += n;
        }
        for (kind, n) in &o.errors_by_kind {
            *self.errors_by_kind.entry(kind).or_insert(0) += n;
        }
    }
}

/// The handoff histograms of every node of the run, killed ones included.
pub(super) struct HandoffCosts {
    pub(super) freeze: hdrhistogram::Histogram<u64>,
    pub(super) ticks_missed: hdrhistogram::Histogram<u64>,
    pub(super) sidecars_ms: hdrhistogram::Histogram<u64>,
    /// How long nobody simulated an entity a new partition moved (a bubble move's handoffs).
    pub(super) partition_gap: hdrhistogram::Histogram<u64>,
}

impl Default for HandoffCosts {
    fn default() -> Self {
        let h = || hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
        Self {
            freeze: h(),
            ticks_missed: h(),
            sidecars_ms: h(),
            partition_gap: h(),
        }
    }
}

impl HandoffCosts {
    pub(super) fn add(&mut self, s: &cellmesh_sidecar::SidecarHandle) {
        let _ = self.freeze.add(s.freeze_ms());
        let _ = self.ticks_missed.add(s.ticks_missed());
        let _ = self.sidecars_ms.add(s.freeze_sidecars_ms());
        let _ = self.partition_gap.add(s.partition_gap_ms());
    }
}

/// The counters and gauges of `sidecars`, summed.
pub(super) fn totals_of(sidecars: &[&cellmesh_sidecar::SidecarHandle]) -> NodeTotals {
    let mut t = NodeTotals::default();
    for s in sidecars.iter().map(|h| h.stats()) {
        t.entities += s.entities;
        // An input handed on from a released avatar reaches a game twice: counted once.
        t.inputs_delivered += s.inputs_delivered.saturating_sub(s.inputs_handed_on);
        t.inputs_dropped += s.inputs_dropped;
        t.errors += s.errors;
        t.ghosts_render += s.ghosts_render;
        t.ghosts_sim += s.ghosts_sim;
        t.subscriptions += s.subscriptions;
        t.routed_messages += s.routed_messages;
        t.cross_node_updates += s.cross_node_updates;
        t.dropped_unknown_account += s.dropped_unknown_account;
        t.handoffs += s.handoffs;
        t.handoffs_refused += s.handoffs_refused;
        t.commands_routed += s.commands_delivered;
        t.commands_forwarded_on_handoff += s.commands_forwarded_on_handoff;
        t.command_results_ok += s.command_results_ok;
        t.command_results_failed += s.command_results_failed;
        t.claims_granted += s.claims_granted;
        t.claims_refused += s.claims_refused;
        t.in_doubt_now += s.in_doubt_now;
        t.stale_epoch_drops += s.stale_epoch_drops;
        t.inputs_from_proxies += s.inputs_from_proxies;
        t.inputs_from_peers += s.inputs_from_peers;
        t.inputs_forwarded += s.inputs_forwarded;
        t.inputs_lost_in_links += s.inputs_lost_in_links;
        t.inputs_on_ended_links += s.inputs_on_ended_links;
        t.inputs_copies_applied += s.inputs_copies_applied;
        t.inputs_copies_refused += s.inputs_copies_refused;
        t.inputs_held += s.inputs_held;
        t.checkpoint_writes += s.checkpoint_writes;
        t.login_record_reads += s.login_record_reads;
        t.checkpoints_stored += s.checkpoints_stored;
        t.checkpoint_stored_bytes += s.checkpoint_stored_bytes;
        for (reason, n) in s.inputs_dropped_by_reason {
            *t.inputs_dropped_by_reason.entry(reason).or_insert(0) += n;
        }
        for (kind, n) in s.errors_by_kind {
            *t.errors_by_kind.entry(kind).or_insert(0) += n;
        }
    }
    t
}

/// Every running node's, and what the killed ones counted (`departed`).
pub(super) fn totals(nodes: &[NodeRun], departed: &NodeTotals) -> NodeTotals {
    let mut t = totals_of(&nodes.iter().map(|n| &n.sidecar).collect::<Vec<_>>());
    t.add_counters(departed);
    t
}
