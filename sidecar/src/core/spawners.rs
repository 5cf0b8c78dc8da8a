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

use cellmesh_proto::local::{sidecar_message, ErrorCode};
use cellmesh_world::geometry::Pos;
use cellmesh_world::spawners::{is_spawned_id, SpawnPoint};

use super::*;
use crate::model::claims::{Pending, RETRY_MS};
use crate::model::spawners::{self as model, Asked};

impl Core {
    /// The game's `DeclareSpawners`.
    pub(crate) fn on_declare_spawners(&mut self, d: local::DeclareSpawners) {
        let points = d
            .points
            .into_iter()
            .map(|p| SpawnPoint {
                key: p.key,
                pos: Pos { x: p.x, y: p.y },
            })
            .collect();
        let me = self.cx.config.node_id;
        let released = match self.spawners.declare(
            &self.cx.config.world,
            points,
            &self.authority.partition,
            me,
            self.cx.now.mono_ms,
        ) {
            Ok(r) => r,
            Err(e) => {
                return self.game_error(
                    ErrorCode::InvalidValue,
                    format!("DeclareSpawners: {e}; the points declared before stay"),
                    0,
                )
            }
        };
        self.spawners_released(released, "the game declared spawn points without it");
        self.spawners_step();
    }

    /// A new partition: points whose chunk went elsewhere are released, those gained asked for.
    pub(crate) fn spawners_replanned(&mut self) {
        let me = self.cx.config.node_id;
        let released = self
            .spawners
            .replanned(&self.authority.partition, me, self.cx.now.mono_ms);
        self.spawners_released(released, "its chunk went to another node");
    }

    fn spawners_released(&mut self, keys: Vec<String>, reason: &str) {
        for key in keys {
            self.cx.metrics.spawners_released.inc();
            self.cx.out.to_game.push(
                sidecar_message::Body::SpawnerReleased(local::SpawnerReleased {
                    key,
                    reason: reason.to_string(),
                })
                .into(),
            );
        }
        self.cx
            .metrics
            .spawners_owned
            .set(self.spawners.owned_count() as i64);
    }

    /// Claims due for this node's points, and stocks never spawned given up.
    pub(crate) fn spawners_step(&mut self) {
        let now = self.cx.now.mono_ms;
        for (id, a) in self.spawners.overdue(now) {
            self.give_up_stock(id, &a.key);
        }
        let due = self.spawners.due(now);
        if due.is_empty() {
            return;
        }
        let ready = self.authority.lease_live && self.game.slot.is_some();
        for key in due {
            let claim_key = model::claim_key(&key);
            if !ready || self.claims.knows(&claim_key, None) {
                // Held here already (by a stock living here, or one handed to the game), or
                // not able to stock now: looked at again later.
                self.spawners.retry(&key, now + model::HELD_RETRY_MS);
                continue;
            }
            let Asked { id, .. } =
                self.spawners
                    .ask(&key, self.cx.now.unix_ms, self.cx.config.node_id);
            let holder = ClaimHolder {
                entity: id,
                entity_epoch: 0,
            };
            let conn = self.game.slot.as_ref().map_or(0, |g| g.conn);
            let token = self.claims.ask(Pending {
                key: claim_key.clone(),
                holder,
                ttl_ms: model::CLAIM_TTL_MS,
                request_id: 0,
                conn,
                sent_at: now,
                released: false,
                spawner: true,
            });
            self.cx.emit(Output::Store(StoreRequest::Claim {
                token,
                key: claim_key,
                holder,
                ttl_ms: model::CLAIM_TTL_MS,
            }));
        }
    }

    /// The store's answer to a claim for a point's next stock.
    pub(crate) fn on_spawner_claimed(&mut self, p: Pending, result: Result<ClaimOutcome, String>) {
        let now = self.cx.now.mono_ms;
        let Some(asked) = self.spawners.answered(p.holder.entity) else {
            if let Ok(ClaimOutcome::Granted(g)) = result {
                self.free_claim(g);
            }
            return;
        };
        let key = asked.key.clone();
        match result {
            Ok(ClaimOutcome::Granted(grant)) => {
                let conn = self.game.slot.as_ref().map_or(0, |g| g.conn);
                if !self.spawners.owns(&key) || conn != p.conn || !self.authority.lease_live {
                    // The point moved on, or the game that was to stock it went, meanwhile.
                    self.free_claim(grant);
                    self.spawners.retry(&key, now);
                    return;
                }
                self.claims.granted(grant, p.ttl_ms, p.sent_at);
                self.cx.metrics.claims_held.set(self.claims.len() as i64);
                self.cx.metrics.spawner_stocks.inc();
                let position = self
                    .spawners
                    .position(&key)
                    .map(|at| local::Vec3::xy(at.x, at.y));
                self.cx.out.to_game.push(
                    sidecar_message::Body::SpawnerOwned(local::SpawnerOwned {
                        key: key.clone(),
                        entity_id: asked.id,
                        generation: asked.generation,
                        position,
                    })
                    .into(),
                );
                self.spawners.granted(asked);
                // Looked at again later: once the stock is gone (its claim freed), restocked.
                self.spawners.retry(&key, now + model::HELD_RETRY_MS);
            }
            Ok(ClaimOutcome::Held { .. }) => {
                // Stocked: by a node that held the point before, or a stock that walked here.
                self.spawners.retry(&key, now + model::HELD_RETRY_MS);
            }
            Err(e) => {
                tracing::debug!(%key, error = %e, "spawn point's claim not answered");
                self.spawners.retry(&key, now + RETRY_MS);
            }
        }
    }

    /// A `Spawn` of a spawner's id: allowed only for a stock handed to this node's game.
    pub(crate) fn check_spawned_id(&mut self, id: u64) -> Result<(), String> {
        if !is_spawned_id(id) || self.spawners.is_awaited(id) {
            return Ok(());
        }
        Err(format!(
            "entity id {id} is a spawn point's, and not one this node was given to stock \
             (SpawnerOwned): mint ids with ReserveIds"
        ))
    }

    /// The game spawned `id`: a stock it was given is no longer awaited.
    pub(crate) fn spawners_spawned(&mut self, id: u64) {
        if is_spawned_id(id) {
            self.spawners.spawned(id);
        }
    }

    fn give_up_stock(&mut self, id: u64, key: &str) {
        if let Some(h) = self.claims.release(&model::claim_key(key), Some(id)) {
            self.free_claim(h.grant);
            self.cx.metrics.claims_held.set(self.claims.len() as i64);
        }
    }

    /// The game went away: its points are forgotten (it declares them again when it returns);
    /// stocks it was given and never spawned are given up. Stocks it spawned keep their claims
    /// while they live.
    pub(crate) fn spawners_game_gone(&mut self) {
        for (id, a) in self.spawners.clear() {
            self.give_up_stock(id, &a.key);
        }
        self.cx.metrics.spawners_owned.set(0);
    }
}
