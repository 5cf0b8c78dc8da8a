//! Entity commands between two cores wired back to back, each with a scripted game that answers
//! freezes, adoptions and commands as a game would.

use bytes::Bytes;
use cellmesh_proto::local::{self, game_message, CommandError};
use cellmesh_proto::mesh::{self, mesh_message};

use super::pair_tests::{at, Pair, LINK};
use super::*;

const NPC: u64 = 0x50;

/// An NPC of node 2 just past the border, seen by node 1 as a ghost.
fn pair_with_a_ghost_on_node_1() -> Pair {
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(2, NPC, 280.0);
    p.steps(4);
    assert_eq!(
        p.node(1).entity(NPC),
        Some((false, 1)),
        "node 1 holds a ghost"
    );
    p
}

#[test]
fn a_command_to_a_ghost_reaches_its_writer_and_its_result_comes_back_once() {
    let mut p = pair_with_a_ghost_on_node_1();
    p.command(1, NPC, 7, 3);
    p.steps(3);
    let got: Vec<(u64, u32, u32)> = p
        .node(2)
        .commands_in
        .iter()
        .map(|c| (c.target, c.r#type, c.from_node))
        .collect();
    assert_eq!(got, [(NPC, 3, 1)], "the writer's game got it once");
    assert!(
        p.node(1).commands_in.is_empty(),
        "a ghost's node never applies"
    );
    let results = p.node(1).result_of(7);
    assert_eq!(results.len(), 1);
    assert!(results[0].ok, "{:?}", results[0]);
    assert_eq!(results[0].payload, Bytes::from_static(b"done by 2"));
    // Nothing else comes, however long one waits.
    p.steps(200);
    assert_eq!(p.node(1).result_of(7).len(), 1);
    assert_eq!(
        p.node(1)
            .core
            .cx
            .metrics
            .commands_forwarded
            .get_or_create(&crate::metrics::WhyLabel { why: "owner" })
            .get(),
        1
    );
}

#[test]
fn a_refusal_is_the_result() {
    let mut p = pair_with_a_ghost_on_node_1();
    p.node(2).refuse = true;
    p.command(1, NPC, 8, 1);
    p.steps(3);
    let r = p.node(1).result_of(8);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].ok, r[0].error), (false, CommandError::Refused as i32));
}

#[test]
fn commands_to_an_entity_handed_off_mid_stream_are_applied_once_in_order_by_the_new_writer() {
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(1, NPC, 200.0);
    p.steps(4);
    assert_eq!(
        p.node(2).entity(NPC),
        Some((false, 1)),
        "node 2 holds a ghost"
    );
    // Node 2's game sends a stream of commands while the NPC walks over to node 2: some reach
    // node 1 before the handoff, some meet it frozen, some follow it after it left.
    let mut sent = Vec::new();
    for k in 0..20u64 {
        if k == 5 {
            p.move_to(1, NPC, 330.0);
        }
        p.command(2, NPC, 100 + k, k as u32);
        sent.push(k as u32);
        p.step();
    }
    p.steps(20);
    assert_eq!(
        p.node(2).entity(NPC).map(|e| e.0),
        Some(true),
        "node 2 writes it now"
    );
    let on_1: Vec<u32> = p.node(1).commands_in.iter().map(|c| c.r#type).collect();
    let on_2: Vec<u32> = p.node(2).commands_in.iter().map(|c| c.r#type).collect();
    assert!(!on_1.is_empty() && !on_2.is_empty(), "{on_1:?} {on_2:?}");
    let all: Vec<u32> = on_1.iter().chain(&on_2).copied().collect();
    assert_eq!(
        all, sent,
        "each applied once, in the order sent, by one writer at a time"
    );
    let followed = p
        .node(1)
        .core
        .cx
        .metrics
        .commands_forwarded
        .get_or_create(&crate::metrics::WhyLabel { why: "handoff" })
        .get();
    assert!(followed > 0, "some followed the NPC through its handoff");
    for k in 0..20 {
        let r = p.node(2).result_of(100 + k);
        assert_eq!(r.len(), 1, "request {k} answered once");
        assert!(r[0].ok, "{:?}", r[0]);
    }
}

#[test]
fn a_command_that_meets_a_frozen_entity_waits_and_is_applied_by_the_new_writer() {
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(1, NPC, 200.0);
    p.steps(4);
    // Node 2's game hangs on the Adopt: the offer stays in doubt, the NPC frozen on node 1.
    p.node(2).adopts = false;
    p.move_to(1, NPC, 330.0);
    p.steps(3);
    assert!(
        p.node(1).core.handoff.outgoing().is_frozen(NPC),
        "frozen on node 1"
    );
    p.command(1, NPC, 9, 4);
    p.command(2, NPC, 10, 5);
    p.steps(3);
    assert!(
        p.node(1).commands_in.is_empty(),
        "nobody applies a frozen entity's command"
    );
    assert!(p.node(2).commands_in.is_empty());
    // The game adopts at last.
    p.node(2).adopts = true;
    let adopt = p.node(2).core.handoff.adopting_epoch(NPC).unwrap();
    p.game_sends(
        2,
        game_message::Body::Adopted(local::Adopted {
            entity_id: NPC,
            entity_epoch: adopt,
        }),
    );
    p.steps(4);
    let on_2: Vec<u32> = p.node(2).commands_in.iter().map(|c| c.r#type).collect();
    assert_eq!(on_2, [4, 5], "applied once each, by the new writer");
    assert!(p.node(1).commands_in.is_empty());
    assert_eq!(p.node(1).result_of(9).len(), 1);
    assert_eq!(p.node(2).result_of(10).len(), 1);
    assert!(p.node(1).result_of(9)[0].ok && p.node(2).result_of(10)[0].ok);
}

#[test]
fn a_command_for_a_despawned_entity_answers_entity_gone() {
    let mut p = pair_with_a_ghost_on_node_1();
    p.game_sends(
        2,
        game_message::Body::Despawn(local::Despawn { entity_id: NPC }),
    );
    p.steps(3);
    assert_eq!(p.node(1).entity(NPC), None, "the ghost went with it");
    p.command(1, NPC, 11, 1);
    p.steps(3);
    let r = p.node(1).result_of(11);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].error, CommandError::EntityGone as i32, "{:?}", r[0]);
    // One that was on its way as the entity went: the writer answers it.
    let mut p = pair_with_a_ghost_on_node_1();
    p.game_sends(
        2,
        game_message::Body::Despawn(local::Despawn { entity_id: NPC }),
    );
    p.command(1, NPC, 12, 1);
    p.steps(3);
    let r = p.node(1).result_of(12);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].error, CommandError::EntityGone as i32, "{:?}", r[0]);
    assert!(p.node(2).commands_in.is_empty());
}

#[test]
fn a_command_to_an_id_known_nowhere_here_is_located_first() {
    // Node 1 sees nothing of an NPC far inside node 2's area: it asks where it is.
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(2, NPC, 384.0);
    p.steps(4);
    assert_eq!(p.node(1).entity(NPC), None);
    p.command(1, NPC, 13, 2);
    p.steps(3);
    assert_eq!(p.node(2).commands_in.len(), 1);
    assert!(p.node(1).result_of(13)[0].ok);
}

#[test]
fn a_stale_epoch_command_is_dropped_and_said_so() {
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(1, NPC, 200.0);
    p.steps(4);
    p.move_to(1, NPC, 330.0);
    p.steps(6);
    let (local, epoch) = p.node(2).entity(NPC).unwrap();
    assert!(local && epoch == 2, "node 2 writes it under epoch 2");
    let token = p.node(1).core.commands.open(14, NPC, u64::MAX).unwrap();
    // A command stamped with epoch 1 (when node 1 wrote it), as a peer with an old view sends.
    let stale = mesh::EntityCommand {
        target: NPC,
        entity_epoch: 1,
        origin_node: 1,
        origin_incarnation: 1,
        seq: 1,
        prev_seq: 0,
        request_id: token,
        r#type: 9,
        hops: 1,
        ..Default::default()
    };
    let now = p.now;
    p.node(2).core.handle(
        at(now),
        Input::LinkFrame {
            link: LINK,
            messages: vec![mesh_message::Body::EntityCommand(stale).into()],
        },
    );
    p.carry();
    p.steps(2);
    assert!(p.node(2).commands_in.is_empty(), "never applied");
    let r = p.node(1).result_of(14);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].error, CommandError::NotDelivered as i32);
    assert!(r[0].detail.contains("stale_epoch"), "{}", r[0].detail);
    let drops = p
        .node(2)
        .core
        .cx
        .metrics
        .commands_dropped
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: "stale_epoch",
        })
        .get();
    assert_eq!(drops, 1);
}

#[test]
fn a_request_nobody_answers_times_out_once() {
    let mut p = pair_with_a_ghost_on_node_1();
    // Node 2's game takes the command and never replies.
    let results_before = p.node(1).results.len();
    p.command(1, NPC, 15, 1);
    p.step();
    // Drop the game's reply before it is sent.
    p.node(2)
        .queued
        .retain(|b| !matches!(b, game_message::Body::CommandReply(_)));
    let timeout = p.node(1).core.cfg.command_timeout_ms;
    p.steps((timeout / 50) as usize + 4);
    let r = p.node(1).result_of(15);
    assert_eq!(r.len(), 1, "{:?}", &p.node(1).results[results_before..]);
    assert_eq!(r[0].error, CommandError::Timeout as i32);
}

#[test]
fn a_request_id_still_waiting_is_refused() {
    let mut p = pair_with_a_ghost_on_node_1();
    p.command(1, NPC, 16, 1);
    p.command(1, NPC, 16, 1);
    p.steps(3);
    let errors: Vec<String> = p.node(1).errors.iter().map(|e| e.detail.clone()).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("request id 16"), "{errors:?}");
    assert_eq!(p.node(2).commands_in.len(), 1, "the second was refused");
    assert_eq!(p.node(1).result_of(16).len(), 1);
}
