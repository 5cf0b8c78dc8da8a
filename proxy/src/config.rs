//! The proxy's configuration: TOML with `CELLMESH_*` overrides (see `cellmesh_admin::config`),
//! defaults that run next to a local sidecar with nothing set.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The token secret shipped as a default; a deployment that keeps it accepts forged logins.
pub const DEFAULT_TOKEN_SECRET: &str = "dev-secret-change-me";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Name sent to gateways in `LinkHello`.
    pub name: String,
    pub geo: String,
    pub client_listen: String,
    pub admin_listen: String,
    /// Mesh addresses of the gateway sidecars; one multiplexed link each.
    pub gateways: Vec<String>,
    /// Shared with the login service: HMAC key of the edge tokens.
    pub token_secret: String,
    pub hello_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub ping_interval_ms: u64,
    pub max_frame_bytes: usize,
    /// Frames queued towards one client before it is kicked as a slow consumer.
    pub client_outbox_frames: usize,
    /// Messages queued towards one gateway before that link is closed as stalled.
    pub link_outbox_frames: usize,
    pub rate: RateConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateConfig {
    pub account_inputs_per_sec: u32,
    pub account_burst: u32,
    pub address_inputs_per_sec: u32,
    pub address_burst: u32,
    /// Inputs dropped within one second that earn a `Kick{FLOOD}`.
    pub flood_kick_drops: u32,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            name: "proxy-1".into(),
            geo: "local".into(),
            client_listen: "127.0.0.1:7300".into(),
            admin_listen: "127.0.0.1:9300".into(),
            gateways: vec!["127.0.0.1:7200".into()],
            token_secret: DEFAULT_TOKEN_SECRET.into(),
            hello_timeout_ms: 5000,
            idle_timeout_ms: 30_000,
            ping_interval_ms: 1000,
            max_frame_bytes: cellmesh_proto::codec::DEFAULT_MAX_FRAME,
            client_outbox_frames: 256,
            link_outbox_frames: 8192,
            rate: RateConfig::default(),
        }
    }
}

impl Default for RateConfig {
    fn default() -> Self {
        Self {
            account_inputs_per_sec: 60,
            account_burst: 120,
            address_inputs_per_sec: 600,
            address_burst: 1200,
            flood_kick_drops: 200,
        }
    }
}

impl ProxyConfig {
    /// Refuses values the proxy cannot run with, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let positive = [
            ("hello_timeout_ms", self.hello_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("ping_interval_ms", self.ping_interval_ms),
            ("max_frame_bytes", self.max_frame_bytes as u64),
            ("client_outbox_frames", self.client_outbox_frames as u64),
            ("link_outbox_frames", self.link_outbox_frames as u64),
            (
                "rate.account_inputs_per_sec",
                self.rate.account_inputs_per_sec.into(),
            ),
            ("rate.account_burst", self.rate.account_burst.into()),
            (
                "rate.address_inputs_per_sec",
                self.rate.address_inputs_per_sec.into(),
            ),
            ("rate.address_burst", self.rate.address_burst.into()),
            ("rate.flood_kick_drops", self.rate.flood_kick_drops.into()),
        ];
        for (key, value) in positive {
            anyhow::ensure!(value > 0, "config: {key} must be greater than 0");
        }
        anyhow::ensure!(
            self.max_frame_bytes <= u32::MAX as usize,
            "config: max_frame_bytes must fit the 4-byte length prefix"
        );
        anyhow::ensure!(
            !self.gateways.is_empty(),
            "config: gateways must name at least one sidecar"
        );
        anyhow::ensure!(
            !self.token_secret.is_empty(),
            "config: token_secret must not be empty"
        );
        Ok(())
    }

    pub fn hello_timeout(&self) -> Duration {
        Duration::from_millis(self.hello_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    pub fn ping_interval(&self) -> Duration {
        Duration::from_millis(self.ping_interval_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_zero_is_named() {
        ProxyConfig::default().validate().unwrap();
        let mut c = ProxyConfig::default();
        c.rate.account_burst = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("rate.account_burst"), "{err}");
        let c = ProxyConfig {
            gateways: vec![],
            ..ProxyConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("gateways"));
    }

    #[test]
    fn loads_nested_rate_section_and_env() {
        let env = vec![
            (
                "CELLMESH_RATE__FLOOD_KICK_DROPS".to_string(),
                "7".to_string(),
            ),
            (
                "CELLMESH_GATEWAYS".to_string(),
                "[\"10.0.0.1:7200\", \"10.0.0.2:7200\"]".to_string(),
            ),
        ];
        let c: ProxyConfig = cellmesh_admin::config::load_with_env(None, env).unwrap();
        assert_eq!(c.rate.flood_kick_drops, 7);
        assert_eq!(c.rate.account_burst, 120);
        assert_eq!(c.gateways, vec!["10.0.0.1:7200", "10.0.0.2:7200"]);
    }
}
