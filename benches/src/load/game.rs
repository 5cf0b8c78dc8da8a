//! A synthetic game server and synthetic clients: only what the mesh needs to carry their
//! traffic, so the game's own cost does not hide the mesh's.
//!
//! Every update a game writes carries a stamp (nanoseconds on this process's clock, and a
//! sequence number) in the first [`STAMP_LEN`] bytes of its public component; a client reads the
//! stamp back to measure the update's latency through the mesh.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::{BufMut, Bytes, BytesMut};
use cellmesh_proto::client;
use cellmesh_proto::edge::{client_message, server_message, Pong};
use cellmesh_proto::local::{
    game_message::Body, sidecar_message, Adopted, Audience, AudienceKind, CheckpointState,
    Component, Event, Load, Release, ReserveIds, Snapshot, Spawn, Update, Vec3,
};
use cellmesh_proto::sdk::{self, OwnedArea, SdkConfig};
use hdrhistogram::Histogram;
use tokio_util::sync::CancellationToken;

use super::report::nanos_histogram;

/// Bytes of a stamp: send time in nanoseconds, then a sequence number.
pub const STAMP_LEN: usize = 16;
/// The component type every stamped update writes.
pub const STAMPED: u32 = 1;
/// The event type of an input's echo: the input's stamp, then how long the game held it
/// ([`read_echo`]).
pub const ECHO: u32 = 2;
/// Bytes of an echo: the input's stamp, then nanoseconds the game held the input.
pub const ECHO_LEN: usize = STAMP_LEN + 8;
/// Bytes of a bench client's input: a stamp and a little state, as a movement input carries.
pub const INPUT_BYTES: usize = 24;

/// An echo's `(input sent_ns, input seq, held_ns)`: `held_ns` is how long the game kept the
/// input before its tick ended (the game's own wait, not the mesh's).
pub fn read_echo(payload: &[u8]) -> Option<(u64, u64, u64)> {
    let (sent, seq) = read_stamp(payload)?;
    let held = u64::from_le_bytes(payload.get(STAMP_LEN..ECHO_LEN)?.try_into().ok()?);
    Some((sent, seq, held))
}

/// Nanoseconds since the first call in this process: the one clock games and clients share.
pub fn now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A payload of `len` bytes (at least [`STAMP_LEN`]) stamped now with `seq`.
pub fn stamped(len: usize, seq: u64) -> Bytes {
    stamped_at(len, seq, now_ns())
}

/// A payload of `len` bytes (at least [`STAMP_LEN`]) stamped `ns` with `seq`.
pub fn stamped_at(len: usize, seq: u64, ns: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(len.max(STAMP_LEN));
    b.put_u64_le(ns);
    b.put_u64_le(seq);
    b.resize(len.max(STAMP_LEN), 0);
    b.freeze()
}

/// The stamp of a payload: `(sent_ns, seq)`.
pub fn read_stamp(payload: &[u8]) -> Option<(u64, u64)> {
    let ns = u64::from_le_bytes(payload.get(..8)?.try_into().ok()?);
    let seq = u64::from_le_bytes(payload.get(8..16)?.try_into().ok()?);
    Some((ns, seq))
}

/// NPCs walking to and fro along x at `speed` metres per tick, turning at `min_x` and `max_x`
/// (so they cross a border between the two).
#[derive(Debug, Clone, Copy)]
pub struct Walk {
    pub speed: f64,
    pub min_x: f64,
    pub max_x: f64,
}

impl Walk {
    /// One step from `x` going `dir` (±1): the new x and direction.
    fn step(self, x: f64, dir: f64) -> (f64, f64) {
        let x = x + dir * self.speed;
        if x >= self.max_x {
            (self.max_x, -1.0)
        } else if x <= self.min_x {
            (self.min_x, 1.0)
        } else {
            (x, dir)
        }
    }
}

#[derive(Debug, Clone)]
pub struct GameConfig {
    /// The sidecar's local-protocol address (`host:port`).
    pub sidecar: String,
    pub tick_hz: u32,
    /// NPCs spawned once ids arrive.
    pub npcs: Vec<(f64, f64)>,
    /// Bytes of the stamped public component of every entity (at least [`STAMP_LEN`]).
    pub payload_bytes: usize,
    /// Every tick, every NPC held and not frozen gets a freshly stamped component.
    pub update_npcs: bool,
    pub walk: Option<Walk>,
    /// Where the avatar of a joining player appears...
    pub avatar_at: (f64, f64),
    /// Which way each NPC of `npcs` first walks along x (±1), by index; east when absent.
    pub npc_dirs: Vec<f64>,
    /// Where the game notes when it froze, answered, adopted and evicted each entity.
    pub handoff_log: Option<Arc<HandoffLog>>,
    /// When the first tick comes (at once when absent): sets the phase of this game's ticks
    /// against another's.
    pub first_tick_at: Option<tokio::time::Instant>,
    /// ...moved by this once for every player who joined before it, so avatars can stand apart.
    pub avatar_step: (f64, f64),
    /// NPCs spawned in one tick, at most: a large crowd arrives over several ticks, in frames
    /// of a bounded size.
    pub spawn_per_tick: usize,
    /// What the scenario changes while the game runs.
    pub control: Option<Arc<GameControl>>,
    /// Hand an NPC over with `Release` in the tick it walks out of the node's area, rather
    /// than wait for the sidecar's `Freeze`.
    pub release: bool,
    /// Every player input is answered at the end of the tick that took it, with an `ECHO`
    /// event for its owner only: the input's stamp and how long the game held it.
    pub echo_inputs: bool,
    /// The game sends `Load` every second: its second longest tick of that second (the ticks
    /// that overran, unless only one did), each tick timed from when it was due (so a game
    /// starved of CPU, whose ticks start late, reports what a real one overrunning its budget
    /// would) to the end of its work.
    pub report_load: bool,
    /// CPU work every tick, as a game simulating its world does; none: the game costs only what
    /// its traffic does.
    pub tick_work: Option<TickWork>,
}

/// What simulating one tick costs a game, in CPU time (not wall time: on a busy machine the
/// work takes longer, as a real game's does).
#[derive(Debug, Clone, Copy)]
pub struct TickWork {
    /// For each NPC it writes (movement, AI).
    pub per_npc: Duration,
    /// For each player it simulates (input, interest, what it sends).
    pub per_player: Duration,
}

impl TickWork {
    fn cost(&self, npcs: usize, players: usize) -> Duration {
        self.per_npc * npcs as u32 + self.per_player * players as u32
    }
}

/// Spends about `cpu` of CPU time computing (calibrated once: a loop, not a clock).
fn burn(cpu: Duration) {
    static PER_US: OnceLock<f64> = OnceLock::new();
    let per_us = *PER_US.get_or_init(|| {
        // The fastest of a few runs: the one least disturbed by the rest of the machine.
        const N: u64 = 200_000;
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                spin(N);
                t.elapsed()
            })
            .min()
            .unwrap_or(Duration::from_millis(1));
        N as f64 / best.as_secs_f64().max(1e-9) / 1e6
    });
    spin((cpu.as_secs_f64() * 1e6 * per_us) as u64);
}

fn spin(n: u64) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x);
}

impl Default for GameConfig {
    fn default() -> Self {
        Self {
            sidecar: String::new(),
            tick_hz: 20,
            npcs: Vec::new(),
            payload_bytes: 32,
            update_npcs: true,
            walk: None,
            avatar_at: (0.0, 0.0),
            npc_dirs: Vec::new(),
            handoff_log: None,
            first_tick_at: None,
            avatar_step: (0.0, 0.0),
            spawn_per_tick: usize::MAX,
            control: None,
            release: false,
            echo_inputs: false,
            report_load: false,
            tick_work: None,
        }
    }
}

/// A span of stamp times, `[from, until)` in [`now_ns`] nanoseconds, that a game and its
/// clients agree on: what the game stamped within it is what the clients should receive.
#[derive(Debug, Default)]
pub struct Window(Mutex<(u64, u64)>);

impl Window {
    pub fn open(&self, from_ns: u64, until_ns: u64) {
        *self.0.lock().expect("window lock poisoned") = (from_ns, until_ns);
    }

    /// A copy to test many stamps against.
    pub fn get(&self) -> (u64, u64) {
        *self.0.lock().expect("window lock poisoned")
    }
}

fn within((from, until): (u64, u64), ns: u64) -> bool {
    (from..until).contains(&ns)
}

/// What a scenario changes in a running game, and what the game counts for it.
#[derive(Debug)]
pub struct GameControl {
    /// NPCs updated per tick, at most (the same ones every tick).
    update_limit: AtomicUsize,
    /// NPCs to spawn besides [`GameConfig::npcs`].
    spawn: Mutex<Vec<(f64, f64)>>,
    /// Every avatar moves by this at the next tick.
    avatar_shift: Mutex<Option<(f64, f64)>>,
    pub window: Arc<Window>,
    /// Updates stamped within `window`.
    stamped_in_window: AtomicU64,
}

impl GameControl {
    pub fn new(window: Arc<Window>) -> Self {
        Self {
            update_limit: AtomicUsize::new(usize::MAX),
            spawn: Mutex::new(Vec::new()),
            avatar_shift: Mutex::new(None),
            window,
            stamped_in_window: AtomicU64::new(0),
        }
    }

    pub fn set_update_limit(&self, npcs: usize) {
        self.update_limit.store(npcs, Relaxed);
    }

    pub fn spawn(&self, at: impl IntoIterator<Item = (f64, f64)>) {
        self.spawn.lock().expect("spawn lock poisoned").extend(at);
    }

    pub fn shift_avatars(&self, by: (f64, f64)) {
        *self.avatar_shift.lock().expect("shift lock poisoned") = Some(by);
    }

    /// Whether a shift waits for the game's next tick.
    pub fn avatar_shift_pending(&self) -> bool {
        self.avatar_shift
            .lock()
            .expect("shift lock poisoned")
            .is_some()
    }

    /// The updates stamped within the window since the last call.
    pub fn take_stamped_in_window(&self) -> u64 {
        self.stamped_in_window.swap(0, Relaxed)
    }

    fn take_spawns(&self) -> Vec<(f64, f64)> {
        std::mem::take(&mut *self.spawn.lock().expect("spawn lock poisoned"))
    }

    fn take_avatar_shift(&self) -> Option<(f64, f64)> {
        self.avatar_shift
            .lock()
            .expect("shift lock poisoned")
            .take()
    }
}

impl Default for GameControl {
    /// With a window of its own, never opened.
    fn default() -> Self {
        Self::new(Arc::default())
    }
}

/// Most ids asked for at once (the sidecar answers at most 65 536 in one frame).
const MAX_IDS_PER_REQUEST: usize = 60_000;

/// What a synthetic game did.
#[derive(Debug, Default)]
pub struct GameStats {
    pub ticks: AtomicU64,
    pub spawned: AtomicU64,
    pub updates: AtomicU64,
    pub snapshots: AtomicU64,
    /// NPCs handed over with `Release`.
    pub released: AtomicU64,
    pub adopted: AtomicU64,
    pub evicted: AtomicU64,
    pub thawed: AtomicU64,
    pub errors: AtomicU64,
    /// The highest `Load` tick time reported since it was last taken, in microseconds.
    pub load_us_max: AtomicU64,
}

/// When the games saw each step of one handoff, on the clock they share ([`now_ns`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoffSeen {
    /// The source game's last `TickEnd` before the `Freeze` came: the end of the entity's last
    /// simulated tick there (it freezes the entity as the `Freeze` comes).
    pub last_tick_end_ns: u64,
    pub freeze_ns: u64,
    /// The frame carrying the `Snapshot` went.
    pub snapshot_ns: u64,
    /// The target game got the `Adopt`...
    pub adopt_ns: u64,
    /// ...and ended its first tick with the entity, in the frame carrying `Adopted`.
    pub first_tick_end_ns: u64,
    /// The source game got the `Evict`.
    pub evict_ns: u64,
}

impl HandoffSeen {
    /// From the end of the entity's last tick at the source to the end of its first at the
    /// target.
    pub fn gap_ns(&self) -> u64 {
        self.first_tick_end_ns.saturating_sub(self.last_tick_end_ns)
    }

    /// The freeze as the games see it (from the tick whose end triggered it to the `Evict`)
    /// less their own time answering `Freeze` and `Adopt`: the sidecars, the link between them
    /// and the four crossings of the local protocol.
    pub fn sidecars_ns(&self) -> u64 {
        let games = self.snapshot_ns.saturating_sub(self.freeze_ns)
            + self.first_tick_end_ns.saturating_sub(self.adopt_ns);
        self.evict_ns
            .saturating_sub(self.last_tick_end_ns)
            .saturating_sub(games)
    }
}

#[derive(Debug, Default)]
struct HandoffNotes {
    /// Handoffs under way, by entity.
    pending: HashMap<u64, PendingHandoff>,
    done: Vec<HandoffSeen>,
}

#[derive(Debug, Default, Clone, Copy)]
struct PendingHandoff {
    last_tick_end_ns: u64,
    freeze_ns: u64,
    snapshot_ns: Option<u64>,
    adopt_ns: Option<u64>,
    first_tick_end_ns: Option<u64>,
}

/// What the games of one process saw of every handoff between them: both ends write here, so
/// one clock times the whole handoff.
#[derive(Debug, Default)]
pub struct HandoffLog {
    notes: Mutex<HandoffNotes>,
}

impl HandoffLog {
    fn note(&self, id: u64, f: impl FnOnce(&mut PendingHandoff)) {
        let mut n = self.notes.lock().expect("handoff log lock poisoned");
        f(n.pending.entry(id).or_default());
    }

    fn frozen(&self, id: u64, last_tick_end_ns: u64) {
        let mut n = self.notes.lock().expect("handoff log lock poisoned");
        n.pending.insert(
            id,
            PendingHandoff {
                last_tick_end_ns,
                freeze_ns: now_ns(),
                ..PendingHandoff::default()
            },
        );
    }

    /// The game released `id` in the tick that ended at `tick_end_ns`: its last tick here,
    /// and its snapshot, in one.
    fn released(&self, id: u64, tick_end_ns: u64) {
        let mut n = self.notes.lock().expect("handoff log lock poisoned");
        n.pending.insert(
            id,
            PendingHandoff {
                last_tick_end_ns: tick_end_ns,
                freeze_ns: tick_end_ns,
                snapshot_ns: Some(tick_end_ns),
                ..PendingHandoff::default()
            },
        );
    }

    fn thawed(&self, id: u64) {
        let mut n = self.notes.lock().expect("handoff log lock poisoned");
        n.pending.remove(&id);
    }

    fn evicted(&self, id: u64) {
        let evict_ns = now_ns();
        let mut n = self.notes.lock().expect("handoff log lock poisoned");
        let Some(p) = n.pending.remove(&id) else {
            return;
        };
        if let (Some(snapshot_ns), Some(adopt_ns), Some(first_tick_end_ns)) =
            (p.snapshot_ns, p.adopt_ns, p.first_tick_end_ns)
        {
            n.done.push(HandoffSeen {
                last_tick_end_ns: p.last_tick_end_ns,
                freeze_ns: p.freeze_ns,
                snapshot_ns,
                adopt_ns,
                first_tick_end_ns,
                evict_ns,
            });
        }
    }

    /// Handoffs whose `Freeze` came before `before_ns` and that are neither evicted nor thawed.
    pub fn frozen_since_before(&self, before_ns: u64) -> usize {
        let n = self.notes.lock().expect("handoff log lock poisoned");
        n.pending
            .values()
            .filter(|p| p.freeze_ns > 0 && p.freeze_ns < before_ns)
            .count()
    }

    /// The handoffs completed since the last call.
    pub fn take(&self) -> Vec<HandoffSeen> {
        std::mem::take(&mut self.notes.lock().expect("handoff log lock poisoned").done)
    }
}

struct Npc {
    at: (f64, f64),
    /// Which way it walks along x: ±1.
    dir: f64,
    frozen: bool,
    epoch: u64,
    /// The sidecar asked for its release at the end of the next tick (`Offload`).
    offload: bool,
}

/// Snapshot state: position and walking direction.
fn encode_state(at: (f64, f64), dir: f64) -> Bytes {
    let mut b = BytesMut::with_capacity(24);
    b.put_f64_le(at.0);
    b.put_f64_le(at.1);
    b.put_f64_le(dir);
    b.freeze()
}

fn decode_state(b: &[u8]) -> Option<((f64, f64), f64)> {
    let f = |i: usize| Some(f64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
    Some(((f(0)?, f(8)?), f(16)?))
}

fn vec3(at: (f64, f64)) -> Vec3 {
    Vec3 {
        x: at.0,
        y: at.1,
        z: 0.0,
    }
}

/// An input's echo: its stamp (the payload's first [`STAMP_LEN`] bytes) and `held_ns`.
fn echo_payload(input: &[u8], held_ns: u64) -> Option<Bytes> {
    let mut b = BytesMut::with_capacity(ECHO_LEN);
    b.put_slice(input.get(..STAMP_LEN)?);
    b.put_u64_le(held_ns);
    Some(b.freeze())
}

/// Tick times over one report period, for `Load`.
#[derive(Debug, Default)]
struct TickTimes {
    since: Option<tokio::time::Instant>,
    /// The longest and the second longest tick of the period.
    worst: [Duration; 2],
}

impl TickTimes {
    /// One tick, due at `due`, ended at `now`; once a second has passed, the period's second
    /// longest tick (about its 95th percentile at 20 Hz: one stray hiccup is not an overrun).
    fn tick(&mut self, due: tokio::time::Instant, now: tokio::time::Instant) -> Option<Duration> {
        let since = *self.since.get_or_insert(now);
        let took = now.saturating_duration_since(due);
        if took > self.worst[0] {
            self.worst = [took, self.worst[0]];
        } else if took > self.worst[1] {
            self.worst[1] = took;
        }
        if now.duration_since(since) < Duration::from_secs(1) {
            return None;
        }
        let report = self.worst[1];
        *self = Self {
            since: Some(now),
            worst: [Duration::ZERO; 2],
        };
        Some(report)
    }
}

fn public(payload: Bytes) -> Component {
    Component {
        r#type: STAMPED,
        payload,
        audience: Some(Audience {
            kind: AudienceKind::PublicInRange as i32,
            accounts: Vec::new(),
        }),
    }
}

/// Runs a synthetic game until `stop` or until its sidecar goes away.
pub async fn run(
    cfg: GameConfig,
    stats: Arc<GameStats>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut sdk_cfg = SdkConfig::tcp(cfg.sidecar.clone(), "bench");
    sdk_cfg.tick_rate_hz = cfg.tick_hz;
    sdk_cfg.connect_deadline = Some(Duration::from_secs(10));
    let (mut tx, mut rx, welcome) = sdk::connect(sdk_cfg)
        .await
        .context("connecting the synthetic game")?;
    let mut area = OwnedArea::from_welcome(&welcome);
    let mut ids: Vec<u64> = Vec::new();
    let mut to_spawn = cfg.npcs.clone();
    let mut joining: Vec<(String, (f64, f64))> = Vec::new();
    let mut npcs: HashMap<u64, Npc> = HashMap::new();
    // Account -> its avatar and where it stands.
    let mut avatars: HashMap<String, (u64, (f64, f64))> = HashMap::new();
    let mut joins = 0u32;
    // Enough for what waits to spawn, and some to spare.
    let ids_wanted = |waiting: usize| (waiting + 64).min(MAX_IDS_PER_REQUEST) as u32;
    tx.push(Body::ReserveIds(ReserveIds {
        request_id: 1,
        count: ids_wanted(to_spawn.len()),
    }));
    tx.flush().await?;
    let mut requested = true;
    let mut ticker = tokio::time::interval_at(
        cfg.first_tick_at.unwrap_or_else(tokio::time::Instant::now),
        Duration::from_secs_f64(1.0 / f64::from(cfg.tick_hz)),
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut tick, mut seq) = (0u64, 0u64);
    let mut dirs = cfg.npc_dirs.clone();
    dirs.resize(cfg.npcs.len(), 1.0);
    // For the handoff log: when the last tick ended, and what the next frame answers.
    let mut last_tick_end_ns = now_ns();
    // Inputs to echo at the tick's end: (avatar, payload, when it came).
    let mut echoes: Vec<(u64, Bytes, u64)> = Vec::new();
    let mut tick_times = TickTimes::default();
    let (mut answering, mut adopting): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
    // NPCs released in the tick under way.
    let mut releasing: Vec<u64> = Vec::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            msg = rx.next() => {
                let Some(msg) = msg else { break };
                let Some(body) = msg.context("reading from the sidecar")?.body else { continue };
                use sidecar_message::Body as M;
                match body {
                    M::IdsReserved(r) => {
                        ids.extend(r.ids);
                        requested = false;
                    }
                    M::PlayerJoin(j) => {
                        let n = f64::from(joins);
                        let spot = (
                            cfg.avatar_at.0 + n * cfg.avatar_step.0,
                            cfg.avatar_at.1 + n * cfg.avatar_step.1,
                        );
                        let at = j.last_position.map_or(spot, |p| (p.x, p.y));
                        if !avatars.contains_key(&j.account) {
                            joins += 1;
                            joining.push((j.account, at));
                        }
                    }
                    M::Input(i) if cfg.echo_inputs => {
                        if let Some((id, _)) = avatars.get(&i.account) {
                            echoes.push((*id, i.payload, now_ns()));
                        }
                    }
                    M::PlayerLeave(l) => {
                        if let Some((id, _)) = avatars.remove(&l.account) {
                            tx.push(Body::Despawn(cellmesh_proto::local::Despawn { entity_id: id }));
                        }
                    }
                    M::Offload(o) => {
                        if let Some(n) = npcs.get_mut(&o.entity_id).filter(|n| !n.frozen) {
                            n.offload = true;
                        }
                    }
                    M::Freeze(f) => {
                        if let Some(n) = npcs.get_mut(&f.entity_id) {
                            if let Some(log) = &cfg.handoff_log {
                                log.frozen(f.entity_id, last_tick_end_ns);
                                answering.push(f.entity_id);
                            }
                            n.frozen = true;
                            tx.push(Body::Snapshot(Snapshot {
                                entity_id: f.entity_id,
                                entity_epoch: f.entity_epoch,
                                state: encode_state(n.at, n.dir),
                            }));
                            stats.snapshots.fetch_add(1, Relaxed);
                        }
                    }
                    M::Thaw(t) => {
                        if let Some(n) = npcs.get_mut(&t.entity_id) {
                            n.frozen = false;
                            stats.thawed.fetch_add(1, Relaxed);
                            if let Some(log) = &cfg.handoff_log {
                                log.thawed(t.entity_id);
                            }
                        }
                    }
                    M::Evict(e) => {
                        let held = npcs.remove(&e.entity_id).is_some();
                        if held {
                            stats.evicted.fetch_add(1, Relaxed);
                            if let Some(log) = &cfg.handoff_log {
                                log.evicted(e.entity_id);
                            }
                        }
                    }
                    M::Adopt(a) => {
                        let (at, dir) = decode_state(&a.state).unwrap_or_else(|| {
                            (a.position.as_ref().map_or((0.0, 0.0), |p| (p.x, p.y)), 1.0)
                        });
                        npcs.insert(a.entity_id, Npc { at, dir, frozen: false, epoch: a.entity_epoch, offload: false });
                        if let Some(log) = &cfg.handoff_log {
                            let adopt_ns = now_ns();
                            log.note(a.entity_id, |p| p.adopt_ns = Some(adopt_ns));
                            adopting.push(a.entity_id);
                        }
                        tx.push(Body::Adopted(Adopted { entity_id: a.entity_id, entity_epoch: a.entity_epoch }));
                        stats.adopted.fetch_add(1, Relaxed);
                    }
                    M::Checkpoint(c) => {
                        for id in c.entity_ids {
                            if let Some(n) = npcs.get(&id) {
                                tx.push(Body::CheckpointState(CheckpointState {
                                    entity_id: id,
                                    entity_epoch: n.epoch,
                                    state: encode_state(n.at, n.dir),
                                }));
                            }
                        }
                    }
                    M::PartitionChanged(p) => area.set_rects(p.owned_area),
                    M::Error(e) => {
                        stats.errors.fetch_add(1, Relaxed);
                        tracing::debug!(?e, "sidecar reported an error");
                    }
                    _ => {}
                }
            }
            due = ticker.tick() => {
                tick += 1;
                if let Some(c) = &cfg.control {
                    to_spawn.extend(c.take_spawns());
                }
                let mut npc_budget = cfg.spawn_per_tick;
                while let Some(&id) = ids.last() {
                    if let Some((account, at)) = joining.pop() {
                        tx.push(Body::Spawn(Spawn {
                            entity_id: id,
                            position: Some(vec3(at)),
                            components: vec![public(stamped(cfg.payload_bytes, 0))],
                            owner_account: account.clone(),
                            is_master: true,
                            parent_id: 0,
                        }));
                        avatars.insert(account, (id, at));
                    } else if npc_budget > 0 && !to_spawn.is_empty() {
                        let at = to_spawn.pop().expect("not empty");
                        tx.push(Body::Spawn(Spawn {
                            entity_id: id,
                            position: Some(vec3(at)),
                            components: vec![public(stamped(cfg.payload_bytes, 0))],
                            owner_account: String::new(),
                            is_master: false,
                            parent_id: 0,
                        }));
                        let dir = dirs.pop().unwrap_or(1.0);
                        npcs.insert(id, Npc { at, dir, frozen: false, epoch: 1, offload: false });
                        npc_budget -= 1;
                    } else {
                        break;
                    }
                    ids.pop();
                    stats.spawned.fetch_add(1, Relaxed);
                }
                let waiting = to_spawn.len() + joining.len();
                if ids.len() < waiting.max(32) && !requested {
                    tx.push(Body::ReserveIds(ReserveIds { request_id: tick, count: ids_wanted(waiting) }));
                    requested = true;
                }
                if let Some(by) = cfg.control.as_ref().and_then(|c| c.take_avatar_shift()) {
                    for (id, at) in avatars.values_mut() {
                        *at = (at.0 + by.0, at.1 + by.1);
                        tx.push(Body::Update(Update {
                            entity_id: *id,
                            position: Some(vec3(*at)),
                            changed: Vec::new(),
                            removed_types: Vec::new(),
                        }));
                    }
                }
                if cfg.update_npcs {
                    let limit = cfg.control.as_ref().map_or(usize::MAX, |c| c.update_limit.load(Relaxed));
                    let window = cfg.control.as_ref().map(|c| c.window.get());
                    let (mut n_updates, mut in_window) = (0, 0);
                    releasing.clear();
                    for (&id, n) in npcs.iter_mut().filter(|(_, n)| !n.frozen).take(limit) {
                        let position = cfg.walk.map(|w| {
                            (n.at.0, n.dir) = w.step(n.at.0, n.dir);
                            vec3(n.at)
                        });
                        seq += 1;
                        let ns = now_ns();
                        if window.is_some_and(|w| within(w, ns)) {
                            in_window += 1;
                        }
                        tx.push(Body::Update(Update {
                            entity_id: id,
                            position,
                            changed: vec![public(stamped_at(cfg.payload_bytes, seq, ns))],
                            removed_types: Vec::new(),
                        }));
                        n_updates += 1;
                        let offload = std::mem::take(&mut n.offload);
                        if offload || (cfg.release && area.release_due(n.at.0, n.at.1)) {
                            n.frozen = true;
                            tx.push(Body::Release(Release {
                                entity_id: id,
                                entity_epoch: n.epoch,
                                state: encode_state(n.at, n.dir),
                                ..Default::default()
                            }));
                            stats.released.fetch_add(1, Relaxed);
                            releasing.push(id);
                        }
                    }
                    stats.updates.fetch_add(n_updates, Relaxed);
                    if let Some(c) = &cfg.control {
                        c.stamped_in_window.fetch_add(in_window, Relaxed);
                    }
                }
                if let Some(work) = cfg.tick_work {
                    burn(work.cost(npcs.len(), avatars.len()));
                }
                let end_ns = now_ns();
                for (id, input, came_ns) in echoes.drain(..) {
                    if let Some(payload) = echo_payload(&input, end_ns.saturating_sub(came_ns)) {
                        tx.push(Body::Event(Event {
                            entity_id: id,
                            r#type: ECHO,
                            payload,
                            audience: Some(Audience {
                                kind: AudienceKind::OwnerOnly as i32,
                                accounts: Vec::new(),
                            }),
                        }));
                    }
                }
                if let Some(tick_ms) = tick_times
                    .tick(due, tokio::time::Instant::now())
                    .filter(|_| cfg.report_load) {
                    stats.load_us_max.fetch_max(tick_ms.as_micros() as u64, Relaxed);
                    tx.push(Body::Load(Load {
                        tick_ms: tick_ms.as_secs_f32() * 1000.0,
                        budget_ms: 1000.0 / cfg.tick_hz as f32,
                        entity_count: (npcs.len() + avatars.len()) as u32,
                    }));
                }
                stats.ticks.fetch_add(1, Relaxed);
                last_tick_end_ns = now_ns();
                if let Some(log) = &cfg.handoff_log {
                    for id in releasing.drain(..) {
                        log.released(id, last_tick_end_ns);
                    }
                    for id in answering.drain(..) {
                        log.note(id, |p| p.snapshot_ns = Some(last_tick_end_ns));
                    }
                    for id in adopting.drain(..) {
                        log.note(id, |p| p.first_tick_end_ns = Some(last_tick_end_ns));
                    }
                }
                tx.end_tick(tick).await.context("sending the tick")?;
            }
        }
    }
    let _ = tx.close().await;
    Ok(())
}

/// What one synthetic client saw.
#[derive(Debug)]
pub struct Watched {
    /// Latency of every stamped update received after the measurement began, in nanoseconds.
    pub latency: Histogram<u64>,
    pub updates: u64,
    /// Entities that appeared in view.
    pub appeared: u64,
}

impl Watched {
    pub fn new() -> Self {
        Self {
            latency: nanos_histogram(),
            updates: 0,
            appeared: 0,
        }
    }
}

impl Default for Watched {
    fn default() -> Self {
        Self::new()
    }
}

/// Logs in with `token` through the proxy at `proxy`, answers pings, and records the latency of
/// every stamped update from `measure_from_ns` on, until `stop`.
pub async fn watch(
    proxy: String,
    token: String,
    measure_from_ns: u64,
    stop: CancellationToken,
) -> anyhow::Result<Watched> {
    let window = Arc::new(Window::default());
    window.open(measure_from_ns, u64::MAX);
    let seen = Arc::new(Mutex::new(Watched::new()));
    watch_window(proxy, token, window, seen.clone(), 0, stop).await?;
    let seen = std::mem::take(&mut *seen.lock().expect("client tally lock poisoned"));
    Ok(seen)
}

/// Like [`watch`], but into `seen`, which the scenario reads and resets between windows: every
/// entity that appears, and the latency of the updates stamped within `window`. With
/// `inputs_hz` above 0 it also sends that many inputs a second, as a player does.
pub async fn watch_window(
    proxy: String,
    token: String,
    window: Arc<Window>,
    seen: Arc<Mutex<Watched>>,
    inputs_hz: u32,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let (mut tx, mut rx, _welcome) = client::login(&proxy, &token)
        .await
        .map_err(|e| anyhow::anyhow!("bench client login: {e}"))?;
    let mut inputs =
        tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(inputs_hz.max(1))));
    inputs.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut input_seq = 0u64;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            _ = inputs.tick(), if inputs_hz > 0 => {
                input_seq += 1;
                tx.input(input_seq, stamped(INPUT_BYTES, input_seq))
                    .await
                    .map_err(|e| anyhow::anyhow!("bench client input: {e}"))?;
                continue;
            }
            m = rx.next() => m,
        };
        let Some(msg) = msg else {
            anyhow::bail!("the proxy closed the bench client's connection")
        };
        let msg = msg.map_err(|e| anyhow::anyhow!("bench client: {e}"))?;
        match msg.body {
            Some(server_message::Body::Batch(b)) => {
                let now = now_ns();
                // Under the lock, so that a reset between windows never splits a batch.
                let mut seen = seen.lock().expect("client tally lock poisoned");
                let window = window.get();
                for d in b.deltas {
                    if d.kind == cellmesh_proto::edge::DeltaKind::Appear as i32 {
                        seen.appeared += 1;
                        continue;
                    }
                    for c in d.components.iter().filter(|c| c.r#type == STAMPED) {
                        let Some((sent, _)) = read_stamp(&c.payload) else {
                            continue;
                        };
                        if within(window, sent) {
                            seen.updates += 1;
                            let _ = seen.latency.record(now.saturating_sub(sent).max(1));
                        }
                    }
                }
            }
            Some(server_message::Body::Ping(p)) => {
                tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await
                    .map_err(|e| anyhow::anyhow!("bench client pong: {e}"))?;
            }
            Some(server_message::Body::Kick(k)) => anyhow::bail!("bench client kicked: {k:?}"),
            _ => {}
        }
    }
    let _ = tx.close().await;
    Ok(())
}

/// `result`; when it failed and so did a game or client task (`tasks`), with why that did.
pub fn with_cause<T>(result: anyhow::Result<T>, tasks: anyhow::Result<()>) -> anyhow::Result<T> {
    match (result, tasks) {
        (Err(e), Err(cause)) => Err(anyhow::anyhow!("{e:#} (a task failed: {cause:#})")),
        (result, _) => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_reads_back_and_pads_to_the_payload_size() {
        let before = now_ns();
        let p = stamped(40, 7);
        assert_eq!(p.len(), 40);
        let (ns, seq) = read_stamp(&p).unwrap();
        assert!(ns >= before && ns <= now_ns());
        assert_eq!(seq, 7);
        assert!(read_stamp(&p[..15]).is_none());
        assert_eq!(stamped(3, 1).len(), STAMP_LEN);
        assert_eq!(read_stamp(&stamped_at(32, 9, 1234)), Some((1234, 9)));
    }

    #[test]
    fn an_echo_carries_the_input_stamp_and_the_time_held() {
        let input = stamped(40, 9);
        let (sent, _) = read_stamp(&input).unwrap();
        let echo = echo_payload(&input, 1234).unwrap();
        assert_eq!(echo.len(), ECHO_LEN);
        assert_eq!(read_echo(&echo), Some((sent, 9, 1234)));
        assert_eq!(echo_payload(&input[..10], 1), None, "no stamp, no echo");
        assert_eq!(read_echo(&echo[..ECHO_LEN - 1]), None);
    }

    #[test]
    fn load_is_the_second_longest_tick_of_the_second_from_when_it_was_due() {
        let mut t = TickTimes::default();
        let start = tokio::time::Instant::now();
        // Twenty-one ticks at 20 Hz, each ended 10 ms after it was due, the last 40 ms late:
        // the second is over at the last.
        let mut report = None;
        for i in 0..21u32 {
            let due = start + Duration::from_millis(50 * u64::from(i));
            let late = match i {
                7 => 90,
                12 => 40,
                3 => 30,
                _ => 10,
            };
            report = t.tick(due, due + Duration::from_millis(late));
            if i < 20 {
                assert_eq!(report, None, "not a second yet at tick {i}");
            }
        }
        assert_eq!(
            report,
            Some(Duration::from_millis(40)),
            "one hiccup of 90 ms aside"
        );
        assert_eq!(
            t.worst,
            [Duration::ZERO; 2],
            "the next second starts afresh"
        );
    }

    #[test]
    fn tick_work_costs_cpu_per_npc_and_per_player() {
        let work = TickWork {
            per_npc: Duration::from_micros(10),
            per_player: Duration::from_micros(100),
        };
        assert_eq!(work.cost(100, 20), Duration::from_millis(3));
        burn(Duration::from_micros(10));
        // On an idle machine about the time asked; never much less on a busy one.
        let t = Instant::now();
        burn(Duration::from_millis(20));
        assert!(
            t.elapsed() >= Duration::from_millis(10),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_window_holds_its_start_and_not_its_end() {
        let w = Window::default();
        assert!(!within(w.get(), 0), "a window never opened holds nothing");
        w.open(10, 20);
        assert!(within(w.get(), 10) && within(w.get(), 19));
        assert!(!within(w.get(), 9) && !within(w.get(), 20));
    }

    #[test]
    fn snapshot_state_round_trips() {
        assert_eq!(
            decode_state(&encode_state((1.5, -2.0), -1.0)),
            Some(((1.5, -2.0), -1.0))
        );
        assert_eq!(decode_state(&[0; 23]), None);
    }

    #[test]
    fn a_walk_turns_at_both_ends() {
        let w = Walk {
            speed: 2.0,
            min_x: 0.0,
            max_x: 5.0,
        };
        assert_eq!(w.step(4.0, 1.0), (5.0, -1.0));
        assert_eq!(w.step(5.0, -1.0), (3.0, -1.0));
        assert_eq!(w.step(1.0, -1.0), (0.0, 1.0));
    }
}
