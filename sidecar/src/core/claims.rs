//! Exclusive claims: a game's `Claim{key, holder_entity}` for one of its entities, granted by the
//! geo's claim store (one holder per key, cluster-wide, with a lease and a fencing token), kept
//! alive by this node's renewals while the holder lives here, carried with the holder through a
//! handoff (the new owner rebinds it under the holder's new epoch, which fences the old owner
//! out), and freed when the holder despawns or the game releases it.
//!
//! The bookkeeping is pure ([`crate::model::claims`]); this file turns the game's messages and
//! the store's answers into store calls and messages to the game.

use cellmesh_proto::local::{sidecar_message, ClaimOutcome as Outcome, ErrorCode};
use cellmesh_stores::claims::ClaimTable;

use super::*;
use crate::model::claims::{Pending, Renewed};
use crate::model::spawners;

/// The shortest and longest lease a game may ask for.
pub const MIN_CLAIM_TTL_MS: u64 = 1_000;
pub const MAX_CLAIM_TTL_MS: u64 = 600_000;
/// Claims asked for and not answered, at most (a flood is refused, not queued).
const MAX_PENDING_CLAIMS: usize = 10_000;

/// Whether `request` is a call to the claim store.
pub fn is_claim_call(request: &StoreRequest) -> bool {
    matches!(
        request,
        StoreRequest::Claim { .. }
            | StoreRequest::RenewClaims { .. }
            | StoreRequest::RebindClaim { .. }
            | StoreRequest::ReleaseClaim { .. }
    )
}

/// Runs a claim call on an in-memory claim table at `now_ms`, as the driver runs it on the geo's
/// store: for a simulated cluster or a test. `reachable` false: every call fails as a timeout
/// and changes nothing. Any other request does nothing here.
pub fn claim_call_on_table(
    table: &mut ClaimTable,
    now_ms: u64,
    request: StoreRequest,
    reachable: bool,
) -> Option<StoreReply> {
    let ttl = std::time::Duration::from_millis;
    fn run<T>(r: Result<T, cellmesh_stores::StoreError>) -> Result<T, String> {
        r.map_err(|e| e.to_string())
    }
    fn down<T>() -> Result<T, String> {
        Err("no answer within 5 s".to_string())
    }
    match request {
        StoreRequest::Claim {
            token,
            key,
            holder,
            ttl_ms,
        } => Some(StoreReply::Claimed {
            token,
            result: if reachable {
                run(table.claim(now_ms, &key, holder, ttl(ttl_ms)))
            } else {
                down()
            },
        }),
        StoreRequest::RenewClaims { claims } => Some(StoreReply::ClaimsRenewed {
            results: claims
                .into_iter()
                .map(|(g, ttl_ms)| {
                    let r = if reachable {
                        run(table.renew(now_ms, &g, ttl(ttl_ms)))
                    } else {
                        down()
                    };
                    (g, r)
                })
                .collect(),
        }),
        StoreRequest::RebindClaim {
            grant,
            entity_epoch,
            ttl_ms,
        } => {
            let result = if reachable {
                run(table.rebind_renewed(now_ms, &grant, entity_epoch, ttl(ttl_ms)))
            } else {
                down()
            };
            Some(StoreReply::ClaimRebound { old: grant, result })
        }
        StoreRequest::ReleaseClaim { grant } => {
            if reachable {
                let _ = table.release(now_ms, &grant);
            }
            None
        }
        _ => None,
    }
}

/// Frees `grant` in the store (no answer: its lease lapses anyway).
pub(crate) fn free_claim(cx: &mut Context, grant: ClaimGrant) {
    cx.metrics.claims_released.inc();
    cx.emit(Output::Store(StoreRequest::ReleaseClaim { grant }));
}

impl Core {
    // ------------------------------------------------------------------ from the game

    /// The game's `Claim`.
    pub(crate) fn on_claim(&mut self, c: local::Claim) {
        let ttl_ms = match u64::from(c.ttl_ms) {
            0 => self.cx.config.claim_ttl_ms,
            t => t,
        };
        let fail = |detail: String| Err(detail);
        let checked = if let Err(e) = cellmesh_stores::claims::check_key(&c.key) {
            fail(e.to_string())
        } else if !(MIN_CLAIM_TTL_MS..=MAX_CLAIM_TTL_MS).contains(&ttl_ms) {
            fail(format!(
                "ttl_ms {ttl_ms}: a claim's lease is {MIN_CLAIM_TTL_MS} to {MAX_CLAIM_TTL_MS} ms"
            ))
        } else if c.key.starts_with(spawners::CLAIM_PREFIX) {
            fail(format!(
                "key {:?}: keys starting {:?} are the spawn points' (see DeclareSpawners)",
                c.key,
                spawners::CLAIM_PREFIX
            ))
        } else if self.claims.pending_count() >= MAX_PENDING_CLAIMS {
            fail(format!(
                "{MAX_PENDING_CLAIMS} claims wait for the store already"
            ))
        } else {
            self.claim_holder(c.holder_entity)
        };
        let holder = match checked {
            Ok(h) => h,
            Err(detail) => {
                self.cx.metrics.claim("failed");
                return self.claim_result(local::ClaimResult {
                    request_id: c.request_id,
                    key: c.key,
                    outcome: Outcome::ClaimFailed as i32,
                    holder_entity: c.holder_entity,
                    detail,
                    ..Default::default()
                });
            }
        };
        let conn = self.game.slot.as_ref().map_or(0, |g| g.conn);
        let token = self.claims.ask(Pending {
            key: c.key.clone(),
            holder,
            ttl_ms,
            request_id: c.request_id,
            conn,
            sent_at: self.cx.now.mono_ms,
            released: false,
            spawner: false,
        });
        self.cx.emit(Output::Store(StoreRequest::Claim {
            token,
            key: c.key,
            holder,
            ttl_ms,
        }));
    }

    /// The holder a claim may name: an entity this node writes, not frozen for a handoff.
    fn claim_holder(&self, id: u64) -> Result<ClaimHolder, String> {
        let Some(e) = self.table.get_local(id).filter(|e| e.origin.is_none()) else {
            return Err(format!(
                "entity {id} is not written here: only the node writing an entity claims for it"
            ));
        };
        if !self.handoff.outgoing.writable(id) || self.handoff.released_by.contains_key(&id) {
            return Err(format!(
                "entity {id} is frozen for a handoff: claim again once it is written"
            ));
        }
        if !self.authority.lease_live {
            return Err("this node's lease lapsed or was lost".into());
        }
        Ok(ClaimHolder {
            entity: id,
            entity_epoch: e.epoch,
        })
    }

    /// The game's `ClaimRelease`.
    pub(crate) fn on_claim_release(&mut self, r: local::ClaimRelease) {
        let holder = (r.holder_entity != 0).then_some(r.holder_entity);
        tracing::debug!(key = %r.key, holder = r.holder_entity, "claim released by the game");
        let spawner = r.key.starts_with(spawners::CLAIM_PREFIX);
        if spawner || !self.claims.knows(&r.key, holder) {
            if !spawner && self.claims.lost_lately(&r.key, holder, self.cx.now.mono_ms) {
                // Sent before the game read our ClaimLost: nothing left to free.
                return;
            }
            return self.game_error(
                ErrorCode::InvalidValue,
                format!(
                    "ClaimRelease of {:?}: no entity here holds or asked for it{}",
                    r.key,
                    holder.map_or(String::new(), |h| format!(" as entity {h}"))
                ),
                r.holder_entity,
            );
        }
        // A holder past its snapshot is the handoff's: its claims go with it to the next owner,
        // and a release from here would free the claim under that owner.
        if let Some(h) = self.claims.get(&r.key).map(|h| h.grant.holder.entity) {
            if holder.is_none_or(|id| id == h) && !self.may_write(h) {
                return;
            }
        }
        if let Some(h) = self.claims.release(&r.key, holder) {
            self.free_claim(h.grant);
            self.cx.metrics.claims_held.set(self.claims.len() as i64);
        }
    }

    pub(crate) fn free_claim(&mut self, grant: ClaimGrant) {
        free_claim(&mut self.cx, grant);
    }

    fn claim_result(&mut self, r: local::ClaimResult) {
        self.cx
            .out
            .to_game
            .push(sidecar_message::Body::ClaimResult(r).into());
    }

    fn claim_lost(&mut self, key: String, holder: u64, reason: &'static str, detail: &str) {
        tracing::debug!(%key, holder, reason, "claim lost");
        self.cx.metrics.claim_lost(reason);
        self.claims.told_lost(&key, holder, self.cx.now.mono_ms);
        if self.game.slot.is_some() {
            self.cx.out.to_game.push(
                sidecar_message::Body::ClaimLost(local::ClaimLost {
                    key,
                    holder_entity: holder,
                    reason: detail.to_string(),
                })
                .into(),
            );
        }
    }

    // ------------------------------------------------------------------ from the store

    /// The store's answer to a `Claim`.
    pub(crate) fn on_claimed(&mut self, token: u64, result: Result<ClaimOutcome, String>) {
        let Some(p) = self.claims.answered(token) else {
            return;
        };
        tracing::debug!(key = %p.key, holder = p.holder.entity, released = p.released, ?result, "claim answered");
        if p.spawner {
            let game = self.game.slot.as_ref().map(|g| g.conn);
            let lease_live = self.authority.lease_live;
            return self.spawners.on_claimed(
                &mut self.cx,
                &mut self.claims,
                game,
                lease_live,
                p,
                result,
            );
        }
        let conn = self.game.slot.as_ref().map_or(0, |g| g.conn);
        let mut r = local::ClaimResult {
            request_id: p.request_id,
            key: p.key.clone(),
            holder_entity: p.holder.entity,
            ..Default::default()
        };
        match result {
            Ok(ClaimOutcome::Granted(grant)) => {
                // Still the holder's, under the epoch asked with, and wanted by the game that asked?
                // Not once a Freeze of the holder went out, even before its snapshot: the game
                // hears of this grant after the Freeze, so it called off what the claim was for,
                // and would release it after the handoff carried it to the next owner.
                let same = !self.handoff.outgoing.is_frozen(p.holder.entity)
                    && self
                        .claim_holder(p.holder.entity)
                        .is_ok_and(|h| h == p.holder);
                if p.released || !same || conn != p.conn {
                    self.free_claim(grant);
                    self.cx.metrics.claim("failed");
                    r.outcome = Outcome::ClaimFailed as i32;
                    r.detail = if p.released {
                        "released before it was granted".into()
                    } else {
                        format!(
                            "entity {} moved on (handed off, frozen or despawned) before the grant",
                            p.holder.entity
                        )
                    };
                } else {
                    self.cx.metrics.claim("granted");
                    r.outcome = Outcome::ClaimGranted as i32;
                    r.token = grant.token;
                    self.claims.granted(grant, p.ttl_ms, p.sent_at);
                    self.cx.metrics.claims_held.set(self.claims.len() as i64);
                }
            }
            Ok(ClaimOutcome::Held { by }) => {
                self.cx.metrics.claim("held");
                r.outcome = Outcome::ClaimHeld as i32;
                r.held_by = by.entity;
            }
            Err(e) => {
                self.cx.metrics.claim("failed");
                r.outcome = Outcome::ClaimFailed as i32;
                r.detail = format!("the claim store did not answer: {e}");
            }
        }
        if conn == p.conn {
            self.claim_result(r);
        }
    }

    /// The store's answers to renewals.
    pub(crate) fn on_claims_renewed(&mut self, results: Vec<(ClaimGrant, Result<bool, String>)>) {
        for (grant, result) in results {
            let id = grant.holder.entity;
            let frozen =
                !self.handoff.outgoing.writable(id) || self.handoff.released_by.contains_key(&id);
            match self.claims.renewed(&grant, result.map_err(|_| ()), frozen) {
                Renewed::Kept | Renewed::Fenced => {}
                Renewed::Lost => self.claim_lost(
                    grant.key,
                    id,
                    "fenced",
                    "the store holds the claim for another grant (its lease lapsed)",
                ),
            }
        }
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    /// The store's answer to the rebind of a claim carried in by a handoff.
    pub(crate) fn on_claim_rebound(
        &mut self,
        old: ClaimGrant,
        result: Result<Option<ClaimGrant>, String>,
    ) {
        let ok = matches!(result, Ok(Some(_)));
        if self.claims.get(&old.key).is_none_or(|h| h.grant != old) {
            // Released (or its holder gone) while the rebind was on its way: free what it bound.
            if let Ok(Some(g)) = result {
                self.free_claim(g);
            }
            return;
        }
        if self.claims.rebound(&old, result.map_err(|_| ())) {
            self.claim_lost(
                old.key,
                old.holder.entity,
                "lapsed_in_handoff",
                "the claim lapsed while its holder was handed over",
            );
        } else if ok {
            self.cx.metrics.claims_rebound.inc();
        }
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    // ------------------------------------------------------------------ entities

    /// The claims `ids` hold, for an offer of them.
    pub(crate) fn claims_of(&self, ids: impl IntoIterator<Item = u64>) -> Vec<mesh::HeldClaim> {
        ids.into_iter()
            .flat_map(|id| self.claims.of(id))
            .filter_map(|k| self.claims.get(&k))
            .map(|h| mesh::HeldClaim {
                key: h.grant.key.clone(),
                holder_entity: h.grant.holder.entity,
                token: h.grant.token,
                entity_epoch: h.grant.holder.entity_epoch,
                ttl_ms: h.ttl_ms as u32,
            })
            .collect()
    }

    /// An offer was adopted here: its claims are the holder's still, under the new epoch once
    /// the store agrees.
    pub(crate) fn claims_adopted(&mut self, claims: &[mesh::HeldClaim]) {
        for c in claims {
            tracing::debug!(key = %c.key, holder = c.holder_entity, "claim carried in");
            let grant = ClaimGrant {
                key: c.key.clone(),
                holder: ClaimHolder {
                    entity: c.holder_entity,
                    entity_epoch: c.entity_epoch,
                },
                token: c.token,
            };
            let ttl = u64::from(c.ttl_ms).clamp(MIN_CLAIM_TTL_MS, MAX_CLAIM_TTL_MS);
            self.claims.carried_in(grant, ttl, self.cx.now.mono_ms);
        }
        if !claims.is_empty() {
            self.claims_step();
        }
    }

    /// `id` was handed away: its claims went with it.
    pub(crate) fn claims_handed_away(&mut self, id: u64) {
        let gone = self.claims.drop_holder(id);
        for h in &gone {
            tracing::debug!(key = %h.grant.key, holder = id, "claim handed away");
        }
        if !gone.is_empty() {
            self.cx.metrics.claims_held.set(self.claims.len() as i64);
        }
    }

    /// `id`'s handoff came back: claims the store gave its target meanwhile are lost.
    pub(crate) fn claims_thawed(&mut self, id: u64) {
        for h in self.claims.thawed(id) {
            self.claim_lost(
                h.grant.key,
                id,
                "fenced",
                "the claim was rebound by the handoff's target",
            );
        }
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    /// `id` despawned: its claims are freed.
    pub(crate) fn claims_holder_gone(&mut self, id: u64) {
        self.claims.abandon_asked(id);
        for h in self.claims.drop_holder(id) {
            tracing::debug!(key = %h.grant.key, holder = id, "claim freed: its holder is gone");
            self.free_claim(h.grant);
        }
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    /// The game went away: what it claimed is freed. Its entities may wait for its return, but
    /// the game that comes back knows nothing of these claims and would never release them.
    pub(crate) fn claims_game_gone(&mut self) {
        for h in self
            .claims
            .forget_games(|k| k.starts_with(spawners::CLAIM_PREFIX))
        {
            self.free_claim(h.grant);
        }
        self.spawners.game_gone(&mut self.cx, &mut self.claims);
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    /// Renewals and rebinds due, lapsed leases, and holders that left the table.
    pub(crate) fn claims_step(&mut self) {
        if self.claims.is_empty() {
            return;
        }
        // A holder gone from the table without a despawn this node saw (dropped with its game).
        let gone: Vec<u64> = self
            .claims
            .held()
            .filter(|h| h.rebinding.is_none())
            .map(|h| h.grant.holder.entity)
            // A stock handed to the game and not spawned yet holds its claim meanwhile.
            .filter(|id| !self.spawners.is_awaited(*id))
            .filter(|id| self.table.get_local(*id).is_none_or(|e| e.origin.is_some()))
            .collect();
        for id in gone {
            self.claims_holder_gone(id);
        }
        let due = self.claims.due(self.cx.now.mono_ms);
        for h in due.lapsed {
            self.claim_lost(
                h.grant.key,
                h.grant.holder.entity,
                "lapsed",
                "the lease lapsed: no renewal reached the store in time",
            );
        }
        if !due.renew.is_empty() {
            self.cx.emit(Output::Store(StoreRequest::RenewClaims {
                claims: due.renew,
            }));
        }
        for (grant, ttl_ms) in due.rebind {
            let entity_epoch = self
                .table
                .get_local(grant.holder.entity)
                .map_or(grant.holder.entity_epoch, |e| e.epoch);
            self.cx.emit(Output::Store(StoreRequest::RebindClaim {
                grant,
                entity_epoch,
                ttl_ms,
            }));
        }
        self.cx.metrics.claims_held.set(self.claims.len() as i64);
    }

    /// The claims this node believes held at `mono_ms` (its own clock): (key, holder entity,
    /// the node's end of the lease). For the cluster simulator's check that no key has two
    /// holders.
    pub fn claims_believed(&self, mono_ms: u64) -> Vec<(String, u64, u64)> {
        self.claims
            .held()
            .filter(|h| !h.fenced && h.lease_until > mono_ms)
            .map(|h| (h.grant.key.clone(), h.grant.holder.entity, h.lease_until))
            .collect()
    }
}
