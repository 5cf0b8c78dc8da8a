//! Trades under exclusive claims: escrows claimed, gifts given once, claims released.

use super::*;

/// Bob's avatar, simulated by another node and seen here as a ghost.
const BOB_GHOST: u64 = 555;
/// Whoever else holds an escrow answered `CLAIM_HELD`.
const OTHER_HOLDER: u64 = 4242;

fn claims(out: &[Body]) -> Vec<Claim> {
    out.iter()
        .filter_map(|b| match b {
            Body::Claim(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

/// (key, holder) of every `ClaimRelease`, in order.
fn claim_releases(out: &[Body]) -> Vec<(String, u64)> {
    out.iter()
        .filter_map(|b| match b {
            Body::ClaimRelease(r) => Some((r.key.clone(), r.holder_entity)),
            _ => None,
        })
        .collect()
}

fn gifts(out: &[Body]) -> Vec<Command> {
    out.iter()
        .filter_map(|b| match b {
            Body::Command(c) if c.r#type == trade::CMD_TRADE => Some(c.clone()),
            _ => None,
        })
        .collect()
}

/// Ticks until a tick asks for claims, within one trade period: that tick's output.
fn tick_to_trade(a: &mut Arena) -> Vec<Body> {
    for _ in 0..trade::TRADE_EVERY_TICKS {
        let out = tick_n(a, 1);
        if !claims(&out).is_empty() {
            return out;
        }
    }
    panic!("no claim asked in a whole trade period");
}

/// The store's answer to claim `c`.
fn answer(a: &mut Arena, c: &Claim, outcome: ClaimOutcome) -> Vec<Body> {
    let held = outcome == ClaimOutcome::ClaimHeld;
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::ClaimResult(ClaimResult {
            request_id: c.request_id,
            key: c.key.clone(),
            outcome: outcome as i32,
            holder_entity: c.holder_entity,
            held_by: if held { OTHER_HOLDER } else { 0 },
            token: if held { 0 } else { 1 },
            detail: String::new(),
        }),
    );
    out
}

fn gift_result(a: &mut Arena, gift: &Command, error: CommandError) -> Vec<Body> {
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::CommandResult(CommandResult {
            request_id: gift.request_id,
            target: gift.target_entity,
            ok: error == CommandError::CommandOk,
            error: error as i32,
            ..Default::default()
        }),
    );
    out
}

fn lose(a: &mut Arena, account: &str, holder: u64) -> Vec<Body> {
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::ClaimLost(ClaimLost {
            key: trade::escrow(account),
            holder_entity: holder,
            reason: "lease lapsed".into(),
        }),
    );
    out
}

/// Whether the census has `account` in a trade: probed with an overlapping opening, which
/// the census refuses (and counts) when it is one, and which is undone when it is not.
fn in_trade(census: &Census, account: &str) -> bool {
    let probe = [account, "probe:nobody"];
    if census.trade_opened(probe, 0) {
        census.trade_closed(probe);
        false
    } else {
        true
    }
}

/// Every trade counter: (started, done, refused, failed, lost, called off, across border).
fn trade_counters(s: &ArenaStats) -> [u64; 7] {
    [
        s.trades_started,
        s.trades_done,
        s.trades_refused,
        s.trades_failed,
        s.trades_lost,
        s.trades_called_off,
        s.trades_across_border,
    ]
}

/// Ann, a player of this arena, and Bob, a ghost of another node 10 m away across the
/// world's seam, at the trade tick: the arena, Ann's avatar, and her two claims (her own
/// escrow's, then Bob's).
fn ann_trading_with_ghost_bob(census: &Arc<Census>) -> (Arena, u64, Claim, Claim) {
    let mut a = arena(0, census);
    let ann = join_at(&mut a, "ann", (0.0, 0.0));
    let mut out = Vec::new();
    a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (SIZE - 10.0, 0.0)));
    let asked = claims(&tick_to_trade(&mut a));
    assert_eq!(asked.len(), 2, "{asked:?}");
    let of = |account: &str| {
        asked
            .iter()
            .find(|c| c.key == trade::escrow(account))
            .cloned()
            .unwrap_or_else(|| panic!("no claim of {account}'s escrow: {asked:?}"))
    };
    (a, ann, of("ann"), of("bob"))
}

/// Both of Ann's escrows granted, then haggling until the gift goes: the gift.
fn granted_until_the_gift(a: &mut Arena, own: &Claim, theirs: &Claim) -> Command {
    assert!(answer(a, own, ClaimOutcome::ClaimGranted).is_empty());
    assert!(answer(a, theirs, ClaimOutcome::ClaimGranted).is_empty());
    let out = tick_n(a, trade::HAGGLE_TICKS);
    let sent = gifts(&out);
    assert_eq!(sent.len(), 1, "{out:?}");
    sent[0].clone()
}

/// No key released twice, and none of `held` (answered `CLAIM_HELD`: never this arena's).
fn assert_released_at_most_once(out: &[Body], held: &[&str]) {
    let released = claim_releases(out);
    let keys: HashSet<&str> = released.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys.len(),
        released.len(),
        "a key released twice: {released:?}"
    );
    for k in held {
        assert!(!keys.contains(k), "{k} was answered held: {released:?}");
    }
}

/// Two players of this arena in reach: each asks both escrows at the trade tick. The one the
/// store grants both haggles, then gives once; the gift's result releases both claims.
#[test]
fn two_players_in_reach_claim_both_escrows_haggle_give_once_and_release_both() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let ann = join_at(&mut a, "ann", (0.0, 0.0));
    let bob = join_at(&mut a, "bob", (trade::REACH_M - 1.0, 0.0));
    let asked = claims(&tick_to_trade(&mut a));
    assert_eq!(asked.len(), 4, "{asked:?}");
    for (avatar, own, theirs) in [(ann, "ann", "bob"), (bob, "bob", "ann")] {
        let mut keys: Vec<String> = asked
            .iter()
            .filter(|c| c.holder_entity == avatar)
            .map(|c| c.key.clone())
            .collect();
        keys.sort();
        let mut want = vec![trade::escrow(own), trade::escrow(theirs)];
        want.sort();
        assert_eq!(keys, want, "{asked:?}");
    }
    assert!(asked.iter().all(|c| c.ttl_ms == trade::CLAIM_TTL_MS));
    let ids: HashSet<u64> = asked.iter().map(|c| c.request_id).collect();
    assert_eq!(ids.len(), 4, "one request id per claim: {asked:?}");
    assert_eq!(
        (a.stats.trades_started, a.stats.trades_across_border),
        (2, 0)
    );

    // As a store would: Ann is granted both escrows, so Bob finds both held.
    let mut out = Vec::new();
    for c in &asked {
        let outcome = if c.holder_entity == ann {
            ClaimOutcome::ClaimGranted
        } else {
            ClaimOutcome::ClaimHeld
        };
        out.extend(answer(&mut a, c, outcome));
    }
    assert!(out.is_empty(), "nothing of Bob's to release: {out:?}");
    assert_eq!((a.stats.claims_granted, a.stats.claims_refused), (2, 2));
    assert_eq!(a.stats.trades_refused, 1);
    assert_eq!(a.trades_open(), 1);
    assert_eq!(census.trades(), (1, 0), "Ann's trade opened, once");
    // A second trade of either player would overlap.
    assert!(in_trade(&census, "ann") && in_trade(&census, "bob"));

    // Haggling: no gift before the haggle is over.
    let out = tick_n(&mut a, trade::HAGGLE_TICKS - 1);
    assert!(gifts(&out).is_empty(), "{out:?}");
    let out = tick_n(&mut a, 4);
    let sent = gifts(&out);
    assert_eq!(sent.len(), 1, "one gift: {out:?}");
    let g = &sent[0];
    assert_eq!(
        (g.target_entity, g.from_entity, g.r#type),
        (bob, ann, trade::CMD_TRADE)
    );
    assert_ne!(g.request_id, 0, "its result is wanted");
    assert_eq!(
        trade::decode(&g.payload).map(|(gold, _)| gold),
        Some(trade::GIFT_GOLD)
    );
    assert!(
        claim_releases(&out).is_empty(),
        "held until the result: {out:?}"
    );

    let out = gift_result(&mut a, g, CommandError::CommandOk);
    let mut released = claim_releases(&out);
    released.sort();
    assert_eq!(
        released,
        [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
    );
    assert_eq!((a.stats.trades_done, a.stats.results_ok), (1, 1));
    assert_eq!(a.trades_open(), 0);
    assert!(!in_trade(&census, "ann") && !in_trade(&census, "bob"));
    // A second result (a broken promise) releases nothing again.
    assert!(gift_result(&mut a, g, CommandError::CommandOk).is_empty());
    assert_eq!((a.stats.trades_done, a.stats.results_unexpected), (1, 1));
}

/// The trade tick is off the attacks' ticks, so that trades and attacks never share a tick.
#[test]
fn trades_open_in_ticks_without_attacks() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    join_at(&mut a, "ann", (0.0, 0.0));
    join_at(&mut a, "bob", (1.0, 0.0));
    tick_to_trade(&mut a);
    assert_eq!(a.ticks, trade::TRADE_EVERY_TICKS - trade::TICK_OFFSET);
    assert!(
        !a.ticks.is_multiple_of(combat::ATTACK_EVERY_TICKS),
        "tick {} opens trades and attacks alike",
        a.ticks
    );
}

#[test]
fn a_partner_seen_as_a_ghost_of_another_node_gets_the_gift_across_the_border() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    assert_eq!((own.holder_entity, theirs.holder_entity), (ann, ann));
    assert_eq!(
        (a.stats.trades_started, a.stats.trades_across_border),
        (1, 1)
    );
    let g = granted_until_the_gift(&mut a, &own, &theirs);
    assert_eq!((g.target_entity, g.from_entity), (BOB_GHOST, ann));
    assert_eq!(census.trades(), (1, 0));
    let mut released = claim_releases(&gift_result(&mut a, &g, CommandError::CommandOk));
    released.sort();
    assert_eq!(
        released,
        [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
    );
    assert_eq!(a.stats.trades_done, 1);
}

/// Bob's escrow held elsewhere after Ann's was granted: refused, Ann's released at once.
#[test]
fn a_held_escrow_refuses_the_trade_and_releases_the_granted_one() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    let mut all = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
    assert!(all.is_empty(), "{all:?}");
    let out = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
    assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
    all.extend(out);
    assert_eq!(a.stats.trades_refused, 1);
    assert_eq!(a.trades_open(), 0);
    assert_eq!(census.trades(), (0, 0), "never opened");
    // Nothing more, up to and including the next trade tick where Ann asks afresh.
    all.extend(tick_n(&mut a, trade::HAGGLE_TICKS));
    let out = tick_to_trade(&mut a);
    let again = claims(&out);
    assert!(again
        .iter()
        .all(|c| c.request_id != own.request_id && c.request_id != theirs.request_id));
    all.extend(out);
    assert!(gifts(&all).is_empty(), "{all:?}");
    assert_released_at_most_once(&all, &[&theirs.key]);
}

/// Bob's escrow held elsewhere before Ann's was answered: nothing to release yet; Ann's is
/// released when its grant comes, once.
#[test]
fn an_escrow_still_asked_when_the_trade_is_refused_is_released_once_granted() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    let mut all = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
    assert!(claim_releases(&all).is_empty(), "{all:?}");
    assert_eq!(a.stats.trades_refused, 1);
    assert_eq!(a.trades_open(), 0);
    let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
    assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
    all.extend(out);
    // A repeated answer releases nothing again.
    all.extend(answer(&mut a, &own, ClaimOutcome::ClaimGranted));
    all.extend(tick_n(&mut a, trade::HAGGLE_TICKS + 1));
    assert!(gifts(&all).is_empty(), "{all:?}");
    assert_released_at_most_once(&all, &[&theirs.key]);
    assert_eq!(a.stats.trades_refused, 1, "one trade, refused once");
}

/// A trade refused while its own escrow is still asked: no next trade for that avatar until
/// the answer came (and was released), so the next trade's escrow is never the same grant
/// as the one the release frees.
#[test]
fn no_next_trade_while_an_escrow_of_the_last_awaits_its_answer() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
    assert_eq!(a.trades_open(), 0);
    let waiting = tick_n(&mut a, 2 * trade::TRADE_EVERY_TICKS);
    assert!(claims(&waiting).is_empty(), "{waiting:?}");
    let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
    assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
    let again = claims(&tick_to_trade(&mut a));
    assert_eq!(again.len(), 2, "the next trade once answered: {again:?}");
}

#[test]
fn an_escrow_still_asked_when_the_trade_is_refused_is_not_released_if_held() {
    let census = Arc::new(Census::default());
    let (mut a, _, own, theirs) = ann_trading_with_ghost_bob(&census);
    let mut all = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
    all.extend(answer(&mut a, &own, ClaimOutcome::ClaimHeld));
    assert!(claim_releases(&all).is_empty(), "{all:?}");
    assert_eq!(a.stats.claims_refused, 2);
    assert_eq!(a.stats.trades_refused, 1, "one trade, refused once");
}

/// A Freeze calls the trade off: its claims are released before the snapshot completes the
/// freeze, so the handoff carries none; the gift's late result moves no trade counter.
#[test]
fn a_freeze_mid_trade_releases_the_escrows_before_the_snapshot() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    let g = granted_until_the_gift(&mut a, &own, &theirs);
    let out = freeze(&mut a, ann, 2);
    let snapshot = out
        .iter()
        .position(|b| matches!(b, Body::Snapshot(s) if s.entity_id == ann))
        .expect("a snapshot");
    let releases_at: Vec<usize> = (0..out.len())
        .filter(|&i| matches!(out[i], Body::ClaimRelease(_)))
        .collect();
    assert_eq!(releases_at.len(), 2, "{out:?}");
    assert!(releases_at.iter().all(|&i| i < snapshot), "{out:?}");
    let mut released = claim_releases(&out);
    released.sort();
    assert_eq!(
        released,
        [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
    );
    assert_eq!(a.stats.trades_called_off, 1);
    assert_eq!(a.trades_open(), 0);
    assert!(!in_trade(&census, "ann"));
    // A repeated Freeze (its answer lost) is answered again, with nothing left to release.
    let out = freeze(&mut a, ann, 2);
    assert!(matches!(out.as_slice(), [Body::Snapshot(_)]), "{out:?}");
    assert_eq!(a.stats.trades_called_off, 1);

    let before = trade_counters(&a.stats);
    let out = gift_result(&mut a, &g, CommandError::CommandOk);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(trade_counters(&a.stats), before);
    assert_eq!((a.stats.results_ok, a.stats.results_unexpected), (1, 0));
}

/// Frozen with one escrow still asked: the granted one goes before the snapshot, the other
/// once its grant comes.
#[test]
fn a_freeze_with_an_escrow_still_asked_releases_it_when_granted() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    assert!(answer(&mut a, &own, ClaimOutcome::ClaimGranted).is_empty());
    let out = freeze(&mut a, ann, 2);
    assert!(
        matches!(out.as_slice(), [Body::ClaimRelease(r), Body::Snapshot(_)]
            if r.key == own.key && r.holder_entity == ann),
        "{out:?}"
    );
    assert_eq!(a.stats.trades_called_off, 1);
    let out = answer(&mut a, &theirs, ClaimOutcome::ClaimGranted);
    assert_eq!(claim_releases(&out), [(theirs.key.clone(), ann)]);
}

/// A player who leaves with an escrow still asked: the despawn frees what the holder had,
/// so the grant that comes after it is not released again (the sidecar knows it no more).
#[test]
fn an_escrow_granted_after_its_avatar_despawned_is_not_released() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    assert!(answer(&mut a, &theirs, ClaimOutcome::ClaimGranted).is_empty());
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::PlayerLeave(PlayerLeave {
            account: "ann".into(),
            session_epoch: 1,
            reason: "logout".into(),
        }),
    );
    let despawn = out
        .iter()
        .position(|b| matches!(b, Body::Despawn(d) if d.entity_id == ann))
        .expect("ann despawned");
    assert_eq!(claim_releases(&out[..despawn]), [(theirs.key.clone(), ann)]);
    assert_eq!(a.trades_open(), 0);
    let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
    assert!(claim_releases(&out).is_empty(), "{out:?}");
}

/// The result of a gift whose trade was called off belongs to that trade only: once the
/// avatar is thawed and trading again, it must not end the new trade.
#[test]
fn a_late_gift_result_does_not_end_the_avatars_next_trade() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    let g = granted_until_the_gift(&mut a, &own, &theirs);
    freeze(&mut a, ann, 2);
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::Thaw(Thaw {
            entity_id: ann,
            reason: "refused".into(),
        }),
    );
    let again = claims(&tick_to_trade(&mut a));
    assert_eq!(again.len(), 2, "{again:?}");
    for c in &again {
        assert!(answer(&mut a, c, ClaimOutcome::ClaimGranted).is_empty());
    }
    let before = trade_counters(&a.stats);
    let out = gift_result(&mut a, &g, CommandError::CommandOk);
    assert!(
        claim_releases(&out).is_empty(),
        "the new trade's claims released by the old gift's result: {out:?}"
    );
    assert_eq!(a.trades_open(), 1, "the new trade ended by the old result");
    assert_eq!(trade_counters(&a.stats), before);
}

/// A lost escrow ends the trade while haggling: only the other one is released, no gift.
#[test]
fn a_claim_lost_mid_haggle_ends_the_trade_without_a_gift() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    assert!(answer(&mut a, &own, ClaimOutcome::ClaimGranted).is_empty());
    assert!(answer(&mut a, &theirs, ClaimOutcome::ClaimGranted).is_empty());
    let out = tick_n(&mut a, trade::HAGGLE_TICKS / 2);
    assert!(gifts(&out).is_empty());
    let mut all = lose(&mut a, "bob", ann);
    assert_eq!(claim_releases(&all), [(trade::escrow("ann"), ann)]);
    assert_eq!((a.stats.trades_lost, a.stats.claims_lost), (1, 1));
    assert_eq!(a.trades_open(), 0);
    assert!(!in_trade(&census, "ann") && !in_trade(&census, "bob"));
    // Lost again: a loss, but no trade of it to end.
    all.extend(lose(&mut a, "bob", ann));
    assert_eq!((a.stats.trades_lost, a.stats.claims_lost), (1, 2));
    all.extend(tick_n(&mut a, trade::HAGGLE_TICKS));
    assert!(gifts(&all).is_empty(), "{all:?}");
    assert_eq!(a.commands_outstanding(), 0);
    assert_released_at_most_once(&all, &[&theirs.key]);
}

/// A loss of an earlier grant (sent as the trade's release was on its way) reaching the
/// avatar's next trade, whose escrow of that key is only asked for: whatever becomes of that
/// trade, no escrow granted to it stays held once it is over.
#[test]
fn a_stale_claim_lost_leaves_no_escrow_of_the_next_trade_held() {
    let census = Arc::new(Census::default());
    let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
    let g = granted_until_the_gift(&mut a, &own, &theirs);
    assert_eq!(
        claim_releases(&gift_result(&mut a, &g, CommandError::CommandOk)).len(),
        2
    );
    let again = claims(&tick_to_trade(&mut a));
    assert_eq!(again.len(), 2, "{again:?}");
    let mut all = lose(&mut a, "ann", ann);
    for c in &again {
        all.extend(answer(&mut a, c, ClaimOutcome::ClaimGranted));
    }
    if a.trades_open() == 0 {
        let mut released = claim_releases(&all);
        released.sort();
        assert_eq!(
            released,
            [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)],
            "the trade ended with a granted escrow left held"
        );
    } else {
        assert!(a.trades[&ann].both_granted());
    }
}

fn gift_in(target: u64, request_id: u64, trade_id: u64) -> M {
    M::CommandIn(CommandIn {
        target,
        from_entity: BOB_GHOST,
        from_account: "bob".into(),
        r#type: trade::CMD_TRADE,
        payload: trade::encode(trade::GIFT_GOLD, trade_id),
        request_id,
        from_node: NODE + 1,
    })
}

#[test]
fn a_gift_to_a_player_here_is_applied_and_one_to_an_npc_refused() {
    let census = Arc::new(Census::default());
    let mut a = arena(1, &census);
    let npc = a.held().find(|h| !h.player).unwrap().id;
    let ann = join_at(&mut a, "ann", (0.0, 0.0));
    let mut out = Vec::new();
    a.on_message(&mut out, gift_in(ann, 7, 42));
    assert!(
        matches!(
            out.as_slice(),
            [Body::CommandReply(CommandReply {
                request_id: 7,
                refused: false,
                ..
            })]
        ),
        "{out:?}"
    );
    assert_eq!((a.stats.gifts_applied, a.stats.commands_refused), (1, 0));
    assert_eq!(census.commands(), (1, 0));

    let mut out = Vec::new();
    a.on_message(&mut out, gift_in(npc, 8, 43));
    let [Body::CommandReply(r)] = out.as_slice() else {
        panic!("one reply: {out:?}")
    };
    assert!(
        r.refused && r.request_id == 8 && !r.detail.is_empty(),
        "{r:?}"
    );
    assert_eq!((a.stats.gifts_applied, a.stats.commands_refused), (1, 1));
    assert_eq!(census.commands(), (1, 0), "not applied");
}

/// A player adopted from another node was seen here as a ghost: it is this arena's own now,
/// never its own trade partner, and not a partner across a border.
#[test]
fn an_adopted_player_is_no_longer_a_partner_by_its_ghost_entry() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let mut out = Vec::new();
    a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (10.0, 0.0)));
    let mut snap = player_snapshot("bob", 0, 0);
    snap.pos = [10.0, 0.0, 0.0];
    a.on_message(&mut out, M::Adopt(adopt_msg(BOB_GHOST, 2, &snap, "bob")));
    assert!(matches!(out.as_slice(), [Body::Adopted(_)]), "{out:?}");
    let out = tick_n(&mut a, trade::TRADE_EVERY_TICKS);
    assert!(claims(&out).is_empty(), "Bob traded with himself: {out:?}");
    assert_eq!(a.stats.trades_started, 0);

    let ann = join_at(&mut a, "ann", (0.0, 0.0));
    assert_eq!(claims(&tick_to_trade(&mut a)).len(), 4);
    assert_eq!(a.trades[&ann].partner, BOB_GHOST);
    assert_eq!(a.trades[&BOB_GHOST].partner, ann);
    assert_eq!(a.trades[&BOB_GHOST].accounts(), ["bob", "ann"]);
    assert_eq!(a.stats.trades_across_border, 0, "Bob is simulated here");
}

/// Another avatar of the same account (a ghost of another node, or a second one adopted
/// here) is never a partner, however near; a farther player still is.
#[test]
fn a_player_never_trades_with_another_avatar_of_its_own_account() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let ann = join_at(&mut a, "ann", (0.0, 0.0));
    let mut out = Vec::new();
    a.on_message(&mut out, player_ghost(777, "ann", (5.0, 0.0)));
    let mut snap = player_snapshot("ann", 0, 0);
    snap.pos = [0.0, 5.0, 0.0];
    a.on_message(&mut out, M::Adopt(adopt_msg(778, 2, &snap, "ann")));
    let out = tick_n(&mut a, trade::TRADE_EVERY_TICKS);
    assert!(claims(&out).is_empty(), "{out:?}");

    let mut out = Vec::new();
    a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (20.0, 0.0)));
    let asked = claims(&tick_to_trade(&mut a));
    assert_eq!(a.trades.keys().copied().collect::<Vec<_>>(), [778, ann]);
    for t in a.trades.values() {
        assert_eq!(t.partner, BOB_GHOST);
        assert_eq!(t.accounts(), ["ann", "bob"]);
    }
    for avatar in [ann, 778] {
        let keys: HashSet<&str> = asked
            .iter()
            .filter(|c| c.holder_entity == avatar)
            .map(|c| c.key.as_str())
            .collect();
        assert_eq!(keys, HashSet::from(["trade:ann", "trade:bob"]), "{asked:?}");
    }
}
