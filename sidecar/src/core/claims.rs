//! Exclusive claims: a game's `Claim{key, holder_entity}` for one of its entities, granted by the
//! geo's claim store (one holder per key, cluster-wide, with a lease and a fencing token), kept
//! alive by this node's renewals while the holder lives here, carried with the holder through a
//! handoff (the new owner rebinds it under the holder's new epoch, which fences the old owner
//! out), and freed when the holder despawns or the game releases it.
//!
//! The bookkeeping is pure ([`crate::model::claims`]); this file turns the game's messages and
//! the store's answers into store calls and messages to the game.

use cellmesh_proto::local::{sidecar_message, ClaimOutcome as Outcome};
use cellmesh_stores::claims::ClaimTable;

use cellmesh_proto::local;
use cellmesh_proto::mesh;
use cellmesh_stores::claims::{ClaimGrant, ClaimHolder, ClaimOutcome};

use super::context::Context;
use super::{ConnId, StoreReply, StoreRequest};
use crate::model::claims::{Claims as ClaimBook, Pending, Renewed};
use crate::model::entities::EntityTable;
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
            | StoreRequest::ClaimForPeer { .. }
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
        StoreRequest::ClaimForPeer {
            link,
            call,
            request,
        } => claim_call_on_table(table, now_ms, *request, reachable).map(|reply| {
            StoreReply::ClaimForPeer {
                link,
                call,
                reply: Box::new(reply),
            }
        }),
        _ => None,
    }
}

/// Frees `grant` in the store (no answer: its lease lapses anyway).
pub(crate) fn free_claim(cx: &mut Context, grant: ClaimGrant) {
    cx.metrics.claims_released.inc();
    cx.claim_call(StoreRequest::ReleaseClaim { grant });
}

/// What the game's `ClaimRelease` comes to.
pub(crate) enum Release {
    /// Nothing to do.
    Nothing,
    /// A mistake of the game's, told to it.
    Refused { detail: String, entity: u64 },
    /// Freed, once the game may still write `guard` (a holder past its snapshot is the
    /// handoff's: its claims go with it, and a release from here would free them under the next
    /// owner).
    Free {
        key: String,
        holder: Option<u64>,
        guard: Option<u64>,
    },
}

/// The claims this node holds and asked for. Its handlers are told what they need of the rest
/// of the node: the game's connection (`game`, if one is connected) and, for a holder, whether
/// it is still the claim's.
#[derive(Default)]
pub(crate) struct Claims {
    book: ClaimBook,
}

impl Claims {
    /// The bookkeeping, for the spawn points' claims (ordinary claims, asked by the node).
    pub(crate) fn book_mut(&mut self) -> &mut ClaimBook {
        &mut self.book
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.book.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn get(&self, key: &str) -> Option<&crate::model::claims::Held> {
        self.book.get(key)
    }

    fn count(&self, cx: &mut Context) {
        cx.metrics.claims_held.set(self.book.len() as i64);
    }

    // ------------------------------------------------------------------ from the game

    /// The game's `Claim`; `holder_of` says whether an entity may hold a claim, and as what.
    pub(crate) fn on_claim(
        &mut self,
        cx: &mut Context,
        c: local::Claim,
        game: Option<ConnId>,
        holder_of: impl FnOnce(u64) -> Result<ClaimHolder, String>,
    ) {
        let ttl_ms = match u64::from(c.ttl_ms) {
            0 => cx.config.claim_ttl_ms,
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
        } else if self.book.pending_count() >= MAX_PENDING_CLAIMS {
            fail(format!(
                "{MAX_PENDING_CLAIMS} claims wait for the store already"
            ))
        } else {
            holder_of(c.holder_entity)
        };
        let holder = match checked {
            Ok(h) => h,
            Err(detail) => {
                cx.metrics.claim("failed");
                return claim_result(
                    cx,
                    local::ClaimResult {
                        request_id: c.request_id,
                        key: c.key,
                        outcome: Outcome::ClaimFailed as i32,
                        holder_entity: c.holder_entity,
                        detail,
                        ..Default::default()
                    },
                );
            }
        };
        let token = self.book.ask(Pending {
            key: c.key.clone(),
            holder,
            ttl_ms,
            request_id: c.request_id,
            conn: game.unwrap_or(0),
            sent_at: cx.now.mono_ms,
            released: false,
            spawner: false,
        });
        cx.claim_call(StoreRequest::Claim {
            token,
            key: c.key,
            holder,
            ttl_ms,
        });
    }

    /// The game's `ClaimRelease`: what it comes to.
    pub(crate) fn on_release(&self, cx: &Context, r: &local::ClaimRelease) -> Release {
        let holder = (r.holder_entity != 0).then_some(r.holder_entity);
        tracing::debug!(key = %r.key, holder = r.holder_entity, "claim released by the game");
        let spawner = r.key.starts_with(spawners::CLAIM_PREFIX);
        if spawner || !self.book.knows(&r.key, holder) {
            if !spawner && self.book.lost_lately(&r.key, holder, cx.now.mono_ms) {
                // Sent before the game read our ClaimLost: nothing left to free.
                return Release::Nothing;
            }
            return Release::Refused {
                detail: format!(
                    "ClaimRelease of {:?}: no entity here holds or asked for it{}",
                    r.key,
                    holder.map_or(String::new(), |h| format!(" as entity {h}"))
                ),
                entity: r.holder_entity,
            };
        }
        let guard = self
            .book
            .get(&r.key)
            .map(|h| h.grant.holder.entity)
            .filter(|h| holder.is_none_or(|id| id == *h));
        Release::Free {
            key: r.key.clone(),
            holder,
            guard,
        }
    }

    /// Frees what a `ClaimRelease` named.
    pub(crate) fn free(&mut self, cx: &mut Context, key: &str, holder: Option<u64>) {
        if let Some(h) = self.book.release(key, holder) {
            free_claim(cx, h.grant);
            self.count(cx);
        }
    }

    fn claim_lost(
        &mut self,
        cx: &mut Context,
        game: Option<ConnId>,
        lost: (String, u64),
        reason: &'static str,
        detail: &str,
    ) {
        let (key, holder) = lost;
        tracing::debug!(%key, holder, reason, "claim lost");
        cx.metrics.claim_lost(reason);
        self.book.told_lost(&key, holder, cx.now.mono_ms);
        if game.is_some() {
            cx.out.to_game.push(
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

    /// The claim a `Claim`'s answer is for, if still asked.
    pub(crate) fn answered(&mut self, token: u64) -> Option<Pending> {
        self.book.answered(token)
    }

    /// The store's answer to a game's `Claim`; `still_held` whether its holder is still the
    /// one asked for, under the epoch asked with, and not frozen for a handoff.
    pub(crate) fn on_claimed(
        &mut self,
        cx: &mut Context,
        p: Pending,
        result: Result<ClaimOutcome, String>,
        game: Option<ConnId>,
        still_held: bool,
    ) {
        let conn = game.unwrap_or(0);
        let mut r = local::ClaimResult {
            request_id: p.request_id,
            key: p.key.clone(),
            holder_entity: p.holder.entity,
            ..Default::default()
        };
        match result {
            Ok(ClaimOutcome::Granted(grant)) => {
                // Not once a Freeze of the holder went out, even before its snapshot: the game
                // hears of this grant after the Freeze, so it called off what the claim was for,
                // and would release it after the handoff carried it to the next owner.
                if p.released || !still_held || conn != p.conn {
                    free_claim(cx, grant);
                    cx.metrics.claim("failed");
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
                    cx.metrics.claim("granted");
                    r.outcome = Outcome::ClaimGranted as i32;
                    r.token = grant.token;
                    self.book.granted(grant, p.ttl_ms, p.sent_at);
                    self.count(cx);
                }
            }
            Ok(ClaimOutcome::Held { by }) => {
                cx.metrics.claim("held");
                r.outcome = Outcome::ClaimHeld as i32;
                r.held_by = by.entity;
            }
            Err(e) => {
                cx.metrics.claim("failed");
                r.outcome = Outcome::ClaimFailed as i32;
                r.detail = format!("the claim store did not answer: {e}");
            }
        }
        if conn == p.conn {
            claim_result(cx, r);
        }
    }

    /// The store's answers to renewals; `frozen` says whether a holder is frozen for a handoff.
    pub(crate) fn on_renewed(
        &mut self,
        cx: &mut Context,
        results: Vec<(ClaimGrant, Result<bool, String>)>,
        game: Option<ConnId>,
        frozen: impl Fn(u64) -> bool,
    ) {
        for (grant, result) in results {
            let id = grant.holder.entity;
            match self
                .book
                .renewed(&grant, result.map_err(|_| ()), frozen(id))
            {
                Renewed::Kept | Renewed::Fenced => {}
                Renewed::Lost => self.claim_lost(
                    cx,
                    game,
                    (grant.key, id),
                    "fenced",
                    "the store holds the claim for another grant (its lease lapsed)",
                ),
            }
        }
        self.count(cx);
    }

    /// The store's answer to the rebind of a claim carried in by a handoff.
    pub(crate) fn on_rebound(
        &mut self,
        cx: &mut Context,
        old: ClaimGrant,
        result: Result<Option<ClaimGrant>, String>,
        game: Option<ConnId>,
    ) {
        let ok = matches!(result, Ok(Some(_)));
        if self.book.get(&old.key).is_none_or(|h| h.grant != old) {
            // Released (or its holder gone) while the rebind was on its way: free what it bound.
            if let Ok(Some(g)) = result {
                free_claim(cx, g);
            }
            return;
        }
        if self.book.rebound(&old, result.map_err(|_| ())) {
            self.claim_lost(
                cx,
                game,
                (old.key, old.holder.entity),
                "lapsed_in_handoff",
                "the claim lapsed while its holder was handed over",
            );
        } else if ok {
            cx.metrics.claims_rebound.inc();
        }
        self.count(cx);
    }

    // ------------------------------------------------------------------ entities

    /// The claims `ids` hold, for an offer of them.
    pub(crate) fn of(&self, ids: impl IntoIterator<Item = u64>) -> Vec<mesh::HeldClaim> {
        ids.into_iter()
            .flat_map(|id| self.book.of(id))
            .filter_map(|k| self.book.get(&k))
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
    /// the store agrees (the caller steps the claims when any came in).
    pub(crate) fn adopted(&mut self, cx: &Context, claims: &[mesh::HeldClaim]) {
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
            self.book.carried_in(grant, ttl, cx.now.mono_ms);
        }
    }

    /// `id` was handed away: its claims went with it.
    pub(crate) fn handed_away(&mut self, cx: &mut Context, id: u64) {
        let gone = self.book.drop_holder(id);
        for h in &gone {
            tracing::debug!(key = %h.grant.key, holder = id, "claim handed away");
        }
        if !gone.is_empty() {
            self.count(cx);
        }
    }

    /// `id`'s handoff came back: claims the store gave its target meanwhile are lost.
    pub(crate) fn thawed(&mut self, cx: &mut Context, id: u64, game: Option<ConnId>) {
        for h in self.book.thawed(id) {
            self.claim_lost(
                cx,
                game,
                (h.grant.key, id),
                "fenced",
                "the claim was rebound by the handoff's target",
            );
        }
        self.count(cx);
    }

    /// `id` despawned: its claims are freed.
    pub(crate) fn holder_gone(&mut self, cx: &mut Context, id: u64) {
        self.book.abandon_asked(id);
        for h in self.book.drop_holder(id) {
            tracing::debug!(key = %h.grant.key, holder = id, "claim freed: its holder is gone");
            free_claim(cx, h.grant);
        }
        self.count(cx);
    }

    /// The game went away: what it claimed is freed. Its entities may wait for its return, but
    /// the game that comes back knows nothing of these claims and would never release them.
    /// The spawn points' claims are the spawners' to give up.
    pub(crate) fn game_gone(&mut self, cx: &mut Context) {
        for h in self
            .book
            .forget_games(|k| k.starts_with(spawners::CLAIM_PREFIX))
        {
            free_claim(cx, h.grant);
        }
        self.count(cx);
    }

    /// Renewals and rebinds due, lapsed leases, and holders that left `table`; `awaited` says
    /// whether an id is a stock handed to the game and not spawned yet.
    pub(crate) fn step(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        game: Option<ConnId>,
        awaited: impl Fn(u64) -> bool,
    ) {
        if self.book.is_empty() {
            return;
        }
        // A holder gone from the table without a despawn this node saw (dropped with its game).
        let gone: Vec<u64> = self
            .book
            .held()
            .filter(|h| h.rebinding.is_none())
            .map(|h| h.grant.holder.entity)
            // A stock handed to the game and not spawned yet holds its claim meanwhile.
            .filter(|id| !awaited(*id))
            .filter(|id| table.get_local(*id).is_none_or(|e| e.origin().is_some()))
            .collect();
        for id in gone {
            self.holder_gone(cx, id);
        }
        let due = self.book.due(cx.now.mono_ms);
        for h in due.lapsed {
            self.claim_lost(
                cx,
                game,
                (h.grant.key, h.grant.holder.entity),
                "lapsed",
                "the lease lapsed: no renewal reached the store in time",
            );
        }
        if !due.renew.is_empty() {
            cx.claim_call(StoreRequest::RenewClaims { claims: due.renew });
        }
        for (grant, ttl_ms) in due.rebind {
            let entity_epoch = table
                .get_local(grant.holder.entity)
                .map_or(grant.holder.entity_epoch, |e| e.epoch);
            cx.claim_call(StoreRequest::RebindClaim {
                grant,
                entity_epoch,
                ttl_ms,
            });
        }
        self.count(cx);
    }

    /// The claims this node believes held at `mono_ms` (its own clock): (key, holder entity,
    /// the node's end of the lease).
    pub(crate) fn believed(&self, mono_ms: u64) -> Vec<(String, u64, u64)> {
        self.book
            .held()
            .filter(|h| !h.fenced && h.lease_until > mono_ms)
            .map(|h| (h.grant.key.clone(), h.grant.holder.entity, h.lease_until))
            .collect()
    }
}

fn claim_result(cx: &mut Context, r: local::ClaimResult) {
    cx.out
        .to_game
        .push(sidecar_message::Body::ClaimResult(r).into());
}
