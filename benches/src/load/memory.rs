//! `memory`: bytes per render ghost, per client session and per chunk subscription, on a
//! cluster of three nodes in vertical strips (node 1 west, node 2 in the middle, node 3 east;
//! nodes 2 and 3 are the gateways), with checkpoints off (in production they go to an external
//! store; here the in-memory store would grow in this process).
//!
//! Each count is grown on its own, once the process settled, while nothing else grows, and
//! every figure is growth divided by the count, twice: `rss`, the resident set (`VmRSS`), which
//! holds whatever the allocator keeps besides the objects (memory freed but not returned,
//! fragmentation), and `heap`, the bytes the allocator has handed out and not taken back
//! (glibc's `mallinfo2`), which follows the objects closely. Both count hash tables grown to
//! the next power of two when the growth crosses one, so a figure moves by a few tens of bytes
//! with the counts. Memory freed earlier in the process (by a scenario run before this one) is
//! taken again before the resident set grows, so `rss` reads lower after another scenario;
//! `heap` does not depend on what ran before.
//!
//! - `entities` (the control of the next): node 1's game spawns G static NPCs deep inside node
//!   1, where no other node looks. Per entity: node 1's entity table and indexes, its payload
//!   (copied out of the spawn frame), and the synthetic game's own record.
//! - `ghosts`: node 3's game spawns G NPCs the same way, in the chunk column two chunks east of
//!   its border with node 2, which node 2 always subscribes to (its ghost keep margin), so node
//!   2 holds a render ghost of each (and no simulation ghost: that column is outside the
//!   interaction band). Per ghost: this growth minus the control's (node 3 grows as node 1 did),
//!   over G: node 2's ghost with its payload (copied out of the mesh frame it came in, so the
//!   frame is freed), and node 3's record of where each of its entities is replicated. No client views them. `payload_bytes` is the size of each ghost's
//!   only component.
//! - `sessions`: S bots (`cellmesh bots`, a process of their own, so the clients' memory is not
//!   counted) log in through the proxy, half to node 2 and half to node 3, whose games spawn each
//!   avatar deep inside their node, 11 chunk rows apart. Per session: the proxy's connection and
//!   session, the gateway's session with its view (121 chunks, and the cache entry of each: see
//!   `view_moves`), the directory entry and player record (in-memory stores, in this process),
//!   the avatar entity and the game's record of it, and whatever its inputs (10 a second) and
//!   pings keep allocated.
//! - `view_moves`: node 3's game moves its avatars 1 km east, still deep inside node 3, so each
//!   view moves to 121 chunks no view held before. Per chunk first viewed: what a node keeps of
//!   every chunk any view ever held (which nodes own chunks near it, cached until the partition
//!   changes), and whatever else such a move leaves allocated.
//! - `chunk_subscriptions`: node 2's game moves its avatars to 16 m east of the border with node
//!   1, so each view reaches three chunk columns of node 1 that node 2 did not subscribe to yet;
//!   then back, then there again, and only that last move is measured: every chunk was viewed
//!   before and every table grew to hold what it needs, so what grows is what the new (chunk,
//!   node) subscriptions hold at node 2 and at node 1 (its record of the subscriber), less the
//!   render ghosts node 1 takes again of the moved avatars (at the `ghosts` figure, which also
//!   holds their share of a growing table, so this slightly undercounts). It is the marginal
//!   cost of a subscription while its tables have room. The resident set barely moves: the
//!   first move's memory was freed, and is taken again.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_sidecar::SidecarConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::{border_x, Cluster, ClusterSpec};
use super::game::{self, with_cause, GameConfig, GameControl, GameStats};
use super::probe::{heap_in_use, rss_bytes};
use super::report::ratio;
use super::Options;

/// Bytes of every entity's one component.
const PAYLOAD: usize = 64;
/// The target: resident bytes per render ghost beyond its payload.
const TARGET_BEYOND_PAYLOAD: f64 = 256.0;
/// NPCs per chunk in the ghost and control blocks.
const PER_CHUNK: usize = 100;
/// Chunk rows between two avatars: their views (11 rows each) do not overlap.
const AVATAR_ROWS_APART: f64 = 11.0;
const NODES: u32 = 3;
/// How far node 3's avatars move east, to chunks no view held, still deep inside node 3.
const VIEW_MOVE: f64 = 1000.0;
/// How far inside its node the control block and the avatars first stand.
const DEEP: f64 = 4000.0;

struct Plan {
    ghosts: usize,
    sessions: usize,
    settle: Duration,
}

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let plan = if opts.quick {
        Plan {
            ghosts: 10_000,
            sessions: 200,
            settle: Duration::from_millis(800),
        }
    } else {
        Plan {
            ghosts: 40_000,
            sessions: 600,
            settle: Duration::from_secs(2),
        }
    };
    let cluster = Cluster::start_with(
        ClusterSpec {
            nodes: NODES,
            gateways: vec![2, 3],
            clients: plan.sessions,
            tls: false,
        },
        |cfg| cfg.checkpoint_interval_ms = 0,
    )
    .await?;
    let rig = Rig::start(&cluster);
    let result = measure(&cluster, &rig, &plan, opts).await;
    let stopped = rig.stop().await;
    with_cause(result, stopped)
}

async fn measure(
    cluster: &Cluster,
    rig: &Rig,
    plan: &Plan,
    opts: &Options,
) -> anyhow::Result<Value> {
    let world = cluster.world;
    let chunk = world.chunk_size;
    let (west, east) = (border_x(&world, NODES, 1), border_x(&world, NODES, 2));
    let rows = plan.ghosts.div_ceil(PER_CHUNK);
    anyhow::ensure!(
        rows as f64 * chunk <= world.height
            && AVATAR_ROWS_APART * plan.sessions.div_ceil(2) as f64 * chunk <= world.height,
        "{} ghosts or {} sessions over two gateways do not fit the world's height",
        plan.ghosts,
        plan.sessions
    );
    let node = |id: u32| cluster.sidecars[id as usize - 1].stats();
    rig.wait("every game connected", || {
        (1..=NODES).all(|n| node(n).game_connected)
    })
    .await?;
    tokio::time::sleep(plan.settle * 2).await;
    let start = Mark::now()?;
    let g = plan.ghosts as f64;

    // The control: entities no other node looks at.
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let before = Mark::settled(plan.settle).await?;
    rig.node1
        .spawn(block(&mut rng, west - DEEP, rows, plan.ghosts, chunk));
    rig.wait("the control entities spawned", || {
        node(1).entities >= plan.ghosts as u64
    })
    .await?;
    let control = Mark::settled(plan.settle).await? - before;

    // Ghosts: the same on node 3, where node 2 holds a ghost of each.
    let ghosts_before = node(2).ghosts_render;
    let before = Mark::settled(plan.settle).await?;
    rig.node3
        .spawn(block(&mut rng, east + chunk, rows, plan.ghosts, chunk));
    rig.wait("node 2 holding a ghost of every NPC of node 3", || {
        node(3).entities >= plan.ghosts as u64
            && node(2).ghosts_render >= ghosts_before + plan.ghosts as u64
    })
    .await?;
    let ghosted = Mark::settled(plan.settle).await? - before;
    let per_ghost = (ghosted - control) / g;
    let sim_ghosts = node(2).ghosts_sim;

    // Sessions, of clients in another process, half on node 2 and half on node 3.
    let before = Mark::settled(plan.settle).await?;
    let avatars_before = node(2).entities + node(3).entities;
    let mut bots = start_bots(cluster, &opts.exe, plan.sessions)?;
    let sessions = plan.sessions as u64;
    let logged_in = rig
        .wait(
            &format!("{sessions} bots logged in with their avatars"),
            || {
                let (s2, s3) = (node(2), node(3));
                s2.sessions + s3.sessions >= sessions
                    && s2.entities + s3.entities >= avatars_before + sessions
            },
        )
        .await;
    if let Err(e) = logged_in {
        return Err(match bots.try_wait() {
            Ok(Some(status)) => e.context(format!("the bots process exited: {status}")),
            _ => e,
        });
    }
    let sessions_grown = Mark::settled(plan.settle).await? - before;
    let per_session = sessions_grown / plan.sessions as f64;
    let (on2, on3) = (node(2).sessions, node(3).sessions);
    anyhow::ensure!(
        on2 > 0 && on3 > 0,
        "the proxy put {on2} sessions on node 2 and {on3} on node 3"
    );
    let side = 2 * u64::from(SidecarConfig::default().view_radius_chunks) + 1;

    // Views moving to chunks no view held, inside node 3.
    let subs_before = node(3).subscriptions;
    let before = Mark::settled(plan.settle).await?;
    rig.node3.shift_avatars((VIEW_MOVE, 0.0));
    rig.wait("node 3's avatars moved", || {
        !rig.node3.avatar_shift_pending()
    })
    .await?;
    let view_moved = Mark::settled(plan.settle).await? - before;
    anyhow::ensure!(
        node(3).subscriptions == subs_before,
        "moving node 3's avatars inside node 3 changed its subscriptions"
    );
    let view_chunks = on3 * side * side;

    // Chunk subscriptions: node 2's views move into chunks of node 1, back, and there again.
    // The second time every chunk was viewed before and every table has grown to hold them:
    // what grows is what the subscriptions hold.
    let (subs_before, subscribers_before) = (node(2).subscriptions, node(1).subscribers);
    let avatar_ghosts_before = node(1).ghosts_render;
    let to_border = 16.0 - DEEP;
    for (by, what) in [(to_border, "to the border"), (-to_border, "back")] {
        rig.node2.shift_avatars((by, 0.0));
        rig.wait(&format!("node 2's avatars moved {what}"), || {
            !rig.node2.avatar_shift_pending()
        })
        .await?;
        tokio::time::sleep(plan.settle).await;
    }
    rig.wait("node 2's subscriptions back as they were", || {
        node(2).subscriptions == subs_before && node(1).ghosts_render == avatar_ghosts_before
    })
    .await?;
    let before = Mark::settled(plan.settle).await?;
    rig.node2.shift_avatars((to_border, 0.0));
    rig.wait("node 1 seeing every moved avatar", || {
        node(1).ghosts_render >= avatar_ghosts_before + on2
    })
    .await?;
    let moved = Mark::settled(plan.settle).await? - before;
    let (s1, s2) = (node(1), node(2));
    let new_subs = s2.subscriptions.saturating_sub(subs_before);
    let new_subscribers = s1.subscribers.saturating_sub(subscribers_before);
    let avatar_ghosts = s1.ghosts_render.saturating_sub(avatar_ghosts_before);
    anyhow::ensure!(
        new_subs > 0,
        "moving the avatars to the border subscribed node 2 to nothing new"
    );
    let per_sub = (moved - per_ghost * avatar_ghosts as f64) / new_subs as f64;
    drop(bots);

    let beyond = per_ghost.heap - PAYLOAD as f64;
    Ok(json!({
        "payload_bytes": PAYLOAD,
        "rss_start_bytes": start.rss,
        "heap_start_bytes": start.heap,
        "entities": {
            "count": plan.ghosts,
            "grown": control.rounded(),
            "bytes_per_entity": (control / g).rounded(),
        },
        "ghosts": {
            "count": plan.ghosts,
            "grown": ghosted.rounded(),
            "bytes_per_ghost": per_ghost.rounded(),
            "heap_beyond_payload_bytes": beyond.round(),
            "simulation_ghosts": sim_ghosts,
        },
        "sessions": {
            "count": plan.sessions,
            "on_node_2": on2,
            "on_node_3": on3,
            "grown": sessions_grown.rounded(),
            "bytes_per_session": per_session.rounded(),
        },
        "view_moves": {
            "count": on3,
            "chunks_first_viewed": view_chunks,
            "grown": view_moved.rounded(),
            "bytes_per_chunk_first_viewed": (view_moved / view_chunks as f64).rounded(),
        },
        "chunk_subscriptions": {
            "count": new_subs,
            "owner_side_count": new_subscribers,
            "avatar_ghosts_subtracted": avatar_ghosts,
            "grown": moved.rounded(),
            "bytes_per_subscription": per_sub.rounded(),
        },
        "baseline": { "payload_bytes_per_ghost": PAYLOAD },
        "ratio": {
            "heap_ghost_vs_payload": ratio(per_ghost.heap, PAYLOAD as f64),
            "heap_beyond_payload_vs_target_256": ratio(beyond, TARGET_BEYOND_PAYLOAD),
            "rss_beyond_payload_vs_target_256": ratio(per_ghost.rss - PAYLOAD as f64, TARGET_BEYOND_PAYLOAD),
        },
    }))
}

/// The process's memory at one moment, or a difference of two: resident, and in use by the
/// allocator.
#[derive(Debug, Clone, Copy, Serialize)]
struct Mark {
    rss: f64,
    heap: f64,
}

impl Mark {
    fn now() -> anyhow::Result<Self> {
        let heap = heap_in_use().context(
            "the memory scenario reads the allocator's own count (glibc's mallinfo2); this build has none",
        )?;
        Ok(Self {
            rss: rss_bytes()? as f64,
            heap: heap as f64,
        })
    }

    /// After `settle`: what a step allocated for a moment has been freed.
    async fn settled(settle: Duration) -> anyhow::Result<Self> {
        tokio::time::sleep(settle).await;
        Self::now()
    }

    fn rounded(self) -> Self {
        Self {
            rss: self.rss.round(),
            heap: self.heap.round(),
        }
    }
}

impl std::ops::Sub for Mark {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self {
            rss: self.rss - o.rss,
            heap: self.heap - o.heap,
        }
    }
}

impl std::ops::Mul<f64> for Mark {
    type Output = Self;
    fn mul(self, k: f64) -> Self {
        Self {
            rss: self.rss * k,
            heap: self.heap * k,
        }
    }
}

impl std::ops::Div<f64> for Mark {
    type Output = Self;
    fn div(self, k: f64) -> Self {
        self * (1.0 / k)
    }
}

/// `count` positions in the chunk column whose west edge is at `x`, `rows` chunk rows from the
/// world's south edge, spread evenly over the chunks.
fn block(rng: &mut StdRng, x: f64, rows: usize, count: usize, chunk: f64) -> Vec<(f64, f64)> {
    (0..count)
        .map(|i| {
            let row = (i % rows) as f64;
            (
                x + rng.random_range(1.0..chunk - 1.0),
                row * chunk + rng.random_range(1.0..chunk - 1.0),
            )
        })
        .collect()
}

/// `count` bots as a process of their own, logging in through the cluster's proxy.
fn start_bots(cluster: &Cluster, exe: &std::path::Path, count: usize) -> anyhow::Result<Child> {
    Command::new(exe)
        .args(["bots", "--proxy", &cluster.proxy_addr()])
        .args(["--count", &count.to_string(), "--duration", "3600"])
        .env("CELLMESH_TOKEN_SECRET", cluster.token_secret())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} bots", exe.display()))
}

/// The games: node 1's and node 3's spawn the NPCs they are told to, node 2's and node 3's the
/// bots' avatars.
struct Rig {
    node1: Arc<GameControl>,
    node2: Arc<GameControl>,
    node3: Arc<GameControl>,
    stop: CancellationToken,
    games: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl Rig {
    fn start(cluster: &Cluster) -> Self {
        let world = cluster.world;
        let chunk = world.chunk_size;
        let (west, east) = (border_x(&world, NODES, 1), border_x(&world, NODES, 2));
        let node1 = Arc::new(GameControl::default());
        let node2 = Arc::new(GameControl::default());
        let node3 = Arc::new(GameControl::default());
        let stop = CancellationToken::new();
        let static_npcs = GameConfig {
            payload_bytes: PAYLOAD,
            update_npcs: false,
            spawn_per_tick: 2000,
            ..GameConfig::default()
        };
        let games = [
            GameConfig {
                sidecar: cluster.local_addr(1),
                control: Some(node1.clone()),
                ..static_npcs.clone()
            },
            GameConfig {
                sidecar: cluster.local_addr(2),
                // In the middle of a chunk.
                avatar_at: (west + DEEP, 6.0 * chunk + chunk / 2.0),
                avatar_step: (0.0, AVATAR_ROWS_APART * chunk),
                control: Some(node2.clone()),
                ..static_npcs.clone()
            },
            GameConfig {
                sidecar: cluster.local_addr(3),
                avatar_at: (east + DEEP, 6.0 * chunk + chunk / 2.0),
                avatar_step: (0.0, AVATAR_ROWS_APART * chunk),
                control: Some(node3.clone()),
                ..static_npcs
            },
        ]
        .into_iter()
        .map(|cfg| tokio::spawn(game::run(cfg, Arc::new(GameStats::default()), stop.clone())))
        .collect();
        Self {
            node1,
            node2,
            node3,
            stop,
            games,
        }
    }

    /// Polls `ready` for up to 30 s, failing early when a game stopped.
    async fn wait(&self, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !ready() {
            anyhow::ensure!(
                !self.games.iter().any(JoinHandle::is_finished),
                "{what}: a game stopped"
            );
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Stops the games; why the first of them that failed did.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        let mut first = Ok(());
        for g in self.games {
            let r = g.await.context("a game task").and_then(|r| r);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_fills_its_column_row_by_row() {
        let mut rng = StdRng::seed_from_u64(1);
        let b = block(&mut rng, 640.0, 4, 10, 32.0);
        assert_eq!(b.len(), 10);
        assert!(b
            .iter()
            .all(|&(x, y)| (640.0..672.0).contains(&x) && (0.0..128.0).contains(&y)));
        let in_row = |r: f64| b.iter().filter(|p| (p.1 / 32.0).floor() == r).count();
        assert_eq!(
            [in_row(0.0), in_row(1.0), in_row(2.0), in_row(3.0)],
            [3, 3, 2, 2]
        );
    }
}
