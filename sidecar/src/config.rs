//! The sidecar's configuration. Defaults run one node on this machine with nothing set.

use std::path::PathBuf;

use cellmesh_world::geometry::{GeometryError, WorldShape};
use serde::{Deserialize, Serialize};

use crate::model::admission::AdmissionConfig;
use crate::model::agones::AgonesConfig;
use crate::model::ids::MAX_NODE_ID;
use crate::model::load::LoadConfig;

/// See [`SidecarConfig::shaping`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshShaping {
    pub to_geos: std::collections::BTreeMap<String, cellmesh_proto::shaping::OneWay>,
}

impl MeshShaping {
    /// The delay towards a peer of `geo` (none within this node's own geo, or unlisted).
    pub fn towards(&self, own: &str, geo: &str) -> cellmesh_proto::shaping::OneWay {
        if geo == own {
            return Default::default();
        }
        self.to_geos.get(geo).copied().unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarConfig {
    /// This node's id: the node part of every entity id it mints, and the fence of its lease in
    /// the topology store. With `node_id_auto`, the lowest id the node may take.
    pub node_id: u32,
    /// Take a free node id from the topology store instead of running as `node_id`: the lowest
    /// id at or above `node_id` whose lease is free or lapsed (the store's atomic grant settles
    /// two nodes racing for one id), so that every node of a fleet stamped from one template may
    /// share one configuration. A node restarted in place first takes back the id its
    /// `state_dir` recorded. An id the partition does not name joins as a spare. Needs a
    /// `topology_url`.
    pub node_id_auto: bool,
    /// The geo (datacenter) this node runs in.
    pub geo: String,
    /// Every geo of the world, the same list on every node (in any order): the homes of the keys
    /// that must be unique world-wide. Each claim key has one home geo among them, whose store
    /// alone grants it; a node of another geo asks a node of the home geo over the mesh. Empty:
    /// this node's geo alone (one geo, every claim granted by its store).
    pub geos: Vec<String>,
    /// The core geo among `geos`, the same on every node: when no node of another geo lives
    /// (its datacenter or its link is down), the core's nodes restore that geo's world from the
    /// copy of its checkpoints kept in the core geo's store. Empty: no core; a geo whose last
    /// node died waits for one of its own nodes to restore it.
    pub core_geo: String,
    /// The core geo's Redis (`redis://…`), required outside the core geo with a Redis
    /// `directory_url`: the directory of accounts (sessions and avatars' master records) is
    /// homed there for the whole world, and a node of another geo copies its checkpoints there
    /// (a core node reads the copies from its own `directory_url`).
    pub core_directory_url: String,
    /// Where the game server connects: `host:port`, or `unix:/path/to.sock` for a Unix socket.
    pub local_listen: String,
    /// Where proxies and peer sidecars dial in. Off loopback only with `mesh_tls`.
    pub mesh_listen: String,
    /// Mutual TLS on every mesh link (`ca`, `cert`, `key`: PEM files; `cellmesh certs` makes
    /// them). The certificate names this node's id (or no id, for a fleet with `node_id_auto`)
    /// and geo; peers' certificates must come from the same CA and agree with their hellos. The
    /// files are read again when they change or on SIGHUP. Unset: plaintext, loopback only.
    pub mesh_tls: cellmesh_trust::MeshTlsConfig,
    /// The keys proxies sign attach attestations with (`["kid:secret", ...]`, shared with every
    /// proxy of the geo): an `Attach` without a valid attestation for its account under one of
    /// them is refused. Empty: the public built-in key, allowed with a loopback `mesh_listen`
    /// only.
    pub attest_keys: Vec<String>,
    pub admin_listen: String,
    /// Bearer token for every admin path but `/live`, `/ready` and `/metrics` (clients send
    /// `Authorization: Bearer <admin_token>`); empty: open, allowed only with `admin_listen` on
    /// loopback. The director's live map asks nodes with its own `admin_token`: give a cluster
    /// one.
    pub admin_token: String,
    pub world: WorldShape,
    /// A chunk within this many chunks of the player's own entity enters the player's view...
    pub view_radius_chunks: u32,
    /// ...and leaves it only this many chunks further out.
    pub release_margin_chunks: u32,
    /// Updates of other entities each client is sent per tick at most; past it the nearest go
    /// first and the rest follow in later ticks, whole (late, never lost). Bounds what one
    /// client costs in a crowd. 0: no bound.
    pub client_updates_per_tick: u32,
    /// Largest frame accepted or sent on any connection.
    pub max_frame_bytes: usize,
    /// Frames queued for one mesh link before the link is declared too slow and closed.
    pub link_outbox_frames: usize,
    /// Frames queued for the game before it is declared too slow and disconnected.
    pub game_outbox_frames: usize,
    /// Session directory: `memory` or `redis://…`.
    pub directory_url: String,
    /// Player records: `memory` or `mongodb://…`.
    pub players_url: String,
    /// Lease of a session's directory entry; renewed at a third of it while attached.
    pub session_lease_ms: u64,
    /// Every attached session's player record (last position) is saved this often, besides on
    /// logout; 0: on logout only.
    pub player_record_every_ms: u64,
    /// Topology store holding the partition and the node leases (`mongodb://…`): the node joins
    /// the cluster it describes. Empty: a lone node that owns the whole world.
    pub topology_url: String,
    /// The address peers dial to reach `mesh_listen` (published in the topology store); empty:
    /// the address actually bound.
    pub mesh_advertise: String,
    /// Lease of this node's id and area in the topology store; renewed every half second.
    pub node_lease_ms: u64,
    /// A directory of this host's own (never shared or copied) where a cluster node keeps a lock
    /// and its last lease grant, so that a process restarted in place after a crash takes its
    /// node id back at once instead of waiting out the old lease. Relative to the working
    /// directory; empty: none, a restart waits out the lease.
    pub state_dir: String,
    /// Foreign entities within this many chunks of the node's area become simulation ghosts...
    pub interaction_band_chunks: u32,
    /// ...and stay until this many chunks further out...
    pub ghost_keep_margin_chunks: u32,
    /// ...and at least this long.
    pub ghost_min_lifespan_ms: u64,
    /// An owned entity is handed to the owner of its position once it stands at least this many
    /// whole chunks past the border, so one pacing on the line never is.
    pub handoff_margin_chunks: u32,
    /// After a refused handoff, the entity is not offered again for this long.
    pub handoff_retry_ms: u64,
    /// A handoff this sidecar decides (not the game's `Release`) asks a game of protocol 1.8 or
    /// later to release the entity at its next tick's end (`Offload`), so it misses no tick,
    /// instead of freezing it at once (`Freeze`, which costs the tick in which the game answers).
    pub handoff_offload: bool,
    /// A command with a request id is answered `TIMEOUT` if no result came back in this long.
    pub command_timeout_ms: u64,
    /// The lease of a `Claim` that names none: how long a claim outlives the last renewal the
    /// sidecar could make (its store unreachable, its process dead).
    pub claim_ttl_ms: u64,
    /// Every entity that changed is checkpointed (its state asked of the game) this often;
    /// 0: never.
    pub checkpoint_interval_ms: u64,
    /// A game that disconnects has this long to come back and get its entities back from
    /// their checkpoints (clients see them stand still meanwhile); past it, or with no
    /// checkpoint, they are despawned. 0: despawned at once.
    pub game_grace_ms: u64,
    /// On SIGTERM, how long the node may take to hand its entities away before it exits.
    pub drain_timeout_ms: u64,
    /// When the director deletes this node's cell (retired: squeezed to no area and emptied):
    /// `spare` stays up holding nothing, for the director to give it a cell again when the
    /// world is busy; `exit` drains and exits (a fleet that scales down).
    pub when_retired: WhenRetired,
    /// When the node stops admitting new sessions (tick overrun, outbox pressure) and when it
    /// opens again: see `model::admission`.
    pub admission: AdmissionConfig,
    /// How the game's load is smoothed, and estimated for a game that reports none: see
    /// `model::load`. The balancer reads it.
    pub load: LoadConfig,
    /// Demo switch: a one-way delay added in-process to what this node sends over its links to
    /// peers of other geos, by geo (`shaping.to_geos.montreal = { base_ms = 45, jitter_ms = 3 }`).
    /// Empty (the default): nothing is delayed and nothing runs.
    pub shaping: MeshShaping,
    /// Under Agones: the sidecar calls the Agones SDK (labels, `Ready`, `Health`, `Shutdown`) on
    /// its game's behalf; see `model::agones`.
    pub agones: AgonesConfig,
}

impl SidecarConfig {
    /// How far past its owner's area an entity may stand: the handoff margin, the chunk it may
    /// cross during the tick that triggers the handoff, and one more while the offer is in
    /// flight. Nodes serve (and subscribe to) chunks within this reach of an area.
    pub fn reach_chunks(&self) -> i64 {
        i64::from(self.handoff_margin_chunks) + 2
    }

    /// This configuration as it may be shown: the stores' URLs without their passwords.
    pub fn redacted(&self) -> Self {
        use cellmesh_stores::redact_url;
        Self {
            directory_url: redact_url(&self.directory_url),
            core_directory_url: redact_url(&self.core_directory_url),
            players_url: redact_url(&self.players_url),
            topology_url: redact_url(&self.topology_url),
            attest_keys: cellmesh_proto::keys::masked(&self.attest_keys),
            admin_token: cellmesh_admin::guard::shown_token(&self.admin_token),
            ..self.clone()
        }
    }
}

impl Default for SidecarConfig {
    fn default() -> Self {
        Self {
            node_id: 1,
            node_id_auto: false,
            geo: "local".into(),
            geos: Vec::new(),
            core_geo: String::new(),
            core_directory_url: String::new(),
            local_listen: "127.0.0.1:7100".into(),
            mesh_listen: "127.0.0.1:7200".into(),
            mesh_tls: Default::default(),
            attest_keys: Vec::new(),
            admin_listen: "127.0.0.1:9100".into(),
            admin_token: String::new(),
            world: WorldShape::default(),
            view_radius_chunks: 5,
            release_margin_chunks: 1,
            client_updates_per_tick: 100,
            max_frame_bytes: cellmesh_proto::codec::DEFAULT_MAX_FRAME,
            link_outbox_frames: 8192,
            game_outbox_frames: 4096,
            directory_url: "memory".into(),
            players_url: "memory".into(),
            session_lease_ms: 30_000,
            player_record_every_ms: 60_000,
            topology_url: String::new(),
            mesh_advertise: String::new(),
            node_lease_ms: 10_000,
            state_dir: "cellmesh-state".into(),
            interaction_band_chunks: 1,
            ghost_keep_margin_chunks: 1,
            ghost_min_lifespan_ms: 2_000,
            handoff_margin_chunks: 1,
            handoff_retry_ms: 1_000,
            handoff_offload: false,
            command_timeout_ms: 5_000,
            claim_ttl_ms: 10_000,
            checkpoint_interval_ms: 2_000,
            game_grace_ms: 5_000,
            drain_timeout_ms: 30_000,
            when_retired: WhenRetired::Spare,
            admission: AdmissionConfig::default(),
            load: LoadConfig::default(),
            shaping: MeshShaping::default(),
            agones: AgonesConfig::default(),
        }
    }
}

/// What a node does once the director deleted its cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenRetired {
    #[default]
    Spare,
    Exit,
}

/// Where the local-protocol listener binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalListen {
    Tcp(String),
    Unix(PathBuf),
}

/// Smallest frame limit that still holds a handshake and a useful batch.
const MIN_FRAME_BYTES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("world: {0}")]
    World(#[from] GeometryError),
    #[error("node_id {0} does not fit the 10-bit node part of entity ids (0..={MAX_NODE_ID})")]
    NodeId(u32),
    #[error("node_id_auto needs a topology_url: a lone node has no topology store to take a node id from")]
    NodeIdAuto,
    #[error("{name} must not be empty")]
    Empty { name: &'static str },
    #[error("{0}")]
    MeshTls(String),
    #[error("{0}")]
    AdminToken(String),
    #[error("local_listen `unix:` needs a socket path")]
    EmptyUnixPath,
    #[error("view_radius_chunks must be at least 1, got 0")]
    ViewRadius,
    #[error("max_frame_bytes {0} is below the minimum of {MIN_FRAME_BYTES}")]
    MaxFrame(usize),
    #[error("{name} must be at least 1, got 0")]
    Zero { name: &'static str },
    #[error("session_lease_ms {0} is below the minimum of 1000")]
    Lease(u64),
    #[error("node_lease_ms {0} is below the minimum of 1000")]
    NodeLease(u64),
    #[error("player_record_every_ms {0} is below the minimum of 1000 (0: on logout only)")]
    PlayerRecordEvery(u64),
    #[error("checkpoint_interval_ms {0} is below the minimum of 100 (0 turns checkpoints off)")]
    CheckpointInterval(u64),
    #[error("geos: {0}")]
    Geos(String),
    #[error("claim_ttl_ms {0} is outside 1000..=600000")]
    ClaimTtl(u64),
    #[error("attest_keys: {0}")]
    AttestKeys(String),
    #[error("{0}")]
    Admission(String),
    #[error("{0}")]
    Load(String),
    #[error("{0}")]
    Agones(String),
}

impl SidecarConfig {
    /// The world's geos, the homes of its unique keys: `geos`, or this node's geo alone.
    pub fn world_geos(&self) -> Vec<String> {
        if self.geos.is_empty() {
            vec![self.geo.clone()]
        } else {
            self.geos.clone()
        }
    }

    fn check_geos(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::BTreeSet::new();
        for g in &self.geos {
            if g.trim().is_empty() {
                return Err(ConfigError::Geos("a geo's name is empty".into()));
            }
            if !seen.insert(g.as_str()) {
                return Err(ConfigError::Geos(format!("{g:?} is listed twice")));
            }
        }
        if !self.geos.is_empty() && !seen.contains(self.geo.as_str()) {
            return Err(ConfigError::Geos(format!(
                "{:?} does not list this node's geo {:?}",
                self.geos, self.geo
            )));
        }
        if !self.core_geo.is_empty() && !self.world_geos().contains(&self.core_geo) {
            return Err(ConfigError::Geos(format!(
                "the core geo {:?} is not among the world's geos {:?}",
                self.core_geo,
                self.world_geos()
            )));
        }
        Ok(())
    }

    /// Checks every value before anything binds; the error names the bad value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.world.validate()?;
        if self.node_id > MAX_NODE_ID {
            return Err(ConfigError::NodeId(self.node_id));
        }
        if self.node_id_auto && self.topology_url.trim().is_empty() {
            return Err(ConfigError::NodeIdAuto);
        }
        for (name, value) in [
            ("geo", &self.geo),
            ("local_listen", &self.local_listen),
            ("mesh_listen", &self.mesh_listen),
            ("admin_listen", &self.admin_listen),
        ] {
            if value.trim().is_empty() {
                return Err(ConfigError::Empty { name });
            }
        }
        cellmesh_trust::tls::require_tls_off_loopback(
            "mesh_listen",
            &self.mesh_listen,
            &self.mesh_tls,
        )
        .map_err(|e| ConfigError::MeshTls(e.to_string()))?;
        self.attest_ring()?;
        if self.attest_keys.is_empty()
            && !cellmesh_trust::tls::is_loopback_listen(&self.mesh_listen)
        {
            return Err(ConfigError::AttestKeys(format!(
                "mesh_listen {} is not loopback and no attest_keys are set: with the public \
                 built-in key anyone who reaches it could attach any account. Set attest_keys \
                 (CELLMESH_ATTEST_KEYS) to the ring the proxies sign attaches with",
                self.mesh_listen
            )));
        }
        cellmesh_admin::guard::require_token_off_loopback(&self.admin_listen, &self.admin_token)
            .map_err(|e| ConfigError::AdminToken(e.to_string()))?;
        if let LocalListen::Unix(p) = self.local() {
            if p.as_os_str().is_empty() {
                return Err(ConfigError::EmptyUnixPath);
            }
        }
        if self.view_radius_chunks == 0 {
            return Err(ConfigError::ViewRadius);
        }
        if self.max_frame_bytes < MIN_FRAME_BYTES {
            return Err(ConfigError::MaxFrame(self.max_frame_bytes));
        }
        if self.link_outbox_frames == 0 {
            return Err(ConfigError::Zero {
                name: "link_outbox_frames",
            });
        }
        if self.game_outbox_frames == 0 {
            return Err(ConfigError::Zero {
                name: "game_outbox_frames",
            });
        }
        if self.session_lease_ms < 1000 {
            return Err(ConfigError::Lease(self.session_lease_ms));
        }
        if self.node_lease_ms < 1000 {
            return Err(ConfigError::NodeLease(self.node_lease_ms));
        }
        if (1..1000).contains(&self.player_record_every_ms) {
            return Err(ConfigError::PlayerRecordEvery(self.player_record_every_ms));
        }
        if (1..100).contains(&self.checkpoint_interval_ms) {
            return Err(ConfigError::CheckpointInterval(self.checkpoint_interval_ms));
        }
        if !(crate::core::claims::MIN_CLAIM_TTL_MS..=crate::core::claims::MAX_CLAIM_TTL_MS)
            .contains(&self.claim_ttl_ms)
        {
            return Err(ConfigError::ClaimTtl(self.claim_ttl_ms));
        }
        self.check_geos()?;
        self.admission.check().map_err(ConfigError::Admission)?;
        self.load.check().map_err(ConfigError::Load)?;
        self.agones.check().map_err(ConfigError::Agones)?;
        Ok(())
    }

    /// The ring attach attestations are checked against: `attest_keys`, or the built-in key.
    pub fn attest_ring(&self) -> Result<cellmesh_proto::keys::KeyRing, ConfigError> {
        let keys = if self.attest_keys.is_empty() {
            vec![cellmesh_proto::attest::DEFAULT_KEY.to_string()]
        } else {
            self.attest_keys.clone()
        };
        cellmesh_proto::keys::KeyRing::parse(&keys, "")
            .map_err(|e| ConfigError::AttestKeys(e.to_string()))
    }

    /// Under Agones (`AGONES_SDK_HTTP_PORT`'s value `sdk_http_port`, when set): the SDK server's
    /// port, unless `agones.sdk_http_port` names one.
    pub fn under_agones(mut self, sdk_http_port: Option<&str>) -> Result<Self, ConfigError> {
        self.agones
            .adopt_env_port(sdk_http_port)
            .map_err(ConfigError::Agones)?;
        Ok(self)
    }

    pub fn local(&self) -> LocalListen {
        match self.local_listen.strip_prefix("unix:") {
            Some(path) => LocalListen::Unix(PathBuf::from(path)),
            None => LocalListen::Tcp(self.local_listen.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admin_port_off_loopback_needs_a_token_and_shows_it_masked() {
        let open = SidecarConfig {
            admin_listen: "0.0.0.0:9100".into(),
            ..SidecarConfig::default()
        };
        let e = open.validate().unwrap_err().to_string();
        assert!(
            e.contains("admin_token") && e.contains("CELLMESH_ADMIN_TOKEN"),
            "{e}"
        );
        let guarded = SidecarConfig {
            admin_token: "s3cret".into(),
            ..open
        };
        guarded.validate().unwrap();
        assert_eq!(guarded.redacted().admin_token, "***");
        let from_env: SidecarConfig = cellmesh_admin::config::load_with_env(
            None,
            [("CELLMESH_ADMIN_TOKEN".to_string(), "s3cret".to_string())],
        )
        .unwrap();
        assert_eq!(from_env.admin_token, "s3cret");
        assert_eq!(SidecarConfig::default().redacted().admin_token, "");
    }

    #[test]
    fn defaults_are_valid() {
        SidecarConfig::default().validate().unwrap();
        assert_eq!(
            SidecarConfig::default().local(),
            LocalListen::Tcp("127.0.0.1:7100".into())
        );
    }

    #[test]
    fn errors_name_the_bad_value() {
        let check = |cfg: SidecarConfig, want: &str| {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        check(
            SidecarConfig {
                node_id: 1024,
                ..Default::default()
            },
            "1024",
        );
        check(
            SidecarConfig {
                world: WorldShape {
                    width: 100.0,
                    ..Default::default()
                },
                ..Default::default()
            },
            "world width",
        );
        check(
            SidecarConfig {
                claim_ttl_ms: 10,
                ..Default::default()
            },
            "claim_ttl_ms 10",
        );
        check(
            SidecarConfig {
                view_radius_chunks: 0,
                ..Default::default()
            },
            "view_radius_chunks",
        );
        check(
            SidecarConfig {
                max_frame_bytes: 10,
                ..Default::default()
            },
            "max_frame_bytes 10",
        );
        check(
            SidecarConfig {
                link_outbox_frames: 0,
                ..Default::default()
            },
            "link_outbox_frames",
        );
        check(
            SidecarConfig {
                local_listen: "unix:".into(),
                ..Default::default()
            },
            "socket path",
        );
        check(
            SidecarConfig {
                session_lease_ms: 5,
                ..Default::default()
            },
            "session_lease_ms 5",
        );
        check(
            SidecarConfig {
                admission: AdmissionConfig {
                    open_below_load: 2.0,
                    ..Default::default()
                },
                ..Default::default()
            },
            "admission.open_below_load",
        );
    }

    #[test]
    fn admission_thresholds_come_from_the_file_and_the_environment() {
        let dir =
            std::env::temp_dir().join(format!("cellmesh-admission-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("sidecar.toml");
        std::fs::write(
            &f,
            "[admission]\nclose_at_load = 0.8\nreopen_after_ms = 2000\n",
        )
        .unwrap();
        let env = vec![(
            "CELLMESH_ADMISSION__OUTBOX_HIGH_FRAMES".to_string(),
            "64".to_string(),
        )];
        let cfg = cellmesh_admin::config::load_with_env::<SidecarConfig>(Some(&f), env).unwrap();
        assert_eq!(
            cfg.admission,
            AdmissionConfig {
                close_at_load: 0.8,
                reopen_after_ms: 2000,
                outbox_high_frames: 64,
                ..AdmissionConfig::default()
            }
        );
        cfg.validate().unwrap();
    }

    #[test]
    fn agones_keys_come_from_the_file_the_environment_and_agones_own_variable() {
        let env = vec![(
            "CELLMESH_AGONES__HEALTH_EVERY_MS".to_string(),
            "500".to_string(),
        )];
        let cfg = cellmesh_admin::config::load_with_env::<SidecarConfig>(None, env).unwrap();
        assert_eq!(cfg.agones.health_every_ms, 500);
        assert_eq!(cfg.agones.port(), None, "off unless under Agones");
        let cfg = cfg.under_agones(Some("9358")).unwrap();
        assert_eq!(cfg.agones.port(), Some(9358));
        cfg.validate().unwrap();
        let cfg = toml_from_str("[agones]\nsdk_http_port = 7001\nenabled = false\n").unwrap();
        assert_eq!(cfg.agones.sdk_http_port, 7001);
        assert_eq!(cfg.agones.port(), None, "turned off");
        assert!(SidecarConfig::default().under_agones(Some("x")).is_err());
        let e = SidecarConfig {
            agones: AgonesConfig {
                health_every_ms: 0,
                ..Default::default()
            },
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("agones.health_every_ms 0"), "{e}");
    }

    #[test]
    fn node_id_auto_comes_from_the_environment_and_needs_a_topology() {
        let load = |env: &[(&str, &str)]| {
            let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
            cellmesh_admin::config::load_with_env::<SidecarConfig>(None, env).unwrap()
        };
        assert!(!load(&[]).node_id_auto, "off by default");
        let alone = load(&[("CELLMESH_NODE_ID_AUTO", "true"), ("CELLMESH_NODE_ID", "3")]);
        assert_eq!((alone.node_id_auto, alone.node_id), (true, 3));
        let e = alone.validate().unwrap_err().to_string();
        assert!(e.contains("node_id_auto needs a topology_url"), "{e}");
        let clustered = load(&[
            ("CELLMESH_NODE_ID_AUTO", "true"),
            ("CELLMESH_TOPOLOGY_URL", "mongodb://h/topology"),
        ]);
        assert!(clustered.node_id_auto);
        clustered.validate().unwrap();
        // The floor is still a node id.
        let e = SidecarConfig {
            node_id: 1024,
            ..clustered
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("node_id 1024"), "{e}");
        let file = toml_from_str("node_id_auto = true\ntopology_url = \"memory\"\n").unwrap();
        assert!(file.node_id_auto);
        file.validate().unwrap();
    }

    #[test]
    fn unix_listen_is_recognised() {
        let cfg = SidecarConfig {
            local_listen: "unix:/run/game.sock".into(),
            ..Default::default()
        };
        assert_eq!(
            cfg.local(),
            LocalListen::Unix(PathBuf::from("/run/game.sock"))
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml_from_str("view_radius = 3\n").unwrap_err();
        assert!(err.contains("view_radius"), "{err}");
        let ok = toml_from_str("node_id = 7\n[world]\nwidth = 65536.0\n").unwrap();
        assert_eq!(
            (ok.node_id, ok.world.width, ok.view_radius_chunks),
            (7, 65536.0, 5)
        );
    }

    #[test]
    fn the_state_dir_is_on_by_default_and_an_empty_one_turns_it_off() {
        let load = |env: Vec<(String, String)>| {
            cellmesh_admin::config::load_with_env::<SidecarConfig>(None, env).unwrap()
        };
        assert_eq!(load(Vec::new()).state_dir, "cellmesh-state");
        let var = |v: &str| vec![("CELLMESH_STATE_DIR".to_string(), v.to_string())];
        assert_eq!(load(var("")).state_dir, "");
        assert_eq!(load(var("node-state")).state_dir, "node-state");
    }

    fn toml_from_str(text: &str) -> Result<SidecarConfig, String> {
        let dir = std::env::temp_dir().join(format!("cellmesh-sidecar-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(format!("{}.toml", text.len()));
        std::fs::write(&f, text).unwrap();
        cellmesh_admin::config::load_with_env::<SidecarConfig>(Some(&f), Vec::new())
            .map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn shaping_delays_only_links_to_listed_other_geos() {
        let cfg = toml_from_str(
            "geo = \"paris\"\n[shaping.to_geos.montreal]\nbase_ms = 45\njitter_ms = 3\n",
        )
        .unwrap();
        let s = &cfg.shaping;
        assert_eq!(s.towards("paris", "montreal").base_ms, 45);
        assert_eq!(s.towards("paris", "montreal").jitter_ms, 3);
        assert!(s.towards("paris", "paris").is_zero());
        assert!(s.towards("paris", "hongkong").is_zero());
        assert!(
            SidecarConfig::default().shaping.to_geos.is_empty(),
            "off by default"
        );
        assert!(toml_from_str("[shaping.to_geos.x]\nbase = 1\n").is_err());
    }

    #[test]
    fn the_worlds_geos_must_list_this_nodes_geo_once() {
        let check = |geos: &[&str]| {
            SidecarConfig {
                geo: "paris".into(),
                geos: geos.iter().map(|g| g.to_string()).collect(),
                ..Default::default()
            }
            .validate()
            .map_err(|e| e.to_string())
        };
        assert!(check(&[]).is_ok());
        assert!(check(&["montreal", "paris"]).is_ok());
        let missing = check(&["montreal", "sydney"]).unwrap_err();
        assert!(missing.contains("\"paris\""), "{missing}");
        assert!(check(&["paris", "paris"]).unwrap_err().contains("twice"));
        assert!(check(&["paris", " "]).unwrap_err().contains("empty"));
        let one = SidecarConfig {
            geo: "paris".into(),
            ..Default::default()
        };
        assert_eq!(one.world_geos(), ["paris"]);
        let core = |core: &str| {
            SidecarConfig {
                geo: "paris".into(),
                geos: vec!["paris".into(), "montreal".into()],
                core_geo: core.into(),
                ..SidecarConfig::default()
            }
            .validate()
        };
        assert!(core("").is_ok() && core("montreal").is_ok() && core("paris").is_ok());
        let err = core("sydney").unwrap_err().to_string();
        assert!(err.contains("core geo \"sydney\""), "{err}");
    }
}
