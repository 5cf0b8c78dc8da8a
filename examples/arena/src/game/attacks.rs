//! Combat by entity commands: a player's avatar attacks the nearest NPC in reach; the NPC's
//! node applies the damage and rewards every attacker on a kill (see `crate::combat`).

use super::{component, public, Arena, Outbox, Role, DEN_PREFIX};
use crate::combat;
use crate::schema;
use crate::trade;
use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, Command, CommandError, CommandIn, CommandReply, CommandResult, Update,
};
use rand::Rng;

impl Arena {
    /// An id for a command's payload: from the census when there is one (unique in the run),
    /// else drawn at random.
    pub(super) fn command_id(&mut self) -> u64 {
        match &self.cfg.census {
            Some(c) => c.next_command_id(),
            None => self.rng.random::<u64>(),
        }
    }

    /// Sends a command, remembering it until its one result; its request id.
    pub(super) fn send_command(
        &mut self,
        out: &mut impl Outbox,
        target: u64,
        r#type: u32,
        payload: Bytes,
        from: u64,
    ) -> u64 {
        self.next_command += 1;
        let request_id = self.next_command;
        self.outstanding.insert(request_id, (r#type, from));
        out.push(Body::Command(Command {
            target_entity: target,
            r#type,
            payload,
            request_id,
            from_entity: from,
        }));
        request_id
    }

    /// Each player with no attack on its way hits the nearest NPC in reach: its own node's or
    /// a ghost of another's, alike.
    pub(super) fn attack(&mut self, out: &mut impl Outbox) {
        let players: Vec<(u64, (f64, f64))> = self
            .entities
            .iter()
            .filter(|(id, e)| {
                matches!(e.role, Role::Player(_)) && !e.frozen && !self.attacking.contains(id)
            })
            .map(|(id, e)| (*id, e.pos))
            .collect();
        for (avatar, at) in players {
            let own = self
                .entities
                .iter()
                .filter(|(_, e)| matches!(e.role, Role::Npc { .. }) && !e.frozen)
                .map(|(id, e)| (*id, e.pos));
            let ghosts = self.npc_ghosts.iter().map(|(id, p)| (*id, *p));
            let nearest = own
                .chain(ghosts)
                .map(|(id, p)| {
                    let (dx, dy) = self.torus.delta(at, p);
                    (dx.hypot(dy), id)
                })
                .filter(|(d, _)| *d <= combat::REACH_M)
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, npc)) = nearest else { continue };
            let attack_id = self.command_id();
            let remote = self.npc_ghosts.contains_key(&npc);
            self.send_command(
                out,
                npc,
                combat::CMD_ATTACK,
                combat::encode(combat::DAMAGE, attack_id),
                avatar,
            );
            self.attacking.insert(avatar);
            self.stats.attacks_sent += 1;
            if remote {
                self.stats.attacks_across_border += 1;
            }
        }
    }

    /// A command to an entity this arena writes.
    pub(super) fn on_command(&mut self, out: &mut impl Outbox, c: CommandIn) {
        let verdict = match c.r#type {
            combat::CMD_ATTACK => self.attacked(out, &c),
            combat::CMD_XP => self.rewarded(&c),
            trade::CMD_TRADE => self.gifted(&c),
            other => Err(format!("unknown command type {other}")),
        };
        if c.request_id == 0 {
            return;
        }
        let (refused, detail) = match verdict {
            Ok(()) => (false, String::new()),
            Err(detail) => {
                self.stats.commands_refused += 1;
                (true, detail)
            }
        };
        out.push(Body::CommandReply(CommandReply {
            request_id: c.request_id,
            refused,
            payload: Bytes::new(),
            detail,
        }));
    }

    /// An attack on one of this arena's NPCs: its damage table grows; a kill shares out XP to
    /// every attacker's avatar, wherever it is, and the NPC rises again at full health.
    pub(super) fn attacked(&mut self, out: &mut impl Outbox, c: &CommandIn) -> Result<(), String> {
        let (damage, attack_id) = combat::decode(&c.payload).ok_or("unreadable attack")?;
        let census = self.cfg.census.clone();
        let e = self
            .entities
            .get_mut(&c.target)
            .ok_or("no such entity here")?;
        if e.frozen {
            return Err("frozen".into());
        }
        let Role::Npc { damage: table, .. } = &mut e.role else {
            return Err("only NPCs are attacked".into());
        };
        if let Some(census) = &census {
            census.command_applied(attack_id);
        }
        self.stats.attacks_applied += 1;
        if c.from_node != self.node {
            self.stats.attacks_applied_from_other_nodes += 1;
        }
        table.hit(&c.from_account, c.from_entity, damage);
        e.health.0 = e.health.0.saturating_sub(damage);
        let mut rewards = Vec::new();
        let mut den_killed = false;
        if e.health.0 == 0 {
            rewards = table.share_out(combat::KILL_XP);
            e.health.0 = e.health.1;
            self.stats.kills += 1;
            den_killed = matches!(&e.role, Role::Npc { name, .. } if name.starts_with(DEN_PREFIX));
        }
        out.push(Body::Update(Update {
            entity_id: c.target,
            changed: vec![component(
                schema::HEALTH,
                schema::health(e.health.0, e.health.1),
                public(),
            )],
            ..Default::default()
        }));
        for (_, avatar, xp) in rewards {
            let reward_id = self.command_id();
            self.send_command(
                out,
                avatar,
                combat::CMD_XP,
                combat::encode(xp, reward_id),
                c.target,
            );
            self.stats.xp_sent += 1;
        }
        if den_killed {
            // A den's NPC does not rise again: the den is stocked anew, under a new id.
            self.stats.den_kills += 1;
            self.despawn_den_npc(out, c.target);
        }
        Ok(())
    }

    /// XP for a kill, to one of this arena's avatars.
    pub(super) fn rewarded(&mut self, c: &CommandIn) -> Result<(), String> {
        let (xp, reward_id) = combat::decode(&c.payload).ok_or("unreadable reward")?;
        let e = self
            .entities
            .get_mut(&c.target)
            .ok_or("no such entity here")?;
        let Role::Player(p) = &mut e.role else {
            return Err("only players gain XP".into());
        };
        if let Some(census) = &self.cfg.census {
            census.command_applied(reward_id);
        }
        p.xp += xp as u64;
        self.stats.xp_applied += 1;
        self.stats.xp_gained += xp as u64;
        if c.from_node != self.node {
            self.stats.xp_from_other_nodes += 1;
        }
        Ok(())
    }

    /// The one result of a command this arena sent.
    pub(super) fn on_command_result(&mut self, out: &mut impl Outbox, r: CommandResult) {
        let Some((r#type, from)) = self.outstanding.remove(&r.request_id) else {
            // A second result, or one for a command never sent: the mesh broke a promise.
            self.stats.results_unexpected += 1;
            return;
        };
        if r#type == trade::CMD_TRADE {
            let ok = r.error == CommandError::CommandOk as i32;
            self.gift_answered(out, from, r.request_id, ok);
        } else {
            self.attacking.remove(&from);
        }
        let s = &mut self.stats;
        match CommandError::try_from(r.error).unwrap_or(CommandError::NotDelivered) {
            CommandError::CommandOk => s.results_ok += 1,
            CommandError::Refused => s.results_refused += 1,
            CommandError::EntityGone => s.results_entity_gone += 1,
            CommandError::Timeout => s.results_timeout += 1,
            CommandError::NotDelivered => s.results_not_delivered += 1,
        }
    }

    // ------------------------------------------------------------------ trade

    /// Commands sent whose result has not come yet.
    pub fn commands_outstanding(&self) -> usize {
        self.outstanding.len()
    }
}
