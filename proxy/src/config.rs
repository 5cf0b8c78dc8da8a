//! The proxy's configuration: TOML with `CELLMESH_*` overrides (see `cellmesh_admin::config`),
//! defaults that run next to a local sidecar with nothing set.

use std::time::Duration;

use cellmesh_world::handover::HandoverParams;
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
    /// TLS for players' connections (`cert`, `key`: PEM files; `cellmesh certs issue --role
    /// edge` makes them), read again when they change or on SIGHUP. Unset: plaintext, allowed
    /// with `client_listen` on loopback, or with `client_plaintext`.
    pub client_tls: cellmesh_trust::ClientTlsConfig,
    /// Serve clients in plaintext off loopback: only behind a load balancer that terminates TLS.
    pub client_plaintext: bool,
    pub admin_listen: String,
    /// Bearer token for every admin path but `/live`, `/ready` and `/metrics` (clients send
    /// `Authorization: Bearer <admin_token>`); empty: open, allowed only with `admin_listen` on
    /// loopback.
    pub admin_token: String,
    /// Mesh addresses of the gateway sidecars; one multiplexed link each.
    pub gateways: Vec<String>,
    /// Mesh addresses of gateway sidecars of another geo (the core geo's), for an outage of
    /// this geo: dialled and kept up like `gateways`, but a session goes to one only while no
    /// gateway of `gateways` is up. It stays there until it ends, that link drops, or a gateway
    /// of `gateways` has been back `fallback_return_ms`; a bridged player's messages cross to
    /// wherever the avatar is simulated.
    pub fallback_gateways: Vec<String>,
    /// How long a gateway of `gateways` must be back before the sessions on fallback gateways
    /// move home to this geo's gateways (each as a move: the client stays connected). 0: they
    /// stay on the fallbacks until they end.
    pub fallback_return_ms: u64,
    /// Mutual TLS on the links to the gateways (`ca`, `cert`, `key`: PEM files; `cellmesh certs
    /// issue --role proxy` makes them), read again when they change or on SIGHUP. Must be set
    /// when the gateways' `mesh_tls` is; unset: plaintext, which a sidecar allows on loopback only.
    pub mesh_tls: cellmesh_trust::MeshTlsConfig,
    /// Shared with the login service: HMAC key of the edge tokens. Every geo's proxies also
    /// sign and check handover cookies with it (under a label of their own).
    pub token_secret: String,
    /// The login tokens' key ring (`["kid:secret", ...]`, shared with the login service): a
    /// token signed under any of them is admitted. Empty: `token_secret` alone, under the kid
    /// derived from it (`cellmesh_proto::keys::derived_kid`).
    pub token_keys: Vec<String>,
    /// The kid `cellmesh token` signs with; empty: the first of `token_keys`.
    pub token_signing_key: String,
    /// The handover cookies' and probe tickets' key ring, shared by every geo's proxies and not
    /// with the login service. Empty: the login ring's signing key (under labels of their own).
    pub cookie_keys: Vec<String>,
    /// The kid new cookies and tickets are sealed with; empty: the first of `cookie_keys`.
    pub cookie_signing_key: String,
    /// The attach attestations' key ring, shared with the gateway sidecars (their
    /// `attest_keys`). Empty: the public built-in key, which sidecars accept on loopback only.
    pub attest_keys: Vec<String>,
    /// The kid attestations are signed with; empty: the first of `attest_keys`.
    pub attest_signing_key: String,
    pub hello_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub ping_interval_ms: u64,
    /// Largest frame accepted from a client before its login is admitted: a hello is small, and
    /// a stranger must not hold more than this much of the proxy's memory.
    pub hello_max_frame_bytes: usize,
    /// Largest frame accepted from a logged-in client.
    pub client_max_frame_bytes: usize,
    /// Largest frame on a gateway link, and sent to a client.
    pub max_frame_bytes: usize,
    /// Client connections open at once; one more is told `Kick{OVERLOADED}` and closed.
    pub max_connections: usize,
    /// Client connections open at once from one address (an IPv6 address counts by its /64).
    /// Generous: a carrier-grade NAT puts many players behind one address.
    pub max_connections_per_address: usize,
    /// Frames queued towards one client before it is kicked as a slow consumer.
    pub client_outbox_frames: usize,
    /// Inputs and RTT reports queued towards one gateway; past it they are dropped and counted,
    /// while session control (attach, detach) still has room of its own.
    pub link_outbox_frames: usize,
    /// A link whose outbox stays full this long is closed (its sessions move to another gateway).
    pub link_stall_ms: u64,
    /// On shutdown: how long the proxy stays not ready, still serving everyone, so that load
    /// balancers stop sending new players before the first is asked to reconnect.
    pub drain_grace_ms: u64,
    /// Then: the window over which clients are asked to reconnect, one at a time at jittered
    /// moments, so the other proxies are not hit by every player at once.
    pub drain_spread_ms: u64,
    pub rate: RateConfig,
    /// The other geos of the network; none (the default) is a single-geo network.
    pub geos: GeosConfig,
}

/// The key rings a proxy signs and checks with.
#[derive(Debug, Clone)]
pub struct Rings {
    /// Login tokens: checked at every login.
    pub token: cellmesh_proto::keys::KeyRing,
    /// Handover cookies and probe tickets.
    pub cookie: cellmesh_proto::keys::KeyRing,
    /// Attach attestations: the signing key signs every `Attach`.
    pub attest: cellmesh_proto::keys::KeyRing,
}

/// Several geos (README.md#geos-bridge-first-hand-over-later): where the other geos' proxies are, this geo's and their Redis, and
/// the handover policy. With no peer, nothing of it runs: no cookie is ever requested, no probe
/// asked for, nobody handed over.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GeosConfig {
    /// This geo's Redis (`redis://…`), where other geos' proxies leave handover hints and the
    /// RTTs they measured to this geo's clients; `memory` for a proxy on its own.
    pub board: String,
    pub peers: Vec<PeerGeo>,
    /// How long a login waits for the client's answer to a `CookieRequest`.
    pub cookie_wait_ms: u64,
    /// How often each client is asked to probe the other geos' proxies (and once at login).
    pub probe_every_ms: u64,
    /// DNS servers (`ip:port`) that resolve the peers' `proxies` names; empty: the system's.
    pub dns_servers: Vec<String>,
    /// Use the kernel's TCP round-trip estimate (`TCP_INFO`) where there is one, rather than the
    /// timed pings. Off only for demos whose latency is shaped in-process, which the kernel
    /// cannot see.
    pub kernel_rtt: bool,
    pub handover: HandoverParams,
}

/// Another geo of the network.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerGeo {
    pub name: String,
    /// Where its proxies accept clients, found by DNS: `host:port` (A and AAAA records), an SRV
    /// name (`_cellmesh._tcp.montreal.example`, no port), or a literal `ip:port`.
    pub proxies: String,
    /// Its Redis: handover hints for it, and the RTTs this proxy measures to its clients.
    pub board: String,
}

impl Default for GeosConfig {
    fn default() -> Self {
        Self {
            board: "memory".into(),
            peers: Vec::new(),
            cookie_wait_ms: 1000,
            probe_every_ms: 60_000,
            dns_servers: Vec::new(),
            kernel_rtt: true,
            handover: HandoverParams::default(),
        }
    }
}

impl GeosConfig {
    /// A network of one geo: none of the geo machinery runs.
    pub fn single(&self) -> bool {
        self.peers.is_empty()
    }

    pub fn peer(&self, name: &str) -> Option<&PeerGeo> {
        self.peers.iter().find(|p| p.name == name)
    }

    fn validate(&self, home: &str) -> anyhow::Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        for p in &self.peers {
            anyhow::ensure!(
                p.name != home,
                "config: geos.peers names this proxy's own geo `{home}`"
            );
            anyhow::ensure!(
                seen.insert(p.name.as_str()),
                "config: geos.peers names geo `{}` twice",
                p.name
            );
            anyhow::ensure!(
                !p.proxies.is_empty(),
                "config: geos.peers `{}` has no proxies address",
                p.name
            );
        }
        anyhow::ensure!(
            self.cookie_wait_ms > 0,
            "config: geos.cookie_wait_ms must be greater than 0"
        );
        anyhow::ensure!(
            self.probe_every_ms > 0,
            "config: geos.probe_every_ms must be greater than 0"
        );
        self.handover
            .validate()
            .map_err(|e| anyhow::anyhow!("config: geos.{e}"))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateConfig {
    pub account_inputs_per_sec: u32,
    pub account_burst: u32,
    /// The per-address limit is this many accounts' worth (rate and burst): it stops one host
    /// flooding with many accounts, without punishing players who share a carrier-grade NAT.
    pub address_accounts: u32,
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
            admin_token: String::new(),
            gateways: vec!["127.0.0.1:7200".into()],
            fallback_gateways: Vec::new(),
            fallback_return_ms: 10_000,
            mesh_tls: Default::default(),
            client_tls: Default::default(),
            client_plaintext: false,
            token_secret: DEFAULT_TOKEN_SECRET.into(),
            token_keys: Vec::new(),
            token_signing_key: String::new(),
            cookie_keys: Vec::new(),
            cookie_signing_key: String::new(),
            attest_keys: Vec::new(),
            attest_signing_key: String::new(),
            hello_timeout_ms: 5000,
            idle_timeout_ms: 30_000,
            ping_interval_ms: 1000,
            hello_max_frame_bytes: 4096,
            client_max_frame_bytes: 16 * 1024,
            max_frame_bytes: cellmesh_proto::codec::DEFAULT_MAX_FRAME,
            max_connections: 20_000,
            max_connections_per_address: 256,
            client_outbox_frames: 256,
            link_outbox_frames: 8192,
            link_stall_ms: 5000,
            drain_grace_ms: 5000,
            drain_spread_ms: 10_000,
            rate: RateConfig::default(),
            geos: GeosConfig::default(),
        }
    }
}

impl Default for RateConfig {
    fn default() -> Self {
        Self {
            account_inputs_per_sec: 60,
            account_burst: 120,
            address_accounts: 64,
            flood_kick_drops: 200,
        }
    }
}

impl ProxyConfig {
    /// Refuses values the proxy cannot run with, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.mesh_tls.enabled()?;
        anyhow::ensure!(
            self.client_tls.enabled()?
                || self.client_plaintext
                || listens_on_loopback(&self.client_listen),
            "config: client_listen {} is reachable from other hosts and client_tls is not set: \
             players' traffic would cross the network in clear. Set client_tls.cert and \
             client_tls.key (CELLMESH_CLIENT_TLS__CERT/__KEY; `cellmesh certs issue --role edge` \
             makes them), or client_plaintext = true behind a load balancer that terminates TLS",
            self.client_listen
        );
        let positive = [
            ("hello_timeout_ms", self.hello_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("ping_interval_ms", self.ping_interval_ms),
            ("hello_max_frame_bytes", self.hello_max_frame_bytes as u64),
            ("client_max_frame_bytes", self.client_max_frame_bytes as u64),
            ("max_frame_bytes", self.max_frame_bytes as u64),
            ("max_connections", self.max_connections as u64),
            (
                "max_connections_per_address",
                self.max_connections_per_address as u64,
            ),
            ("client_outbox_frames", self.client_outbox_frames as u64),
            ("link_outbox_frames", self.link_outbox_frames as u64),
            ("link_stall_ms", self.link_stall_ms),
            (
                "rate.account_inputs_per_sec",
                self.rate.account_inputs_per_sec.into(),
            ),
            ("rate.account_burst", self.rate.account_burst.into()),
            ("rate.address_accounts", self.rate.address_accounts.into()),
            ("rate.flood_kick_drops", self.rate.flood_kick_drops.into()),
        ];
        for (key, value) in positive {
            anyhow::ensure!(value > 0, "config: {key} must be greater than 0");
        }
        for (key, value) in [
            ("hello_max_frame_bytes", self.hello_max_frame_bytes),
            ("client_max_frame_bytes", self.client_max_frame_bytes),
            ("max_frame_bytes", self.max_frame_bytes),
        ] {
            anyhow::ensure!(
                value <= u32::MAX as usize,
                "config: {key} must fit the 4-byte length prefix"
            );
        }
        anyhow::ensure!(
            self.hello_max_frame_bytes <= self.client_max_frame_bytes,
            "config: hello_max_frame_bytes ({}) must not exceed client_max_frame_bytes ({})",
            self.hello_max_frame_bytes,
            self.client_max_frame_bytes
        );
        anyhow::ensure!(
            !self.gateways.is_empty(),
            "config: gateways must name at least one sidecar"
        );
        if let Some(both) = self
            .fallback_gateways
            .iter()
            .find(|f| self.gateways.contains(f))
        {
            anyhow::bail!(
                "config: gateway {both} is in both gateways and fallback_gateways: a fallback is \
                 another geo's gateway, used only while none of gateways is up"
            );
        }
        self.geos.validate(&self.geo)?;
        anyhow::ensure!(
            !self.token_secret.is_empty(),
            "config: token_secret must not be empty"
        );
        let rings = self.rings()?;
        anyhow::ensure!(
            !rings.token.contains_secret(DEFAULT_TOKEN_SECRET.as_bytes())
                || listens_on_loopback(&self.client_listen),
            "config: token_secret is the public built-in default and client_listen {} is reachable \
             from other hosts, where anyone could sign a login: set token_secret (or \
             CELLMESH_TOKEN_SECRET) to the login service's secret",
            self.client_listen
        );
        anyhow::ensure!(
            !rings
                .cookie
                .contains_secret(DEFAULT_TOKEN_SECRET.as_bytes())
                || listens_on_loopback(&self.client_listen),
            "config: cookie_keys holds the public built-in default secret and client_listen {} \
             is reachable from other hosts, where anyone could seal a handover cookie: set \
             cookie_keys (CELLMESH_COOKIE_KEYS)",
            self.client_listen
        );
        if let Some(g) = self
            .all_gateways()
            .find(|g| self.attest_keys.is_empty() && !listens_on_loopback(g))
        {
            anyhow::bail!(
                "config: gateway {g} is not on loopback and no attest_keys are set: sidecars \
                 off loopback refuse the public built-in key; set attest_keys \
                 (CELLMESH_ATTEST_KEYS) to the ring the gateways check attaches with"
            );
        }
        cellmesh_admin::guard::require_token_off_loopback(&self.admin_listen, &self.admin_token)?;
        Ok(())
    }

    /// Every gateway the proxy dials: `gateways`, then `fallback_gateways`. A gateway's index
    /// in this order is its id in the core and in the driver.
    pub fn all_gateways(&self) -> impl Iterator<Item = &String> {
        self.gateways.iter().chain(&self.fallback_gateways)
    }

    /// The address of gateway `g`, by its index in [`Self::all_gateways`].
    pub fn gateway_addr(&self, g: usize) -> &str {
        match self.gateways.get(g) {
            Some(addr) => addr,
            None => &self.fallback_gateways[g - self.gateways.len()],
        }
    }

    /// True while the proxy runs with the public default secret (allowed on loopback only).
    pub fn uses_default_secret(&self) -> bool {
        self.rings().map_or(true, |r| {
            r.token.contains_secret(DEFAULT_TOKEN_SECRET.as_bytes())
        })
    }

    /// The key rings the config names, each checked.
    pub fn rings(&self) -> anyhow::Result<Rings> {
        use cellmesh_proto::keys::KeyRing;
        let token = KeyRing::parse_or_single(
            &self.token_keys,
            &self.token_signing_key,
            &self.token_secret,
        )
        .map_err(|e| anyhow::anyhow!("config: token_keys: {e}"))?;
        let cookie = if self.cookie_keys.is_empty() {
            anyhow::ensure!(
                self.cookie_signing_key.is_empty(),
                "config: cookie_signing_key `{}` is set but cookie_keys is empty",
                self.cookie_signing_key
            );
            KeyRing::of(token.signing().clone())
        } else {
            KeyRing::parse(&self.cookie_keys, &self.cookie_signing_key)
                .map_err(|e| anyhow::anyhow!("config: cookie_keys: {e}"))?
        };
        let attest = if self.attest_keys.is_empty() {
            anyhow::ensure!(
                self.attest_signing_key.is_empty(),
                "config: attest_signing_key `{}` is set but attest_keys is empty",
                self.attest_signing_key
            );
            KeyRing::parse(&[cellmesh_proto::attest::DEFAULT_KEY.to_string()], "")
        } else {
            KeyRing::parse(&self.attest_keys, &self.attest_signing_key)
        }
        .map_err(|e| anyhow::anyhow!("config: attest_keys: {e}"))?;
        Ok(Rings {
            token,
            cookie,
            attest,
        })
    }

    /// The configuration with every secret replaced by `***` (a public default is left for
    /// whoever kept it to see).
    pub fn masked(&self) -> Self {
        use cellmesh_proto::keys::masked;
        let mut shown = self.clone();
        if shown.token_secret != DEFAULT_TOKEN_SECRET {
            shown.token_secret = "***".into();
        }
        shown.token_keys = masked(&shown.token_keys);
        shown.cookie_keys = masked(&shown.cookie_keys);
        shown.attest_keys = masked(&shown.attest_keys);
        shown.admin_token = cellmesh_admin::guard::shown_token(&shown.admin_token);
        shown
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
    pub fn link_stall(&self) -> Duration {
        Duration::from_millis(self.link_stall_ms)
    }
    pub fn drain_grace(&self) -> Duration {
        Duration::from_millis(self.drain_grace_ms)
    }
    pub fn drain_spread(&self) -> Duration {
        Duration::from_millis(self.drain_spread_ms)
    }
}

impl RateConfig {
    /// The per-address limit: `address_accounts` accounts' worth.
    pub fn address_inputs_per_sec(&self) -> u32 {
        self.account_inputs_per_sec
            .saturating_mul(self.address_accounts)
    }
    pub fn address_burst(&self) -> u32 {
        self.account_burst.saturating_mul(self.address_accounts)
    }
}

/// Whether `listen` (`host:port`) only accepts connections from this host (the mesh listeners'
/// rule, in one place).
fn listens_on_loopback(listen: &str) -> bool {
    cellmesh_trust::tls::is_loopback_listen(listen)
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
    fn default_secret_is_refused_beyond_loopback() {
        for listen in ["127.0.0.1:7300", "[::1]:7300", "localhost:7300"] {
            let c = ProxyConfig {
                client_listen: listen.into(),
                ..ProxyConfig::default()
            };
            c.validate()
                .unwrap_or_else(|e| panic!("{listen} is loopback: {e}"));
        }
        for listen in [
            "0.0.0.0:7300",
            "[::]:7300",
            "10.1.2.3:7300",
            "edge.example:7300",
        ] {
            let c = ProxyConfig {
                client_listen: listen.into(),
                client_plaintext: true,
                ..ProxyConfig::default()
            };
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.contains("token_secret") && err.contains("CELLMESH_TOKEN_SECRET"),
                "{listen}: {err}"
            );
            let own = ProxyConfig {
                token_secret: "the login service's".into(),
                ..c
            };
            own.validate().unwrap();
        }
    }

    #[test]
    fn clients_off_loopback_need_tls() {
        let bare = ProxyConfig {
            client_listen: "0.0.0.0:7300".into(),
            token_secret: "the login service's".into(),
            ..ProxyConfig::default()
        };
        let err = bare.validate().unwrap_err().to_string();
        assert!(
            err.contains("client_tls") && err.contains("CELLMESH_CLIENT_TLS__CERT"),
            "{err}"
        );
        let half = ProxyConfig {
            client_tls: cellmesh_trust::ClientTlsConfig {
                cert: "cert.pem".into(),
                key: String::new(),
            },
            ..bare.clone()
        };
        assert!(half.validate().is_err());
        let tls = ProxyConfig {
            client_tls: cellmesh_trust::ClientTlsConfig {
                cert: "cert.pem".into(),
                key: "key.pem".into(),
            },
            ..bare.clone()
        };
        tls.validate().unwrap();
        let behind_a_balancer = ProxyConfig {
            client_plaintext: true,
            ..bare
        };
        behind_a_balancer.validate().unwrap();
    }

    #[test]
    fn an_admin_port_off_loopback_needs_a_token() {
        let open = ProxyConfig {
            admin_listen: "0.0.0.0:9300".into(),
            ..ProxyConfig::default()
        };
        let err = open.validate().unwrap_err().to_string();
        assert!(
            err.contains("admin_token") && err.contains("CELLMESH_ADMIN_TOKEN"),
            "{err}"
        );
        ProxyConfig {
            admin_token: "ops".into(),
            ..open
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn address_limit_is_a_multiple_of_the_account_limit() {
        let r = RateConfig {
            account_inputs_per_sec: 60,
            account_burst: 120,
            address_accounts: 64,
            ..RateConfig::default()
        };
        assert_eq!(r.address_inputs_per_sec(), 3840);
        assert_eq!(r.address_burst(), 7680);
        let huge = RateConfig {
            address_accounts: u32::MAX,
            ..r
        };
        assert_eq!(huge.address_inputs_per_sec(), u32::MAX);
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

    #[test]
    fn fallback_gateways_load_from_env_like_gateways_and_come_after_them() {
        let env = vec![(
            "CELLMESH_FALLBACK_GATEWAYS".to_string(),
            "10.1.0.1:7200,10.1.0.2:7200".to_string(),
        )];
        let c: ProxyConfig = cellmesh_admin::config::load_with_env(None, env).unwrap();
        assert_eq!(c.fallback_gateways, vec!["10.1.0.1:7200", "10.1.0.2:7200"]);
        assert_eq!(
            c.all_gateways().collect::<Vec<_>>(),
            ["127.0.0.1:7200", "10.1.0.1:7200", "10.1.0.2:7200"]
        );
        assert_eq!(c.gateway_addr(0), "127.0.0.1:7200");
        assert_eq!(c.gateway_addr(2), "10.1.0.2:7200");
        let none: ProxyConfig = cellmesh_admin::config::load_with_env(None, vec![]).unwrap();
        assert!(none.fallback_gateways.is_empty());
    }

    #[test]
    fn an_address_in_both_gateway_lists_is_refused_by_name() {
        let c = ProxyConfig {
            gateways: vec!["127.0.0.1:7200".into(), "127.0.0.1:7201".into()],
            fallback_gateways: vec!["127.0.0.1:7300".into(), "127.0.0.1:7201".into()],
            ..ProxyConfig::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("127.0.0.1:7201") && err.contains("fallback_gateways"),
            "{err}"
        );
        ProxyConfig {
            fallback_gateways: vec!["127.0.0.1:7300".into()],
            ..c.clone()
        }
        .validate()
        .unwrap();
        let only_fallbacks = ProxyConfig {
            gateways: vec![],
            ..c
        };
        let err = only_fallbacks.validate().unwrap_err().to_string();
        assert!(err.contains("gateways must name"), "{err}");
    }

    #[test]
    fn a_fallback_gateway_off_loopback_needs_attest_keys_too() {
        let c = ProxyConfig {
            fallback_gateways: vec!["10.1.0.1:7200".into()],
            ..ProxyConfig::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("10.1.0.1:7200") && err.contains("attest_keys"),
            "{err}"
        );
        ProxyConfig {
            attest_keys: vec!["a1:attest-secret".into()],
            ..c
        }
        .validate()
        .unwrap();
    }
}
