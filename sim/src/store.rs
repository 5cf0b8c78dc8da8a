//! The stores as the simulated cluster sees them: the session directory and the player records,
//! answering after a drawn delay, or not at all during an outage (the driver's timeout answers).

use std::collections::BTreeMap;

use cellmesh_proto::mesh::HandoffOffer;
use cellmesh_sidecar::core::claims::{claim_call_on_table, is_claim_call};
use cellmesh_sidecar::core::{Registration, StoreReply, StoreRequest};
use cellmesh_stores::claims::ClaimTable;
use cellmesh_stores::{MasterEntry, PlayerRecord, SessionEntry};
use cellmesh_world::partition::NodeId;

/// What the driver answers when a store call times out.
const TIMEOUT_MS: u64 = 5_000;

type Checkpoints = BTreeMap<(NodeId, u64), BTreeMap<u64, HandoffOffer>>;

/// The core geo: the first.
const CORE: usize = 0;

#[derive(Default)]
pub(crate) struct SimStore {
    /// account -> (gateway, session epoch, lease expiry ms).
    directory: BTreeMap<String, (NodeId, u64, u64)>,
    /// The last epoch handed out per account: epochs never repeat.
    epochs: BTreeMap<String, u64>,
    players: BTreeMap<String, PlayerRecord>,
    masters: BTreeMap<String, MasterEntry>,
    /// (the geo whose store holds them, the geo whose processes wrote them) -> (node, lease
    /// epoch) -> entity -> its checkpoint. A geo's own are under (g, g); the copy a geo other
    /// than the core (geo 0) keeps in the core's store under (0, g).
    checkpoints: BTreeMap<(usize, usize), Checkpoints>,
    /// The processes marked restored, for good (in the topology, which every geo shares).
    restored: std::collections::BTreeSet<(NodeId, u64)>,
    /// The geos' names, by index (a `copy_of` names its geo).
    geo_names: Vec<String>,
    /// Each geo's claim store (by geo index), on the true clock: a key is granted by its home
    /// geo's alone.
    pub claims: BTreeMap<usize, ClaimTable>,
    /// No answers before this time.
    pub down_until: u64,
}

impl SimStore {
    pub fn with_geos(geo_names: Vec<String>) -> Self {
        Self {
            geo_names,
            ..Self::default()
        }
    }

    /// Runs `request` at `now`; the answer (if the request has one) and how long after the
    /// delay it comes: at once, or at the driver's timeout during an outage.
    /// `cut`: the asking machine is cut from the store (its claim calls time out). `geo`: the
    /// asking machine's, whose claim store it reaches.
    pub fn execute(
        &mut self,
        now: u64,
        request: StoreRequest,
        cut: bool,
        geo: usize,
    ) -> (Option<StoreReply>, u64) {
        let reachable = now >= self.down_until && !cut;
        if is_claim_call(&request) {
            let claims = self.claims.entry(geo).or_default();
            let reply = claim_call_on_table(claims, now, request, reachable);
            return (reply, if reachable { 0 } else { TIMEOUT_MS });
        }
        if now < self.down_until {
            let err = || "no answer within 5 s".to_string();
            let reply = match request {
                StoreRequest::Register {
                    session, account, ..
                } => Some(StoreReply::Registered {
                    session,
                    account,
                    result: Err(err()),
                }),
                StoreRequest::Renew { sessions, .. } => Some(StoreReply::Renewed {
                    results: sessions
                        .into_iter()
                        .map(|(k, _, e)| (k, e, Err(err())))
                        .collect(),
                }),
                StoreRequest::Lookup { account } => Some(StoreReply::LookedUp {
                    account,
                    result: Err(err()),
                }),
                StoreRequest::Reregister {
                    session,
                    account,
                    held,
                    ..
                } => Some(StoreReply::Reregistered {
                    session,
                    account,
                    held,
                    result: Err(err()),
                }),
                StoreRequest::LoadCheckpoints {
                    node, lease_epoch, ..
                } => Some(StoreReply::CheckpointsLoaded {
                    node,
                    lease_epoch,
                    result: Err(err()),
                }),
                StoreRequest::ListCheckpointed { copy_of } => Some(StoreReply::Checkpointed {
                    copy_of,
                    result: Err(err()),
                    restored: Vec::new(),
                }),
                StoreRequest::WriteMasters { set, .. } => Some(StoreReply::MastersNotWritten {
                    accounts: set.into_iter().map(|(a, _)| a).collect(),
                }),
                StoreRequest::PutCheckpoints {
                    lease_epoch,
                    put,
                    remove,
                    ..
                } => Some(StoreReply::CheckpointsNotWritten {
                    lease_epoch,
                    put: put.iter().map(|c| c.entity_id).collect(),
                    remove,
                }),
                StoreRequest::Claim { .. }
                | StoreRequest::RenewClaims { .. }
                | StoreRequest::RebindClaim { .. }
                | StoreRequest::ReleaseClaim { .. }
                | StoreRequest::ClaimForPeer { .. }
                | StoreRequest::EndSession { .. }
                | StoreRequest::SaveRecords { .. }
                | StoreRequest::Release { .. }
                | StoreRequest::DropCheckpoints { .. }
                | StoreRequest::FenceLease { .. }
                | StoreRequest::CommitPartition { .. } => None,
            };
            return (reply, TIMEOUT_MS);
        }
        let reply = match request {
            StoreRequest::Register {
                session,
                account,
                node,
                lease_ms,
                handed_over_from,
                moved_from,
            } => {
                let record = match handed_over_from {
                    Some(_) => None,
                    None => self.players.get(&account).cloned(),
                };
                let floor = handed_over_from
                    .or(record.as_ref().map(|r| r.session_epoch))
                    .unwrap_or(0);
                let epoch = self.epochs.entry(account.clone()).or_insert(0);
                // A moved session whose account logged in again after it: not registered.
                if let Some(moved_from) = moved_from {
                    if (*epoch).max(floor) > moved_from {
                        return (Some(StoreReply::Superseded { session, account }), 0);
                    }
                }
                *epoch = (*epoch).max(floor) + 1;
                // As the real store: a hint older than the record this geo's directory counted
                // past is overruled by the record.
                let mut record = record;
                if let Some(hinted) = handed_over_from.filter(|h| *epoch > h + 1) {
                    if let Some(r) = self
                        .players
                        .get(&account)
                        .filter(|r| r.session_epoch > hinted)
                    {
                        *epoch = (*epoch).max(r.session_epoch + 1);
                        record = Some(r.clone());
                    }
                }
                let epoch = *epoch;
                self.directory
                    .insert(account.clone(), (node, epoch, now + lease_ms));
                let master = self.masters.get(&account).copied();
                Some(StoreReply::Registered {
                    session,
                    account,
                    result: Ok(Registration {
                        epoch,
                        record,
                        master,
                    }),
                })
            }
            StoreRequest::Renew { sessions, lease_ms } => Some(StoreReply::Renewed {
                results: sessions
                    .into_iter()
                    .map(|(key, account, epoch)| {
                        let current = match self.directory.get_mut(&account) {
                            Some(e) if e.1 == epoch && e.2 > now => {
                                e.2 = now + lease_ms;
                                true
                            }
                            _ => false,
                        };
                        (key, epoch, Ok(current))
                    })
                    .collect(),
            }),
            StoreRequest::Reregister {
                session,
                account,
                node,
                lease_ms,
                held,
            } => {
                let epoch = self.epochs.entry(account.clone()).or_insert(0);
                let result = if *epoch > held {
                    None
                } else {
                    *epoch = held + 1;
                    self.directory
                        .insert(account.clone(), (node, *epoch, now + lease_ms));
                    Some(*epoch)
                };
                Some(StoreReply::Reregistered {
                    session,
                    account,
                    held,
                    result: Ok(result),
                })
            }
            StoreRequest::Lookup { account } => {
                let entry =
                    self.directory
                        .get(&account)
                        .filter(|e| e.2 > now)
                        .map(|e| SessionEntry {
                            gateway_node: e.0,
                            session_epoch: e.1,
                        });
                Some(StoreReply::LookedUp {
                    account,
                    result: Ok(entry),
                })
            }
            StoreRequest::EndSession {
                record,
                epoch,
                hold_ms,
            } => {
                self.players.insert(record.account.clone(), record.clone());
                if hold_ms > 0 {
                    if let Some(e) = self.directory.get_mut(&record.account) {
                        if e.1 == epoch {
                            e.2 = now + hold_ms;
                        }
                    }
                } else {
                    self.release(&record.account, epoch);
                }
                None
            }
            StoreRequest::Release { account, epoch } => {
                self.release(&account, epoch);
                None
            }
            StoreRequest::SaveRecords { records } => {
                for r in records {
                    self.players.insert(r.account.clone(), r);
                }
                None
            }
            StoreRequest::WriteMasters { set, clear } => {
                for (account, entry) in set {
                    if entry.replaces(self.masters.get(&account)) {
                        self.masters.insert(account, entry);
                    }
                }
                for (account, id, epoch) in clear {
                    if self
                        .masters
                        .get(&account)
                        .is_some_and(|m| m.entity_id == id && m.entity_epoch == epoch)
                    {
                        self.masters.remove(&account);
                    }
                }
                None
            }
            StoreRequest::PutCheckpoints {
                node,
                lease_epoch,
                put,
                remove,
            } => {
                // This geo's store, and the core's copy of a geo other than the core.
                let places: &[(usize, usize)] = if geo == CORE {
                    &[(CORE, CORE)]
                } else {
                    &[(geo, geo), (CORE, geo)]
                };
                for place in places {
                    let kept = self
                        .checkpoints
                        .entry(*place)
                        .or_default()
                        .entry((node, lease_epoch))
                        .or_default();
                    for id in &remove {
                        kept.remove(id);
                    }
                    for c in &put {
                        kept.insert(c.entity_id, c.clone());
                    }
                }
                None
            }
            StoreRequest::LoadCheckpoints {
                node,
                lease_epoch,
                copy_of,
            } => {
                let place = self.place(geo, copy_of.as_deref());
                let all = self
                    .checkpoints
                    .get(&place)
                    .and_then(|c| c.get(&(node, lease_epoch)))
                    .map(|k| k.values().cloned().collect())
                    .unwrap_or_default();
                Some(StoreReply::CheckpointsLoaded {
                    node,
                    lease_epoch,
                    result: Ok(all),
                })
            }
            StoreRequest::DropCheckpoints {
                node,
                lease_epoch,
                copy_of,
            } => {
                self.restored.insert((node, lease_epoch));
                let place = self.place(geo, copy_of.as_deref());
                let mut places = vec![place];
                if copy_of.is_none() && geo != CORE {
                    places.push((CORE, geo));
                }
                for place in places {
                    if let Some(c) = self.checkpoints.get_mut(&place) {
                        c.remove(&(node, lease_epoch));
                    }
                }
                None
            }
            StoreRequest::ListCheckpointed { copy_of } => {
                let place = self.place(geo, copy_of.as_deref());
                let all: Vec<(NodeId, u64)> = self
                    .checkpoints
                    .get(&place)
                    .into_iter()
                    .flatten()
                    .filter(|(_, kept)| !kept.is_empty())
                    .map(|(k, _)| *k)
                    .collect();
                let restored = all
                    .iter()
                    .copied()
                    .filter(|p| self.restored.contains(p))
                    .collect();
                Some(StoreReply::Checkpointed {
                    copy_of,
                    result: Ok(all),
                    restored,
                })
            }
            // The world commits partitions itself (it publishes them to the nodes).
            StoreRequest::CommitPartition { .. } | StoreRequest::FenceLease { .. } => None,
            // Claim calls were run above.
            StoreRequest::Claim { .. }
            | StoreRequest::RenewClaims { .. }
            | StoreRequest::RebindClaim { .. }
            | StoreRequest::ReleaseClaim { .. }
            | StoreRequest::ClaimForPeer { .. } => None,
        };
        (reply, 0)
    }

    /// Where a checkpoint request of a machine of `geo` reads: its geo's store, or the copy of
    /// `copy_of`'s kept there.
    fn place(&self, geo: usize, copy_of: Option<&str>) -> (usize, usize) {
        let of = copy_of
            .and_then(|name| self.geo_names.iter().position(|g| g == name))
            .unwrap_or(geo);
        (geo, of)
    }

    fn release(&mut self, account: &str, epoch: u64) {
        if self.directory.get(account).is_some_and(|e| e.1 == epoch) {
            self.directory.remove(account);
        }
    }
}
