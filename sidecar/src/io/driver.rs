//! The driver: one task that owns the [`Core`], feeds it the events of the connection, store
//! and membership tasks with the time, wakes it when it asks, and carries out its outputs.
//! Sends never wait: a full outbox cuts that connection, and the core is told.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cellmesh_admin::Admin;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_world::partition::NodeId;
use cellmesh_world::world_map::{NodeMap, NODE_SAMPLE_MAX};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::mesh::MeshCtx;
use super::spans::Spans;
use super::{dial, store, Event, GameHandle, GameOut, LinkHandle};
use crate::core::wire::forwarded_inputs;
use crate::core::{ConnId, Core, Input, LeaseTerms, LinkId, Now, Output, Restored};
use crate::metrics::Metrics;
use crate::model::agones::{NodeStatus, Stopped};
use crate::Real;

/// Events handled before the outputs are carried out, so one burst becomes one frame per peer.
const EVENTS_PER_FLUSH: usize = 64;
/// Restores kept for the handle's owner to take, at most; later ones are not kept.
const RESTORED_KEPT: usize = 100_000;

/// The time now: monotonic since `start`, and the wall clock.
/// `at` on the core's monotonic clock (milliseconds since `start`; 0 if before it).
pub(crate) fn mono_ms(start: Instant, at: Instant) -> u64 {
    at.saturating_duration_since(start).as_millis() as u64
}

pub(crate) fn now(start: Instant) -> Now {
    Now {
        mono_ms: start.elapsed().as_millis() as u64,
        unix_ms: super::unix_ms(),
    }
}

pub(crate) struct Driver {
    pub core: Core,
    pub start: Instant,
    pub games: HashMap<ConnId, GameHandle>,
    pub links: HashMap<LinkId, LinkHandle>,
    pub dialers: HashMap<NodeId, CancellationToken>,
    pub stores: Stores,
    /// Where partitions are committed (a cluster node's): a dead node's re-plan.
    pub topology: Option<Arc<dyn TopologyStore>>,
    /// For store answers.
    pub inbox: mpsc::Sender<Event>,
    pub tasks: TaskTracker,
    pub admin: Arc<Admin>,
    pub published: Arc<Mutex<serde_json::Value>>,
    pub census: Arc<Mutex<Vec<Real>>>,
    /// This node's part of the live map (`/api/node-map`), as of the last publish.
    pub node_map: Arc<Mutex<NodeMap>>,
    /// Restores decided here, until the handle's owner takes them (at most [`RESTORED_KEPT`]).
    pub restored: Arc<Mutex<Vec<Restored>>>,
    pub mesh_ctx: MeshCtx,
    pub metrics: Metrics,
    pub shutdown: CancellationToken,
    /// Why the node stopped, when it could not go on (the handle reports it).
    pub failure: Arc<Mutex<Option<String>>>,
    /// The latest report to the balancer, for the membership task to publish.
    pub load_reports: tokio::sync::watch::Sender<Option<cellmesh_world::balance::CellReport>>,
    /// The players attached here, as membership publishes them.
    pub player_samples:
        tokio::sync::watch::Sender<Option<Vec<cellmesh_stores::topology::PlayerSample>>>,
    /// What the Agones task (if any) follows.
    pub agones: tokio::sync::watch::Sender<NodeStatus>,
    /// The spans of handoffs and entity commands under way, when spans are exported.
    pub spans: Spans,
}

impl Driver {
    fn now(&self) -> Now {
        now(self.start)
    }

    pub async fn run(mut self, mut events: mpsc::Receiver<Event>) {
        loop {
            let wake = self
                .core
                .poll_timeout()
                .map(|ms| self.start + Duration::from_millis(ms));
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    self.on_event(ev);
                    for _ in 1..EVENTS_PER_FLUSH {
                        match events.try_recv() {
                            Ok(ev) => self.on_event(ev),
                            Err(_) => break,
                        }
                    }
                }
                _ = sleep_until(wake) => {
                    let now = self.now();
                    self.core.handle(now, Input::Timer);
                }
            }
            self.act();
            self.tell_agones(None);
        }
        let now = self.now();
        self.core.handle(now, Input::Shutdown);
        self.act();
        // Stopped: cleanly after a drain (or a signal cutting it short), or on a failure.
        let failed = self
            .failure
            .lock()
            .expect("failure lock poisoned")
            .is_some();
        self.tell_agones(Some(if failed {
            Stopped::Failed
        } else {
            Stopped::Cleanly
        }));
        self.spans.close_all();
        // Dropping the handles lets every connection write what is queued, then close.
        self.games.clear();
        self.links.clear();
        for (_, d) in self.dialers.drain() {
            d.cancel();
        }
    }

    /// Publishes the node's status for the Agones task, when it changed.
    fn tell_agones(&self, stopped: Option<Stopped>) {
        let status = NodeStatus {
            game: self.core.game_connected(),
            ready: self.admin.is_ready(),
            stopped,
        };
        self.agones.send_if_modified(|s| {
            let changed = *s != status;
            *s = status;
            changed
        });
    }

    fn on_event(&mut self, ev: Event) {
        let input = match ev {
            Event::GameHello {
                conn,
                hello,
                rest,
                handle,
            } => {
                self.games.insert(conn, handle);
                Input::GameHello { conn, hello, rest }
            }
            Event::LinkUp {
                link,
                hello,
                remote,
                handle,
                rest,
            } => {
                self.links.insert(link, handle);
                self.spans.link_up(link, &hello);
                self.spans.received(&rest);
                Input::LinkUp {
                    link,
                    hello,
                    remote,
                    rest,
                }
            }
            Event::LeaseRenewed { lease, deadline } => Input::LeaseRenewed(LeaseTerms {
                lease,
                until_ms: mono_ms(self.start, deadline),
            }),
            Event::Core(input) => {
                match &input {
                    Input::GameClosed { conn, .. } => {
                        self.games.remove(conn);
                    }
                    Input::LinkClosed { link, .. } => {
                        self.links.remove(link);
                        self.spans.link_closed(*link);
                    }
                    Input::LinkFrame { messages, .. } => self.spans.received(messages),
                    _ => {}
                }
                input
            }
        };
        let now = self.now();
        self.core.handle(now, input);
    }

    /// Carries out everything the core wants done. Never waits.
    fn act(&mut self) {
        if self.spans.on() {
            self.spans.sweep(mono_ms(self.start, Instant::now()));
        }
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::ToGame { conn, frame } => {
                    let Some(g) = self.games.get(&conn) else {
                        continue;
                    };
                    if let Err(TrySendError::Full(_)) = g.outbox.try_send(GameOut::Frame(frame)) {
                        g.kill.cancel();
                        self.games.remove(&conn);
                        let now = self.now();
                        self.core.handle(now, Input::GameStalled { conn });
                    }
                }
                Output::GameFatal { conn, error } => {
                    if let Some(g) = self.games.remove(&conn) {
                        // A fresh outbox always has room; if the task is gone nobody hears.
                        let _ = g.outbox.try_send(GameOut::Fatal(error));
                    }
                }
                Output::KillGame { conn } => {
                    if let Some(g) = self.games.remove(&conn) {
                        g.kill.cancel();
                    }
                }
                Output::ReleaseGame { conn } => {
                    self.games.remove(&conn);
                }
                Output::ToLink { link, frame } => {
                    let Some(l) = self.links.get_mut(&link) else {
                        let lost = forwarded_inputs(&frame.messages);
                        self.metrics.inputs_lost_in_links.inc_by(lost);
                        continue;
                    };
                    if self.spans.on() {
                        let now_ms = mono_ms(self.start, Instant::now());
                        self.spans.sent(link, &frame.messages, now_ms);
                    }
                    let sent = l.outbox.try_send(frame);
                    // A deep outbox is latency for everyone on the link: the core hears of it
                    // (its admission policy decides), at most every so often.
                    let queued = l.outbox.max_capacity() - l.outbox.capacity();
                    if sent.is_ok() && queued >= self.core.cfg.admission.outbox_high_frames {
                        let now = now(self.start);
                        let due = l.backlog_reported_ms.is_none_or(|t| {
                            now.mono_ms >= t + crate::core::BACKLOG_REPORT_EVERY_MS
                        });
                        if due {
                            l.backlog_reported_ms = Some(now.mono_ms);
                            self.core.handle(
                                now,
                                Input::LinkBacklog {
                                    link,
                                    frames: queued,
                                },
                            );
                        }
                    }
                    if let Err(e) = sent {
                        let full = matches!(e, TrySendError::Full(_));
                        let (TrySendError::Full(frame) | TrySendError::Closed(frame)) = e;
                        let lost = forwarded_inputs(&frame.messages);
                        self.metrics.inputs_lost_in_links.inc_by(lost);
                        if full {
                            l.kill.cancel();
                            self.links.remove(&link);
                            let now = self.now();
                            self.core.handle(now, Input::LinkStalled { link });
                        }
                    }
                }
                Output::KillLink { link } => {
                    if let Some(l) = self.links.remove(&link) {
                        l.kill.cancel();
                    }
                }
                Output::ReleaseLink { link } => {
                    self.links.remove(&link);
                }
                Output::Dial { node, addr } => {
                    if let Some(d) = self.dialers.remove(&node) {
                        d.cancel();
                    }
                    let stop = self.shutdown.child_token();
                    self.dialers.insert(node, stop.clone());
                    self.tasks
                        .spawn(dial::dial(node, addr, self.mesh_ctx.clone(), stop));
                }
                Output::StopDial { node } => {
                    if let Some(d) = self.dialers.remove(&node) {
                        d.cancel();
                    }
                }
                Output::Store(request) => {
                    let (stores, topology, inbox, metrics) = (
                        self.stores.clone(),
                        self.topology.clone(),
                        self.inbox.clone(),
                        self.metrics.clone(),
                    );
                    self.tasks.spawn(async move {
                        let reply =
                            store::execute(&stores, topology.as_deref(), request, &metrics).await;
                        if let Some(reply) = reply {
                            let _ = inbox.send(Event::Core(Input::Store(reply))).await;
                        }
                    });
                }
                Output::Ready(ready) => self.admin.set_ready(ready),
                Output::LoadReport(report) => {
                    self.load_reports.send_replace(Some(*report));
                }
                Output::Players(players) => {
                    self.player_samples.send_replace(Some(players));
                }
                Output::Publish => {
                    *self.published.lock().expect("state lock poisoned") = self.core.state();
                    *self.census.lock().expect("census lock poisoned") = self.core.reals();
                    *self.node_map.lock().expect("node map lock poisoned") =
                        self.core.node_map(NODE_SAMPLE_MAX);
                    let restored = self.core.take_restored();
                    if !restored.is_empty() {
                        let mut log = self.restored.lock().expect("restore log lock poisoned");
                        let room = RESTORED_KEPT.saturating_sub(log.len());
                        log.extend(restored.into_iter().take(room));
                    }
                }
                Output::Stop => self.shutdown.cancel(),
                Output::Exit { reason } => {
                    tracing::error!("{reason}: the sidecar exits");
                    *self.failure.lock().expect("failure lock poisoned") = Some(reason);
                    self.shutdown.cancel();
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
