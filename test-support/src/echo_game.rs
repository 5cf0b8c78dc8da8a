//! A small real game: it connects to a sidecar over the local protocol with the SDK, ticks at
//! 50 Hz, and sends each input's payload back to its account in the next tick; an input
//! `flood <n>` is answered with `n` messages of 32 KB instead (for a client that stops reading).
//! What it was told (inputs, joins, leaves) is kept for the test to read.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cellmesh_proto::local::{game_message, sidecar_message, Send};
use cellmesh_proto::sdk::{self, SdkConfig};

/// An input as the game got it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GameInput {
    pub account: String,
    pub session_epoch: u64,
    pub seq: u64,
    pub payload: Vec<u8>,
}

#[derive(Default)]
struct Seen {
    inputs: Vec<GameInput>,
    joins: Vec<String>,
    /// (account, reason)
    leaves: Vec<(String, String)>,
}

/// The running game; it stops when dropped.
pub struct EchoGame {
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

/// The message type of an echo.
pub const ECHO: u32 = 1;

impl EchoGame {
    /// Connects to the sidecar's local-protocol address and starts playing.
    pub async fn connect(local_addr: &str) -> Self {
        let cfg = SdkConfig::tcp(local_addr, "echo-game");
        let (mut tx, mut rx, _) = crate::within("the game's handshake", sdk::connect(cfg))
            .await
            .expect("the game connects");
        let seen = Arc::new(Mutex::new(Seen::default()));
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                let mut tick = 0;
                let mut every = tokio::time::interval(Duration::from_millis(20));
                loop {
                    tokio::select! {
                        m = rx.next() => {
                            let Some(Ok(m)) = m else { return };
                            let Some(body) = m.body else { continue };
                            // One frame each: a tick's echoes together could pass the
                            // local protocol's frame limit.
                            for message in record(&seen, body) {
                                tx.push(message);
                                if tx.flush().await.is_err() {
                                    return;
                                }
                            }
                        }
                        _ = every.tick() => {
                            tick += 1;
                            if tx.end_tick(tick).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
        Self { seen, task }
    }

    /// Every input so far, in the order the game got them.
    pub fn inputs(&self) -> Vec<GameInput> {
        self.seen.lock().unwrap().inputs.clone()
    }

    /// The accounts that joined, in order.
    pub fn joins(&self) -> Vec<String> {
        self.seen.lock().unwrap().joins.clone()
    }

    /// The accounts that left, with the sidecar's reason, in order.
    pub fn leaves(&self) -> Vec<(String, String)> {
        self.seen.lock().unwrap().leaves.clone()
    }

    /// Waits until `pred` holds of the inputs, joins and leaves.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&EchoGame) -> bool) {
        crate::within(what, async {
            while !pred(self) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
    }
}

impl Drop for EchoGame {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Keeps what the sidecar said; the messages to send back, if it was an input.
fn record(seen: &Mutex<Seen>, body: sidecar_message::Body) -> Vec<game_message::Body> {
    let mut seen = seen.lock().unwrap();
    match body {
        sidecar_message::Body::Input(i) => {
            let flood = std::str::from_utf8(&i.payload)
                .ok()
                .and_then(|p| p.strip_prefix("flood "))
                .and_then(|n| n.parse::<usize>().ok());
            let (count, payload) = match flood {
                Some(n) => (n, vec![7u8; 32 * 1024].into()),
                None => (1, i.payload.clone()),
            };
            let send = game_message::Body::Send(Send {
                accounts: vec![i.account.clone()],
                r#type: ECHO,
                payload,
            });
            seen.inputs.push(GameInput {
                account: i.account,
                session_epoch: i.session_epoch,
                seq: i.seq,
                payload: i.payload.to_vec(),
            });
            vec![send; count]
        }
        sidecar_message::Body::PlayerJoin(j) => {
            seen.joins.push(j.account);
            Vec::new()
        }
        sidecar_message::Body::PlayerLeave(l) => {
            seen.leaves.push((l.account, l.reason));
            Vec::new()
        }
        _ => Vec::new(),
    }
}
