//! The store executor: runs the node's store requests off the node task, each with a timeout,
//! and hands the answers back as inputs.

use std::time::Duration;

use cellmesh_proto::mesh::HandoffOffer;
use cellmesh_stores::topology::{Commit, TopologyStore};
use cellmesh_stores::{MasterEntry, PlayerRecord, Stores};
use prost::Message;

use cellmesh_world::partition::{NodeId, Partition};

use crate::core::{Registration, StoreReply, StoreRequest};
use crate::metrics::Metrics;

/// Longest a store call may take before the node gives up on it.
pub(crate) const STORE_TIMEOUT: Duration = Duration::from_secs(5);
/// A registration that failed is tried again after these pauses: a directory restarting, or a
/// connection it dropped, costs a login a moment instead of a kick (the proxy gives an attach
/// five seconds).
const REGISTER_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_millis(1_000),
];

async fn timed<T, E: std::fmt::Display>(
    fut: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(STORE_TIMEOUT, fut).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {} s", STORE_TIMEOUT.as_secs())),
    }
}

/// Carries out one request; the answer, for the requests that have one.
pub(crate) async fn execute(
    stores: &Stores,
    topology: Option<&dyn TopologyStore>,
    request: StoreRequest,
    metrics: &Metrics,
) -> Option<StoreReply> {
    match request {
        StoreRequest::Register {
            session,
            account,
            node,
            lease_ms,
            handed_over_from,
            moved_from,
        } => {
            let lease = Duration::from_millis(lease_ms);
            let started = tokio::time::Instant::now();
            let mut pauses = REGISTER_RETRY_PAUSES.iter();
            let registered = loop {
                let attempt = register(
                    stores,
                    metrics,
                    &account,
                    node,
                    lease,
                    handed_over_from,
                    moved_from,
                )
                .await;
                // Each step is monotonic (a register above a floor), so a step that landed
                // before its answer was lost costs an epoch, never a second session.
                match (attempt, pauses.next()) {
                    (Err(e), Some(&pause)) if started.elapsed() + pause < STORE_TIMEOUT => {
                        metrics.error("register_retried");
                        tracing::debug!(%account, error = %e, "registration failed: trying again");
                        tokio::time::sleep(pause).await;
                    }
                    (attempt, _) => break attempt,
                }
            };
            Some(match registered {
                Ok(None) => StoreReply::Superseded { session, account },
                Ok(Some(r)) => StoreReply::Registered {
                    session,
                    account,
                    result: Ok(r),
                },
                Err(e) => StoreReply::Registered {
                    session,
                    account,
                    result: Err(e),
                },
            })
        }
        StoreRequest::Renew { sessions, lease_ms } => {
            let lease = Duration::from_millis(lease_ms);
            // All at once: the directory's connection pipelines them, so a thousand sessions
            // cost one round trip and a store that does not answer costs one timeout, not one
            // per session.
            let results = futures::future::join_all(sessions.into_iter().map(
                |(key, account, epoch)| async move {
                    let r = timed(stores.directory.renew(&account, epoch, lease)).await;
                    (key, epoch, r)
                },
            ))
            .await;
            Some(StoreReply::Renewed { results })
        }
        StoreRequest::Reregister {
            session,
            account,
            node,
            lease_ms,
            held,
        } => {
            let lease = Duration::from_millis(lease_ms);
            let result = timed(stores.directory.register_moved(&account, node, lease, held)).await;
            Some(StoreReply::Reregistered {
                session,
                account,
                held,
                result,
            })
        }
        StoreRequest::Lookup { account } => {
            let result = timed(stores.directory.lookup(&account)).await;
            Some(StoreReply::LookedUp { account, result })
        }
        StoreRequest::EndSession {
            record,
            epoch,
            hold_ms,
        } => {
            end_session(stores, metrics, &record, epoch, hold_ms).await;
            None
        }
        StoreRequest::SaveRecords { records } => {
            for record in records {
                if let Err(e) = timed(stores.players.save(&record)).await {
                    metrics.error("store");
                    tracing::warn!(account = %record.account, error = %e, "saving the player record failed");
                }
            }
            None
        }
        StoreRequest::Release { account, epoch } => {
            let _ = timed(stores.directory.release(&account, epoch)).await;
            None
        }
        StoreRequest::WriteMasters { set, clear } => {
            write_masters(stores, metrics, set, clear).await
        }
        StoreRequest::PutCheckpoints {
            node,
            lease_epoch,
            put,
            remove,
        } => put_checkpoints(stores, metrics, node, lease_epoch, put, remove).await,
        StoreRequest::LoadCheckpoints {
            node,
            lease_epoch,
            copy_of,
        } => Some(StoreReply::CheckpointsLoaded {
            node,
            lease_epoch,
            result: match checkpoints_of(stores, copy_of.as_deref()) {
                Ok(store) => load_checkpoints(store, node, lease_epoch).await,
                Err(e) => Err(e),
            },
        }),
        StoreRequest::DropCheckpoints {
            node,
            lease_epoch,
            copy_of,
        } => {
            drop_checkpoints(stores, topology, metrics, node, lease_epoch, copy_of).await;
            None
        }
        StoreRequest::ListCheckpointed { copy_of } => {
            let (result, restored) = list_checkpointed(stores, topology, copy_of.as_deref()).await;
            Some(StoreReply::Checkpointed {
                copy_of,
                result,
                restored,
            })
        }
        StoreRequest::FenceLease { node, epoch } => Some(StoreReply::LeaseFenced {
            node,
            epoch,
            result: match topology {
                None => Err("no topology store: a lone node fences nothing".to_string()),
                Some(t) => timed(cellmesh_stores::topology::fence_lease(t, node, epoch)).await,
            },
        }),
        StoreRequest::CommitPartition { partition } => Some(StoreReply::PartitionCommitted {
            epoch: partition.epoch(),
            result: commit_partition(topology, &partition).await,
        }),
        StoreRequest::Claim {
            token,
            key,
            holder,
            ttl_ms,
        } => Some(StoreReply::Claimed {
            token,
            result: timed(
                stores
                    .claims
                    .claim(&key, holder, Duration::from_millis(ttl_ms)),
            )
            .await,
        }),
        StoreRequest::RenewClaims { claims } => {
            let mut results = Vec::with_capacity(claims.len());
            for (grant, ttl_ms) in claims {
                let r = timed(stores.claims.renew(&grant, Duration::from_millis(ttl_ms))).await;
                results.push((grant, r));
            }
            Some(StoreReply::ClaimsRenewed { results })
        }
        StoreRequest::RebindClaim {
            grant,
            entity_epoch,
            ttl_ms,
        } => {
            let ttl = Duration::from_millis(ttl_ms);
            let result = timed(stores.claims.rebind_renewed(&grant, entity_epoch, ttl)).await;
            Some(StoreReply::ClaimRebound { old: grant, result })
        }
        StoreRequest::ReleaseClaim { grant } => {
            if let Err(e) = timed(stores.claims.release(&grant)).await {
                metrics.error("store");
                tracing::warn!(key = %grant.key, error = %e, "claim not released (its lease lapses)");
            }
            None
        }
        StoreRequest::ClaimForPeer {
            link,
            call,
            request,
        } => Box::pin(execute(stores, topology, *request, metrics))
            .await
            .map(|reply| StoreReply::ClaimForPeer {
                link,
                call,
                reply: Box::new(reply),
            }),
    }
}

/// A login's or a moved session's registration: the record read (unless a hint names the
/// epoch), the directory's epoch above it, and the avatar's master entry; `None` when a newer
/// login registered after the moved session's epoch.
async fn register(
    stores: &Stores,
    metrics: &Metrics,
    account: &str,
    node: NodeId,
    lease: Duration,
    handed_over_from: Option<u64>,
    moved_from: Option<u64>,
) -> Result<Option<Registration>, String> {
    // The record first: the epoch it names (a session in another geo, whose
    // directory counts on its own) is the floor of the new one.
    let (record, floor) = match handed_over_from {
        Some(epoch) => (None, epoch),
        None => {
            metrics.login_record_reads.inc();
            let record = timed(stores.players.load(account)).await?;
            let floor = record.as_ref().map_or(0, |r| r.session_epoch);
            (record, floor)
        }
    };
    let mut record = record;
    let epoch = match moved_from {
        None => {
            let epoch = timed(stores.directory.register_above(account, node, lease, floor)).await?;
            match handed_over_from {
                // This geo's directory had counted past the hinted session: a later
                // one may have saved the record since. Session epochs order records
                // across geos (each login registers above the record it read), so
                // the record decides; a hint older than it must not rewind it.
                Some(hinted) if epoch > hinted + 1 => {
                    metrics.login_record_reads.inc();
                    match timed(stores.players.load(account)).await? {
                        Some(r) if r.session_epoch > hinted => {
                            let newer = r.session_epoch;
                            record = Some(r);
                            if newer >= epoch {
                                timed(stores.directory.register_above(account, node, lease, newer))
                                    .await?
                            } else {
                                epoch
                            }
                        }
                        _ => epoch,
                    }
                }
                _ => epoch,
            }
        }
        // The record names a later session: one that began after this one.
        Some(moved_from) if floor > moved_from => return Ok(None),
        Some(moved_from) => match timed(
            stores
                .directory
                .register_moved(account, node, lease, moved_from),
        )
        .await?
        {
            Some(epoch) => epoch,
            None => return Ok(None),
        },
    };
    match timed(stores.directory.master(account)).await {
        Ok(master) => Ok(Some(Registration {
            epoch,
            record,
            master,
        })),
        Err(e) => {
            let _ = timed(stores.directory.release(account, epoch)).await;
            Err(e)
        }
    }
}

/// The partition a lone node's balancer planned, over the epoch before it.
async fn commit_partition(
    topology: Option<&dyn TopologyStore>,
    partition: &Partition,
) -> Result<(), String> {
    let Some(t) = topology else {
        return Err("no topology store: a lone node commits nothing".to_string());
    };
    match timed(t.commit_partition(partition.epoch().saturating_sub(1), partition)).await? {
        Commit::Committed => Ok(()),
        Commit::Stale { current_epoch } => Err(format!("the store is at epoch {current_epoch}")),
        Commit::Fenced { .. } => Err("refused: a plain commit is never fenced".to_string()),
    }
}

/// A session's end: its record saved, its directory entry released, or held `hold_ms` for the
/// login a handover sent to the other geo.
async fn end_session(
    stores: &Stores,
    metrics: &Metrics,
    record: &PlayerRecord,
    epoch: u64,
    hold_ms: u64,
) {
    if let Err(e) = timed(stores.players.save(record)).await {
        metrics.error("store");
        tracing::warn!(account = %record.account, error = %e, "saving the player record failed");
    }
    let ended = if hold_ms > 0 {
        // Displaced by the login in the other geo, or expired if it never comes.
        let hold = Duration::from_millis(hold_ms);
        timed(stores.directory.renew(&record.account, epoch, hold)).await
    } else {
        timed(stores.directory.release(&record.account, epoch)).await
    };
    if let Err(e) = ended {
        metrics.error("store");
        tracing::warn!(account = %record.account, error = %e, "releasing the session failed");
    }
}

/// Avatars' master entries set and cleared; the accounts whose entry was not written, to retry.
async fn write_masters(
    stores: &Stores,
    metrics: &Metrics,
    set: Vec<(String, MasterEntry)>,
    clear: Vec<(String, u64, u64)>,
) -> Option<StoreReply> {
    let mut failed = Vec::new();
    for (account, entry) in set {
        if let Err(e) = timed(stores.directory.set_master(&account, entry)).await {
            tracing::warn!(%account, error = %e, "writing the avatar's master record failed; retrying");
            failed.push(account);
        }
    }
    for (account, id, epoch) in clear {
        if let Err(e) = timed(stores.directory.clear_master(&account, id, epoch)).await {
            // Harmless if left: a login sent to this node finds no avatar and spawns.
            tracing::debug!(%account, error = %e, "clearing the avatar's master record failed");
        }
    }
    if failed.is_empty() {
        None
    } else {
        metrics.error("store");
        Some(StoreReply::MastersNotWritten { accounts: failed })
    }
}

/// Checkpoints written and removed in one call; what was not written, for the next flush.
async fn put_checkpoints(
    stores: &Stores,
    metrics: &Metrics,
    node: NodeId,
    lease_epoch: u64,
    put: Vec<HandoffOffer>,
    remove: Vec<u64>,
) -> Option<StoreReply> {
    let ids: Vec<u64> = put.iter().map(|c| c.entity_id).collect();
    let put = put
        .into_iter()
        .map(|c| (c.entity_id, c.encode_to_vec()))
        .collect();
    // The core geo's copy is written with the same changes: a write either missed is written
    // again, whole, with the next flush (both are idempotent).
    let written = match &stores.core_copy {
        None => {
            timed(
                stores
                    .checkpoints
                    .write(node, lease_epoch, put, remove.clone()),
            )
            .await
        }
        Some(copy) => {
            let own = timed(stores.checkpoints.write(
                node,
                lease_epoch,
                put.clone(),
                remove.clone(),
            ));
            let copy = async {
                timed(copy.write(node, lease_epoch, put, remove.clone()))
                    .await
                    .map_err(|e| format!("the core geo's copy: {e}"))
            };
            let (own, copy) = tokio::join!(own, copy);
            own.and(copy)
        }
    };
    match written {
        Ok(()) => None,
        Err(e) => {
            // The node writes them again with its next flush.
            metrics.error("checkpoint_write");
            tracing::warn!(error = %e, "writing checkpoints failed");
            Some(StoreReply::CheckpointsNotWritten {
                lease_epoch,
                put: ids,
                remove,
            })
        }
    }
}

/// The checkpoint store a request names: this geo's, or the copy of `copy_of`'s kept here.
fn checkpoints_of<'a>(
    stores: &'a Stores,
    copy_of: Option<&str>,
) -> Result<&'a dyn cellmesh_stores::CheckpointStore, String> {
    match copy_of {
        None => Ok(stores.checkpoints.as_ref()),
        Some(geo) => stores.copies.get(geo).map(|c| c.as_ref()).ok_or_else(|| {
            format!(
                "this node keeps no copy of geo {geo:?}'s checkpoints (a core geo's node reads \
                 the copies from its directory's Redis, and every node of {geo:?} needs \
                 core_directory_url)"
            )
        }),
    }
}

/// The processes with checkpoints in the store named, and which of them the topology marks
/// restored. A mark that cannot be read fails the listing: a round on it could bring back what
/// was restored, and then killed, elsewhere.
async fn list_checkpointed(
    stores: &Stores,
    topology: Option<&dyn TopologyStore>,
    copy_of: Option<&str>,
) -> (Result<Vec<(NodeId, u64)>, String>, Vec<(NodeId, u64)>) {
    let listed = match checkpoints_of(stores, copy_of) {
        Ok(store) => timed(store.processes()).await,
        Err(e) => Err(e),
    };
    let all = match listed {
        Ok(all) => all,
        Err(e) => return (Err(e), Vec::new()),
    };
    let Some(topology) = topology else {
        return (Ok(all), Vec::new());
    };
    match timed(topology.restored_among(&all)).await {
        Ok(restored) => (Ok(all), restored),
        Err(e) => (Err(format!("reading which were restored: {e}")), Vec::new()),
    }
}

/// Marks a dead process restored for good, then drops its checkpoints: from the store named,
/// and from the core geo's copy when they are this geo's own. Not marked, nothing is dropped
/// (the next listing finds it again and drops it then).
async fn drop_checkpoints(
    stores: &Stores,
    topology: Option<&dyn TopologyStore>,
    metrics: &Metrics,
    node: NodeId,
    lease_epoch: u64,
    copy_of: Option<String>,
) {
    if let Some(topology) = topology {
        if let Err(e) = timed(topology.mark_restored(node, lease_epoch)).await {
            metrics.error("store");
            tracing::warn!(node, lease_epoch, error = %e, "marking a dead node's world restored failed; its checkpoints are kept");
            return;
        }
    }
    let mut stores_of: Vec<&dyn cellmesh_stores::CheckpointStore> = Vec::new();
    match checkpoints_of(stores, copy_of.as_deref()) {
        Ok(store) => stores_of.push(store),
        Err(e) => tracing::warn!(node, error = %e, "a dead node's checkpoints are not dropped"),
    }
    if copy_of.is_none() {
        stores_of.extend(stores.core_copy.as_deref());
    }
    for store in stores_of {
        if let Err(e) = timed(store.drop_all(node, lease_epoch)).await {
            metrics.error("store");
            tracing::warn!(node, error = %e, "dropping a dead node's checkpoints failed");
        }
    }
}

/// A dead process's checkpoints, each decoded as the offer it was written from.
async fn load_checkpoints(
    store: &dyn cellmesh_stores::CheckpointStore,
    node: NodeId,
    lease_epoch: u64,
) -> Result<Vec<HandoffOffer>, String> {
    timed(store.load(node, lease_epoch))
        .await?
        .into_iter()
        .map(|(id, bytes)| {
            HandoffOffer::decode(bytes.as_slice())
                .map_err(|e| format!("checkpoint of entity {id}: {e}"))
        })
        .collect()
}
