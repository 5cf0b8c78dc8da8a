//! The cases of seed `002`, in virtual time: a world whose west half is homed in Paris and east
//! half in Montreal, a player connected to the Paris proxy, stepped a second at a time.

use super::*;

const BORDER_X: f64 = 65_536.0;
/// Small regions, so that a walker crosses one in minutes.
const REGION_M: f64 = 1_024.0;

fn world() -> WorldShape {
    WorldShape::default()
}

fn whereabouts(x: f64) -> Whereabouts {
    Whereabouts {
        geo: if (0.0..BORDER_X).contains(&x) {
            "paris"
        } else {
            "montreal"
        }
        .into(),
        region: (x / REGION_M).floor() as u64,
        pos: Pos { x, y: 1_000.0 },
    }
}

fn figure(ms: f64) -> RttFigure {
    RttFigure {
        min_ms: ms,
        median_ms: ms + 2.0,
        samples: 10,
    }
}

/// RTT as the Paris proxy measured it, and as the Montreal proxy measured and published it.
fn rtt(paris_ms: f64, montreal_ms: f64) -> GeoRtt {
    GeoRtt {
        current: Some(figure(paris_ms)),
        far: HashMap::from([("montreal".to_string(), figure(montreal_ms))]),
    }
}

/// A player from Montreal: 90 ms to Paris, 10 ms to Montreal.
fn montrealer() -> GeoRtt {
    rtt(90.0, 10.0)
}

/// Runs a path (`x` at each second) and returns every verdict with its time.
fn run(path: impl Fn(u64) -> f64, seconds: u64, rtt: &GeoRtt) -> Vec<(u64, Verdict)> {
    let mut h = Handover::new(HandoverParams::default(), world(), "paris");
    (0..=seconds)
        .map(|s| {
            let at = whereabouts(path(s));
            (s * 1000, h.observe(s * 1000, &1u64, &at, rtt))
        })
        .collect()
}

fn handovers(verdicts: &[(u64, Verdict)]) -> Vec<(u64, Because)> {
    verdicts
        .iter()
        .filter_map(|(t, v)| match v {
            Verdict::HandOver { to_geo, because } => {
                assert_eq!(to_geo, "montreal");
                Some((*t, *because))
            }
            Verdict::Stay { .. } => None,
        })
        .collect()
}

/// Walks east at 5 m/s from 100 m west of the border, for `walk_s`, then stands still.
fn walk_east(walk_s: u64) -> impl Fn(u64) -> f64 {
    move |s| BORDER_X - 100.0 + 5.0 * s.min(walk_s) as f64
}

#[test]
fn a_player_who_crosses_back_pays_nothing() {
    // Over the border for 40 s (200 m deep), then back: bridged all the while, never handed over.
    let path = |s: u64| {
        let out = BORDER_X - 100.0 + 5.0 * s.min(60) as f64;
        if s <= 60 {
            out
        } else {
            (out - 5.0 * (s - 60) as f64).max(BORDER_X - 200.0)
        }
    };
    let v = run(path, 1200, &montrealer());
    assert!(handovers(&v).is_empty(), "{:?}", handovers(&v));
    assert!(v.iter().any(|(_, v)| *v
        == Verdict::Stay {
            why: Stay::Settling
        }));
    assert_eq!(
        v.last().unwrap().1,
        Verdict::Stay { why: Stay::Home },
        "back home, the bridge is gone"
    );
}

/// Into Montreal's first region, 300 m deep, for two minutes; then on east into the next region.
fn settle_then_cross(s: u64) -> f64 {
    let x = BORDER_X - 100.0 + 5.0 * s.min(80) as f64;
    if s < 200 {
        x
    } else {
        x + 5.0 * (s - 200) as f64
    }
}

#[test]
fn a_settled_player_is_handed_over_at_their_next_crossing() {
    let path = settle_then_cross;
    let crossing_s = (0..).find(|&s| path(s) >= BORDER_X + REGION_M).unwrap();
    let v = run(path, crossing_s + 600, &montrealer());
    assert_eq!(
        handovers(&v).first(),
        Some(&(crossing_s * 1000, Because::SettledCrossing)),
        "handed over exactly at the crossing"
    );
    // Settled (past settle_ms, deep enough) long before, waiting for that crossing.
    let (armed_at, _) = v
        .iter()
        .find(|(_, v)| {
            *v == Verdict::Stay {
                why: Stay::AwaitingCrossing,
            }
        })
        .unwrap();
    assert!(*armed_at < crossing_s * 1000 && *armed_at >= 60_000);
}

#[test]
fn a_player_who_neither_crosses_back_nor_on_is_handed_over_after_the_longest_bridge() {
    let v = run(walk_east(60), 900, &montrealer());
    let p = HandoverParams::default();
    // Entered the far geo after 20 s (100 m at 5 m/s).
    assert_eq!(
        handovers(&v).first(),
        Some(&(20_000 + p.max_bridge_ms, Because::MaxBridge))
    );
}

#[test]
fn a_player_near_the_proxy_is_never_handed_over_however_long_they_stay() {
    // A Parisian who walks deep into Montreal's half and roams there for two hours, crossing
    // region after region: the ocean is in the path whichever proxy they use.
    let path = |s: u64| BORDER_X - 100.0 + 5.0 * s as f64 % 60_000.0;
    let v = run(path, 7200, &rtt(6.0, 96.0));
    assert!(handovers(&v).is_empty());
    assert!(v.iter().filter(|(t, _)| *t > 30_000).all(|(_, v)| *v
        == Verdict::Stay {
            why: Stay::NearProxy
        }));
}

#[test]
fn what_the_far_proxy_measured_decides_not_what_the_client_says() {
    // The client would claim 10 ms to Montreal; the Montreal proxy measured 85 ms (it is not
    // clearly nearer than the 90 ms to Paris), so the player stays bridged for good.
    let path = |s: u64| BORDER_X - 100.0 + 5.0 * s as f64 % 60_000.0;
    let v = run(path, 3600, &rtt(90.0, 85.0));
    assert!(handovers(&v).is_empty());
    assert_eq!(
        v.last().unwrap().1,
        Verdict::Stay {
            why: Stay::NotNearer
        }
    );
}

#[test]
fn no_far_measurement_means_no_handover() {
    let no_far = GeoRtt {
        current: Some(figure(90.0)),
        far: HashMap::new(),
    };
    let v = run(walk_east(60), 3600, &no_far);
    assert!(handovers(&v).is_empty());
    let thin = GeoRtt {
        current: Some(figure(90.0)),
        far: HashMap::from([(
            "montreal".to_string(),
            RttFigure {
                samples: 2,
                ..figure(10.0)
            },
        )]),
    };
    assert!(handovers(&run(walk_east(60), 3600, &thin)).is_empty());
}

#[test]
fn a_crossing_before_settling_does_not_count() {
    // A ship at 200 m/s crosses a region every 5 s from the moment it enters: none of those
    // crossings counts until it has been in the far geo for settle_ms.
    let ship = |s: u64| BORDER_X - 100.0 + 200.0 * s as f64;
    let v = run(ship, 200, &montrealer());
    let first_inner = (0..).find(|&s| ship(s) >= BORDER_X + REGION_M).unwrap();
    let h = handovers(&v);
    assert!(
        h.first().is_some_and(|(t, b)| *t > first_inner * 1000
            && *t >= 60_000
            && *b == Because::SettledCrossing),
        "{h:?}"
    );
}

#[test]
fn bad_parameters_are_refused_by_name() {
    let bad = HandoverParams {
        max_bridge_ms: 1,
        ..HandoverParams::default()
    };
    assert_eq!(bad.validate().unwrap_err().name, "max_bridge_ms");
    let bad = HandoverParams {
        max_ratio: 0.0,
        ..HandoverParams::default()
    };
    assert_eq!(bad.validate().unwrap_err().name, "max_ratio");
    let bad = HandoverParams {
        near_ms: f64::NAN,
        ..HandoverParams::default()
    };
    assert_eq!(bad.validate().unwrap_err().name, "near_ms");
    HandoverParams::default().validate().unwrap();
}

/// What the proxies would measure of a client that delays its answers by `delay_ms` (to its own
/// proxy when `own`, to the far one when `far`): the kernel's figure does not move, timed pings
/// do.
fn measured(true_current: f64, true_far: f64, own: f64, far: f64, kernel: bool) -> GeoRtt {
    if kernel {
        rtt(true_current, true_far)
    } else {
        rtt(true_current + own, true_far + far)
    }
}

#[test]
fn a_client_delaying_its_answers_from_login_gets_the_honest_decisions_from_kernel_figures() {
    // A Montrealer on the Paris proxy, settling in Montreal's half and crossing on: the honest
    // run hands them over at the crossing.
    let path = settle_then_cross;
    let honest = run(path, 900, &measured(90.0, 10.0, 0.0, 0.0, true));
    assert!(!handovers(&honest).is_empty());
    for (own, far) in [(90.0, 90.0), (0.0, 90.0)] {
        // Delays every pong, or only the far site's probes: with the kernel's figures, the
        // decisions are the honest ones, verdict for verdict.
        let cheat = run(path, 900, &measured(90.0, 10.0, own, far, true));
        assert_eq!(cheat, honest, "own +{own} ms, far +{far} ms");
    }
    // Timed pings alone: delaying every answer shifts both figures alike and still gets the
    // honest handover; delaying only the far site's probes makes it look no nearer, and the
    // player would stay bridged for good.
    let pinged = run(path, 900, &measured(90.0, 10.0, 90.0, 90.0, false));
    assert_eq!(handovers(&pinged).first(), handovers(&honest).first());
    let pinged = run(path, 900, &measured(90.0, 10.0, 0.0, 90.0, false));
    assert!(handovers(&pinged).is_empty());
}
