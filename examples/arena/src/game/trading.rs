//! Trades between two players in reach, under exclusive claims on both escrows (see
//! `crate::trade`): claimed, haggled, given once, released.

use super::{Arena, Outbox, Role};
use crate::trade;
use crate::trade::Escrow;
use crate::trade::Trade;
use cellmesh_proto::local::{
    game_message::Body, Claim, ClaimLost, ClaimOutcome, ClaimRelease, ClaimResult, CommandIn,
};

impl Arena {
    pub(super) fn claim(&mut self, out: &mut impl Outbox, key: String, avatar: u64) -> u64 {
        self.next_claim += 1;
        let request_id = self.next_claim;
        self.claims_asked.insert(request_id, avatar);
        out.push(Body::Claim(Claim {
            key,
            holder_entity: avatar,
            ttl_ms: trade::CLAIM_TTL_MS,
            request_id,
        }));
        request_id
    }

    /// Each player in no trade opens one with the nearest other player in reach: claims both
    /// escrows for its avatar. Not while a claim of its last trade awaits its answer: the store
    /// grants a holder its own key again, so a new trade's escrow would be the same claim as
    /// the old one's, and the old one's release (once granted) would free the new one's.
    pub(super) fn open_trades(&mut self, out: &mut impl Outbox) {
        let players: Vec<(u64, String, (f64, f64))> = self
            .entities
            .iter()
            .filter(|(id, e)| !e.frozen && !self.trades.contains_key(id))
            .filter(|(id, _)| !self.release_on_answer.values().any(|a| a == *id))
            .filter_map(|(id, e)| match &e.role {
                Role::Player(p) => Some((*id, p.account.clone(), e.pos)),
                Role::Npc { .. } => None,
            })
            .collect();
        for (avatar, account, at) in players {
            let own = self.entities.iter().filter_map(|(id, e)| match &e.role {
                Role::Player(p) if *id != avatar && !e.frozen => Some((*id, &p.account, e.pos)),
                _ => None,
            });
            // A ghost that became this arena's own (adopted) is not a ghost any more.
            let ghosts = self
                .player_ghosts
                .iter()
                .filter(|(id, _)| !self.entities.contains_key(id))
                .map(|(id, (a, p))| (*id, a, *p));
            let nearest = own
                .chain(ghosts)
                .map(|(id, a, p)| {
                    let (dx, dy) = self.torus.delta(at, p);
                    (dx.hypot(dy), id, a.clone())
                })
                .filter(|(d, _, a)| *d <= trade::REACH_M && *a != account)
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, partner, theirs)) = nearest else {
                continue;
            };
            let own_claim = self.claim(out, trade::escrow(&account), avatar);
            let their_claim = self.claim(out, trade::escrow(&theirs), avatar);
            self.trades.insert(
                avatar,
                Trade::new(partner, &account, &theirs, [own_claim, their_claim]),
            );
            self.stats.trades_started += 1;
            if self.player_ghosts.contains_key(&partner) {
                self.stats.trades_across_border += 1;
            }
        }
    }

    pub(super) fn on_claim_result(&mut self, out: &mut impl Outbox, r: ClaimResult) {
        let granted = r.outcome == ClaimOutcome::ClaimGranted as i32;
        if granted {
            self.stats.claims_granted += 1;
            if let Some(c) = &self.cfg.census {
                c.claim_granted(&r.key, self.node, r.holder_entity);
            }
        } else if r.outcome == ClaimOutcome::ClaimHeld as i32 {
            self.stats.claims_refused += 1;
        }
        if let Some(avatar) = self.release_on_answer.remove(&r.request_id) {
            // A despawned holder's claims were freed by its despawn.
            if granted && self.entities.contains_key(&avatar) {
                if let Some(c) = &self.cfg.census {
                    c.claim_freed(&r.key, avatar);
                }
                out.push(Body::ClaimRelease(ClaimRelease {
                    key: r.key,
                    holder_entity: avatar,
                }));
            }
            return;
        }
        let Some(avatar) = self.claims_asked.remove(&r.request_id) else {
            return;
        };
        let Some(t) = self.trades.get_mut(&avatar) else {
            return;
        };
        if !t.answered(r.request_id, granted) {
            return;
        }
        if t.refused() {
            if r.outcome == ClaimOutcome::ClaimHeld as i32 {
                self.stats.trades_refused += 1;
            } else {
                self.stats.trades_failed += 1;
            }
            return self.end_trade(out, avatar);
        }
        if !t.both_granted() {
            return;
        }
        t.gift_at = Some(self.ticks + trade::HAGGLE_TICKS);
        if let Some(c) = &self.cfg.census {
            c.trade_opened(t.accounts(), self.node);
        }
    }

    /// Trades done haggling send their gift.
    pub(super) fn send_gifts(&mut self, out: &mut impl Outbox) {
        let now = self.ticks;
        let due: Vec<(u64, u64)> = self
            .trades
            .iter()
            .filter(|(_, t)| t.gift.is_none() && t.gift_at.is_some_and(|at| at <= now))
            .map(|(avatar, t)| (*avatar, t.partner))
            .collect();
        for (avatar, partner) in due {
            let trade_id = self.command_id();
            let request_id = self.send_command(
                out,
                partner,
                trade::CMD_TRADE,
                trade::encode(trade::GIFT_GOLD, trade_id),
                avatar,
            );
            if let Some(t) = self.trades.get_mut(&avatar) {
                t.gift = Some(request_id);
            }
        }
    }

    pub(super) fn on_claim_lost(&mut self, out: &mut impl Outbox, l: ClaimLost) {
        self.stats.claims_lost += 1;
        if let Some(c) = &self.cfg.census {
            c.claim_freed(&l.key, l.holder_entity);
        }
        tracing::debug!(key = %l.key, holder = l.holder_entity, reason = %l.reason, "claim lost");
        if self
            .trades
            .get_mut(&l.holder_entity)
            .is_some_and(|t| t.lost(&l.key))
        {
            self.stats.trades_lost += 1;
            self.end_trade(out, l.holder_entity);
        }
    }

    /// The gift's one result: the trade is over.
    pub(super) fn gift_answered(
        &mut self,
        out: &mut impl Outbox,
        avatar: u64,
        request_id: u64,
        ok: bool,
    ) {
        if self
            .trades
            .get(&avatar)
            .is_none_or(|t| t.gift != Some(request_id))
        {
            // Its trade was called off meanwhile (counted then); the avatar may be in another.
            return;
        }
        if ok {
            self.stats.trades_done += 1;
        } else {
            self.stats.trades_failed += 1;
        }
        self.end_trade(out, avatar);
    }

    /// A trade's avatar is frozen for a handoff: the trade ends here.
    pub(super) fn call_off_trade(&mut self, out: &mut impl Outbox, avatar: u64) {
        if self.trades.contains_key(&avatar) {
            self.stats.trades_called_off += 1;
            self.end_trade(out, avatar);
        }
    }

    /// Ends `avatar`'s trade: closed in the census first, then its claims released.
    pub(super) fn end_trade(&mut self, out: &mut impl Outbox, avatar: u64) {
        let Some(t) = self.trades.remove(&avatar) else {
            return;
        };
        if let (Some(c), Some(_)) = (&self.cfg.census, t.gift_at) {
            c.trade_closed(t.accounts());
        }
        self.claims_asked.retain(|_, a| *a != avatar);
        for (account, escrow) in &t.parties {
            match escrow {
                Escrow::Granted => {
                    let key = trade::escrow(account);
                    if let Some(c) = &self.cfg.census {
                        c.claim_freed(&key, avatar);
                    }
                    out.push(Body::ClaimRelease(ClaimRelease {
                        key,
                        holder_entity: avatar,
                    }))
                }
                // Its answer may be on its way already: released once it comes, if granted.
                Escrow::Asked(request_id) => {
                    self.release_on_answer.insert(*request_id, avatar);
                }
                Escrow::Refused => {}
            }
        }
    }

    /// A trade's gift to one of this arena's avatars.
    pub(super) fn gifted(&mut self, c: &CommandIn) -> Result<(), String> {
        let (_, trade_id) = trade::decode(&c.payload).ok_or("unreadable gift")?;
        let e = self.entities.get(&c.target).ok_or("no such entity here")?;
        if !matches!(e.role, Role::Player(_)) {
            return Err("only players receive gifts".into());
        }
        if let Some(census) = &self.cfg.census {
            census.command_applied(trade_id);
        }
        self.stats.gifts_applied += 1;
        Ok(())
    }

    /// Trades this arena has open.
    pub fn trades_open(&self) -> usize {
        self.trades.len()
    }
}
