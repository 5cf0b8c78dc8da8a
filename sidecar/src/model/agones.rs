//! Running under Agones: what the sidecar calls on the Agones SDK server, and when, on the game's
//! behalf (so a game that adopts cellmesh needs no Agones SDK of its own). The io task
//! (`io::agones`) makes the calls over the SDK server's local REST API; this decides them.
//!
//! - labels `cellmesh-node` (the node id) and `cellmesh-geo` (the geo) are set once, first;
//! - `Ready` once a game said `Hello` and the node itself is ready (its admin `/ready`); once only,
//!   a game that reconnects later does not send it again;
//! - `Health` every `health_every_ms` from the start (a game may take a while to connect), and on
//!   while a game is connected or draining; it pauses while the game that said `Hello` is gone,
//!   so that Agones marks the game server unhealthy if it stays away past the fleet's
//!   `health.failureThreshold` periods, and resumes if it comes back before;
//! - `Shutdown` once the sidecar stopped cleanly (after its drain, or a second signal cutting the
//!   drain short), as the last call; not when it stops on a failure (its node lease was lost):
//!   that process exits non-zero to be restarted beside the same game.
//!
//! One call at a time, in that order of precedence. A failed label, `Ready` or `Shutdown` is tried
//! again after a back-off (250 ms doubling to 5 s); a failed `Health` waits for the next period.
//! `Shutdown` is given up [`SHUTDOWN_PATIENCE_MS`] after the stop, so that a missing SDK server
//! never holds the process.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The label carrying the node id (Agones sets it as `agones.dev/sdk-cellmesh-node`).
pub const LABEL_NODE: &str = "cellmesh-node";
/// The label carrying the geo (`agones.dev/sdk-cellmesh-geo`).
pub const LABEL_GEO: &str = "cellmesh-geo";
/// The first pause after a failed call; each failure in a row doubles it...
pub const RETRY_MIN_MS: u64 = 250;
/// ...up to this.
pub const RETRY_MAX_MS: u64 = 5_000;
/// How long after the stop `Shutdown` is still tried.
pub const SHUTDOWN_PATIENCE_MS: u64 = 3_000;
/// The longest a Kubernetes label value may be.
const LABEL_VALUE_MAX: usize = 63;

/// The `[agones]` section of the sidecar's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgonesConfig {
    /// The port of the Agones SDK server's REST API on localhost. 0: taken from
    /// `AGONES_SDK_HTTP_PORT` when `cellmesh sidecar` starts (Agones sets it), otherwise none
    /// and Agones is never called.
    pub sdk_http_port: u16,
    /// False: never call Agones, even under it (a game that keeps its own Agones SDK).
    pub enabled: bool,
    /// How often `Health` is sent; below the fleet's `health.periodSeconds` (5 s by default).
    pub health_every_ms: u64,
}

impl Default for AgonesConfig {
    fn default() -> Self {
        Self {
            sdk_http_port: 0,
            enabled: true,
            health_every_ms: 2_000,
        }
    }
}

impl AgonesConfig {
    /// The SDK server's port, when Agones is to be called.
    pub fn port(&self) -> Option<u16> {
        (self.enabled && self.sdk_http_port != 0).then_some(self.sdk_http_port)
    }

    pub fn check(&self) -> Result<(), String> {
        if !(100..=60_000).contains(&self.health_every_ms) {
            return Err(format!(
                "agones.health_every_ms {} is outside 100..=60000",
                self.health_every_ms
            ));
        }
        Ok(())
    }

    /// Takes the port from `AGONES_SDK_HTTP_PORT`'s value `env` unless the configuration names
    /// one.
    pub fn adopt_env_port(&mut self, env: Option<&str>) -> Result<(), String> {
        let Some(text) = env.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(());
        };
        if self.sdk_http_port != 0 {
            return Ok(());
        }
        match text.parse::<u16>() {
            Ok(port) if port != 0 => {
                self.sdk_http_port = port;
                Ok(())
            }
            _ => Err(format!("AGONES_SDK_HTTP_PORT {text:?} is not a port")),
        }
    }
}

/// What the node tells the Agones task about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeStatus {
    /// A game is connected (it said `Hello`).
    pub game: bool,
    /// The node is ready (its admin `/ready` answers 200).
    pub ready: bool,
    /// The sidecar has stopped, and how.
    pub stopped: Option<Stopped>,
}

/// How the sidecar stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// After its drain (or a second signal): the game server is done, Agones may remove it.
    Cleanly,
    /// On a failure (node lease lost): the process exits non-zero to be restarted.
    Failed,
}

/// One call of the Agones SDK's REST API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Label { key: &'static str, value: String },
    Ready,
    Health,
    Shutdown,
}

impl Call {
    /// Its name in logs and in the `agones_calls` metric.
    pub fn name(&self) -> &'static str {
        match self {
            Call::Label { .. } => "label",
            Call::Ready => "ready",
            Call::Health => "health",
            Call::Shutdown => "shutdown",
        }
    }

    pub fn method(&self) -> &'static str {
        match self {
            Call::Label { .. } => "PUT",
            _ => "POST",
        }
    }

    pub fn path(&self) -> &'static str {
        match self {
            Call::Label { .. } => "/metadata/label",
            Call::Ready => "/ready",
            Call::Health => "/health",
            Call::Shutdown => "/shutdown",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        match self {
            Call::Label { key, value } => {
                serde_json::json!({ "key": key, "value": value }).to_string()
            }
            _ => "{}".into(),
        }
    }
}

/// `text` as a valid Kubernetes label value: at most 63 characters of `[A-Za-z0-9._-]`, starting
/// and ending with a letter or digit (anything else becomes `-`, the ends are trimmed).
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let trimmed = mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    let cut = &trimmed[..trimmed.len().min(LABEL_VALUE_MAX)];
    cut.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// The pause before retrying after `failures` failures in a row.
fn backoff_ms(failures: u32) -> u64 {
    let doublings = failures.saturating_sub(1).min(16);
    (RETRY_MIN_MS << doublings).min(RETRY_MAX_MS)
}

/// Failures in a row of one kind of call, and when it may be tried again.
#[derive(Debug, Clone, Copy, Default)]
struct Retry {
    failures: u32,
    not_before_ms: u64,
}

impl Retry {
    fn due(&self, now_ms: u64) -> bool {
        now_ms >= self.not_before_ms
    }

    fn failed(&mut self, now_ms: u64) {
        self.failures = self.failures.saturating_add(1);
        self.not_before_ms = now_ms + backoff_ms(self.failures);
    }

    fn succeeded(&mut self) {
        *self = Self::default();
    }
}

/// What the sidecar owes Agones. Feed it the node's [`NodeStatus`] and each call's outcome; it
/// hands out the next call ([`poll_call`](Self::poll_call)) and says when to ask again
/// ([`poll_timeout`](Self::poll_timeout)). Times are monotonic milliseconds.
#[derive(Debug)]
pub struct AgonesSdk {
    health_every_ms: u64,
    status: NodeStatus,
    /// Labels still to set, in order.
    labels: VecDeque<(&'static str, String)>,
    label_retry: Retry,
    ready_sent: bool,
    ready_retry: Retry,
    /// A game said `Hello` at some point.
    game_seen: bool,
    next_health_ms: u64,
    /// When the sidecar stopped cleanly.
    stopped_at_ms: Option<u64>,
    shutdown_retry: Retry,
    in_flight: Option<Call>,
    finished: bool,
}

impl AgonesSdk {
    /// What a node `node_id` of `geo` owes Agones, from `now_ms` on (the first `Health` at once).
    pub fn new(node_id: u32, geo: &str, health_every_ms: u64, now_ms: u64) -> Self {
        Self {
            health_every_ms: health_every_ms.max(1),
            status: NodeStatus::default(),
            labels: VecDeque::from([
                (LABEL_NODE, node_id.to_string()),
                (LABEL_GEO, label_value(geo)),
            ]),
            label_retry: Retry::default(),
            ready_sent: false,
            ready_retry: Retry::default(),
            game_seen: false,
            next_health_ms: now_ms,
            stopped_at_ms: None,
            shutdown_retry: Retry::default(),
            in_flight: None,
            finished: false,
        }
    }

    /// The node's status now. Once it has stopped, later statuses change nothing.
    pub fn status(&mut self, now_ms: u64, status: NodeStatus) {
        if self.status.stopped.is_some() {
            return;
        }
        self.status = status;
        self.game_seen |= status.game;
        match status.stopped {
            Some(Stopped::Cleanly) => self.stopped_at_ms = Some(now_ms),
            Some(Stopped::Failed) => self.finished = true,
            None => {}
        }
    }

    /// Whether `Health` is owed: from the start until a game has said `Hello`, then while one
    /// is connected; never after the stop.
    fn health_wanted(&self) -> bool {
        self.status.stopped.is_none() && (self.status.game || !self.game_seen)
    }

    fn ready_wanted(&self) -> bool {
        self.status.stopped.is_none() && !self.ready_sent && self.status.game && self.status.ready
    }

    /// The next call to make now, if any (one at a time: none while one is in flight).
    pub fn poll_call(&mut self, now_ms: u64) -> Option<Call> {
        if self.finished || self.in_flight.is_some() {
            return None;
        }
        let call = if let Some(stopped_at) = self.stopped_at_ms {
            if now_ms >= stopped_at + SHUTDOWN_PATIENCE_MS {
                self.finished = true;
                return None;
            }
            self.shutdown_retry.due(now_ms).then_some(Call::Shutdown)?
        } else if let Some((key, value)) =
            self.labels.front().filter(|_| self.label_retry.due(now_ms))
        {
            Call::Label {
                key,
                value: value.clone(),
            }
        } else if self.ready_wanted() && self.ready_retry.due(now_ms) {
            Call::Ready
        } else if self.health_wanted() && now_ms >= self.next_health_ms {
            self.next_health_ms = now_ms + self.health_every_ms;
            Call::Health
        } else {
            return None;
        };
        self.in_flight = Some(call.clone());
        Some(call)
    }

    /// The call handed out last ended, well (`ok`) or not.
    pub fn done(&mut self, now_ms: u64, ok: bool) {
        let Some(call) = self.in_flight.take() else {
            return;
        };
        match (call, ok) {
            (Call::Label { .. }, true) => {
                self.labels.pop_front();
                self.label_retry.succeeded();
            }
            (Call::Label { .. }, false) => self.label_retry.failed(now_ms),
            (Call::Ready, true) => {
                self.ready_sent = true;
                self.ready_retry.succeeded();
            }
            (Call::Ready, false) => self.ready_retry.failed(now_ms),
            // The next one comes at its period anyway.
            (Call::Health, _) => {}
            (Call::Shutdown, true) => self.finished = true,
            (Call::Shutdown, false) => self.shutdown_retry.failed(now_ms),
        }
    }

    /// When to call [`poll_call`](Self::poll_call) again at the latest (monotonic ms); `None`
    /// while a call is in flight or once nothing is left to do.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.finished || self.in_flight.is_some() {
            return None;
        }
        if let Some(stopped_at) = self.stopped_at_ms {
            return Some(
                self.shutdown_retry
                    .not_before_ms
                    .min(stopped_at + SHUTDOWN_PATIENCE_MS),
            );
        }
        let labels = (!self.labels.is_empty()).then_some(self.label_retry.not_before_ms);
        let ready = self
            .ready_wanted()
            .then_some(self.ready_retry.not_before_ms);
        let health = self.health_wanted().then_some(self.next_health_ms);
        [labels, ready, health].into_iter().flatten().min()
    }

    /// Nothing is left to call: `Shutdown` went through or was given up, or the sidecar failed.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Whether Agones was told the game server is ready.
    pub fn ready_sent(&self) -> bool {
        self.ready_sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: u64 = 1_000;

    fn sdk() -> AgonesSdk {
        AgonesSdk::new(7, "paris", PERIOD, 0)
    }

    fn status(game: bool, ready: bool) -> NodeStatus {
        NodeStatus {
            game,
            ready,
            stopped: None,
        }
    }

    fn stopped(how: Stopped) -> NodeStatus {
        NodeStatus {
            game: true,
            ready: false,
            stopped: Some(how),
        }
    }

    /// Every call made at `now`, each answered `ok`, until none is due.
    fn drain(s: &mut AgonesSdk, now: u64, ok: bool) -> Vec<Call> {
        let mut calls = Vec::new();
        while let Some(c) = s.poll_call(now) {
            assert!(s.poll_call(now).is_none(), "one call at a time");
            assert_eq!(
                s.poll_timeout(),
                None,
                "no timeout while a call is in flight"
            );
            calls.push(c);
            s.done(now, ok);
            assert!(calls.len() < 100, "a loop: {calls:?}");
        }
        calls
    }

    fn label(key: &'static str, value: &str) -> Call {
        Call::Label {
            key,
            value: value.into(),
        }
    }

    #[test]
    fn labels_first_then_health_and_no_ready_before_a_game_is_there() {
        let mut s = sdk();
        assert_eq!(
            drain(&mut s, 0, true),
            vec![
                label(LABEL_NODE, "7"),
                label(LABEL_GEO, "paris"),
                Call::Health
            ]
        );
        assert_eq!(s.poll_timeout(), Some(PERIOD));
        // The node alone is not enough, nor the game alone.
        s.status(10, status(false, true));
        assert_eq!(drain(&mut s, 10, true), vec![]);
        s.status(20, status(true, false));
        assert_eq!(drain(&mut s, 20, true), vec![]);
        assert_eq!(drain(&mut s, PERIOD, true), vec![Call::Health]);
        s.status(1500, status(true, true));
        assert_eq!(drain(&mut s, 1500, true), vec![Call::Ready]);
        assert!(s.ready_sent());
        assert_eq!(drain(&mut s, 2 * PERIOD, true), vec![Call::Health]);
        assert_eq!(drain(&mut s, 3 * PERIOD, true), vec![Call::Health]);
    }

    #[test]
    fn ready_is_sent_once_even_when_the_game_comes_back() {
        let mut s = sdk();
        s.status(0, status(true, true));
        let calls = drain(&mut s, 0, true);
        assert_eq!(calls.iter().filter(|c| **c == Call::Ready).count(), 1);
        s.status(100, status(false, false));
        s.status(200, status(true, true));
        assert!(!drain(&mut s, 5 * PERIOD, true).contains(&Call::Ready));
    }

    #[test]
    fn health_pauses_while_the_game_is_gone_and_resumes_when_it_comes_back() {
        let mut s = sdk();
        s.status(0, status(true, true));
        drain(&mut s, 0, true);
        s.status(500, status(false, false));
        assert_eq!(
            s.poll_timeout(),
            None,
            "nothing owed while the game is gone"
        );
        for t in 1..5 {
            assert_eq!(drain(&mut s, t * PERIOD, true), vec![]);
        }
        s.status(5_500, status(true, true));
        assert_eq!(drain(&mut s, 5_500, true), vec![Call::Health]);
    }

    #[test]
    fn a_failed_call_is_tried_again_after_a_growing_back_off_and_health_goes_on() {
        let mut s = sdk();
        s.status(0, status(true, true));
        // Everything fails: each label and Ready once, Health once.
        assert_eq!(
            drain(&mut s, 0, false),
            vec![label(LABEL_NODE, "7"), Call::Ready, Call::Health]
        );
        assert_eq!(s.poll_timeout(), Some(RETRY_MIN_MS));
        assert_eq!(
            drain(&mut s, RETRY_MIN_MS, false),
            vec![label(LABEL_NODE, "7"), Call::Ready]
        );
        // Doubled.
        assert_eq!(drain(&mut s, 2 * RETRY_MIN_MS, false), vec![]);
        assert_eq!(s.poll_timeout(), Some(3 * RETRY_MIN_MS));
        // Health keeps its period whatever the others do.
        assert_eq!(
            drain(&mut s, PERIOD, false),
            vec![label(LABEL_NODE, "7"), Call::Ready, Call::Health]
        );
        // Once the server answers, the rest goes through.
        let later = 60_000;
        assert_eq!(
            drain(&mut s, later, true),
            vec![
                label(LABEL_NODE, "7"),
                label(LABEL_GEO, "paris"),
                Call::Ready,
                Call::Health
            ]
        );
    }

    #[test]
    fn the_back_off_is_capped() {
        assert_eq!(backoff_ms(1), RETRY_MIN_MS);
        assert_eq!(backoff_ms(2), 2 * RETRY_MIN_MS);
        assert_eq!(backoff_ms(5), 4_000);
        assert_eq!(backoff_ms(6), RETRY_MAX_MS);
        assert_eq!(backoff_ms(50), RETRY_MAX_MS);
    }

    #[test]
    fn shutdown_is_the_last_call_after_a_clean_stop() {
        let mut s = sdk();
        s.status(0, status(true, true));
        drain(&mut s, 0, true);
        s.status(1_200, stopped(Stopped::Cleanly));
        assert_eq!(s.poll_timeout(), Some(0), "due at once");
        assert_eq!(drain(&mut s, 1_200, true), vec![Call::Shutdown]);
        assert!(s.finished());
        assert_eq!(s.poll_timeout(), None);
        // Nothing after it, whatever comes.
        s.status(1_300, status(true, true));
        assert_eq!(drain(&mut s, 10 * PERIOD, true), vec![]);
    }

    #[test]
    fn a_stop_before_ready_skips_what_is_left_and_shuts_down() {
        let mut s = sdk();
        s.status(0, stopped(Stopped::Cleanly));
        assert_eq!(drain(&mut s, 0, true), vec![Call::Shutdown]);
        assert!(s.finished());
    }

    #[test]
    fn shutdown_is_retried_then_given_up_so_the_process_can_exit() {
        let mut s = sdk();
        s.status(0, stopped(Stopped::Cleanly));
        let (mut now, mut tries) = (0, 0);
        while !s.finished() {
            while let Some(c) = s.poll_call(now) {
                assert_eq!(c, Call::Shutdown);
                tries += 1;
                s.done(now, false);
            }
            if s.finished() {
                break;
            }
            let t = s.poll_timeout().expect("a retry or the end is due");
            assert!(t > now, "time goes on");
            now = t;
        }
        assert_eq!(
            now, SHUTDOWN_PATIENCE_MS,
            "given up at the end of its patience"
        );
        assert!(tries >= 3, "tried {tries} times");
    }

    #[test]
    fn a_failed_stop_calls_nothing_more() {
        let mut s = sdk();
        s.status(0, status(true, true));
        drain(&mut s, 0, true);
        s.status(100, stopped(Stopped::Failed));
        assert!(s.finished());
        assert_eq!(drain(&mut s, 10 * PERIOD, true), vec![]);
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn calls_are_the_rest_api_of_the_sdk_server() {
        let l = label(LABEL_GEO, "paris");
        assert_eq!((l.method(), l.path()), ("PUT", "/metadata/label"));
        let body: serde_json::Value = serde_json::from_str(&l.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"key": "cellmesh-geo", "value": "paris"})
        );
        for (c, path) in [
            (Call::Ready, "/ready"),
            (Call::Health, "/health"),
            (Call::Shutdown, "/shutdown"),
        ] {
            assert_eq!(
                (c.method(), c.path(), c.body().as_str()),
                ("POST", path, "{}")
            );
        }
    }

    #[test]
    fn label_values_are_valid_kubernetes_label_values() {
        assert_eq!(label_value("paris"), "paris");
        assert_eq!(label_value("eu-west_1.b"), "eu-west_1.b");
        assert_eq!(label_value("São Paulo"), "S-o-Paulo");
        assert_eq!(label_value("-edge-"), "edge");
        assert_eq!(label_value("!!!"), "");
        let long = label_value(&format!("{}-{}", "a".repeat(62), "b"));
        assert_eq!(long, "a".repeat(62), "cut at 63, then trimmed");
        let long = label_value(&"x".repeat(100));
        assert_eq!(long.len(), 63);
    }

    #[test]
    fn the_port_comes_from_the_environment_unless_configured() {
        let mut c = AgonesConfig::default();
        assert_eq!(c.port(), None, "off with nothing set");
        c.adopt_env_port(None).unwrap();
        assert_eq!(c.port(), None);
        c.adopt_env_port(Some("9358")).unwrap();
        assert_eq!(c.port(), Some(9358));
        let mut set = AgonesConfig {
            sdk_http_port: 7000,
            ..Default::default()
        };
        set.adopt_env_port(Some("9358")).unwrap();
        assert_eq!(set.port(), Some(7000), "the configuration wins");
        let mut off = AgonesConfig {
            enabled: false,
            ..Default::default()
        };
        off.adopt_env_port(Some("9358")).unwrap();
        assert_eq!(off.port(), None, "turned off");
        let e = AgonesConfig::default()
            .adopt_env_port(Some("http"))
            .unwrap_err();
        assert!(e.contains("AGONES_SDK_HTTP_PORT"), "{e}");
        assert!(AgonesConfig {
            health_every_ms: 10,
            ..Default::default()
        }
        .check()
        .is_err());
        AgonesConfig::default().check().unwrap();
    }
}
