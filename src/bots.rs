//! Bots: simulated players that log in through a proxy, walk around and count what they see.
//!
//! A bot answers the proxy's pings (so the proxy measures its RTT), sends a walking direction at a
//! fixed rate with increasing sequence numbers, follows its own avatar (the entity whose `Kind` is
//! `player:<its account>`), and turns back toward home when it strays beyond the roam radius.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::HashMap;

use cellmesh_arena::{schema, Census};
use cellmesh_proto::client::{self, ClientError, ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, DeltaKind, KickReason, Pong, Transfer};
use cellmesh_world::geometry::{Pos, WorldShape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

mod click_to_screen;
pub use click_to_screen::{Bin, ClickToScreen, Figures};

#[derive(Debug, Clone)]
pub struct BotConfig {
    pub proxy: String,
    pub secret: String,
    pub input_hz: f64,
    /// Bots turn back toward `home` beyond `roam` metres from it.
    pub home: (f64, f64),
    pub roam: f64,
    pub seed: u64,
    /// The sidecars' view radius: an entity vanishing this close was not out of range.
    pub view_radius_chunks: u32,
    /// What the games spawned and despawned, to tell a real vanish from one a handoff caused.
    pub census: Option<Arc<Census>>,
    /// Several geos: where the bot is, and how it reaches each proxy from there.
    pub geo: Option<BotGeo>,
    /// TLS to the proxies (`None`: plaintext, for proxies on loopback).
    pub tls: Option<client::ClientTls>,
}

/// A bot on a network of several geos.
#[derive(Debug, Clone, Default)]
pub struct BotGeo {
    /// Where the bot plays from (a geo name): its figures are kept per location.
    pub location: String,
    /// A proxy's address as the proxies name it (`Transfer`, `ProbeRequest`) -> the address this
    /// bot dials for it: a relay that adds the latency from its location to that proxy's geo.
    pub via: HashMap<String, String>,
}

impl BotConfig {
    /// The address to dial for the proxy at `addr`.
    fn dial(&self, addr: &str) -> String {
        self.geo
            .as_ref()
            .and_then(|g| g.via.get(addr).cloned())
            .unwrap_or_else(|| addr.to_string())
    }
}

impl Default for BotConfig {
    fn default() -> Self {
        Self {
            proxy: "127.0.0.1:7300".into(),
            secret: cellmesh_proxy::config::DEFAULT_TOKEN_SECRET.into(),
            input_hz: 10.0,
            home: (1000.0, 1000.0),
            roam: 150.0,
            seed: 7,
            view_radius_chunks: 5,
            census: None,
            geo: None,
            tls: None,
        }
    }
}

/// How long a leaving bot waits for the proxy to close after its `Bye`.
const BYE_LINGER: Duration = Duration::from_secs(3);
/// How long a bot waits before it logs in again after a failure (or a `SERVER_FULL` without a
/// hint).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Counters shared by all bots of one run.
#[derive(Debug, Default)]
pub struct BotStats {
    pub inputs_sent: AtomicU64,
    pub batches: AtomicU64,
    pub updates_delivered: AtomicU64,
    pub appears: AtomicU64,
    pub vanishes: AtomicU64,
    pub logins: AtomicU64,
    /// Welcomes after the first: the session moved to another gateway, the connection stayed.
    pub sessions_moved: AtomicU64,
    pub online: AtomicU64,
    pub kicks: AtomicU64,
    pub errors: AtomicU64,
    /// Connections that broke (a kick, a proxy gone, an I/O error), and what became of the
    /// player's session: `resumed` when the bot's next session found the avatar it had (the
    /// session outlived its connection, as when a proxy restarts), `dropped` when it found
    /// another, none, or the bot never got back in before the run ended.
    pub connections_lost: AtomicU64,
    pub sessions_resumed: AtomicU64,
    pub sessions_dropped: AtomicU64,
    /// Logins refused `SERVER_FULL` (retried after the proxy's hint; not errors).
    pub refused_full: AtomicU64,
    /// Vanishes of entities well inside the view that no game despawned.
    pub vanished_on_handoff: AtomicU64,
    /// Inputs sent on sessions that ended by a kick or an error: at most what those connections
    /// lost before the proxy read it.
    pub inputs_on_broken_sessions: AtomicU64,
    /// The accounts logged in now.
    pub online_accounts: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Handovers followed (a `Transfer`, then a login at the other geo's proxy), and how long each
    /// reconnect took, from the `Transfer` to the new `Welcome` (ms).
    pub handovers: AtomicU64,
    pub reconnect_ms: std::sync::Mutex<Vec<f64>>,
    /// Click to screen: from sending an input to seeing its avatar acknowledge it (the game's
    /// `INPUT_ACK`), by the bot's location.
    pub click_to_screen: ClickToScreen,
    /// Probes of other geos' proxies answered.
    pub probes: AtomicU64,
    /// For each bot handed over: the median click-to-screen time of its session before the
    /// handover, and of the one after (ms).
    pub handed_over_input_to_update_ms: std::sync::Mutex<Vec<(f64, f64)>>,
    /// Handed-over bots that found, in the new geo, the same avatar with the same inventory as
    /// before the handover, or another.
    pub handover_avatar_kept: AtomicU64,
    pub handover_avatar_replaced: AtomicU64,
    /// Handed-over bots that found the same entity, where a session ended before its
    /// inventory came (nothing to compare).
    pub handover_inventory_unseen: AtomicU64,
}

fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len().checked_sub(1)? / 2).copied()
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct BotTotals {
    pub inputs_sent: u64,
    pub batches: u64,
    pub updates_delivered: u64,
    pub appears: u64,
    pub vanishes: u64,
    pub logins: u64,
    pub sessions_moved: u64,
    pub online: u64,
    pub kicks: u64,
    pub errors: u64,
    pub connections_lost: u64,
    pub sessions_resumed: u64,
    pub sessions_dropped: u64,
    pub refused_full: u64,
    pub vanished_on_handoff: u64,
    pub inputs_on_broken_sessions: u64,
}

impl BotStats {
    pub fn totals(&self) -> BotTotals {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BotTotals {
            inputs_sent: l(&self.inputs_sent),
            batches: l(&self.batches),
            updates_delivered: l(&self.updates_delivered),
            appears: l(&self.appears),
            vanishes: l(&self.vanishes),
            logins: l(&self.logins),
            sessions_moved: l(&self.sessions_moved),
            online: l(&self.online),
            kicks: l(&self.kicks),
            errors: l(&self.errors),
            connections_lost: l(&self.connections_lost),
            sessions_resumed: l(&self.sessions_resumed),
            sessions_dropped: l(&self.sessions_dropped),
            refused_full: l(&self.refused_full),
            vanished_on_handoff: l(&self.vanished_on_handoff),
            inputs_on_broken_sessions: l(&self.inputs_on_broken_sessions),
        }
    }
}

fn set_online(stats: &BotStats, account: &str, online: bool) {
    let mut set = stats
        .online_accounts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if online {
        set.insert(account.to_string());
    } else {
        set.remove(account);
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs one bot until `stop`; reconnects after a lost connection (each loss counted as an
/// error), and judges by the avatar it then finds whether its session was resumed or dropped.
pub async fn run_bot(
    account: String,
    cfg: Arc<BotConfig>,
    stats: Arc<BotStats>,
    stop: CancellationToken,
) {
    // A connection that broke, and the avatar it had then (`Some(None)`: none seen yet).
    let mut lost: Option<Option<u64>> = None;
    run_sessions(&account, &cfg, &stats, &stop, &mut lost).await;
    if lost.is_some() {
        // Never back in before the end.
        stats.sessions_dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether the session after a broken connection found the player's avatar again.
fn judge_resume(stats: &BotStats, account: &str, before: Option<u64>, now: Option<u64>) {
    let resumed = match (before, now) {
        (Some(b), Some(n)) => b == n,
        // Lost before its avatar was seen: any avatar is the one it would have had.
        (None, Some(_)) => true,
        (_, None) => false,
    };
    let counter = if resumed {
        &stats.sessions_resumed
    } else {
        tracing::warn!(%account, ?before, ?now, "the session after a lost connection did not find the avatar it had");
        &stats.sessions_dropped
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

async fn run_sessions(
    account: &str,
    cfg: &BotConfig,
    stats: &BotStats,
    stop: &CancellationToken,
    lost: &mut Option<Option<u64>>,
) {
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ fxhash(account));
    let mut seq = 0u64;
    // Where the bot logs in, and the cookie of the last handover (its proxy changes with one).
    let mut proxy = cfg.proxy.clone();
    let mut cookie: Vec<u8> = Vec::new();
    // The name the next proxy's certificate carries, when a `Transfer` named one.
    let mut server_name = String::new();
    let mut transferred_at: Option<std::time::Instant> = None;
    // The median click-to-screen time of the session a handover ended, and its avatar (id and
    // inventory), until the next session's are known.
    let mut before_handover: Option<f64> = None;
    let mut avatar_before: Option<(u64, Vec<u8>)> = None;
    while !stop.is_cancelled() {
        let token = cellmesh_proto::token::sign(cfg.secret.as_bytes(), account, now_unix() + 3600);
        let how = client::Login {
            token,
            tls: cfg.tls.clone(),
            server_name: server_name.clone(),
            offer_cookie: !cookie.is_empty(),
            cookie: std::mem::take(&mut cookie),
        };
        let dial = cfg.dial(&proxy);
        let login = tokio::select! {
            _ = stop.cancelled() => return,
            r = client::login_with(&dial, &how) => r,
        };
        match login {
            Ok((tx, rx, welcome)) => {
                if let Some(at) = transferred_at.take() {
                    stats
                        .reconnect_ms
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(at.elapsed().as_secs_f64() * 1000.0);
                }
                stats.logins.fetch_add(1, Ordering::Relaxed);
                stats.online.fetch_add(1, Ordering::Relaxed);
                set_online(stats, account, true);
                let world = WorldShape {
                    width: welcome.world_width,
                    height: welcome.world_height,
                    chunk_size: welcome.chunk_size,
                    ..WorldShape::default()
                };
                let mut log = SessionLog::default();
                let ended = play(
                    account, cfg, stats, stop, &mut rng, &mut seq, &mut log, world, tx, rx,
                )
                .await;
                let SessionLog {
                    sent,
                    mut samples,
                    avatar,
                } = log;
                if let Some(before) = lost.take() {
                    judge_resume(stats, account, before, avatar.as_ref().map(|a| a.0));
                }
                if let (Some(before), Some(now)) = (avatar_before.take(), &avatar) {
                    // The inventory is owner-only and may follow the avatar's appearance: a
                    // session that ended first (the run's stop) shows only the entity.
                    let counter = if before.0 == now.0 && (before.1.is_empty() || now.1.is_empty())
                    {
                        tracing::info!(%account, entity = now.0, "handed over to the same avatar; a session ended before its inventory came");
                        &stats.handover_inventory_unseen
                    } else if before == *now {
                        &stats.handover_avatar_kept
                    } else {
                        tracing::warn!(%account, ?before, ?now, "handed over, and found another avatar");
                        &stats.handover_avatar_replaced
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                if let (Some(before), Some(after)) = (before_handover.take(), median(&mut samples))
                {
                    stats
                        .handed_over_input_to_update_ms
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((before, after));
                }
                stats.online.fetch_sub(1, Ordering::Relaxed);
                set_online(stats, account, false);
                match ended {
                    Ok(None) => return,
                    Ok(Some(t)) => {
                        // Handed over: to the other geo's proxy at once, with the cookie. What
                        // it sent after the proxy decided was not read.
                        stats
                            .inputs_on_broken_sessions
                            .fetch_add(sent, Ordering::Relaxed);
                        before_handover = median(&mut samples);
                        avatar_before = avatar;
                        stats.handovers.fetch_add(1, Ordering::Relaxed);
                        proxy = format!("{}:{}", t.host, t.port);
                        server_name = t.server_name.clone();
                        cookie = t.cookie.to_vec();
                        transferred_at = Some(std::time::Instant::now());
                        continue;
                    }
                    Err(e) => {
                        // What the proxy had not read yet went down with the connection.
                        stats
                            .inputs_on_broken_sessions
                            .fetch_add(sent, Ordering::Relaxed);
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        stats.connections_lost.fetch_add(1, Ordering::Relaxed);
                        *lost = Some(avatar.map(|a| a.0));
                        tracing::warn!(%account, error = %e, "bot lost its session");
                    }
                }
            }
            Err(ClientError::Kicked(k)) if k.reason == KickReason::ServerFull as i32 => {
                // The server sheds load at the door: come back when it says, as a player would.
                stats.refused_full.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%account, retry_after_ms = k.retry_after_ms, "server full: retrying later");
                let wait = retry_wait(k.retry_after_ms, &mut rng);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            Err(e) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%account, error = %e, "bot could not log in");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RETRY_AFTER) => {}
        }
    }
}

/// How long to wait after `SERVER_FULL`: the hint (a second without one), plus up to a quarter
/// more, so that bots refused together do not come back together.
fn retry_wait(hint_ms: u32, rng: &mut StdRng) -> Duration {
    let base = if hint_ms == 0 {
        RETRY_AFTER
    } else {
        Duration::from_millis(u64::from(hint_ms))
    };
    base.mul_f64(1.0 + rng.random_range(0.0..0.25))
}

/// How far apart two positions are, in chunks (Chebyshev, the short way round the torus): the
/// measure of the sidecars' view.
fn chunks_apart(world: &WorldShape, a: (f64, f64), b: (f64, f64)) -> f64 {
    let (dx, dy) = world.delta(Pos { x: a.0, y: a.1 }, Pos { x: b.0, y: b.1 });
    dx.abs().max(dy.abs()) / world.chunk_size.max(1e-9)
}

/// What one session leaves behind: the inputs sent on it, its click-to-screen samples (ms), and
/// its avatar (the id it appeared under, and the inventory last seen on it).
#[derive(Default)]
struct SessionLog {
    sent: u64,
    samples: Vec<f64>,
    avatar: Option<(u64, Vec<u8>)>,
}

/// Plays one session; `seq` is the account's input sequence, across sessions.
#[allow(clippy::too_many_arguments)]
async fn play(
    account: &str,
    cfg: &BotConfig,
    stats: &BotStats,
    stop: &CancellationToken,
    rng: &mut StdRng,
    seq: &mut u64,
    log: &mut SessionLog,
    world: WorldShape,
    mut tx: ClientSender,
    mut rx: ClientReceiver,
) -> Result<Option<Transfer>, ClientError> {
    let me = format!("player:{account}");
    // When each recent input was sent, for the click-to-screen time.
    let mut sent_at: std::collections::VecDeque<(u64, std::time::Instant)> =
        std::collections::VecDeque::new();
    let mut acked = 0u64;
    let mut my_entity: Option<u64> = None;
    let mut my_pos: Option<(f64, f64)> = None;
    let mut dir: (f32, f32) = (0.0, 0.0);
    // Where each entity in view was last seen.
    let mut seen: HashMap<u64, (f64, f64)> = HashMap::new();
    // Well inside the view: the release margin and a chunk of rounding away from its edge.
    let inside = f64::from(cfg.view_radius_chunks.saturating_sub(1));
    let mut input_timer =
        tokio::time::interval(Duration::from_secs_f64(1.0 / cfg.input_hz.max(0.1)));
    input_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                let _ = tx.close().await;
                // Leave as a client should: read until the proxy closes, so it reads every input
                // sent before the Bye (closing at once would reset the connection under them).
                let gone = tokio::time::timeout(BYE_LINGER, async {
                    while let Some(Ok(_)) = rx.next().await {}
                })
                .await;
                if gone.is_err() {
                    stats.inputs_on_broken_sessions.fetch_add(log.sent, Ordering::Relaxed);
                }
                return Ok(None);
            }
            msg = rx.next() => {
                let msg = match msg {
                    Some(m) => m?,
                    None => return Err(ClientError::Closed),
                };
                match msg.body {
                    Some(server_message::Body::Batch(b)) => {
                        stats.batches.fetch_add(1, Ordering::Relaxed);
                        stats.updates_delivered.fetch_add(b.deltas.len() as u64, Ordering::Relaxed);
                        for d in &b.deltas {
                            match DeltaKind::try_from(d.kind) {
                                Ok(DeltaKind::Appear) => {
                                    stats.appears.fetch_add(1, Ordering::Relaxed);
                                    let mine = d.components.iter().any(|c| c.r#type == schema::KIND && c.payload == me.as_bytes());
                                    if mine {
                                        my_entity = Some(d.entity_id);
                                        if log.avatar.is_none() {
                                            log.avatar = Some((d.entity_id, Vec::new()));
                                        }
                                    }
                                }
                                Ok(DeltaKind::Vanish) => {
                                    stats.vanishes.fetch_add(1, Ordering::Relaxed);
                                    let was = seen.remove(&d.entity_id);
                                    let close = match (was, my_pos) {
                                        (Some(p), Some(me)) => chunks_apart(&world, p, me) <= inside,
                                        _ => false,
                                    };
                                    let despawned = cfg.census.as_ref().is_none_or(|c| c.is_despawned(d.entity_id));
                                    if close && !despawned && !stop.is_cancelled() {
                                        stats.vanished_on_handoff.fetch_add(1, Ordering::Relaxed);
                                        tracing::warn!(%account, entity = d.entity_id, "an entity vanished from well inside the view without being despawned");
                                    }
                                }
                                _ => {}
                            }
                            if Some(d.entity_id) == my_entity {
                                // Owner-only, it may come a little after the avatar itself.
                                if let (Some(inv), Some((id, held))) = (d.components.iter().find(|c| c.r#type == schema::INVENTORY), log.avatar.as_mut()) {
                                    if *id == d.entity_id {
                                        *held = inv.payload.to_vec();
                                    }
                                }
                                if let Some(ack) = d.components.iter().find(|c| c.r#type == schema::INPUT_ACK) {
                                    let last = ack.payload.get(..8).map_or(0, |b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
                                    if last > acked {
                                        acked = last;
                                        while sent_at.front().is_some_and(|(s, _)| *s < last) {
                                            sent_at.pop_front();
                                        }
                                        if let Some((s, at)) = sent_at.front().copied() {
                                            if s == last {
                                                sent_at.pop_front();
                                                let now = std::time::Instant::now();
                                                let ms = now.duration_since(at).as_secs_f64() * 1000.0;
                                                log.samples.push(ms);
                                                let location = cfg.geo.as_ref().map_or("", |g| g.location.as_str());
                                                stats.click_to_screen.record(location, now, ms);
                                            }
                                        }
                                    }
                                }
                            }
                            if let Some(p) = &d.position {
                                if d.kind != DeltaKind::Vanish as i32 {
                                    seen.insert(d.entity_id, (p.x, p.y));
                                }
                                if Some(d.entity_id) == my_entity {
                                    my_pos = Some((p.x, p.y));
                                }
                            }
                        }
                    }
                    Some(server_message::Body::Ping(p)) => {
                        tx.send(client_message::Body::Pong(Pong { nonce: p.nonce })).await?;
                    }
                    Some(server_message::Body::Welcome(_)) => {
                        // The session moved to another gateway: the view starts over.
                        stats.sessions_moved.fetch_add(1, Ordering::Relaxed);
                        seen.clear();
                        my_entity = None;
                    }
                    Some(server_message::Body::Transfer(t)) => {
                        // Read what the proxy still sends until it closes, then go.
                        let _ = tokio::time::timeout(BYE_LINGER, async {
                            while let Some(Ok(_)) = rx.next().await {}
                        })
                        .await;
                        return Ok(Some(t));
                    }
                    Some(server_message::Body::Probe(p)) => {
                        // Each far proxy times the bot itself; nothing comes back here.
                        for mut target in p.targets {
                            let named = format!("{}:{}", target.host, target.port);
                            if let Some((host, port)) = cfg.dial(&named).rsplit_once(':') {
                                target.host = host.to_string();
                                target.port = port.parse().unwrap_or(target.port);
                            }
                            stats.probes.fetch_add(1, Ordering::Relaxed);
                            let tls = cfg.tls.clone();
                            tokio::spawn(async move {
                                let _ = client::answer_probe(&target, Duration::ZERO, tls.as_ref())
                                    .await;
                            });
                        }
                    }
                    Some(server_message::Body::Kick(k)) => {
                        let leaving = [KickReason::Shutdown as i32, KickReason::Reconnect as i32];
                        if !leaving.contains(&k.reason) || !stop.is_cancelled() {
                            stats.kicks.fetch_add(1, Ordering::Relaxed);
                        }
                        return Err(ClientError::Kicked(k));
                    }
                    _ => {}
                }
            }
            _ = input_timer.tick() => {
                dir = steer(dir, my_pos, cfg, world, rng);
                *seq += 1;
                if sent_at.len() == 256 {
                    sent_at.pop_front();
                }
                sent_at.push_back((*seq, std::time::Instant::now()));
                tx.input(*seq, schema::input(dir.0, dir.1)).await?;
                log.sent += 1;
                stats.inputs_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Keeps walking, turns now and then, and heads home when beyond the roam radius.
fn steer(
    dir: (f32, f32),
    pos: Option<(f64, f64)>,
    cfg: &BotConfig,
    world: WorldShape,
    rng: &mut StdRng,
) -> (f32, f32) {
    if let Some((x, y)) = pos {
        // Home the short way round the torus.
        let home = Pos {
            x: cfg.home.0,
            y: cfg.home.1,
        };
        let (hx, hy) = world.delta(Pos { x, y }, home);
        if hx.hypot(hy) > cfg.roam {
            return (hx as f32, hy as f32);
        }
    }
    if dir == (0.0, 0.0) || rng.random_ratio(1, 10) {
        let a: f32 = rng.random_range(0.0..std::f32::consts::TAU);
        return (a.cos(), a.sin());
    }
    dir
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_server_is_retried_after_its_hint_with_jitter() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..100 {
            let w = retry_wait(4000, &mut rng);
            assert!(
                w >= Duration::from_secs(4) && w < Duration::from_secs(5),
                "{w:?}"
            );
            let w = retry_wait(0, &mut rng);
            assert!(w >= RETRY_AFTER && w < RETRY_AFTER.mul_f64(1.25), "{w:?}");
        }
    }

    #[test]
    fn a_lost_connection_is_a_dropped_session_unless_the_next_finds_the_same_avatar() {
        let stats = BotStats::default();
        judge_resume(&stats, "a", Some(7), Some(7));
        judge_resume(&stats, "a", None, Some(9));
        judge_resume(&stats, "a", Some(7), Some(8));
        judge_resume(&stats, "a", Some(7), None);
        let t = stats.totals();
        assert_eq!((t.sessions_resumed, t.sessions_dropped), (2, 2));
    }

    #[test]
    fn steer_heads_home_when_far() {
        let cfg = BotConfig {
            home: (0.0, 0.0),
            roam: 10.0,
            ..BotConfig::default()
        };
        let world = WorldShape {
            width: 1000.0,
            height: 1000.0,
            chunk_size: 10.0,
            region_size: 100.0,
        };
        let mut rng = StdRng::seed_from_u64(1);
        let d = steer((1.0, 0.0), Some((100.0, 0.0)), &cfg, world, &mut rng);
        assert!(d.0 < 0.0 && d.1.abs() < 1e-6);
        // Just west of the seam, home is east across it, not 990 m west.
        let d = steer((1.0, 0.0), Some((990.0, 0.0)), &cfg, world, &mut rng);
        assert!(d.0 > 0.0 && d.1.abs() < 1e-6);
        let d = steer((0.0, 0.0), Some((1.0, 1.0)), &cfg, world, &mut rng);
        assert!(d != (0.0, 0.0));
        assert!((chunks_apart(&world, (995.0, 5.0), (5.0, 995.0)) - 1.0).abs() < 1e-9);
    }
}
