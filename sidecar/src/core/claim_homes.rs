//! Claims across geos (docs/geo.md#homes-of-keys): every claim key has one home geo
//! (`cellmesh_world::homes`, over the world's `geos`), and only the home geo's store grants it.
//! A call for a key homed here goes to this geo's store. One homed elsewhere goes over the mesh to
//! a node of the home geo, which runs it on its own store and answers; that node refuses a key
//! whose home is not its geo, so a node with a different list of geos cannot make a second home.
//!
//! With no link up to a node of the home geo, a call is refused at once ("home unreachable"),
//! never granted by another store. A call under way when its link drops fails the same way: the
//! node counts a lease from when it sent the call, so a grant it never heard of only lapses in the
//! home's store.

use std::collections::BTreeMap;

use cellmesh_proto::mesh::{self, claim_call, mesh_message};
use cellmesh_stores::claims::{ClaimGrant, ClaimHolder, ClaimOutcome};
use cellmesh_world::partition::NodeId;

use super::context::Context;
use super::peers::Mesh;
use super::{LinkId, StoreReply, StoreRequest};

/// One link's calls run here at once, at most: past that they are refused, not queued.
pub const MAX_SERVED_PER_LINK: usize = 10_000;

/// The calls this node sent to other geos, and those it runs for them.
pub(crate) struct ClaimHomes {
    /// The world's geos, and this node's.
    geos: Vec<String>,
    own: String,
    /// Calls sent to a node of another geo and not answered: that node, and the call.
    asked: BTreeMap<u64, (NodeId, StoreRequest)>,
    next_call: u64,
    /// Calls run here for each peer link, not answered yet.
    serving: BTreeMap<LinkId, usize>,
}

/// The key a call is about (a renewal's first; each goes to its own home).
fn key_of(request: &StoreRequest) -> Option<&str> {
    match request {
        StoreRequest::Claim { key, .. } => Some(key),
        StoreRequest::RebindClaim { grant, .. } | StoreRequest::ReleaseClaim { grant } => {
            Some(&grant.key)
        }
        StoreRequest::RenewClaims { claims } => claims.first().map(|(g, _)| g.key.as_str()),
        _ => None,
    }
}

/// What the asking node hears when a call did not reach the home's store, or has no answer.
fn failed(request: StoreRequest, why: &str) -> Option<StoreReply> {
    match request {
        StoreRequest::Claim { token, .. } => Some(StoreReply::Claimed {
            token,
            result: Err(why.to_string()),
        }),
        StoreRequest::RenewClaims { claims } => Some(StoreReply::ClaimsRenewed {
            results: claims
                .into_iter()
                .map(|(g, _)| (g, Err(why.to_string())))
                .collect(),
        }),
        StoreRequest::RebindClaim { grant, .. } => Some(StoreReply::ClaimRebound {
            old: grant,
            result: Err(why.to_string()),
        }),
        _ => None,
    }
}

fn held_claim(grant: &ClaimGrant, ttl_ms: u64) -> mesh::HeldClaim {
    mesh::HeldClaim {
        key: grant.key.clone(),
        holder_entity: grant.holder.entity,
        token: grant.token,
        entity_epoch: grant.holder.entity_epoch,
        ttl_ms: ttl_ms.min(u64::from(u32::MAX)) as u32,
    }
}

fn grant_of(h: &mesh::HeldClaim) -> (ClaimGrant, u64) {
    (
        ClaimGrant {
            key: h.key.clone(),
            holder: ClaimHolder {
                entity: h.holder_entity,
                entity_epoch: h.entity_epoch,
            },
            token: h.token,
        },
        u64::from(h.ttl_ms),
    )
}

/// The call as it goes on the mesh.
fn encode(request: &StoreRequest) -> Option<claim_call::Op> {
    use claim_call::Op;
    Some(match request {
        StoreRequest::Claim {
            key,
            holder,
            ttl_ms,
            ..
        } => Op::Claim(mesh::ClaimAsk {
            key: key.clone(),
            holder_entity: holder.entity,
            entity_epoch: holder.entity_epoch,
            ttl_ms: (*ttl_ms).min(u64::from(u32::MAX)) as u32,
        }),
        StoreRequest::RenewClaims { claims } => Op::Renew(mesh::ClaimRenewals {
            claims: claims.iter().map(|(g, ttl)| held_claim(g, *ttl)).collect(),
        }),
        StoreRequest::RebindClaim {
            grant,
            entity_epoch,
            ttl_ms,
        } => Op::Rebind(mesh::ClaimRebind {
            grant: Some(held_claim(grant, *ttl_ms)),
            entity_epoch: *entity_epoch,
        }),
        StoreRequest::ReleaseClaim { grant } => Op::Release(held_claim(grant, 0)),
        _ => return None,
    })
}

/// The call a peer sent, as this node's store runs it; `None` when it names nothing.
fn decode(call: u64, op: claim_call::Op) -> Option<StoreRequest> {
    use claim_call::Op;
    Some(match op {
        Op::Claim(a) => StoreRequest::Claim {
            token: call,
            key: a.key,
            holder: ClaimHolder {
                entity: a.holder_entity,
                entity_epoch: a.entity_epoch,
            },
            ttl_ms: u64::from(a.ttl_ms),
        },
        Op::Renew(r) => StoreRequest::RenewClaims {
            claims: r.claims.iter().map(grant_of).collect(),
        },
        Op::Rebind(r) => {
            let (grant, ttl_ms) = grant_of(r.grant.as_ref()?);
            StoreRequest::RebindClaim {
                grant,
                entity_epoch: r.entity_epoch,
                ttl_ms,
            }
        }
        Op::Release(h) => StoreRequest::ReleaseClaim {
            grant: grant_of(&h).0,
        },
    })
}

fn result_error(e: String) -> mesh::ClaimCallResult {
    mesh::ClaimCallResult {
        error: e,
        ..Default::default()
    }
}

/// The store's answer, as it goes back on the mesh.
fn encode_answer(reply: StoreReply) -> Vec<mesh::ClaimCallResult> {
    let ok = |ok| mesh::ClaimCallResult {
        ok,
        ..Default::default()
    };
    match reply {
        StoreReply::Claimed { result, .. } => vec![match result {
            Ok(ClaimOutcome::Granted(g)) => mesh::ClaimCallResult {
                ok: true,
                token: g.token,
                ..Default::default()
            },
            Ok(ClaimOutcome::Held { by }) => mesh::ClaimCallResult {
                held_by_entity: by.entity,
                held_by_epoch: by.entity_epoch,
                ..Default::default()
            },
            Err(e) => result_error(e),
        }],
        StoreReply::ClaimsRenewed { results } => results
            .into_iter()
            .map(|(_, r)| r.map_or_else(result_error, ok))
            .collect(),
        StoreReply::ClaimRebound { result, .. } => {
            vec![result.map_or_else(result_error, |g| ok(g.is_some()))]
        }
        _ => Vec::new(),
    }
}

/// The home's answer to `request`, as the asking node's store would have given it.
fn decode_answer(request: StoreRequest, results: Vec<mesh::ClaimCallResult>) -> Option<StoreReply> {
    let missing = || result_error("the home's answer left this claim out".into());
    let mut results = results.into_iter();
    let mut next = move || results.next().unwrap_or_else(missing);
    let outcome = |r: mesh::ClaimCallResult| {
        if r.error.is_empty() {
            Ok(r)
        } else {
            Err(r.error)
        }
    };
    match request {
        StoreRequest::Claim {
            token, key, holder, ..
        } => Some(StoreReply::Claimed {
            token,
            result: outcome(next()).map(|r| {
                if r.ok {
                    ClaimOutcome::Granted(ClaimGrant {
                        key,
                        holder,
                        token: r.token,
                    })
                } else {
                    ClaimOutcome::Held {
                        by: ClaimHolder {
                            entity: r.held_by_entity,
                            entity_epoch: r.held_by_epoch,
                        },
                    }
                }
            }),
        }),
        StoreRequest::RenewClaims { claims } => Some(StoreReply::ClaimsRenewed {
            results: claims
                .into_iter()
                .map(|(g, _)| (g, outcome(next()).map(|r| r.ok)))
                .collect(),
        }),
        StoreRequest::RebindClaim {
            grant,
            entity_epoch,
            ..
        } => {
            let result = outcome(next()).map(|r| {
                r.ok.then(|| ClaimGrant {
                    holder: ClaimHolder {
                        entity_epoch,
                        ..grant.holder
                    },
                    ..grant.clone()
                })
            });
            Some(StoreReply::ClaimRebound { old: grant, result })
        }
        _ => None,
    }
}

impl ClaimHomes {
    pub(crate) fn new(config: &crate::config::SidecarConfig) -> Self {
        Self {
            geos: config.world_geos(),
            own: config.geo.clone(),
            asked: BTreeMap::new(),
            next_call: 0,
            serving: BTreeMap::new(),
        }
    }

    /// The home geo of `key`.
    pub(crate) fn home(&self, key: &str) -> &str {
        cellmesh_world::homes::home_geo(key, &self.geos).unwrap_or(&self.own)
    }

    fn is_home(&self, key: &str) -> bool {
        self.home(key) == self.own
    }

    /// Calls sent to other geos and not answered yet.
    #[cfg(test)]
    pub(crate) fn asked(&self) -> usize {
        self.asked.len()
    }

    /// Sends `request` to the store of its key's home: this geo's, or a node's of the home geo
    /// over the mesh. What the node hears at once when no node of the home geo can be reached.
    pub(crate) fn route(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        request: StoreRequest,
    ) -> Vec<StoreReply> {
        // A renewal's claims may have several homes: one call per home.
        if let StoreRequest::RenewClaims { claims } = request {
            let mut by_home: BTreeMap<String, Vec<(ClaimGrant, u64)>> = BTreeMap::new();
            for (g, ttl) in claims {
                by_home
                    .entry(self.home(&g.key).to_string())
                    .or_default()
                    .push((g, ttl));
            }
            return by_home
                .into_iter()
                .flat_map(|(home, claims)| {
                    self.route_one(cx, mesh, &home, StoreRequest::RenewClaims { claims })
                })
                .collect();
        }
        let Some(home) = key_of(&request).map(|k| self.home(k).to_string()) else {
            return Vec::new();
        };
        self.route_one(cx, mesh, &home, request)
            .into_iter()
            .collect()
    }

    fn route_one(
        &mut self,
        cx: &mut Context,
        mesh: &Mesh,
        home: &str,
        request: StoreRequest,
    ) -> Option<StoreReply> {
        if home == self.own {
            cx.store(request);
            return None;
        }
        let key = key_of(&request).unwrap_or_default();
        let Some(node) = mesh.linked_peer_in_geo(home, key) else {
            cx.metrics.claim_home_call("home_unreachable");
            return failed(request, &format!("refused: home geo {home} unreachable"));
        };
        let op = encode(&request)?;
        self.next_call += 1;
        let call = self.next_call;
        cx.metrics.claim_home_call("asked");
        mesh.try_send(
            cx,
            node,
            mesh_message::Body::ClaimCall(mesh::ClaimCall { call, op: Some(op) }),
        );
        if !matches!(request, StoreRequest::ReleaseClaim { .. }) {
            self.asked.insert(call, (node, request));
        }
        None
    }

    /// A node of another geo's call, on `link`: run on this geo's store if its keys are homed
    /// here.
    pub(crate) fn on_call(&mut self, cx: &mut Context, link: LinkId, c: mesh::ClaimCall) {
        let Some(request) = c.op.and_then(|op| decode(c.call, op)) else {
            cx.metrics.error("bad_claim_call");
            return;
        };
        let answer = |cx: &mut Context, results| {
            cx.queue_for_link(
                link,
                mesh_message::Body::ClaimAnswer(mesh::ClaimAnswer {
                    call: c.call,
                    results,
                }),
            )
        };
        let not_home = match &request {
            StoreRequest::RenewClaims { claims } => {
                claims.iter().any(|(g, _)| !self.is_home(&g.key))
            }
            other => key_of(other).is_some_and(|k| !self.is_home(k)),
        };
        let release = matches!(request, StoreRequest::ReleaseClaim { .. });
        if not_home {
            cx.metrics.claim_home_call("not_home");
            if !release {
                let why = format!("refused: geo {} is not the home of this key", self.own);
                answer(
                    cx,
                    encode_answer(failed(request, &why).expect("a call with an answer")),
                );
            }
            return;
        }
        if release {
            cx.metrics.claim_home_call("served");
            return cx.store(request);
        }
        let serving = self.serving.entry(link).or_default();
        if *serving >= MAX_SERVED_PER_LINK {
            cx.metrics.claim_home_call("busy");
            let why = format!("refused: {MAX_SERVED_PER_LINK} calls of this node under way here");
            return answer(
                cx,
                encode_answer(failed(request, &why).expect("a call with an answer")),
            );
        }
        *serving += 1;
        cx.metrics.claim_home_call("served");
        cx.store(StoreRequest::ClaimForPeer {
            link,
            call: c.call,
            request: Box::new(request),
        });
    }

    /// This geo's store answered a call run for a peer: the answer goes back on its link, if
    /// that link is still up.
    pub(crate) fn on_served(
        &mut self,
        cx: &mut Context,
        link: LinkId,
        call: u64,
        reply: StoreReply,
    ) {
        let Some(serving) = self.serving.get_mut(&link) else {
            return;
        };
        *serving = serving.saturating_sub(1);
        cx.queue_for_link(
            link,
            mesh_message::Body::ClaimAnswer(mesh::ClaimAnswer {
                call,
                results: encode_answer(reply),
            }),
        );
    }

    /// The home's answer to a call of this node's, from `node`.
    pub(crate) fn on_answer(&mut self, node: NodeId, a: mesh::ClaimAnswer) -> Option<StoreReply> {
        if self.asked.get(&a.call).is_none_or(|(n, _)| *n != node) {
            return None;
        }
        let (_, request) = self.asked.remove(&a.call)?;
        decode_answer(request, a.results)
    }

    /// The link to `node` (on `link`) is gone: the calls it was asked fail, and those it asked
    /// of this node are not answered.
    pub(crate) fn peer_down(&mut self, node: NodeId, link: LinkId) -> Vec<StoreReply> {
        self.serving.remove(&link);
        let calls: Vec<u64> = self
            .asked
            .iter()
            .filter(|(_, (n, _))| *n == node)
            .map(|(c, _)| *c)
            .collect();
        calls
            .into_iter()
            .filter_map(|c| self.asked.remove(&c))
            .filter_map(|(_, request)| {
                failed(
                    request,
                    &format!("refused: home unreachable (the link to node {node} dropped)"),
                )
            })
            .collect()
    }
}
