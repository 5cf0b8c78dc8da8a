//! Attacks by entity commands: damage tables, kills, rewards, one result per command.

use super::*;

#[test]
fn an_npc_keeps_every_attacker_in_its_damage_table_and_its_kill_rewards_each_avatar() {
    let census = Arc::new(Census::default());
    let mut owner = arena(1, &census);
    let npc = owner.held().find(|h| !h.player).unwrap().id;
    let ann = join(&mut owner, "ann", 1);
    let mut out = Vec::new();
    // Ann here, Bob from node 9 (his avatar simulated there), until the NPC (50 health) dies.
    for k in 0..5 {
        let (account, avatar, node) = if k % 2 == 0 {
            ("ann", ann, NODE)
        } else {
            ("bob", 77, 9)
        };
        owner.on_message(&mut out, attack_in(npc, account, avatar, node, k + 1));
        if k == 3 {
            let table = owner.damage_table(npc).unwrap();
            assert_eq!(table, [("ann".into(), 20), ("bob".into(), 20)]);
            // The table travels with the NPC in its snapshot.
            let frozen = freeze(&mut owner, npc, 1);
            let snap = snapshot_of(&frozen, npc);
            assert_eq!(snap.damage.len(), 2);
            owner.on_message(
                &mut out,
                M::Thaw(Thaw {
                    entity_id: npc,
                    reason: "kept".into(),
                }),
            );
        }
    }
    let refusals: Vec<&str> = out
        .iter()
        .filter_map(|b| match b {
            Body::CommandReply(r) if r.refused => Some(r.detail.as_str()),
            _ => None,
        })
        .collect();
    assert!(refusals.is_empty(), "{refusals:?}");
    assert_eq!(owner.stats.kills, 1);
    assert_eq!(owner.stats.attacks_applied_from_other_nodes, 2);
    let replies = out
        .iter()
        .filter(|b| matches!(b, Body::CommandReply(r) if !r.refused))
        .count();
    assert_eq!(replies, 5, "every attack answered");
    // The kill's XP goes by command to each attacker's avatar, wherever it is.
    let rewards: Vec<(u64, u32)> = out
        .iter()
        .filter_map(|b| match b {
            Body::Command(c) if c.r#type == combat::CMD_XP => {
                Some((c.target_entity, combat::decode(&c.payload).unwrap().0))
            }
            _ => None,
        })
        .collect();
    assert_eq!(rewards, [(ann, 60), (77, 40)]);
    assert!(owner.damage_table(npc).unwrap().is_empty(), "a new life");
    // Bob's own node applies his share to his avatar.
    let mut remote = arena(0, &census);
    let bob = join(&mut remote, "bob", 1);
    let mut out = Vec::new();
    remote.on_message(
        &mut out,
        M::CommandIn(CommandIn {
            target: bob,
            from_entity: npc,
            r#type: combat::CMD_XP,
            payload: combat::encode(40, 99),
            request_id: 5,
            // The kill happened on the NPC's node, another than Bob's.
            from_node: NODE + 1,
            ..Default::default()
        }),
    );
    assert_eq!(remote.xp_of("bob"), Some(40));
    assert_eq!(remote.stats.xp_from_other_nodes, 1);
    assert_eq!(
        census.commands(),
        (6, 0),
        "five attacks and one reward, each once"
    );
}

#[test]
fn a_result_comes_once_per_command_and_a_second_is_counted() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let mut out = Vec::new();
    a.send_command(&mut out, 5, combat::CMD_ATTACK, combat::encode(10, 1), 1);
    assert_eq!(a.commands_outstanding(), 1);
    let result = CommandResult {
        request_id: 1,
        target: 5,
        ok: true,
        ..Default::default()
    };
    a.on_message(&mut out, M::CommandResult(result.clone()));
    a.on_message(&mut out, M::CommandResult(result));
    assert_eq!(a.commands_outstanding(), 0);
    assert_eq!((a.stats.results_ok, a.stats.results_unexpected), (1, 1));
}
