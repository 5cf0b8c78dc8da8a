//! The end of a run: the bots leave, every game halts, in-flight inputs land, the census reads
//! the world at rest, and everything stops; what the run did is collected on the way.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cellmesh_arena::{ArenaStats, Census};
use cellmesh_proxy::ProxyStats;

use super::bot_fleet::BotFleet;
use super::census;
use super::chaos::{chaos_figures, Chaos};
use super::cluster::Cluster;
use super::crowd::Bubble;
use super::edge_outage::EdgeOutage;
use super::input_ledger::InputLedger;
use super::live::Live;
use super::node::NodeRun;
use super::node_totals::{totals, NodeTotals};
use super::proxies::proxy_stats;
use super::summary::{BubbleFigures, EdgeFigures, Figures, BUBBLE_SETTLE_S};
use super::UpOptions;
use crate::bots::{BotStats, BotTotals};

/// Winds the run down and collects its figures.
///
/// Bots first; then every game halts (the world comes to rest for the census), and in-flight
/// inputs land before the counters are read (see [`settle_inputs`]).
pub(super) async fn wind_down(
    opts: &UpOptions,
    cluster: &mut Cluster,
    bots: BotFleet,
    mut live: Live,
    (mut chaos, outage): (Chaos, EdgeOutage),
    started: Instant,
) -> Figures {
    let games = cluster.env.games.clone();
    let bot_stats = bots.stats.clone();
    let (accounts_with_two_avatars, sessions_without_avatar) =
        avatars_of_sessions(&games, &bot_stats);
    let (knee_rtt_ms_p99, admitted_rtt_ms_p99) = bots.rtt_p99s();
    bots.stop();
    cluster.director_stop.cancel();
    let directed = match cluster.director.take() {
        Some(d) => {
            let st = d.stats();
            let _ = tokio::time::timeout(Duration::from_secs(5), d.wait()).await;
            st
        }
        None => cellmesh_director::DirectorStats::default(),
    };
    let load_end = live.spreads.last().copied().unwrap_or(0.0);
    let bubble = bubble_figures(
        opts,
        &cluster.env.geos,
        &cluster.env.world,
        &directed,
        &bot_stats,
        outage.went_dark_at_s,
        started,
    );
    bots.wait().await;
    cluster
        .env
        .halt
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (inputs_by_hop, s, p, b) = settle_inputs(cluster, &chaos, &bot_stats).await;
    let (census, census_at_rest) = census::at_rest(&cluster.nodes, &games).await;
    let mut handoff_costs = chaos.departed_handoffs;
    for n in &cluster.nodes {
        handoff_costs.add(&n.sidecar);
        chaos.restored.extend(n.sidecar.take_restored());
    }
    let in_doubt_now = totals(&cluster.nodes, &chaos.departed).in_doubt_now;
    let avatars_after_logout = games.avatars().values().map(|ids| ids.len() as u64).sum();

    cluster.env.stop.cancel();
    let (arenas, inputs_ignored_by_games) =
        arena_stats(&mut cluster.nodes, chaos.departed_arenas).await;
    live.take_handovers(&cluster.proxies, &cluster.env.geos);
    shut_down(cluster).await;
    let chaos_figures = chaos_figures(&chaos.kills, &chaos.restored);
    let edge = EdgeFigures {
        outages: outage.outages(),
        fallback_ms: outage.fallback_ms(&chaos.restored),
    };
    // Epochs past the first, whoever committed them (the director, or a failover).
    let partition_epochs = cluster
        .env
        .topology
        .partition()
        .await
        .ok()
        .flatten()
        .map_or(0, |p| p.epoch() - 1);
    Figures {
        started,
        nodes: opts.nodes,
        bots: opts.bots,
        bsp: opts.bsp,
        geos: cluster.env.geos.clone(),
        sidecars: s,
        proxies: p,
        bot_totals: b,
        bot_stats,
        inputs_by_hop,
        arenas,
        inputs_ignored_by_games,
        trades_overlapping: games.trades().1,
        claims_overlapping: games.claims().1,
        handoff_costs,
        in_doubt_now,
        census,
        census_at_rest,
        entities_peak: live.entities_peak,
        nodes_killed: chaos.kills.len() as u64,
        chaos: chaos_figures,
        accounts_with_two_avatars,
        sessions_without_avatar,
        avatars_after_logout,
        bridged_peak: live.bridged_peak,
        partition_epochs,
        directed,
        spreads: live.spreads,
        load_end,
        bridged_over_time: live.bridged_over_time,
        handover_marks: live.handover_marks,
        kill_marks: chaos.kill_marks,
        bubble,
        edge,
        knee_rtt_ms_p99,
        admitted_rtt_ms_p99,
    }
}

/// The gathering bots' figures: their bubble's first move (the first committed epoch that gave
/// the region of their point to another geo), and their click to screen on either side of it
/// (after it: until an edge outage, if one came).
fn bubble_figures(
    opts: &UpOptions,
    geos: &super::geo_layout::GeoLayout,
    world: &cellmesh_world::geometry::WorldShape,
    directed: &cellmesh_director::DirectorStats,
    bot_stats: &BotStats,
    outage_at_s: Option<f64>,
    started: Instant,
) -> BubbleFigures {
    if !opts.bubbles {
        return BubbleFigures::default();
    }
    let (x, y) = Bubble::POINT;
    let r = world.region_of(cellmesh_world::geometry::Pos { x, y });
    let region = (r.x as u32, r.y as u32);
    let start_unix_ms = super::unix_ms().saturating_sub(started.elapsed().as_millis() as u64);
    let moved_at_s = directed
        .first_moves
        .iter()
        .find(|f| f.region == region)
        .map(|f| f.at_unix_ms.saturating_sub(start_unix_ms) as f64 / 1000.0);
    let location = Bubble::location(&geos.names[geos.names.len() - 1]);
    let c = &bot_stats.click_to_screen;
    BubbleFigures {
        moved_at_s,
        before: c.median_between(&location, 0.0, moved_at_s.unwrap_or(f64::INFINITY)),
        // Up to an edge outage: the bubble falls back to the core then.
        after: moved_at_s.and_then(|at| {
            c.median_between(
                &location,
                at + BUBBLE_SETTLE_S,
                outage_at_s.unwrap_or(f64::INFINITY),
            )
        }),
    }
}

/// One avatar per logged-in account, none for anyone else (read before the bots leave): the
/// accounts with more than one, and the logged-in accounts with none.
fn avatars_of_sessions(games: &Census, bot_stats: &BotStats) -> (u64, u64) {
    let avatars = games.avatars();
    let accounts_with_two_avatars = avatars.values().filter(|ids| ids.len() > 1).count() as u64;
    let sessions_without_avatar = bot_stats
        .online_accounts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|a| !avatars.contains_key(*a))
        .count() as u64;
    if accounts_with_two_avatars > 0 || sessions_without_avatar > 0 {
        tracing::error!(
            accounts_with_two_avatars,
            sessions_without_avatar,
            "avatars do not match the sessions"
        );
    }
    (accounts_with_two_avatars, sessions_without_avatar)
}

/// Every hop's input counters now, and the counters they were read from.
fn read_ledger(
    cluster: &Cluster,
    chaos: &Chaos,
    bot_stats: &BotStats,
) -> (InputLedger, NodeTotals, ProxyStats, BotTotals) {
    let (s, p, b) = (
        totals(&cluster.nodes, &chaos.departed),
        proxy_stats(&cluster.proxies),
        bot_stats.totals(),
    );
    let ledger = InputLedger {
        bots_sent: b.inputs_sent,
        bots_on_broken_sessions: b.inputs_on_broken_sessions,
        proxy_received: p.inputs_received,
        proxy_rate_limited: p.inputs_dropped,
        proxy_lost: p.inputs_lost.clone(),
        proxy_written: p.inputs_written,
        proxy_on_ended_links: p.inputs_on_ended_links,
        sidecars_from_proxies: s.inputs_from_proxies,
        sidecars_from_peers: s.inputs_from_peers,
        sidecars_forwarded: s.inputs_forwarded,
        sidecars_lost_in_links: s.inputs_lost_in_links,
        sidecars_on_ended_links: s.inputs_on_ended_links,
        sidecars_dropped: s.inputs_dropped_by_reason.clone(),
        sidecars_copies_applied: s.inputs_copies_applied,
        sidecars_copies_refused: s.inputs_copies_refused,
        sidecars_held: s.inputs_held,
        sidecars_held_by_killed: chaos.held_by_killed,
        delivered: s.inputs_delivered,
    };
    (ledger, s, p, b)
}

/// Waits for the inputs in flight to land. An overloaded cluster is seconds behind, so this
/// waits until every input is accounted for, or the ledger holds still for longer than a dead
/// link takes to be noticed (whose inputs are named only once it is), at most 30 s. Returns the
/// last ledger read, and the counters it was read from.
async fn settle_inputs(
    cluster: &Cluster,
    chaos: &Chaos,
    bot_stats: &BotStats,
) -> (InputLedger, NodeTotals, ProxyStats, BotTotals) {
    let settle = Instant::now() + Duration::from_secs(30);
    let (mut inputs_by_hop, mut s, mut p, mut b) = read_ledger(cluster, chaos, bot_stats);
    let mut still = 0;
    // The proxy's link silence (the sidecar's is the same).
    let still_for = (cellmesh_proxy::LINK_SILENCE + Duration::from_secs(1)).as_millis() / 300;
    // Held inputs may still go on: they are waited for like an open gap.
    let open = |l: &InputLedger| l.undelivered().1 != 0 || l.sidecars_held > 0;
    while open(&inputs_by_hop) && still < still_for && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let next = read_ledger(cluster, chaos, bot_stats);
        still = if next.0 == inputs_by_hop {
            still + 1
        } else {
            0
        };
        (inputs_by_hop, s, p, b) = next;
    }
    (inputs_by_hop, s, p, b)
}

/// Waits for every arena to end (5 s at most each), and adds their figures up with those of the
/// arenas of killed nodes: the arenas' counters, and the inputs the games ignored, by why.
async fn arena_stats(
    nodes: &mut [NodeRun],
    departed_arenas: Vec<ArenaStats>,
) -> (ArenaStats, BTreeMap<String, u64>) {
    let mut arena_stats = ArenaStats::default();
    let mut inputs_ignored_by_games = BTreeMap::new();
    let mut ended = Vec::new();
    for n in nodes.iter_mut() {
        ended.push(
            match tokio::time::timeout(Duration::from_secs(5), &mut n.arena).await {
                Ok(Ok(r)) => Some(r),
                _ => None,
            },
        );
    }
    let all = departed_arenas
        .into_iter()
        .map(|st| Some(Ok(st)))
        .chain(ended);
    for arena in all {
        match arena {
            Some(Ok(st)) => {
                arena_stats.inputs_applied += st.inputs_applied;
                arena_stats.errors_from_sidecar += st.errors_from_sidecar;
                arena_stats.trades_done += st.trades_done;
                arena_stats.trades_refused += st.trades_refused;
                for (why, n) in [
                    ("duplicate", st.inputs_duplicate),
                    ("while_frozen", st.inputs_while_frozen),
                    ("no_player", st.inputs_no_player),
                    ("stale_session", st.inputs_stale_session),
                ] {
                    if n > 0 {
                        *inputs_ignored_by_games.entry(why.to_string()).or_insert(0) += n;
                    }
                }
            }
            Some(Err(e)) => tracing::warn!(error = %e, "arena ended with an error"),
            None => {}
        }
    }
    (arena_stats, inputs_ignored_by_games)
}

/// Waits for the proxies and then the nodes to stop (5 s at most each), and shuts down the
/// nodes' own runtimes.
async fn shut_down(cluster: &mut Cluster) {
    for proxy in std::mem::take(&mut cluster.proxies) {
        let _ = tokio::time::timeout(Duration::from_secs(5), proxy.wait()).await;
    }
    for n in std::mem::take(&mut cluster.nodes) {
        let _ = tokio::time::timeout(Duration::from_secs(5), n.sidecar.wait()).await;
        if let Some(rt) = n.runtime {
            let _ =
                tokio::task::spawn_blocking(move || rt.shutdown_timeout(Duration::from_secs(1)))
                    .await;
        }
    }
}
