//! Region-owned spawners: the game declares its static spawn points once (`DeclareSpawners`);
//! the node owning a point's chunk asks the geo's claim store for `spawner:<key>` on behalf of
//! the point's next stock, an id derived from (key, generation), and hands the stock to its game
//! (`SpawnerOwned`) once granted. The claim is the stock's from then on, an ordinary claim: it
//! follows the stock through handoffs and restores and is freed when the stock despawns, and
//! only then can the owner of the point be granted the next generation. A re-plan moves the
//! asking with the chunk (`SpawnerReleased` to the node that gave it up).
//!
//! The bookkeeping is pure ([`crate::model::spawners`]); this file turns it into claims and
//! messages to the game.

use cellmesh_proto::local::sidecar_message;
use cellmesh_world::geometry::Pos;
use cellmesh_world::spawners::{is_spawned_id, SpawnPoint};

use cellmesh_proto::local;
use cellmesh_stores::claims::{ClaimHolder, ClaimOutcome};
use cellmesh_world::partition::Partition;

use super::claims::free_claim;
use super::context::Context;
use super::{ConnId, StoreRequest};
use crate::model::claims::{Claims, Pending, RETRY_MS};
use crate::model::spawners::{self as model, Asked, SpawnerBook};

/// The spawn points this node stocks. Its handlers borrow the claims, which a stock's claim
/// is one of, and are told whether the game can stock now: `game` the connection of the game
/// (if one is connected) and `lease_live` whether this node may write.
#[derive(Default)]
pub(crate) struct Spawners {
    book: SpawnerBook,
}

impl Spawners {
    /// The game's `DeclareSpawners`; the error is for the game.
    pub(crate) fn on_declare(
        &mut self,
        cx: &mut Context,
        d: local::DeclareSpawners,
        partition: &Partition,
    ) -> Result<(), String> {
        let points = d
            .points
            .into_iter()
            .map(|p| SpawnPoint {
                key: p.key,
                pos: Pos { x: p.x, y: p.y },
            })
            .collect();
        let me = cx.config.node_id;
        let released = self
            .book
            .declare(&cx.config.world, points, partition, me, cx.now.mono_ms)
            .map_err(|e| format!("DeclareSpawners: {e}; the points declared before stay"))?;
        self.released(cx, released, "the game declared spawn points without it");
        Ok(())
    }

    /// A new partition: points whose chunk went elsewhere are released, those gained asked for.
    pub(crate) fn replanned(&mut self, cx: &mut Context, partition: &Partition) {
        let me = cx.config.node_id;
        let released = self.book.replanned(partition, me, cx.now.mono_ms);
        self.released(cx, released, "its chunk went to another node");
    }

    fn released(&mut self, cx: &mut Context, keys: Vec<String>, reason: &str) {
        for key in keys {
            cx.metrics.spawners_released.inc();
            cx.out.to_game.push(
                sidecar_message::Body::SpawnerReleased(local::SpawnerReleased {
                    key,
                    reason: reason.to_string(),
                })
                .into(),
            );
        }
        cx.metrics
            .spawners_owned
            .set(self.book.owned_count() as i64);
    }

    /// Claims due for this node's points, and stocks never spawned given up.
    pub(crate) fn step(
        &mut self,
        cx: &mut Context,
        claims: &mut Claims,
        game: Option<ConnId>,
        lease_live: bool,
    ) {
        let now = cx.now.mono_ms;
        for (id, a) in self.book.overdue(now) {
            give_up_stock(cx, claims, id, &a.key);
        }
        let due = self.book.due(now);
        if due.is_empty() {
            return;
        }
        let ready = lease_live && game.is_some();
        for key in due {
            let claim_key = model::claim_key(&key);
            if !ready || claims.knows(&claim_key, None) {
                // Held here already (by a stock living here, or one handed to the game), or
                // not able to stock now: looked at again later.
                self.book.retry(&key, now + model::HELD_RETRY_MS);
                continue;
            }
            let Asked { id, .. } = self.book.ask(&key, cx.now.unix_ms, cx.config.node_id);
            let holder = ClaimHolder {
                entity: id,
                entity_epoch: 0,
            };
            let token = claims.ask(Pending {
                key: claim_key.clone(),
                holder,
                ttl_ms: model::CLAIM_TTL_MS,
                request_id: 0,
                conn: game.unwrap_or(0),
                sent_at: now,
                released: false,
                spawner: true,
            });
            cx.claim_call(StoreRequest::Claim {
                token,
                key: claim_key,
                holder,
                ttl_ms: model::CLAIM_TTL_MS,
            });
        }
    }

    /// The store's answer to a claim for a point's next stock.
    pub(crate) fn on_claimed(
        &mut self,
        cx: &mut Context,
        claims: &mut Claims,
        game: Option<ConnId>,
        lease_live: bool,
        p: Pending,
        result: Result<ClaimOutcome, String>,
    ) {
        let now = cx.now.mono_ms;
        let Some(asked) = self.book.answered(p.holder.entity) else {
            if let Ok(ClaimOutcome::Granted(g)) = result {
                free_claim(cx, g);
            }
            return;
        };
        let key = asked.key.clone();
        match result {
            Ok(ClaimOutcome::Granted(grant)) => {
                if !self.book.owns(&key) || game.unwrap_or(0) != p.conn || !lease_live {
                    // The point moved on, or the game that was to stock it went, meanwhile.
                    free_claim(cx, grant);
                    self.book.retry(&key, now);
                    return;
                }
                claims.granted(grant, p.ttl_ms, p.sent_at);
                cx.metrics.claims_held.set(claims.len() as i64);
                cx.metrics.spawner_stocks.inc();
                let position = self
                    .book
                    .position(&key)
                    .map(|at| local::Vec3::xy(at.x, at.y));
                cx.out.to_game.push(
                    sidecar_message::Body::SpawnerOwned(local::SpawnerOwned {
                        key: key.clone(),
                        entity_id: asked.id,
                        generation: asked.generation,
                        position,
                    })
                    .into(),
                );
                self.book.granted(asked);
                // Looked at again later: once the stock is gone (its claim freed), restocked.
                self.book.retry(&key, now + model::HELD_RETRY_MS);
            }
            Ok(ClaimOutcome::Held { .. }) => {
                // Stocked: by a node that held the point before, or a stock that walked here.
                self.book.retry(&key, now + model::HELD_RETRY_MS);
            }
            Err(e) => {
                tracing::debug!(%key, error = %e, "spawn point's claim not answered");
                self.book.retry(&key, now + RETRY_MS);
            }
        }
    }

    /// A `Spawn` of a spawner's id: allowed only for a stock handed to this node's game.
    pub(crate) fn check_spawned_id(&self, id: u64) -> Result<(), String> {
        if !is_spawned_id(id) || self.book.is_awaited(id) {
            return Ok(());
        }
        Err(format!(
            "entity id {id} is a spawn point's, and not one this node was given to stock \
             (SpawnerOwned): mint ids with ReserveIds"
        ))
    }

    /// The game spawned `id`: a stock it was given is no longer awaited.
    pub(crate) fn spawned(&mut self, id: u64) {
        if is_spawned_id(id) {
            self.book.spawned(id);
        }
    }

    /// Whether `id` is a stock handed to the game and not spawned yet.
    pub(crate) fn is_awaited(&self, id: u64) -> bool {
        self.book.is_awaited(id)
    }

    /// The game went away: its points are forgotten (it declares them again when it returns);
    /// stocks it was given and never spawned are given up. Stocks it spawned keep their claims
    /// while they live.
    pub(crate) fn game_gone(&mut self, cx: &mut Context, claims: &mut Claims) {
        for (id, a) in self.book.clear() {
            give_up_stock(cx, claims, id, &a.key);
        }
        cx.metrics.spawners_owned.set(0);
    }
}

fn give_up_stock(cx: &mut Context, claims: &mut Claims, id: u64, key: &str) {
    if let Some(h) = claims.release(&model::claim_key(key), Some(id)) {
        free_claim(cx, h.grant);
        cx.metrics.claims_held.set(claims.len() as i64);
    }
}
