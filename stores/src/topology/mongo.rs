//! The topology in the global MongoDB, in the database named by the URL path (`cellmesh` if
//! none):
//!
//! - `partition`: one document, `{_id: "current", epoch, partition, director}`. A commit is an
//!   insert (first epoch; a duplicate `_id` means someone else was first) or an update filtered on
//!   the epoch it replaces. The director's lease (`{holder, epoch, expires_unix_ms}`) lives in the
//!   same document, so a director's commit, filtered on its lease being current and live by the
//!   server's clock, is refused atomically once the lease lapsed or passed to another director.
//! - `nodes`: one document per node id, `{_id: node, holder, epoch, expires_unix_ms,
//!   ids_floor_unix_ms, ids_below_unix_ms, record, load, players}`. A grant is one
//!   `findOneAndUpdate` filtered on "lapsed or mine" with upsert: when the lease is held, the
//!   filter misses the existing document and the upsert's insert fails on the duplicate `_id`,
//!   so of two contenders exactly one wins. A takeover is one `findOneAndUpdate` filtered on the
//!   exact grant it replaces (node, holder and epoch), without upsert; if that grant is gone it
//!   is an ordinary grant. A grant clears the record, load and players: they were the previous
//!   holder's.
//!   Every time is the server's (`$$NOW` in update pipelines and `$expr` filters):
//!   lapse never depends on a caller's clock.
//!
//! Writes and reads use majority concerns, so a grant survives a primary's failover.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use mongodb::error::{Error as MongoError, ErrorKind, WriteFailure};
use mongodb::options::{CollectionOptions, ReadConcern, ReturnDocument, WriteConcern};
use mongodb::{Client, Collection};
use serde::{Deserialize, Serialize};

use super::{
    check_commit, check_holder, check_request, Acquire, Commit, DirectorAcquire, DirectorLease,
    Lease, NodeEntry, NodeRecord, PlayerSample, TopologyError, TopologyStore, MAX_PLAYER_SAMPLES,
};
use crate::mongo::{bounded, error, MongoConn};
use crate::StoreError;
use cellmesh_world::balance::CellReport;
use cellmesh_world::partition::{NodeId, Partition};

const CURRENT: &str = "current";
const DUPLICATE_KEY: i32 = 11000;

#[derive(Serialize, Deserialize)]
struct PartitionDoc {
    #[serde(rename = "_id")]
    id: String,
    /// Copied out of `partition` for the compare-and-set filter.
    epoch: i64,
    partition: Partition,
    /// The director's lease, in the same document so that a commit checks it atomically.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    director: Option<DirectorDoc>,
}

#[derive(Serialize, Deserialize)]
struct DirectorDoc {
    holder: String,
    epoch: i64,
    expires_unix_ms: i64,
}

impl DirectorDoc {
    fn lease(&self) -> DirectorLease {
        DirectorLease {
            holder: self.holder.clone(),
            epoch: self.epoch.max(0) as u64,
            expires_unix_ms: self.expires_unix_ms.max(0) as u64,
        }
    }
}

/// An update pipeline stage giving the director's lease a new expiry. The lease is set whole: a
/// dotted path into it is not honoured by every MongoDB-compatible server.
fn director_with_expiry(expires: impl Into<mongodb::bson::Bson>) -> Document {
    doc! { "$set": { "director": {
        "holder": "$director.holder",
        "epoch": "$director.epoch",
        "expires_unix_ms": expires.into(),
    } } }
}

/// Filter clauses: the partition document's director lease is `lease`, and live.
fn director_is(lease: &DirectorLease) -> Result<Document, TopologyError> {
    Ok(doc! {
        "_id": CURRENT,
        "director.holder": &lease.holder,
        "director.epoch": as_i64(lease.epoch)?,
        "$expr": { "$gt": ["$director.expires_unix_ms", server_now()] },
    })
}

#[derive(Deserialize)]
struct NodeDoc {
    #[serde(rename = "_id")]
    node: i64,
    holder: String,
    epoch: i64,
    expires_unix_ms: i64,
    #[serde(default)]
    ids_floor_unix_ms: i64,
    #[serde(default)]
    record: Option<RecordDoc>,
    /// Added by the server when listing: live by its clock.
    #[serde(default)]
    live: bool,
}

#[derive(Serialize, Deserialize)]
struct RecordDoc {
    geo: String,
    mesh_addr: String,
    admin_addr: String,
}

impl NodeDoc {
    fn into_entry(self) -> Result<NodeEntry, String> {
        let node = NodeId::try_from(self.node)
            .map_err(|_| format!("node id {} out of range", self.node))?;
        let unsigned = |name: &str, v: i64| {
            u64::try_from(v).map_err(|_| format!("node {node}: negative {name} {v}"))
        };
        Ok(NodeEntry {
            lease: Lease {
                node,
                holder: self.holder,
                epoch: unsigned("epoch", self.epoch)?,
                expires_unix_ms: unsigned("expires_unix_ms", self.expires_unix_ms)?,
                ids_floor_unix_ms: unsigned("ids_floor_unix_ms", self.ids_floor_unix_ms)?,
            },
            live: self.live,
            record: self.record.map(|r| NodeRecord {
                node,
                geo: r.geo,
                mesh_addr: r.mesh_addr,
                admin_addr: r.admin_addr,
            }),
        })
    }
}

#[derive(Clone)]
pub struct MongoTopology {
    client: Client,
    partition: Collection<PartitionDoc>,
    nodes: Collection<NodeDoc>,
    /// One document per dead process whose world was restored, `_id` `"node:lease_epoch"`.
    restored: Collection<Document>,
    /// For error messages: the URL without its password.
    url: String,
}

fn is_duplicate_key(e: &MongoError) -> bool {
    match e.kind.as_ref() {
        ErrorKind::Command(c) => c.code == DUPLICATE_KEY,
        ErrorKind::Write(WriteFailure::WriteError(w)) => w.code == DUPLICATE_KEY,
        _ => false,
    }
}

/// Fencing filter: `lease` is still the current grant of its node.
fn current(lease: &Lease) -> Result<Document, TopologyError> {
    Ok(
        doc! { "_id": i64::from(lease.node), "holder": &lease.holder, "epoch": as_i64(lease.epoch)? },
    )
}

/// The server's clock, unix milliseconds, in an aggregation expression.
fn server_now() -> Document {
    doc! { "$toLong": "$$NOW" }
}

/// A filter clause: the lease is live by the server's clock.
fn live() -> Document {
    doc! { "$expr": { "$gt": ["$expires_unix_ms", server_now()] } }
}

/// The update pipeline of a grant to `holder` for `ttl` ms: the next epoch, the expiry by the
/// server's clock, ids from past every earlier grant's expiry, and no record, load or players
/// (they were the previous holder's).
fn grant(holder: &str, ttl: i64) -> Vec<Document> {
    vec![
        doc! { "$set": {
            "holder": holder,
            "epoch": { "$add": [{ "$ifNull": ["$epoch", 0_i64] }, 1_i64] },
            "expires_unix_ms": { "$add": [server_now(), ttl] },
            "ids_floor_unix_ms": { "$ifNull": ["$ids_below_unix_ms", 0_i64] },
        } },
        doc! { "$set": {
            "ids_below_unix_ms": { "$max": ["$ids_floor_unix_ms", "$expires_unix_ms"] },
        } },
        doc! { "$unset": ["record", "load", "players"] },
    ]
}

/// The `_id` of a restored process's mark.
fn restored_id(node: NodeId, lease_epoch: u64) -> String {
    format!("{node}:{lease_epoch}")
}

fn ttl_ms(ttl: u64) -> Result<i64, TopologyError> {
    i64::try_from(ttl).map_err(|_| TopologyError::Ttl(std::time::Duration::from_millis(ttl)))
}

fn as_i64(v: u64) -> Result<i64, TopologyError> {
    i64::try_from(v).map_err(|_| TopologyError::Time(v))
}

impl MongoTopology {
    /// Extends `lease` to the server's now + `ttl` if it is still the current grant and
    /// `condition` holds of it; the lease as extended, or `None`.
    async fn extend_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
        condition: Document,
        op: &str,
    ) -> Result<Option<Lease>, TopologyError> {
        let ttl = ttl_ms(check_request(lease.node, &lease.holder, ttl)?)?;
        let mut filter = current(lease)?;
        filter.extend(condition);
        let update = vec![
            doc! { "$set": { "expires_unix_ms": { "$add": [server_now(), ttl] } } },
            doc! { "$set": {
                "ids_below_unix_ms": { "$max": ["$ids_below_unix_ms", "$expires_unix_ms"] },
            } },
        ];
        let extend = self
            .nodes
            .find_one_and_update(filter, update)
            .return_document(ReturnDocument::After);
        let extended = self.bounded(op, extend).await?;
        extended
            .map(|d| {
                d.into_entry()
                    .map(|e| e.lease)
                    .map_err(|why| self.corrupt(&why))
            })
            .transpose()
    }

    /// Connects to the MongoDB at `url` (`mongodb://host:port[/database]`) and checks that a
    /// server answers a `ping`.
    pub async fn connect(url: &str) -> Result<Self, TopologyError> {
        let conn = MongoConn::open(url).await?;
        let (client, db, shown) = (conn.client, conn.db, conn.url);
        let concerns = CollectionOptions::builder()
            .write_concern(WriteConcern::majority())
            .read_concern(ReadConcern::majority())
            .build();
        let this = Self {
            client: client.clone(),
            partition: db.collection_with_options("partition", concerns.clone()),
            nodes: db.collection_with_options("nodes", concerns.clone()),
            restored: db.collection_with_options("restored", concerns),
            url: shown,
        };
        Ok(this)
    }

    async fn bounded<T>(
        &self,
        op: &str,
        fut: impl IntoFuture<Output = Result<T, MongoError>>,
    ) -> Result<T, StoreError> {
        self.answer(op, fut).await?.map_err(|e| self.error(op, &e))
    }

    /// Like [`bounded`](Self::bounded), but a duplicate-key error comes back as `Ok(None)`.
    async fn unless_duplicate<T>(
        &self,
        op: &str,
        fut: impl IntoFuture<Output = Result<T, MongoError>>,
    ) -> Result<Option<T>, StoreError> {
        match self.answer(op, fut).await? {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_duplicate_key(&e) => Ok(None),
            Err(e) => Err(self.error(op, &e)),
        }
    }

    async fn answer<T>(
        &self,
        op: &str,
        fut: impl IntoFuture<Output = Result<T, MongoError>>,
    ) -> Result<Result<T, MongoError>, StoreError> {
        bounded(&self.url, op, fut).await
    }

    fn error(&self, op: &str, e: &MongoError) -> StoreError {
        error(&self.url, op, e)
    }

    /// Sets the partition (and its epoch) in the document `filter` matches, leaving the
    /// director's lease; true if it matched.
    async fn set_partition(
        &self,
        filter: Document,
        next: &Partition,
    ) -> Result<bool, TopologyError> {
        let partition = mongodb::bson::to_bson(next)
            .map_err(|e| self.corrupt(&format!("encoding the partition: {e}")))?;
        let update = doc! { "$set": { "epoch": as_i64(next.epoch())?, "partition": partition } };
        // `findOneAndUpdate`, not `updateOne`: its answer (the document or none) is the match,
        // where some MongoDB-compatible servers count an `$expr` filter's matches loosely.
        let found = self
            .bounded(
                "commit partition",
                self.partition.find_one_and_update(filter, update),
            )
            .await?;
        Ok(found.is_some())
    }

    /// The partition document's director lease, if any.
    async fn director(&self) -> Result<Option<DirectorLease>, TopologyError> {
        let found = self
            .bounded(
                "read director",
                self.partition.find_one(doc! { "_id": CURRENT }),
            )
            .await?;
        Ok(found.and_then(|d| d.director.map(|d| d.lease())))
    }

    /// The nodes collection, as documents.
    fn nodes_raw(&self) -> Collection<Document> {
        self.nodes.clone_with_type()
    }

    async fn current_epoch(&self) -> Result<u64, TopologyError> {
        Ok(self.partition().await?.map_or(0, |p| p.epoch()))
    }

    /// One node's entry, its liveness judged by the server.
    async fn entry(&self, node: NodeId) -> Result<Option<NodeEntry>, TopologyError> {
        Ok(self
            .list(doc! { "_id": i64::from(node) })
            .await?
            .into_iter()
            .next())
    }

    async fn list(&self, filter: Document) -> Result<Vec<NodeEntry>, TopologyError> {
        let pipeline = [
            doc! { "$match": filter },
            doc! { "$addFields": { "live": { "$gt": ["$expires_unix_ms", server_now()] } } },
            doc! { "$sort": { "_id": 1 } },
        ];
        let cursor = self
            .bounded("list nodes", self.nodes.aggregate(pipeline))
            .await?;
        let docs: Vec<Document> = self.bounded("list nodes", cursor.try_collect()).await?;
        docs.into_iter()
            .map(|d| {
                mongodb::bson::from_document::<NodeDoc>(d)
                    .map_err(|e| e.to_string())
                    .and_then(NodeDoc::into_entry)
                    .map_err(|why| self.corrupt(&why))
            })
            .collect()
    }

    /// Sets `field` of the node's document to `value` if `lease` is its live, current grant;
    /// true if it was.
    async fn publish_field(
        &self,
        lease: &Lease,
        field: &str,
        value: mongodb::bson::Bson,
        op: &str,
    ) -> Result<bool, TopologyError> {
        let mut filter = current(lease)?;
        filter.extend(live());
        // `findOneAndUpdate`: its answer is the match (see `set_partition`).
        let nodes = self.nodes_raw();
        // Only the id comes back: the document may carry thousands of players.
        let publish = nodes
            .find_one_and_update(filter, doc! { "$set": { field: value } })
            .projection(doc! { "_id": 1 });
        Ok(self.bounded(op, publish).await?.is_some())
    }

    /// `field` of every node whose lease is live and that published it, by node.
    async fn published<T: serde::de::DeserializeOwned>(
        &self,
        field: &str,
        op: &str,
    ) -> Result<BTreeMap<NodeId, T>, TopologyError> {
        let mut filter = live();
        filter.insert(field, doc! { "$exists": true });
        let nodes = self.nodes_raw();
        let cursor = self.bounded(op, nodes.find(filter)).await?;
        let docs: Vec<Document> = self.bounded(op, cursor.try_collect()).await?;
        docs.into_iter()
            .map(|d| {
                let node = d
                    .get_i64("_id")
                    .ok()
                    .and_then(|n| NodeId::try_from(n).ok())
                    .ok_or_else(|| self.corrupt("a node document without a node id"))?;
                let value = d
                    .get(field)
                    .cloned()
                    .ok_or_else(|| self.corrupt(&format!("a {field} filtered for and missing")))?;
                let value = mongodb::bson::from_bson(value)
                    .map_err(|e| self.corrupt(&format!("node {node}'s {field}: {e}")))?;
                Ok((node, value))
            })
            .collect()
    }

    fn corrupt(&self, why: &str) -> TopologyError {
        StoreError::Corrupt(format!("mongodb at {}: {why}", self.url)).into()
    }
}

#[async_trait]
impl TopologyStore for MongoTopology {
    async fn partition(&self) -> Result<Option<Partition>, TopologyError> {
        let found = self
            .bounded(
                "read partition",
                self.partition.find_one(doc! { "_id": CURRENT }),
            )
            .await?;
        Ok(found.map(|d| d.partition))
    }

    async fn commit_partition(
        &self,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        check_commit(expected_epoch, next)?;
        let document = PartitionDoc {
            id: CURRENT.into(),
            epoch: as_i64(next.epoch())?,
            partition: next.clone(),
            director: None,
        };
        let won = if expected_epoch == 0 {
            self.unless_duplicate("commit partition", self.partition.insert_one(&document))
                .await?
                .is_some()
        } else {
            let filter = doc! { "_id": CURRENT, "epoch": as_i64(expected_epoch)? };
            self.set_partition(filter, next).await?
        };
        if won {
            return Ok(Commit::Committed);
        }
        Ok(Commit::Stale {
            current_epoch: self.current_epoch().await?,
        })
    }

    async fn acquire_director(
        &self,
        holder: &str,
        ttl: Duration,
    ) -> Result<DirectorAcquire, TopologyError> {
        let ttl = ttl_ms(check_holder(holder, ttl)?)?;
        let filter = doc! {
            "_id": CURRENT,
            "$or": [
                { "director": { "$exists": false } },
                { "$expr": { "$lte": ["$director.expires_unix_ms", server_now()] } },
                { "director.holder": holder },
            ],
        };
        let grant = vec![doc! { "$set": { "director": {
            "holder": holder,
            "epoch": { "$add": [{ "$ifNull": ["$director.epoch", 0_i64] }, 1_i64] },
            "expires_unix_ms": { "$add": [server_now(), ttl] },
        } } }];
        let granted = self
            .bounded(
                "acquire director",
                self.partition
                    .find_one_and_update(filter, grant)
                    .return_document(ReturnDocument::After),
            )
            .await?;
        if let Some(d) = granted.and_then(|d| d.director) {
            return Ok(DirectorAcquire::Granted(d.lease()));
        }
        let current = self
            .bounded(
                "read director",
                self.partition.find_one(doc! { "_id": CURRENT }),
            )
            .await?
            .ok_or(TopologyError::NoPartition)?;
        match current.director {
            Some(d) => Ok(DirectorAcquire::Held(d.lease())),
            // The filter missed only a live lease of another holder, and nothing removes one.
            None => Err(self.corrupt("the director's lease vanished while it was asked for")),
        }
    }

    async fn renew_director(
        &self,
        lease: &DirectorLease,
        ttl: Duration,
    ) -> Result<Option<DirectorLease>, TopologyError> {
        let ttl = ttl_ms(check_holder(&lease.holder, ttl)?)?;
        let renew = vec![director_with_expiry(doc! { "$add": [server_now(), ttl] })];
        let renewed = self
            .bounded(
                "renew director",
                self.partition
                    .find_one_and_update(director_is(lease)?, renew)
                    .return_document(ReturnDocument::After),
            )
            .await?;
        Ok(renewed.and_then(|d| d.director.map(|d| d.lease())))
    }

    async fn release_director(&self, lease: &DirectorLease) -> Result<bool, TopologyError> {
        let released = self
            .bounded(
                "release director",
                self.partition.find_one_and_update(
                    director_is(lease)?,
                    vec![director_with_expiry(mongodb::bson::Bson::Int64(0))],
                ),
            )
            .await?;
        Ok(released.is_some())
    }

    async fn commit_partition_as(
        &self,
        director: &DirectorLease,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        check_commit(expected_epoch, next)?;
        let mut filter = director_is(director)?;
        filter.insert("epoch", as_i64(expected_epoch)?);
        if self.set_partition(filter, next).await? {
            return Ok(Commit::Committed);
        }
        let current_epoch = self.current_epoch().await?;
        if current_epoch != expected_epoch {
            return Ok(Commit::Stale { current_epoch });
        }
        // The epoch matched: the lease did not.
        Ok(Commit::Fenced {
            director: self.director().await?,
        })
    }

    async fn acquire_lease(
        &self,
        node: NodeId,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        let ttl = ttl_ms(check_request(node, holder, ttl)?)?;
        let filter = doc! {
            "_id": i64::from(node),
            "$or": [
                { "$expr": { "$lte": ["$expires_unix_ms", server_now()] } },
                { "holder": holder },
            ],
        };
        let update = grant(holder, ttl);
        // A holder that lapses between our failed grant and our read shows as lapsed; asking
        // again then grants or names the new holder.
        for _ in 0..3 {
            let grant = self
                .nodes
                .find_one_and_update(filter.clone(), update.clone());
            let granted = self
                .unless_duplicate(
                    "acquire lease",
                    grant.upsert(true).return_document(ReturnDocument::After),
                )
                .await?;
            let entry = match granted {
                Some(Some(d)) => {
                    return Ok(Acquire::Granted(
                        d.into_entry().map_err(|why| self.corrupt(&why))?.lease,
                    ))
                }
                Some(None) => return Err(self.corrupt("upsert returned no document")),
                None => self.entry(node).await?,
            };
            if let Some(e) = entry.filter(|e| e.live) {
                return Ok(Acquire::Held(e.lease));
            }
        }
        Err(StoreError::Unavailable(format!(
            "mongodb at {}: lease of node {node} keeps changing hands",
            self.url
        ))
        .into())
    }

    async fn take_over_lease(
        &self,
        previous: &Lease,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        let millis = ttl_ms(check_request(previous.node, holder, ttl)?)?;
        // Filtered on the exact grant, live or not; no upsert: a node never leased has no grant
        // to replace, and acquiring covers it.
        let take = self
            .nodes
            .find_one_and_update(current(previous)?, grant(holder, millis))
            .return_document(ReturnDocument::After);
        if let Some(d) = self.bounded("take over lease", take).await? {
            return Ok(Acquire::Granted(
                d.into_entry().map_err(|why| self.corrupt(&why))?.lease,
            ));
        }
        self.acquire_lease(previous.node, holder, ttl).await
    }

    async fn renew_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        self.extend_lease(lease, ttl, live(), "renew lease").await
    }

    async fn reclaim_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        // Lapsed or live, but not given up.
        let not_released = doc! { "expires_unix_ms": { "$gt": 0_i64 } };
        self.extend_lease(lease, ttl, not_released, "reclaim lease")
            .await
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, TopologyError> {
        let release = self.nodes.update_one(
            current(lease)?,
            doc! { "$set": { "expires_unix_ms": 0_i64 } },
        );
        Ok(self.bounded("release lease", release).await?.matched_count == 1)
    }

    async fn publish_node(
        &self,
        lease: &Lease,
        record: &NodeRecord,
    ) -> Result<bool, TopologyError> {
        record.check_lease(lease)?;
        let mut filter = current(lease)?;
        filter.extend(live());
        let fields = RecordDoc {
            geo: record.geo.clone(),
            mesh_addr: record.mesh_addr.clone(),
            admin_addr: record.admin_addr.clone(),
        };
        let fields = mongodb::bson::to_bson(&fields).map_err(|e| self.corrupt(&e.to_string()))?;
        let publish = self
            .nodes
            .update_one(filter, doc! { "$set": { "record": fields } });
        Ok(self.bounded("publish node", publish).await?.matched_count == 1)
    }

    async fn mark_restored(&self, node: NodeId, lease_epoch: u64) -> Result<(), TopologyError> {
        let mark = self
            .restored
            .insert_one(doc! { "_id": restored_id(node, lease_epoch) });
        // Marked already: the same.
        self.unless_duplicate("mark restored", mark).await?;
        Ok(())
    }

    async fn restored_among(
        &self,
        processes: &[(NodeId, u64)],
    ) -> Result<Vec<(NodeId, u64)>, TopologyError> {
        if processes.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = processes.iter().map(|&(n, e)| restored_id(n, e)).collect();
        let find = self.restored.find(doc! { "_id": { "$in": &ids } });
        let cursor = self.bounded("read restored", find).await?;
        let docs: Vec<Document> = self.bounded("read restored", cursor.try_collect()).await?;
        let marked: std::collections::BTreeSet<&str> =
            docs.iter().filter_map(|d| d.get_str("_id").ok()).collect();
        Ok(processes
            .iter()
            .copied()
            .filter(|&(n, e)| marked.contains(restored_id(n, e).as_str()))
            .collect())
    }

    async fn nodes(&self) -> Result<Vec<NodeEntry>, TopologyError> {
        self.list(doc! {}).await
    }

    async fn publish_load(
        &self,
        lease: &Lease,
        report: &CellReport,
    ) -> Result<bool, TopologyError> {
        let load = mongodb::bson::to_bson(report).map_err(|e| self.corrupt(&e.to_string()))?;
        self.publish_field(lease, "load", load, "publish load")
            .await
    }

    async fn loads(&self) -> Result<BTreeMap<NodeId, CellReport>, TopologyError> {
        self.published("load", "read loads").await
    }

    async fn publish_players(
        &self,
        lease: &Lease,
        players: &[PlayerSample],
    ) -> Result<bool, TopologyError> {
        let kept = &players[..players.len().min(MAX_PLAYER_SAMPLES)];
        let players = mongodb::bson::to_bson(kept).map_err(|e| self.corrupt(&e.to_string()))?;
        self.publish_field(lease, "players", players, "publish players")
            .await
    }

    async fn players(&self) -> Result<BTreeMap<NodeId, Vec<PlayerSample>>, TopologyError> {
        self.published("players", "read players").await
    }

    async fn close(&self) {
        self.client.clone().shutdown().await;
    }
}
