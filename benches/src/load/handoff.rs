//! `handoff`: handoffs per second at a fixed entity count, and what each costs under that load.
//!
//! Two nodes share the world in strips; NPCs walk to and fro across the border between them, each
//! game ticking at 20 Hz and in step with the other (the common tick phase), at a speed that makes
//! about [`HANDOFFS_PER_S`] handoffs a second. The walk runs twice: first with every handoff
//! started by the sidecar's `Freeze` (the baseline: the source game answers in its next tick, so
//! the unit misses it), then with the games releasing each NPC in the tick it walks out
//! (`Release`: the snapshot comes with the tick, and the target adopts it for its next one).
//!
//! The figures come from the sidecars' own histograms over the measured window: the freeze (from
//! the tick that triggered it to the ack), the game ticks in which nobody simulated the entity,
//! and the sidecars' own share of the freeze (the freeze less the time the two games took to
//! answer; see `cellmesh_sidecar::model::handoff::freeze_cost`). The games of this process share
//! a clock, so they time every handoff again end to end, to the microsecond (`seen_by_games`): a
//! check on the sidecars' estimate, which has no common clock and counts whole milliseconds.
//!
//! The targets are no tick missed per handoff at p99 and a sidecars' share of at most
//! [`SIDECARS_TARGET_MS`] at p99.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::cluster::{border_x, Cluster, ClusterSpec};
use super::game::{self, GameConfig, GameStats, HandoffLog, HandoffSeen, Walk};
use super::report::{nanos_histogram, ratio};
use super::Options;

const TICK_HZ: u32 = 20;
/// NPCs walking across the border: the fixed entity count.
const NPCS: usize = 1000;
/// The handoff rate the walking speed is chosen for.
const HANDOFFS_PER_S: f64 = 200.0;
/// How far past the border on either side an NPC turns: two chunks, one past the handoff
/// margin, so every crossing is handed over.
const REACH_M: f64 = 64.0;
/// The target for the sidecars' share of the freeze at p99.
const SIDECARS_TARGET_MS: f64 = 2.0;
/// A handoff frozen this long at the end of the run counts as stuck.
const STUCK_AFTER: Duration = Duration::from_secs(1);

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    // The baseline first: the same walk, every handoff started by the sidecar's Freeze.
    let freeze = measure(opts, false).await?;
    let release = measure(opts, true).await?;
    let tick_ms = 1000.0 / f64::from(TICK_HZ);
    let p99 = |v: &Value, a: &str| v[a]["p99"].as_f64().unwrap_or(f64::NAN);
    let mut out = release.clone();
    out["handoffs_by"] = json!("release");
    out["target"] = json!({ "ticks_missed_p99": 0, "sidecars_share_p99_ms": SIDECARS_TARGET_MS });
    out["baseline"] = json!({ "tick_ms": tick_ms, "freeze": freeze });
    out["ratio"] = json!({
        "freeze_p99_vs_tick": ratio(p99(&release, "freeze_ms"), tick_ms),
        "freeze_p99_release_vs_freeze": ratio(p99(&release, "freeze_ms"), p99(&freeze, "freeze_ms")),
        "sidecars_share_p99_vs_target": ratio(p99(&release, "sidecars_share_ms"), SIDECARS_TARGET_MS),
    });
    Ok(out)
}

/// One run of the walk: handed over by the games' `Release` (`release`) or by the sidecars'
/// `Freeze`.
async fn measure(opts: &Options, release: bool) -> anyhow::Result<Value> {
    let (warm_up, measure) = if opts.quick {
        (Duration::from_secs(2), Duration::from_secs(6))
    } else {
        (Duration::from_secs(3), Duration::from_secs(30))
    };
    let tick_ms = 1000.0 / f64::from(TICK_HZ);
    // Each NPC walks a loop of 4 * REACH_M and is handed over twice per loop.
    let speed = HANDOFFS_PER_S * 4.0 * REACH_M / (2.0 * NPCS as f64 * f64::from(TICK_HZ));

    let cluster = Cluster::start(ClusterSpec {
        nodes: 2,
        gateways: vec![],
        clients: 0,
        tls: false,
    })
    .await?;
    let border = border_x(&cluster.world, 2, 1);
    let walk = Walk {
        speed,
        min_x: border - REACH_M,
        max_x: border + REACH_M,
    };
    // Spread evenly along the loop, so the handoffs come at a steady rate; each NPC starts on
    // the node that owns where it stands.
    let mut npcs: [Spawns; 2] = Default::default();
    for i in 0..NPCS {
        let along = 4.0 * REACH_M * (i as f64 + 0.5) / NPCS as f64;
        let (x, dir) = if along < 2.0 * REACH_M {
            (walk.min_x + along, 1.0)
        } else {
            (walk.max_x - (along - 2.0 * REACH_M), -1.0)
        };
        // Rows 8 m apart, so no chunk holds more than a few of them.
        let y = 1000.0 + 8.0 * (i % 512) as f64;
        let side = usize::from(x >= border);
        npcs[side].at.push((x, y));
        npcs[side].dirs.push(dir);
    }
    let log = Arc::new(HandoffLog::default());
    // Both games connect well before their first tick, and tick in step (as the common tick
    // phase of `Welcome` has them).
    let first_tick = tokio::time::Instant::now() + Duration::from_millis(500);
    let stop = CancellationToken::new();
    let stats: Vec<Arc<GameStats>> = (0..2).map(|_| Arc::default()).collect();
    let games: Vec<_> = npcs
        .into_iter()
        .enumerate()
        .map(|(i, spawns)| {
            let cfg = GameConfig {
                sidecar: cluster.local_addr(i as u32 + 1),
                tick_hz: TICK_HZ,
                npcs: spawns.at,
                npc_dirs: spawns.dirs,
                walk: Some(walk),
                handoff_log: Some(log.clone()),
                first_tick_at: Some(first_tick),
                release,
                ..GameConfig::default()
            };
            tokio::spawn(game::run(cfg, stats[i].clone(), stop.clone()))
        })
        .collect();
    cluster
        .wait_until("both games connected", |c| {
            c.sidecars.iter().all(|s| s.stats().game_connected)
        })
        .await?;

    tokio::time::sleep(warm_up).await;
    let before = Window::read(&cluster, &stats);
    log.take();
    tokio::time::sleep(measure).await;
    let after = Window::read(&cluster, &stats);
    let seen = log.take();
    let stuck =
        log.frozen_since_before(game::now_ns().saturating_sub(STUCK_AFTER.as_nanos() as u64));
    let in_flight_at_end: u64 = cluster
        .sidecars
        .iter()
        .map(|s| s.stats().in_doubt_now)
        .sum();
    stop.cancel();
    for g in games {
        g.await.context("a game task")??;
    }
    drop(cluster);

    let w = after.since(&before)?;
    anyhow::ensure!(
        w.handoffs > 0 && !w.ticks_missed.is_empty(),
        "no handoff completed while measuring ({} NPCs at {speed:.2} m a tick)",
        NPCS
    );
    let q = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64;
    let handoffs_per_s = w.handoffs as f64 / measure.as_secs_f64();
    Ok(json!({
        "npcs": NPCS,
        "tick_hz": TICK_HZ,
        "speed_m_per_tick": (speed * 1000.0).round() / 1000.0,
        "offered_handoffs_per_s": HANDOFFS_PER_S,
        "measured_s": measure.as_secs_f64(),
        "handoffs": w.handoffs,
        "handoffs_per_s": (handoffs_per_s * 10.0).round() / 10.0,
        // Refused by the target; every unit its source gave up and resumed (refused, unsent,
        // despawned before its snapshot); frozen for over a second at the end.
        "failed": { "refused": w.refused, "thawed": w.thawed, "stuck": stuck },
        "offers_in_flight_at_end": in_flight_at_end,
        "freeze_ms": {
            "p50": q(&w.freeze, 0.5),
            "p99": q(&w.freeze, 0.99),
            "p999": q(&w.freeze, 0.999),
            "max": w.freeze.max() as f64,
        },
        "ticks_missed": {
            "handoffs": w.ticks_missed.len(),
            "none_missed": none_missed(&w.ticks_missed),
            "p50": q(&w.ticks_missed, 0.5),
            "p99": q(&w.ticks_missed, 0.99),
            "max": w.ticks_missed.max() as f64,
        },
        "sidecars_share_ms": {
            "p50": q(&w.sidecars, 0.5),
            "p99": q(&w.sidecars, 0.99),
            "p999": q(&w.sidecars, 0.999),
        },
        "seen_by_games": seen_by_games(&seen, tick_ms),
    }))
}

/// The NPCs one game spawns: where, and which way each walks first.
#[derive(Default)]
struct Spawns {
    at: Vec<(f64, f64)>,
    dirs: Vec<f64>,
}

/// The figures of both nodes at one moment: the sidecars' histograms are cumulative, so a
/// window is the difference of two reads.
struct Window {
    handoffs: u64,
    refused: u64,
    thawed: u64,
    freeze: Histogram<u64>,
    ticks_missed: Histogram<u64>,
    sidecars: Histogram<u64>,
}

impl Window {
    fn read(cluster: &Cluster, games: &[Arc<GameStats>]) -> Self {
        let empty = || Histogram::new(3).expect("valid histogram");
        let mut w = Self {
            handoffs: 0,
            refused: 0,
            thawed: games.iter().map(|g| g.thawed.load(Relaxed)).sum(),
            freeze: empty(),
            ticks_missed: empty(),
            sidecars: empty(),
        };
        for s in &cluster.sidecars {
            let st = s.stats();
            w.handoffs += st.handoffs;
            w.refused += st.handoffs_refused;
            let _ = w.freeze.add(s.freeze_ms());
            let _ = w.ticks_missed.add(s.ticks_missed());
            let _ = w.sidecars.add(s.freeze_sidecars_ms());
        }
        w
    }

    fn since(mut self, before: &Window) -> anyhow::Result<Self> {
        self.handoffs -= before.handoffs;
        self.refused -= before.refused;
        self.thawed -= before.thawed;
        self.freeze.subtract(&before.freeze)?;
        self.ticks_missed.subtract(&before.ticks_missed)?;
        self.sidecars.subtract(&before.sidecars)?;
        Ok(self)
    }
}

/// The fraction of handoffs that missed no tick, to three decimals.
fn none_missed(ticks: &Histogram<u64>) -> f64 {
    ratio(ticks.count_between(0, 0) as f64, ticks.len().max(1) as f64)
}

/// The same figures from the games' one clock, for the handoffs completed while measuring, and
/// where the freeze went, step by step.
fn seen_by_games(seen: &[HandoffSeen], tick_ms: f64) -> Value {
    let mut ticks = Histogram::<u64>::new(3).expect("valid histogram");
    let mut sidecars = nanos_histogram();
    let mut freeze = nanos_histogram();
    // The steps, in order: the source sidecar takes the tick and sends `Freeze`; the source
    // game answers in its next frame; the sidecars carry the snapshot to the target's game;
    // that game ends its next tick with the entity; the sidecars carry the answer back.
    let mut steps: [(&str, Histogram<u64>); 5] = [
        ("tick_end_to_freeze", nanos_histogram()),
        ("source_game", nanos_histogram()),
        ("snapshot_to_adopt", nanos_histogram()),
        ("target_game", nanos_histogram()),
        ("adopted_to_evict", nanos_histogram()),
    ];
    for h in seen {
        let gap_ms = h.gap_ns() as f64 / 1e6;
        let _ = ticks.record(((gap_ms / tick_ms).round() - 1.0).max(0.0) as u64);
        let _ = sidecars.record(h.sidecars_ns().max(1));
        let _ = freeze.record(h.evict_ns.saturating_sub(h.last_tick_end_ns).max(1));
        let times = [
            h.last_tick_end_ns,
            h.freeze_ns,
            h.snapshot_ns,
            h.adopt_ns,
            h.first_tick_end_ns,
            h.evict_ns,
        ];
        for (i, (_, step)) in steps.iter_mut().enumerate() {
            let _ = step.record(times[i + 1].saturating_sub(times[i]).max(1));
        }
    }
    let ms = |h: &Histogram<u64>, q: f64| (h.value_at_quantile(q) as f64 / 1e3).round() / 1e3;
    let steps: serde_json::Map<String, Value> = steps
        .iter()
        .map(|(name, h)| {
            let v = json!({ "p50": ms(h, 0.5), "p99": ms(h, 0.99) });
            (format!("{name}_ms"), v)
        })
        .collect();
    json!({
        "handoffs": seen.len(),
        "ticks_missed": {
            "none_missed": none_missed(&ticks),
            "p50": ticks.value_at_quantile(0.5) as f64,
            "p99": ticks.value_at_quantile(0.99) as f64,
        },
        "freeze_ms": { "p50": ms(&freeze, 0.5), "p99": ms(&freeze, 0.99) },
        "sidecars_share_ms": {
            "p50": ms(&sidecars, 0.5),
            "p99": ms(&sidecars, 0.99),
            "p999": ms(&sidecars, 0.999),
        },
        "steps": steps,
    })
}
