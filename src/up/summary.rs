//! The summary of a run (`--summary-json`), drawn from the figures it collected, and what it
//! shows went wrong.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cellmesh_arena::ArenaStats;
use cellmesh_proxy::ProxyStats;
use serde::Serialize;

use super::census::CensusRead;
use super::chaos::ChaosFigures;
use super::geo_layout::GeoLayout;
use super::input_ledger::InputLedger;
use super::node_totals::{HandoffCosts, NodeTotals};
use super::plot;
use crate::bots::{BotStats, BotTotals};
use cellmesh_director::DirectorStats;

/// What a run did; written as `--summary-json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    pub nodes: usize,
    pub bots: usize,
    pub sessions_peak: u64,
    pub inputs_sent: u64,
    pub inputs_delivered: u64,
    pub inputs_applied: u64,
    /// Inputs the games received and ignored, by why: `duplicate` (a sequence number already
    /// applied: a double delivery), `while_frozen`, `no_player`, `stale_session`.
    pub inputs_ignored_by_games: BTreeMap<String, u64>,
    pub updates_delivered: u64,
    pub batches_delivered: u64,
    pub entities: u64,
    pub errors: u64,
    /// The errors by where they were counted: `bots_lost_session` (a bot's session broke or
    /// its login failed), `sidecar_<kind>` (a sidecar's `errors_total{kind}`), and
    /// `games_told` (errors the sidecars reported to their games: each also a `sidecar_` one).
    pub errors_by_kind: BTreeMap<String, u64>,
    pub kicks: u64,
    /// Bot logins refused `SERVER_FULL` (every gateway overloaded), retried after the hint.
    pub logins_refused: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    /// With more than 200 bots, the first 200 play alone first: their sessions' RTT p99 then
    /// (ms, 0 otherwise)...
    pub knee_rtt_ms_p99: f64,
    /// ...and every admitted session's once the rest came (from 4 s after they started to the
    /// end): the crowd's newcomers are refused rather than let this grow.
    pub admitted_rtt_ms_p99: f64,
    pub inputs_dropped_by_proxy: u64,
    /// Inputs the sidecars dropped, each under a named reason (`inputs_dropped_total{reason}`).
    pub inputs_dropped_by_sidecars: u64,
    /// Every input sent and not delivered, by where and why it was lost (see [`InputLedger`]).
    pub inputs_undelivered: BTreeMap<String, u64>,
    /// Sent, less delivered and undelivered under a reason: 0 when every input is accounted for.
    pub inputs_unaccounted: i64,
    /// Every hop's input counters the reasons were drawn from.
    pub inputs_by_hop: InputLedger,
    pub ghosts_render: u64,
    pub ghosts_sim: u64,
    pub subscriptions: u64,
    pub routed_messages: u64,
    pub cross_node_updates: u64,
    pub dropped_unknown_account: u64,
    /// Handoffs completed (entities that moved to another node).
    pub handoffs: u64,
    /// Entity commands handed to the game writing their target (the arenas' attacks and XP),
    /// and those that followed their target through a handoff on the way.
    pub commands_routed: u64,
    pub commands_forwarded_on_handoff: u64,
    /// Results the games got for their commands: ok, and every other (refused, entity gone,
    /// timeout, not delivered).
    pub command_results_ok: u64,
    pub command_results_failed: u64,
    /// Exclusive claims the sidecars granted (the arenas' trade escrows), and refused because
    /// another entity held the key.
    pub claims_granted: u64,
    pub claims_refused: u64,
    /// The arenas' trades: done (gift applied), refused by a claim held elsewhere, and opened
    /// while a player was in another trade by the census (must be 0).
    pub trades_done: u64,
    pub trades_refused: u64,
    pub trades_overlapping: u64,
    /// Claims granted to an arena's entity while another entity held the key, world-wide (every
    /// geo's arenas in one census): keys held twice, must be 0.
    pub claims_overlapping: u64,
    pub handoffs_refused: u64,
    pub handoff_freeze_ms_p50: f64,
    pub handoff_freeze_ms_p99: f64,
    /// Per completed handoff, game ticks in which nobody simulated the entity.
    pub handoff_ticks_missed_p50: f64,
    pub handoff_ticks_missed_p99: f64,
    /// The sidecars' own share of the freeze: the freeze less the time the two games took.
    pub handoff_freeze_sidecars_ms_p50: f64,
    pub handoff_freeze_sidecars_ms_p99: f64,
    /// Offers unanswered at the end (entities frozen, in doubt).
    pub in_doubt_now: u64,
    pub stale_epoch_drops: u64,
    /// Clients that saw an entity vanish from well inside their view when no game despawned it.
    pub vanished_on_handoff: u64,
    /// From a census of the world at rest (everything halted, no handoff in flight): every real
    /// of every node against what the games spawned and despawned.
    pub entities_alive: u64,
    pub entities_lost: u64,
    pub entities_duplicated: u64,
    /// Whether the world came to rest before the census (false: the figures above read a world
    /// still handing entities over).
    pub census_at_rest: bool,
    /// The cost of checkpoints in the geo's store: writes (one atomic write per node flush),
    /// checkpoints and bytes they carried, and the same per second per 1,000 entities.
    pub checkpoint_writes: u64,
    pub checkpoints_stored: u64,
    pub checkpoint_stored_bytes: u64,
    pub checkpoint_writes_per_s_per_1000_entities: f64,
    pub checkpoint_bytes_per_s_per_1000_entities: f64,
    /// `--chaos`: nodes killed, and the entities of theirs restored on live nodes: how long after
    /// the kill (the lease's lapse included) each was simulated again, and how far back its
    /// state went (the kill less when its restored state was taken).
    pub nodes_killed: u64,
    pub entities_restored: u64,
    pub restore_ms_p50: f64,
    pub restore_ms_p99: f64,
    pub progress_lost_ms_p50: f64,
    pub progress_lost_ms_p99: f64,
    /// Sessions moved to another gateway with the client connected, and sessions that ended
    /// without the client asking (kicked, or the connection lost).
    pub sessions_kept: u64,
    pub sessions_dropped: u64,
    /// Before the bots leave: accounts with more than one avatar in the world, and logged-in
    /// accounts with none. After they left: avatars still in the world.
    pub accounts_with_two_avatars: u64,
    pub sessions_without_avatar: u64,
    pub avatars_after_logout: u64,
    /// `--geos`: the geos, the most sessions bridged at once (simulated in another geo than
    /// their proxy's), handovers, how long a handed-over bot took from `Transfer` to `Welcome`,
    /// the logins whose hint or cookie saved the player record read, the reads that were made,
    /// and the click-to-screen time by bot location.
    pub geos: Vec<String>,
    pub bridged_sessions: u64,
    pub handovers: u64,
    pub handover_reconnect_ms_p50: f64,
    pub hint_hits: u64,
    pub cookie_hits: u64,
    pub mongo_reads_at_login: u64,
    pub probes_served: u64,
    pub input_to_update_ms: BTreeMap<String, Percentiles>,
    /// Bots handed over and then played on: the median over them of their click-to-screen
    /// medians before and after the handover.
    pub handed_over_bots: usize,
    /// Handed-over bots that found the same avatar (entity and inventory) in the new geo, or
    /// another one.
    pub handover_avatar_kept: u64,
    pub handover_avatar_replaced: u64,
    /// Handed-over bots that found the same entity, with a session before or after the handover
    /// that ended (the run's stop) before the inventory came: nothing to compare it with.
    pub handover_inventory_unseen: u64,
    pub handed_over_input_to_update_ms_before: f64,
    pub handed_over_input_to_update_ms_after: f64,
    /// `--partition bsp`: the layout's kind, the epochs committed during the run, what the
    /// director did (`--balance`), and the busiest node's load over the average (end of run, and
    /// over the run's seconds).
    pub partition: String,
    pub partition_epochs: u64,
    pub balance_moves: u64,
    pub cells_added: u64,
    pub cells_retired: u64,
    pub chunks_moved: u64,
    pub load_max_over_avg: LoadSpread,
    /// `--bubbles`: bubbles whose regions the geo-aware director committed to another geo (one
    /// per bubble and epoch), the regions moved, when the gathering bots' bubble first moved (s
    /// into the run; 0: never), the 99th percentile freeze of an entity a new partition moved
    /// (nobody simulates it from its last tick at the source to its first at the target), and
    /// the gathering bots' click to screen before that move and after it (from
    /// [`BUBBLE_SETTLE_S`] after, once its handoffs are done), with the samples of each.
    pub bubble_moves: u64,
    pub regions_moved: u64,
    pub bubble_moved_at_s: f64,
    pub bubble_switch_freeze_ms_p99: f64,
    pub click_to_screen_ms_p50_before: f64,
    pub click_to_screen_ms_p50_after: f64,
    pub click_to_screen_samples_before: usize,
    pub click_to_screen_samples_after: usize,
    /// `--edge-outage`: the outages (every node of a geo killed at once), how long after its
    /// outage each of the dark geo's entities was simulated again (by the core, from the copies of
    /// its checkpoints) and how many were, and the sessions the proxies attached to a fallback
    /// gateway of the core geo (the players stayed connected), and those moved back to their
    /// geo's gateways once it had been back a while.
    pub edge_outages: u64,
    pub fallback_s_p50: f64,
    pub fallback_s_p99: f64,
    pub entities_fallen_back: u64,
    pub sessions_fallen_back: u64,
    pub sessions_returned_home: u64,
}

/// Seconds after a bubble's move before its bots' click to screen counts as "after".
pub const BUBBLE_SETTLE_S: f64 = 5.0;

/// The gathering bots' figures of a `--bubbles` run.
#[derive(Debug, Clone, Default)]
pub(super) struct BubbleFigures {
    /// When their bubble's region was first committed to another geo (s into the run).
    pub(super) moved_at_s: Option<f64>,
    pub(super) before: Option<(f64, usize)>,
    pub(super) after: Option<(f64, usize)>,
}

/// Within how long after an edge outage its geo's world must be simulated by the core again.
pub const FALLBACK_WITHIN_S: f64 = 30.0;

/// What an `--edge-outage` cost.
#[derive(Debug, Clone, Default)]
pub(super) struct EdgeFigures {
    pub(super) outages: u64,
    /// From the outage to each of the dark geo's entities simulated again (ms): p50, p99, how
    /// many.
    pub(super) fallback_ms: (f64, f64, u64),
}

/// The busiest node's load over the average of the nodes holding a cell.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadSpread {
    /// The last second's, before the bots left.
    pub end: f64,
    pub p50: f64,
    pub p99: f64,
    /// Seconds sampled (those with every node's load known).
    pub samples: usize,
}

/// The median and 99th percentile of some samples.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub samples: usize,
}

impl Percentiles {
    fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            v.get(((v.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        Self {
            p50: at(0.5),
            p99: at(0.99),
            samples: v.len(),
        }
    }
}

impl Summary {
    /// What the run broke: an entity lost or held twice, or an input neither delivered nor
    /// dropped under a reason.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.entities_lost > 0 {
            p.push(format!("{} entities lost", self.entities_lost));
        }
        if self.entities_duplicated > 0 {
            p.push(format!("{} entities held twice", self.entities_duplicated));
        }
        if self.inputs_unaccounted != 0 {
            p.push(format!(
                "{} inputs unaccounted for ({} sent, {} delivered, undelivered by reason {:?})",
                self.inputs_unaccounted,
                self.inputs_sent,
                self.inputs_delivered,
                self.inputs_undelivered
            ));
        }
        if !self.census_at_rest {
            p.push("the world did not come to rest for the census".to_string());
        }
        if self.trades_overlapping > 0 {
            p.push(format!(
                "{} trades opened while a player was in another (two holders of a claim)",
                self.trades_overlapping
            ));
        }
        if self.claims_overlapping > 0 {
            p.push(format!(
                "{} claims granted while another entity held the key (two holders of a claim)",
                self.claims_overlapping
            ));
        }
        if self.accounts_with_two_avatars > 0 {
            p.push(format!(
                "{} accounts with two avatars",
                self.accounts_with_two_avatars
            ));
        }
        if self.sessions_without_avatar > 0 {
            p.push(format!(
                "{} sessions without an avatar",
                self.sessions_without_avatar
            ));
        }
        if self.avatars_after_logout > 0 {
            p.push(format!(
                "{} avatars left after every player logged out",
                self.avatars_after_logout
            ));
        }
        if self.nodes_killed > 0 && self.sessions_dropped > 0 {
            p.push(format!(
                "{} sessions dropped while nodes were killed",
                self.sessions_dropped
            ));
        }
        if self.edge_outages > 0 && self.entities_fallen_back == 0 {
            p.push("no entity of the dark geo was simulated again".to_string());
        }
        if self.fallback_s_p99 > FALLBACK_WITHIN_S {
            p.push(format!(
                "the dark geo's entities were simulated again {:.1} s after the outage (p99), more than {FALLBACK_WITHIN_S} s",
                self.fallback_s_p99
            ));
        }
        p
    }
}

/// What a run collected, once wound down: what its [`Summary`] and its plot are drawn from.
pub(super) struct Figures {
    pub(super) started: Instant,
    pub(super) nodes: usize,
    pub(super) bots: usize,
    pub(super) bsp: bool,
    pub(super) geos: Arc<GeoLayout>,
    /// The counters once the inputs settled: the nodes' (killed ones' included), the proxies'
    /// and the bots'.
    pub(super) sidecars: NodeTotals,
    pub(super) proxies: ProxyStats,
    pub(super) bot_totals: BotTotals,
    pub(super) bot_stats: Arc<BotStats>,
    pub(super) inputs_by_hop: InputLedger,
    /// Every arena's, killed nodes' included.
    pub(super) arenas: ArenaStats,
    pub(super) inputs_ignored_by_games: BTreeMap<String, u64>,
    pub(super) trades_overlapping: u64,
    pub(super) claims_overlapping: u64,
    pub(super) handoff_costs: HandoffCosts,
    pub(super) in_doubt_now: u64,
    pub(super) census: CensusRead,
    pub(super) census_at_rest: bool,
    pub(super) entities_peak: u64,
    pub(super) nodes_killed: u64,
    pub(super) chaos: ChaosFigures,
    pub(super) accounts_with_two_avatars: u64,
    pub(super) sessions_without_avatar: u64,
    pub(super) avatars_after_logout: u64,
    pub(super) knee_rtt_ms_p99: f64,
    pub(super) admitted_rtt_ms_p99: f64,
    pub(super) bridged_peak: u64,
    pub(super) partition_epochs: u64,
    pub(super) directed: DirectorStats,
    /// The load spread of each second, and the last before the bots left.
    pub(super) spreads: Vec<f64>,
    pub(super) load_end: f64,
    /// What only the plot shows.
    pub(super) bridged_over_time: Vec<(f64, u64)>,
    pub(super) handover_marks: Vec<plot::HandoverMark>,
    pub(super) kill_marks: Vec<plot::KillMark>,
    pub(super) bubble: BubbleFigures,
    pub(super) edge: EdgeFigures,
}

impl Summary {
    /// The summary of a run from what it collected.
    pub(super) fn of(f: &Figures) -> Self {
        Self::traffic(f)
            .with_census_and_chaos(f)
            .with_geos(f)
            .with_partition(f)
            .with_bubbles(f)
            .with_edge_outage(f)
    }

    /// `--edge-outage`: how the dark geo's world and players fell back to the core.
    fn with_edge_outage(self, f: &Figures) -> Self {
        let (p50, p99, n) = f.edge.fallback_ms;
        Summary {
            edge_outages: f.edge.outages,
            fallback_s_p50: p50 / 1000.0,
            fallback_s_p99: p99 / 1000.0,
            entities_fallen_back: n,
            sessions_fallen_back: f.proxies.sessions_fallen_back,
            sessions_returned_home: f.proxies.sessions_returned_home,
            ..self
        }
    }

    /// `--bubbles`: what the geo-aware director moved, and what the gathering bots saw of it.
    fn with_bubbles(self, f: &Figures) -> Self {
        let (d, b) = (&f.directed, &f.bubble);
        let freeze = &f.handoff_costs.partition_gap;
        Summary {
            bubble_moves: d.bubble_moves,
            regions_moved: d.regions_moved,
            bubble_moved_at_s: b.moved_at_s.unwrap_or(0.0),
            bubble_switch_freeze_ms_p99: if freeze.is_empty() {
                0.0
            } else {
                freeze.value_at_quantile(0.99) as f64
            },
            click_to_screen_ms_p50_before: b.before.map_or(0.0, |(ms, _)| ms),
            click_to_screen_ms_p50_after: b.after.map_or(0.0, |(ms, _)| ms),
            click_to_screen_samples_before: b.before.map_or(0, |(_, n)| n),
            click_to_screen_samples_after: b.after.map_or(0, |(_, n)| n),
            ..self
        }
    }

    /// What the sidecars, proxies, bots and games counted.
    fn traffic(f: &Figures) -> Self {
        let (s, p, b, arena_stats) = (&f.sidecars, &f.proxies, &f.bot_totals, &f.arenas);
        let handoff_costs = &f.handoff_costs;
        let (inputs_undelivered, inputs_unaccounted) = f.inputs_by_hop.undelivered();
        Summary {
            duration_s: f.started.elapsed().as_secs_f64(),
            nodes: f.nodes,
            bots: f.bots,
            sessions_peak: p.sessions_peak,
            inputs_sent: b.inputs_sent,
            inputs_delivered: s.inputs_delivered,
            inputs_applied: arena_stats.inputs_applied,
            inputs_ignored_by_games: f.inputs_ignored_by_games.clone(),
            updates_delivered: b.updates_delivered,
            batches_delivered: b.batches,
            entities: s.entities,
            errors: b.errors + s.errors + arena_stats.errors_from_sidecar,
            errors_by_kind: s
                .errors_by_kind
                .iter()
                .map(|(kind, n)| (format!("sidecar_{kind}"), *n))
                .chain([
                    ("bots_lost_session".to_string(), b.errors),
                    ("games_told".to_string(), arena_stats.errors_from_sidecar),
                ])
                .filter(|(_, n)| *n > 0)
                .collect(),
            kicks: b.kicks,
            logins_refused: b.refused_full,
            rtt_ms_p50: p.rtt_ms_p50,
            rtt_ms_p99: p.rtt_ms_p99,
            rtt_samples: p.rtt_samples,
            knee_rtt_ms_p99: f.knee_rtt_ms_p99,
            admitted_rtt_ms_p99: f.admitted_rtt_ms_p99,
            inputs_dropped_by_proxy: p.inputs_dropped,
            inputs_dropped_by_sidecars: s.inputs_dropped,
            inputs_undelivered,
            inputs_unaccounted,
            inputs_by_hop: f.inputs_by_hop.clone(),
            ghosts_render: s.ghosts_render,
            ghosts_sim: s.ghosts_sim,
            subscriptions: s.subscriptions,
            routed_messages: s.routed_messages,
            cross_node_updates: s.cross_node_updates,
            dropped_unknown_account: s.dropped_unknown_account,
            handoffs: s.handoffs,
            handoffs_refused: s.handoffs_refused,
            commands_routed: s.commands_routed,
            commands_forwarded_on_handoff: s.commands_forwarded_on_handoff,
            command_results_ok: s.command_results_ok,
            command_results_failed: s.command_results_failed,
            claims_granted: s.claims_granted,
            claims_refused: s.claims_refused,
            trades_done: arena_stats.trades_done,
            trades_refused: arena_stats.trades_refused,
            trades_overlapping: f.trades_overlapping,
            claims_overlapping: f.claims_overlapping,
            handoff_freeze_ms_p50: handoff_costs.freeze.value_at_quantile(0.5) as f64,
            handoff_freeze_ms_p99: handoff_costs.freeze.value_at_quantile(0.99) as f64,
            handoff_ticks_missed_p50: handoff_costs.ticks_missed.value_at_quantile(0.5) as f64,
            handoff_ticks_missed_p99: handoff_costs.ticks_missed.value_at_quantile(0.99) as f64,
            handoff_freeze_sidecars_ms_p50: handoff_costs.sidecars_ms.value_at_quantile(0.5) as f64,
            handoff_freeze_sidecars_ms_p99: handoff_costs.sidecars_ms.value_at_quantile(0.99)
                as f64,
            in_doubt_now: f.in_doubt_now,
            stale_epoch_drops: s.stale_epoch_drops,
            vanished_on_handoff: b.vanished_on_handoff,
            ..Summary::default()
        }
    }

    /// The census at rest, the checkpoints' cost, the kills' restores, and the avatars.
    fn with_census_and_chaos(self, f: &Figures) -> Self {
        let (s, b, chaos) = (&f.sidecars, &f.bot_totals, &f.chaos);
        Summary {
            entities_alive: f.census.alive as u64,
            entities_lost: f.census.lost.len() as u64,
            entities_duplicated: f.census.duplicated.len() as u64,
            census_at_rest: f.census_at_rest,
            checkpoint_writes: s.checkpoint_writes,
            checkpoints_stored: s.checkpoints_stored,
            checkpoint_stored_bytes: s.checkpoint_stored_bytes,
            checkpoint_writes_per_s_per_1000_entities: per_s_per_1000(
                s.checkpoint_writes,
                f.started.elapsed().as_secs_f64(),
                f.entities_peak,
            ),
            checkpoint_bytes_per_s_per_1000_entities: per_s_per_1000(
                s.checkpoint_stored_bytes,
                f.started.elapsed().as_secs_f64(),
                f.entities_peak,
            ),
            nodes_killed: f.nodes_killed,
            entities_restored: chaos.restored,
            restore_ms_p50: chaos.restore_ms.0,
            restore_ms_p99: chaos.restore_ms.1,
            progress_lost_ms_p50: chaos.progress_lost_ms.0,
            progress_lost_ms_p99: chaos.progress_lost_ms.1,
            sessions_kept: b.sessions_moved,
            sessions_dropped: b.errors,
            accounts_with_two_avatars: f.accounts_with_two_avatars,
            sessions_without_avatar: f.sessions_without_avatar,
            avatars_after_logout: f.avatars_after_logout,
            ..self
        }
    }

    /// `--geos`: bridges, handovers, and click to screen by bot location.
    fn with_geos(self, f: &Figures) -> Self {
        let (s, p, bot_stats) = (&f.sidecars, &f.proxies, &f.bot_stats);
        let handed_over = bot_stats
            .handed_over_input_to_update_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Summary {
            geos: if f.geos.several() {
                f.geos.names.clone()
            } else {
                Vec::new()
            },
            bridged_sessions: f.bridged_peak,
            handovers: p.handovers,
            handover_reconnect_ms_p50: Percentiles::of(
                bot_stats
                    .reconnect_ms
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone(),
            )
            .p50,
            hint_hits: p.hint_hits,
            cookie_hits: p.cookie_hits,
            mongo_reads_at_login: s.login_record_reads,
            probes_served: p.probes_served,
            handed_over_bots: handed_over.len(),
            handover_avatar_kept: bot_stats
                .handover_avatar_kept
                .load(std::sync::atomic::Ordering::Relaxed),
            handover_avatar_replaced: bot_stats
                .handover_avatar_replaced
                .load(std::sync::atomic::Ordering::Relaxed),
            handover_inventory_unseen: bot_stats
                .handover_inventory_unseen
                .load(std::sync::atomic::Ordering::Relaxed),
            handed_over_input_to_update_ms_before: Percentiles::of(
                handed_over.iter().map(|(b, _)| *b).collect(),
            )
            .p50,
            handed_over_input_to_update_ms_after: Percentiles::of(
                handed_over.iter().map(|(_, a)| *a).collect(),
            )
            .p50,
            input_to_update_ms: bot_stats
                .click_to_screen
                .figures()
                .into_iter()
                .map(|(loc, figures)| {
                    let p = Percentiles {
                        p50: figures.p50_ms,
                        p99: figures.p99_ms,
                        samples: figures.samples as usize,
                    };
                    (loc, p)
                })
                .collect(),
            ..self
        }
    }

    /// `--partition bsp`: the epochs, what the director did, and the load spread.
    fn with_partition(self, f: &Figures) -> Self {
        let directed = &f.directed;
        Summary {
            partition: if f.bsp { "bsp" } else { "grid" }.into(),
            partition_epochs: f.partition_epochs,
            balance_moves: directed.balance_moves,
            cells_added: directed.cells_added,
            cells_retired: directed.cells_retired,
            chunks_moved: directed.chunks_moved,
            load_max_over_avg: {
                let pct = Percentiles::of(f.spreads.clone());
                LoadSpread {
                    end: f.load_end,
                    p50: pct.p50,
                    p99: pct.p99,
                    samples: pct.samples,
                }
            },
            ..self
        }
    }
}

/// A count over a run, per second and per 1,000 entities (0 for an empty or instant run).
fn per_s_per_1000(count: u64, seconds: f64, entities: u64) -> f64 {
    if seconds <= 0.0 || entities == 0 {
        return 0.0;
    }
    count as f64 / seconds / (entities as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_per_second_and_per_thousand_entities() {
        // 600 writes over 30 s for 300 entities: 20/s, 66.7/s per 1,000.
        let r = per_s_per_1000(600, 30.0, 300);
        assert!((r - 66.666).abs() < 0.01, "{r}");
        assert_eq!(per_s_per_1000(600, 0.0, 300), 0.0);
        assert_eq!(per_s_per_1000(600, 30.0, 0), 0.0);
    }
}
