//! The stores of a cellmesh cluster, behind traits so that the embedded in-memory default and
//! the real servers are interchangeable (docs/mesh.md, docs/partition.md):
//!
//! | trait | real store | scope |
//! |---|---|---|
//! | [`topology::TopologyStore`]: the committed partition, node leases (the fencing tokens), node records | MongoDB ([`topology::mongo::MongoTopology`]) | global |
//! | [`SessionDirectory`] | Redis ([`redis::RedisDirectory`]) | per geo |
//! | [`PlayerRecords`] | MongoDB ([`mongo::MongoPlayers`]) | global |
//! | [`EdgeBoard`] | Redis ([`redis::RedisDirectory`]) | per geo |
//!
//! Each has an in-memory implementation ([`memory`], [`topology::memory`]) for `cellmesh up` and
//! unit tests; [`claims`] holds the exclusive claims with their fencing tokens. The pure rules
//! they serve (geometry, partition, policies) are the `cellmesh-world` crate.

pub mod claims;
pub mod lazy_board;
pub mod memory;
#[cfg(feature = "mongodb")]
pub mod mongo;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
mod redis_claims;
pub mod topology;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store returned malformed data: {0}")]
    Corrupt(String),
    /// The URL (password redacted), and why it was refused if it has a supported scheme.
    #[error("bad store url {0} (expected `memory`, `redis://…` or `mongodb://…`)")]
    BadUrl(String),
    #[error("invalid geo name `{0}` (expected ASCII letters, digits, `-`, `_` or `.`)")]
    InvalidGeo(String),
    /// A node outside the core geo with a Redis directory named no `core_directory_url`.
    #[error(
        "no core_directory_url (redis://…) outside the core geo `{0}`: the directory of accounts \
         is homed in the core geo's Redis, and this geo's own would be a second home"
    )]
    NoCoreDirectory(String),
    /// The URL names a store this build has no client for.
    #[error(
        "{url}: this build of cellmesh has no {store} client; build it with `--features {feature}` \
         (the container image has both Redis and MongoDB)"
    )]
    NotBuiltIn {
        url: String,
        store: &'static str,
        feature: &'static str,
    },
}

/// A geo name is part of every key, so it must not contain the separator (`:`) or glob
/// characters: `eu-west` and `eu` must never see each other's keys.
pub(crate) fn valid_geo(geo: &str) -> bool {
    !geo.is_empty()
        && geo
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Whether `url` names a Redis (`redis://…`, `rediss://…`).
pub fn is_redis_url(url: &str) -> bool {
    url.starts_with("redis://") || url.starts_with("rediss://")
}

/// Whether `url` names a MongoDB (`mongodb://…`, `mongodb+srv://…`).
pub fn is_mongodb_url(url: &str) -> bool {
    url.starts_with("mongodb://") || url.starts_with("mongodb+srv://")
}

/// The error for a store URL this build cannot open.
#[allow(dead_code)] // used only by builds without one of the clients
fn not_built_in(url: &str, store: &'static str, feature: &'static str) -> StoreError {
    StoreError::NotBuiltIn {
        url: redact_url(url),
        store,
        feature,
    }
}

/// `url` as it may appear in logs and errors: the password, if any, replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let authority_end = url[scheme_end..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| scheme_end + i);
    let Some(at) = url[scheme_end..authority_end]
        .rfind('@')
        .map(|i| scheme_end + i)
    else {
        return url.to_string();
    };
    match url[scheme_end..at].find(':').map(|i| scheme_end + i) {
        Some(colon) => format!("{}:***{}", &url[..colon], &url[at..]),
        None => url.to_string(),
    }
}

/// Where an account's session lives: its gateway node and the session epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionEntry {
    pub gateway_node: u32,
    pub session_epoch: u64,
}

/// `account → (gateway node, session epoch)` with a lease, for one geo.
///
/// A new login bumps the epoch; everything addressed to an older epoch is stale. Entries expire
/// when their lease is not renewed, so a dead gateway's sessions vanish by themselves.
#[async_trait]
pub trait SessionDirectory: Send + Sync {
    /// Registers a new session of `account` on `gateway_node`, displacing any older one; returns
    /// the new session epoch, strictly greater than every epoch handed out before for `account`.
    async fn register(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
    ) -> Result<u64, StoreError> {
        self.register_above(account, gateway_node, lease, 0).await
    }

    /// [`Self::register`], with an epoch also strictly greater than `floor`: the epoch of the
    /// account's last session in another geo (each geo's directory counts on its own), so that
    /// the avatar's owner takes the new session for the newer one.
    async fn register_above(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        floor: u64,
    ) -> Result<u64, StoreError>;

    /// Registers again, on `gateway_node`, a session of `account` that held epoch `moved_from`
    /// on a gateway that was lost, with a new epoch as [`Self::register`] gives; `None` (and
    /// nothing written) if a login registered after it, whose session must not be displaced
    /// by this older one.
    async fn register_moved(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        moved_from: u64,
    ) -> Result<Option<u64>, StoreError>;

    /// The live session of `account`, if any.
    async fn lookup(&self, account: &str) -> Result<Option<SessionEntry>, StoreError>;

    /// Extends the lease if `session_epoch` is still the current one; false if displaced or gone.
    async fn renew(
        &self,
        account: &str,
        session_epoch: u64,
        lease: Duration,
    ) -> Result<bool, StoreError>;

    /// Removes the entry if `session_epoch` is still the current one; false if it was not.
    async fn release(&self, account: &str, session_epoch: u64) -> Result<bool, StoreError>;

    /// Where `account`'s avatar (its master entity) is simulated, as its owners last wrote.
    async fn master(&self, account: &str) -> Result<Option<MasterEntry>, StoreError>;

    /// Records the owner of `account`'s master, unless a later owner of the same entity (a
    /// higher entity epoch) wrote already: a late write of a previous owner loses.
    async fn set_master(&self, account: &str, entry: MasterEntry) -> Result<(), StoreError>;

    /// Forgets the record if it still names `entity_id` under `entity_epoch` (the avatar is gone
    /// from that owner and nobody wrote since).
    async fn clear_master(
        &self,
        account: &str,
        entity_id: u64,
        entity_epoch: u64,
    ) -> Result<(), StoreError>;
}

/// The one process simulating an account's avatar: the node, the lease epoch of its process, the
/// entity and its epoch. A login anywhere in the geo finds the avatar through it instead of
/// spawning a second one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterEntry {
    pub node: u32,
    pub lease_epoch: u64,
    pub entity_id: u64,
    pub entity_epoch: u64,
}

impl MasterEntry {
    /// Whether `self` may replace `current`: another entity (a new avatar), or a later epoch of
    /// the same one.
    pub fn replaces(&self, current: Option<&MasterEntry>) -> bool {
        current.is_none_or(|c| c.entity_id != self.entity_id || c.entity_epoch <= self.entity_epoch)
    }
}

/// What the world remembers about a player between sessions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlayerRecord {
    pub account: String,
    /// Last position of the player's master entity (x, y, z), if it ever had one.
    pub last_position: Option<[f64; 3]>,
    /// The geo the player was first seen in.
    pub home_geo: String,
    pub updated_unix_ms: u64,
    /// The geo of the gateway that wrote the record (where the player was connected).
    pub gateway_geo: String,
    /// The session epoch of that session: a login in another geo registers above it.
    pub session_epoch: u64,
    /// When the player was last handed over to another geo, if ever.
    pub last_handover_unix_ms: Option<u64>,
}

#[async_trait]
pub trait PlayerRecords: Send + Sync {
    async fn load(&self, account: &str) -> Result<Option<PlayerRecord>, StoreError>;
    /// Inserts or replaces the record of `record.account`.
    async fn save(&self, record: &PlayerRecord) -> Result<(), StoreError>;
}

/// A far proxy's measurement of a client's RTT, published onto the client's current geo.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FarRtt {
    pub min_ms: f64,
    pub median_ms: f64,
    pub samples: u32,
    /// Whether the figures are the kernel's TCP estimate (a client cannot bend it) or timed pings.
    pub kernel: bool,
    pub measured_unix_ms: u64,
}

/// What a geo's proxies tell each other about players, in that geo's Redis: handover hints
/// addressed to this geo, and the RTTs other geos' proxies measured to this geo's clients.
///
/// A hint is the sealed cookie the client was given (`cellmesh_proto::cookie`), so it is opened
/// and checked exactly like the cookie; the board only keeps it for a while.
#[async_trait]
pub trait EdgeBoard: Send + Sync {
    /// Pins a hint for `account`'s next login in this geo, for `ttl`.
    async fn put_hint(&self, account: &str, sealed: &[u8], ttl: Duration)
        -> Result<(), StoreError>;
    /// Takes (and removes) the hint for `account`, if one is pinned and not expired.
    async fn take_hint(&self, account: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Marks `account`'s one-shot `nonce` used, for `ttl` (the rest of what it was good for),
    /// atomically: true for the first use, false for any other while it is remembered.
    async fn use_nonce(
        &self,
        account: &str,
        nonce: &[u8],
        ttl: Duration,
    ) -> Result<bool, StoreError>;
    /// Records what `geo`'s proxy measured to `account`, kept for `ttl`.
    async fn put_far_rtt(
        &self,
        account: &str,
        geo: &str,
        rtt: FarRtt,
        ttl: Duration,
    ) -> Result<(), StoreError>;
    /// Every other geo's latest measurement of `account`, by geo.
    async fn far_rtts(&self, account: &str) -> Result<Vec<(String, FarRtt)>, StoreError>;
}

impl std::fmt::Debug for dyn EdgeBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EdgeBoard")
    }
}

/// Opens a geo's board: `memory`, or `redis://…` (that geo's Redis).
#[cfg_attr(not(feature = "redis"), allow(unused_variables))] // `geo` names Redis keys
pub async fn open_board(url: &str, geo: &str) -> Result<Arc<dyn EdgeBoard>, StoreError> {
    match url {
        "memory" | "" => Ok(Arc::new(memory::MemoryBoard::default())),
        #[cfg(feature = "redis")]
        u if is_redis_url(u) => Ok(Arc::new(redis::RedisDirectory::connect(u, geo).await?)),
        #[cfg(not(feature = "redis"))]
        u if is_redis_url(u) => Err(not_built_in(u, "Redis", "redis")),
        other => Err(StoreError::BadUrl(redact_url(other))),
    }
}

/// The checkpoints of every live process of a geo, each under its incarnation (node id and
/// lease epoch): entity id -> the latest opaque checkpoint. What a dead process left is read
/// once to restore its world elsewhere, then dropped.
#[async_trait]
pub trait CheckpointStore: Send + Sync {
    /// Writes `put` and removes `remove` among the checkpoints of one process, atomically.
    async fn write(
        &self,
        node: u32,
        lease_epoch: u64,
        put: Vec<(u64, Vec<u8>)>,
        remove: Vec<u64>,
    ) -> Result<(), StoreError>;

    /// Every checkpoint the process left, in entity order.
    async fn load(&self, node: u32, lease_epoch: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;

    /// Forgets the process's checkpoints (its world is restored).
    async fn drop_all(&self, node: u32, lease_epoch: u64) -> Result<(), StoreError>;

    /// Every process (node, lease epoch) that has checkpoints here: a process that died and
    /// whose world nobody restored yet is among them.
    async fn processes(&self) -> Result<Vec<(u32, u64)>, StoreError>;
}

/// The stores one process uses.
#[derive(Clone)]
pub struct Stores {
    pub directory: Arc<dyn SessionDirectory>,
    pub players: Arc<dyn PlayerRecords>,
    /// In the geo's Redis, beside the directory.
    pub checkpoints: Arc<dyn CheckpointStore>,
    /// Exclusive claims, in the geo's Redis beside the directory.
    pub claims: Arc<dyn claims::ClaimStore>,
    /// A node outside the core geo writes its checkpoints here too: the core geo's store, under
    /// [`copy_keyspace`] of its geo. When no node of its geo lives, the core restores its world
    /// from this copy. None: a core node, or a world with no core geo.
    pub core_copy: Option<Arc<dyn CheckpointStore>>,
    /// A core geo's node reads the copies every other geo writes to its store, by geo.
    pub copies: std::collections::BTreeMap<String, Arc<dyn CheckpointStore>>,
}

/// The keyspace of the core geo's store that holds the copy of `geo`'s checkpoints.
pub fn copy_keyspace(geo: &str) -> String {
    format!("{geo}.copy")
}

impl Stores {
    /// The embedded default: everything in this process's memory.
    pub fn in_memory() -> Self {
        Self {
            directory: Arc::new(memory::MemoryDirectory::default()),
            players: Arc::new(memory::MemoryPlayers::default()),
            checkpoints: Arc::new(memory::MemoryCheckpoints::default()),
            claims: Arc::new(claims::MemoryClaims::default()),
            core_copy: None,
            copies: Default::default(),
        }
    }

    /// Sets up what the core geo `core_geo` keeps for the whole world. The directory of accounts
    /// is homed there: a node of another geo registers its sessions and its avatars' master
    /// records in the core's Redis (`core_url`), under the core's keyspace, so a login anywhere
    /// finds the one avatar. And the copies of checkpoints (see [`Stores::core_copy`]): a node of
    /// another geo writes its own to `core_url` too, a core node reads every other geo's from its
    /// own directory's Redis. A node outside the core with a Redis directory must name the core's
    /// Redis: its own directory would be a second home of its players' accounts. In memory
    /// nothing is shared between processes (`cellmesh up` shares the stores itself).
    #[cfg_attr(not(feature = "redis"), allow(unused_variables, unused_mut))]
    pub async fn with_core_geo(
        mut self,
        geo: &str,
        geos: &[String],
        core_geo: &str,
        directory_url: &str,
        core_url: &str,
    ) -> Result<Self, StoreError> {
        if core_geo.is_empty() {
            return Ok(self);
        }
        // A URL that names no Redis copies nothing: a typo must not pass for "no copy".
        if geo != core_geo && !matches!(core_url, "" | "memory") && !is_redis_url(core_url) {
            return Err(StoreError::BadUrl(redact_url(core_url)));
        }
        if geo != core_geo && is_redis_url(directory_url) && !is_redis_url(core_url) {
            return Err(StoreError::NoCoreDirectory(core_geo.to_string()));
        }
        #[cfg(feature = "redis")]
        if geo == core_geo {
            if is_redis_url(directory_url) {
                for g in geos.iter().filter(|g| *g != core_geo) {
                    let keyspace = copy_keyspace(g);
                    let copy = redis::RedisDirectory::connect(directory_url, &keyspace).await?;
                    self.copies.insert(g.clone(), Arc::new(copy));
                }
            }
        } else if is_redis_url(core_url) {
            let copy = redis::RedisDirectory::connect(core_url, &copy_keyspace(geo)).await?;
            self.core_copy = Some(Arc::new(copy));
            self.directory = Arc::new(redis::RedisDirectory::connect(core_url, core_geo).await?);
        }
        #[cfg(not(feature = "redis"))]
        if geo != core_geo && is_redis_url(core_url) {
            return Err(not_built_in(core_url, "Redis", "redis"));
        }
        Ok(self)
    }

    /// Opens the stores named by URLs: `memory`, `redis://host:port` (directory) and
    /// `mongodb://host:port/db` (player records).
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))] // `geo` names Redis keys
    pub async fn open(
        directory_url: &str,
        players_url: &str,
        geo: &str,
    ) -> Result<Self, StoreError> {
        type Redis = (
            Arc<dyn SessionDirectory>,
            Arc<dyn CheckpointStore>,
            Arc<dyn claims::ClaimStore>,
        );
        let (directory, checkpoints, claims): Redis = match directory_url {
            "memory" | "" => (
                Arc::new(memory::MemoryDirectory::default()),
                Arc::new(memory::MemoryCheckpoints::default()),
                Arc::new(claims::MemoryClaims::default()),
            ),
            #[cfg(feature = "redis")]
            u if is_redis_url(u) => {
                let redis = Arc::new(redis::RedisDirectory::connect(u, geo).await?);
                (redis.clone(), redis.clone(), redis)
            }
            #[cfg(not(feature = "redis"))]
            u if is_redis_url(u) => return Err(not_built_in(u, "Redis", "redis")),
            other => return Err(StoreError::BadUrl(redact_url(other))),
        };
        let players: Arc<dyn PlayerRecords> = match players_url {
            "memory" | "" => Arc::new(memory::MemoryPlayers::default()),
            #[cfg(feature = "mongodb")]
            u if is_mongodb_url(u) => Arc::new(mongo::MongoPlayers::connect(u).await?),
            #[cfg(not(feature = "mongodb"))]
            u if is_mongodb_url(u) => return Err(not_built_in(u, "MongoDB", "mongodb")),
            other => return Err(StoreError::BadUrl(redact_url(other))),
        };
        Ok(Self {
            directory,
            players,
            checkpoints,
            claims,
            core_copy: None,
            copies: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{redact_url, StoreError, Stores};

    #[tokio::test]
    async fn a_url_of_no_known_scheme_is_refused_without_its_password() {
        for (directory, players) in [
            ("reddis://:s3cret@h:1", "memory"),
            ("memory", "mongo://u:s3cret@h/db"),
        ] {
            let Err(err) = Stores::open(directory, players, "local").await else {
                panic!("{directory} {players} opened");
            };
            assert!(matches!(err, StoreError::BadUrl(_)), "{err}");
            let shown = err.to_string();
            assert!(
                !shown.contains("s3cret") && shown.contains("***"),
                "{shown}"
            );
        }
    }

    #[test]
    fn redacted_urls_keep_everything_but_the_password() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(redact_url("redis://:s3cret@h:1"), "redis://:***@h:1");
        assert_eq!(
            redact_url("mongodb://app:p@ss:w@h1,h2/db?authSource=admin"),
            "mongodb://app:***@h1,h2/db?authSource=admin"
        );
        assert_eq!(redact_url("mongodb://app@h/db"), "mongodb://app@h/db");
        assert_eq!(redact_url("mongodb://h/db?x=a@b"), "mongodb://h/db?x=a@b");
        assert_eq!(redact_url("memory"), "memory");
    }

    #[test]
    fn user_only_and_option_carrying_urls_are_redacted_right() {
        assert_eq!(
            redact_url("mongodb://app:pw@h1:27017,h2:27017/db?replicaSet=rs0&authSource=admin"),
            "mongodb://app:***@h1:27017,h2:27017/db?replicaSet=rs0&authSource=admin"
        );
        assert_eq!(
            redact_url("mongodb+srv://app:pw@cluster0.example.net/db?retryWrites=true&w=majority"),
            "mongodb+srv://app:***@cluster0.example.net/db?retryWrites=true&w=majority"
        );
        assert_eq!(
            redact_url("mongodb://app:pw@h/db?x=a@b"),
            "mongodb://app:***@h/db?x=a@b"
        );
        assert_eq!(
            redact_url("rediss://default:pw@h:6380/0"),
            "rediss://default:***@h:6380/0"
        );
        assert_eq!(redact_url("redis://app@h:1"), "redis://app@h:1");
        assert_eq!(redact_url("redis://:@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url(""), "");
    }
}
