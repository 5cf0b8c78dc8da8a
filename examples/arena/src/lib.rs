//! `arena`: a toy game server that uses nothing but the cellmesh local-protocol SDK.
//!
//! Players walk where their input points; NPCs wander. It shows the audiences: `Kind` is public,
//! `Health` is public for NPCs and owner-and-party for players, `Inventory` and `InputAck` are
//! owner-only. It is the reference for how a game adopts the local protocol (see the README),
//! handoffs included: a frozen entity is neither moved nor written, its snapshot is complete
//! ([`schema::SampleSnapshot`]), an evicted one is forgotten without a despawn, and an adopted one
//! carries on from its snapshot, input sequence numbers included.

mod census;
pub mod combat;
mod game;
pub mod schema;
pub mod trade;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_proto::local::{game_message::Body, Load};
use cellmesh_proto::sdk::{self, SdkConfig, SidecarAddr, TickClock};

pub use census::{Census, CensusReport};
pub use game::{Arena, Held, Outbox};

#[derive(Debug, Clone)]
pub struct ArenaConfig {
    pub sidecar: SidecarAddr,
    pub npcs: u32,
    /// Where NPCs and new players appear, and the square they roam in (`spread` metres a side).
    pub center: (f64, f64),
    pub spread: f64,
    pub tick_hz: u32,
    pub seed: u64,
    /// Metres per second a player walks.
    pub player_speed: f64,
    /// Metres per second an NPC wanders.
    pub npc_speed: f64,
    /// Where this arena records what it spawns, despawns, adopts and evicts.
    pub census: Option<Arc<Census>>,
    /// Once set, nothing moves any more (a census of a world at rest).
    pub halt: Option<Arc<AtomicBool>>,
    /// Hand an entity over with `Release` in the tick it walks out of the node's area (else
    /// the sidecar's `Freeze` does it, a tick later).
    pub release: bool,
    /// With `release`, players' avatars are released too, naming the last input applied
    /// (protocol 1.8); else the sidecar's `Freeze` hands them over.
    pub release_avatars: bool,
    /// Milliseconds of tick each entity is reported to cost in `Load`, on top of the tick as
    /// measured: the toy's own tick takes microseconds, and a balancer needs a game's weight.
    pub entity_cost_ms: f32,
    /// Players attack the nearest NPC in reach with entity commands (see `combat`).
    pub combat: bool,
    /// Players trade with the nearest other player in reach, under exclusive claims (see
    /// `trade`).
    pub trade: bool,
    /// Dens (the mesh's spawn points): (key, position). The node owning a den's chunk stocks it
    /// with one NPC; a den NPC killed is gone, and the den is stocked again.
    pub dens: Vec<(String, (f64, f64))>,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        Self {
            sidecar: SidecarAddr::Tcp("127.0.0.1:7100".into()),
            npcs: 100,
            center: (1000.0, 1000.0),
            spread: 400.0,
            tick_hz: 20,
            seed: 1,
            player_speed: schema::PLAYER_SPEED,
            npc_speed: schema::NPC_SPEED,
            census: None,
            halt: None,
            release: true,
            release_avatars: false,
            entity_cost_ms: 0.0,
            combat: true,
            trade: true,
            dens: Vec::new(),
        }
    }
}

/// What the arena did, for logs and tests.
#[derive(Debug, Clone, Default)]
pub struct ArenaStats {
    pub ticks: u64,
    pub inputs_applied: u64,
    pub inputs_duplicate: u64,
    pub players_joined: u64,
    pub errors_from_sidecar: u64,
    /// Entities frozen for a handoff by the sidecar's `Freeze`.
    pub frozen: u64,
    /// Entities this arena released (`Release`) as they walked out of its area...
    pub released: u64,
    /// ...and of those, how many the sidecar kept (thawed).
    pub releases_kept: u64,
    /// Of the releases, those of a player's avatar (named with the last input applied).
    pub avatars_released: u64,
    /// Snapshots sent (a repeated Freeze is answered again).
    pub snapshots: u64,
    /// Checkpoints answered.
    pub checkpoints: u64,
    pub adopted: u64,
    pub evicted: u64,
    /// Handoffs refused: entities resumed.
    pub thawed: u64,
    /// Inputs that reached a frozen player, ignored: the sidecar holds them back after its
    /// `Freeze`, and hands on those after the last one applied after a `Release`.
    pub inputs_while_frozen: u64,
    /// Inputs for an account with no avatar here (ignored).
    pub inputs_no_player: u64,
    /// Inputs of a session older than the avatar's (ignored).
    pub inputs_stale_session: u64,
    /// Attacks sent (entity commands), and of those at an NPC seen as a ghost of another node.
    pub attacks_sent: u64,
    pub attacks_across_border: u64,
    /// Attacks applied to this arena's NPCs, and of those sent from another node.
    pub attacks_applied: u64,
    pub attacks_applied_from_other_nodes: u64,
    pub kills: u64,
    /// XP commands sent for kills, applied here, and the XP they carried.
    pub xp_sent: u64,
    pub xp_applied: u64,
    pub xp_gained: u64,
    /// XP applied here for kills on another node.
    pub xp_from_other_nodes: u64,
    /// Commands to this arena it would not apply.
    pub commands_refused: u64,
    /// Results of the commands this arena sent.
    pub results_ok: u64,
    pub results_refused: u64,
    pub results_entity_gone: u64,
    pub results_timeout: u64,
    pub results_not_delivered: u64,
    /// Results for no command waiting (a second result): must stay 0.
    pub results_unexpected: u64,
    /// Trades this arena opened (both escrows asked for), and how they ended: gift applied,
    /// refused by a claim held elsewhere, failed (a claim or the gift's command failed),
    /// lost (a claim lost midway), called off (the avatar frozen for a handoff).
    pub trades_started: u64,
    pub trades_done: u64,
    pub trades_refused: u64,
    pub trades_failed: u64,
    pub trades_lost: u64,
    pub trades_called_off: u64,
    /// Trades whose partner stood on another node (seen as a ghost).
    pub trades_across_border: u64,
    /// Gifts applied to this arena's avatars.
    pub gifts_applied: u64,
    /// Claim answers and losses this arena had.
    pub claims_granted: u64,
    pub claims_refused: u64,
    pub claims_lost: u64,
    /// Den NPCs this arena spawned when its node was given a den to stock (`SpawnerOwned`),
    /// killed (then gone: the den is stocked again), and dens given up to another node.
    pub dens_stocked: u64,
    pub den_kills: u64,
    pub dens_released: u64,
}

/// An arena that stops holds nothing: releases its census entries however `run` ends.
struct Holding(Option<(Arc<Census>, u32)>);

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some((census, node)) = self.0.take() {
            census.release_holder(node);
        }
    }
}

/// Microseconds since the Unix epoch on the wall clock, which the common tick clock counts in.
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Keeps the two longest of the ticks seen, longest first.
fn note_tick(longest: &mut [Duration; 2], took: Duration) {
    if took > longest[0] {
        longest[1] = longest[0];
        longest[0] = took;
    } else if took > longest[1] {
        longest[1] = took;
    }
}

/// Runs the arena until `shutdown` completes or the sidecar goes away. When it ends (or its task
/// is dropped) its census entries are released: read a census report before stopping arenas.
pub async fn run(
    cfg: ArenaConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<ArenaStats> {
    let mut sdk_cfg = SdkConfig::tcp("", "arena");
    sdk_cfg.addr = cfg.sidecar.clone();
    sdk_cfg.tick_rate_hz = cfg.tick_hz;
    let (mut tx, mut rx, welcome) = sdk::connect(sdk_cfg)
        .await
        .context("connecting to the sidecar")?;
    tracing::info!(node = welcome.node_id, "arena joined its sidecar");
    let tick_len = Duration::from_secs_f64(1.0 / cfg.tick_hz.max(1) as f64);
    // Ticks start on the world's common clock, so an entity released at the end of a tick here
    // is adopted for the next one on its new node.
    let clock = TickClock::from_welcome(&welcome, cfg.tick_hz);
    let _holding = Holding(cfg.census.clone().map(|c| (c, welcome.node_id)));
    let halt = cfg.halt.clone();
    let entity_cost_ms = cfg.entity_cost_ms;
    let mut arena = Arena::new(cfg, &welcome);
    arena.start(&mut tx);
    // A first report at once: the sidecar paces the logins that come before the first tick's
    // report by it, rather than admit a crowd on no word at all.
    let entities = arena.entity_count() as u32;
    tx.push(Body::Load(Load {
        tick_ms: entities as f32 * entity_cost_ms,
        budget_ms: tick_len.as_secs_f32() * 1000.0,
        entity_count: entities,
    }));
    tx.flush().await?;
    let (mut tick, wait) = clock.next_tick(unix_us());
    let mut next_at = tokio::time::Instant::now() + wait;
    let mut ticks: u64 = 0;
    let mut last_load = tokio::time::Instant::now();
    // The two longest ticks since the last `Load` report, each timed from when it was due.
    let mut longest = [Duration::ZERO; 2];
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = rx.next() => match msg {
                Some(Ok(m)) => if let Some(body) = m.body { arena.on_message(&mut tx, body) },
                Some(Err(e)) => return Err(e).context("reading from the sidecar"),
                None => { tracing::info!("sidecar closed the connection"); break }
            },
            _ = tokio::time::sleep_until(next_at) => {
                let due = next_at;
                ticks += 1;
                if halt.as_ref().is_some_and(|h| h.load(Ordering::Relaxed)) {
                    arena.halt();
                }
                arena.tick(&mut tx, tick_len.as_secs_f64());
                arena.request_ids(&mut tx);
                // From when the tick was due: a process starved of CPU starts its ticks late,
                // and its players wait as they would for a game overrunning its budget.
                note_tick(&mut longest, due.elapsed());
                if last_load.elapsed() >= Duration::from_secs(1) {
                    last_load = tokio::time::Instant::now();
                    let entities = arena.entity_count() as u32;
                    // The second longest: one slow tick a second is not an overload.
                    let tick_ms = std::mem::take(&mut longest)[1].as_secs_f32() * 1000.0;
                    tx.push(Body::Load(Load {
                        tick_ms: tick_ms + entities as f32 * entity_cost_ms,
                        budget_ms: tick_len.as_secs_f32() * 1000.0,
                        entity_count: entities,
                    }));
                }
                arena.stats.ticks = ticks;
                tx.end_tick(tick).await.context("sending the tick")?;
                // The next tick of the common clock (one that is already late is skipped).
                let (next, wait) = clock.next_tick(unix_us());
                tick = next.max(tick + 1);
                next_at = tokio::time::Instant::now() + wait;
            }
        }
    }
    let _ = tx.close().await;
    Ok(arena.stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_report_names_the_second_longest_tick() {
        let mut longest = [Duration::ZERO; 2];
        for ms in [3, 70, 5, 12, 9] {
            note_tick(&mut longest, Duration::from_millis(ms));
        }
        assert_eq!(
            longest,
            [Duration::from_millis(70), Duration::from_millis(12)]
        );
        note_tick(&mut longest, Duration::from_millis(80));
        assert_eq!(longest[1], Duration::from_millis(70));
    }
}
