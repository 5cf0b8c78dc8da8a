//! Player records in the global MongoDB: collection `players` of the database named by the URL
//! path (`cellmesh` if none), one document per account with the account as `_id`.

use std::future::IntoFuture;
use std::time::Duration;

use async_trait::async_trait;
use mongodb::bson::doc;
use mongodb::error::{Error as MongoError, ErrorKind};
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection};
use serde::{Deserialize, Serialize};

use super::{redact_url, PlayerRecord, PlayerRecords, StoreError};

const DEFAULT_DATABASE: &str = "cellmesh";
const COLLECTION: &str = "players";
/// How long to look for a usable server before failing, unless the URL says otherwise.
const SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

/// The stored form of a [`PlayerRecord`]: the account is the document id.
#[derive(Serialize, Deserialize)]
struct PlayerDoc {
    #[serde(rename = "_id")]
    account: String,
    last_position: Option<[f64; 3]>,
    home_geo: String,
    /// BSON has no unsigned integers; milliseconds since 1970 fit an i64 for 292 million years.
    updated_unix_ms: i64,
    /// Absent from records written before geos had gateways of their own.
    #[serde(default)]
    gateway_geo: String,
    #[serde(default)]
    session_epoch: i64,
    #[serde(default)]
    last_handover_unix_ms: Option<i64>,
}

impl PlayerDoc {
    fn from_record(r: &PlayerRecord) -> Self {
        Self {
            account: r.account.clone(),
            last_position: r.last_position,
            home_geo: r.home_geo.clone(),
            updated_unix_ms: i64::try_from(r.updated_unix_ms).unwrap_or(i64::MAX),
            gateway_geo: r.gateway_geo.clone(),
            session_epoch: i64::try_from(r.session_epoch).unwrap_or(i64::MAX),
            last_handover_unix_ms: r
                .last_handover_unix_ms
                .map(|t| i64::try_from(t).unwrap_or(i64::MAX)),
        }
    }

    fn into_record(self) -> Result<PlayerRecord, String> {
        Ok(PlayerRecord {
            updated_unix_ms: u64::try_from(self.updated_unix_ms)
                .map_err(|_| format!("negative updated_unix_ms {}", self.updated_unix_ms))?,
            session_epoch: u64::try_from(self.session_epoch)
                .map_err(|_| format!("negative session_epoch {}", self.session_epoch))?,
            last_handover_unix_ms: self
                .last_handover_unix_ms
                .map(|t| u64::try_from(t).map_err(|_| format!("negative last_handover {t}")))
                .transpose()?,
            account: self.account,
            last_position: self.last_position,
            home_geo: self.home_geo,
            gateway_geo: self.gateway_geo,
        })
    }
}

/// Player records in MongoDB.
#[derive(Clone)]
pub struct MongoPlayers {
    players: Collection<PlayerDoc>,
    /// For error messages: the URL without its password.
    url: String,
}

impl MongoPlayers {
    /// Connects to the MongoDB at `url` (`mongodb://host:port[/database]`) and checks that a
    /// server answers a `ping`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let conn = MongoConn::open(url).await?;
        Ok(Self {
            players: conn.db.collection(COLLECTION),
            url: conn.url,
        })
    }

    async fn bounded<T>(
        &self,
        op: &str,
        fut: impl IntoFuture<Output = Result<T, MongoError>>,
    ) -> Result<T, StoreError> {
        bounded(&self.url, op, fut)
            .await?
            .map_err(|e| error(&self.url, op, &e))
    }
}

/// One MongoDB connection as every cellmesh store opens it: bounded timeouts, the database named by
/// the URL path (`cellmesh` if none), and a `ping` answered before it is handed out.
pub(crate) struct MongoConn {
    pub client: Client,
    pub db: mongodb::Database,
    /// The URL without its password, for error messages.
    pub url: String,
}

impl MongoConn {
    pub(crate) async fn open(url: &str) -> Result<Self, StoreError> {
        let shown = redact_url(url);
        let mut options = tokio::time::timeout(CONNECT_TIMEOUT, ClientOptions::parse(url))
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "mongodb at {shown}: url not resolved within {CONNECT_TIMEOUT:?}"
                ))
            })?
            .map_err(|e| match *e.kind {
                // `mongodb+srv://` URLs resolve through DNS while parsing.
                ErrorKind::DnsResolve { .. } => {
                    StoreError::Unavailable(format!("mongodb at {shown}: {e}"))
                }
                _ => StoreError::BadUrl(format!("{shown}: {e}")),
            })?;
        options
            .server_selection_timeout
            .get_or_insert(SERVER_SELECTION_TIMEOUT);
        options.connect_timeout.get_or_insert(CONNECT_TIMEOUT);
        options.app_name.get_or_insert_with(|| "cellmesh".into());
        let database = options
            .default_database
            .clone()
            .unwrap_or_else(|| DEFAULT_DATABASE.into());
        let client = Client::with_options(options)
            .map_err(|e| StoreError::BadUrl(format!("{shown}: {e}")))?;
        let admin = client.database("admin");
        bounded(&shown, "ping", admin.run_command(doc! { "ping": 1 }))
            .await?
            .map_err(|e| error(&shown, "ping", &e))?;
        Ok(Self {
            db: client.database(&database),
            client,
            url: shown,
        })
    }
}

/// Bounds one operation: the driver has no per-operation timeout of its own, and a stalled server
/// must surface as `Unavailable` instead of a hung login or a lease renewal past its lease.
pub(crate) async fn bounded<T>(
    url: &str,
    op: &str,
    fut: impl IntoFuture<Output = Result<T, MongoError>>,
) -> Result<Result<T, MongoError>, StoreError> {
    tokio::time::timeout(OPERATION_TIMEOUT, fut)
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!(
                "mongodb at {url}: {op}: no answer within {OPERATION_TIMEOUT:?}"
            ))
        })
}

/// A driver error as a store error: undecodable documents are corrupt, everything else unavailable.
pub(crate) fn error(url: &str, op: &str, e: &MongoError) -> StoreError {
    let what = format!("mongodb at {url}: {op}: {e}");
    match *e.kind {
        ErrorKind::BsonDeserialization(_) => StoreError::Corrupt(what),
        _ => StoreError::Unavailable(what),
    }
}

#[async_trait]
impl PlayerRecords for MongoPlayers {
    async fn load(&self, account: &str) -> Result<Option<PlayerRecord>, StoreError> {
        let found = self
            .bounded("load", self.players.find_one(doc! { "_id": account }))
            .await?;
        found
            .map(PlayerDoc::into_record)
            .transpose()
            .map_err(|why| {
                StoreError::Corrupt(format!(
                    "mongodb at {}: player `{account}`: {why}",
                    self.url
                ))
            })
    }

    async fn save(&self, record: &PlayerRecord) -> Result<(), StoreError> {
        let replacement = PlayerDoc::from_record(record);
        self.bounded(
            "save",
            self.players
                .replace_one(doc! { "_id": &record.account }, &replacement)
                .upsert(true),
        )
        .await
        .map(drop)
    }
}
