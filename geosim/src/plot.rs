//! The run as an SVG: players' RTT over time, the weighted means of the policy and its two
//! yardsticks, the fairness cap, the sites' outages (shaded), and the moves, each labelled with its
//! group and kind (gain, cap, merge, fallback). Labels are laid out in rows so that none overlaps
//! another; past [`MAX_LABELLED_MOVES`] moves (a crowd of a thousand players), the moves are drawn
//! as one lane per group under the chart instead, ticks coloured by kind, so the picture stays
//! legible.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use cellmesh_plot::{
    draw_lanes, draw_legend, draw_marks, err, lanes_by, lanes_height, legend_height, steps, Key,
    Mark, MarkFrame, PlotError, OUTAGE, PALETTE, WIDTH,
};
use cellmesh_world::bubbles::BubbleId;

use super::run::Report;

/// Beyond this many lines of players, lines are drawn per location (their mean).
const MAX_PLAYER_LINES: usize = 8;

const HEIGHT: u32 = 560;
/// Beyond this many moves, they are drawn in lanes rather than labelled one by one.
pub const MAX_LABELLED_MOVES: usize = 30;
/// The plotting area's width in pixels (the figure less the margins and the y labels).
const PLOT_PX: f64 = (WIDTH - 60 - 2 * 16) as f64;

const MOVE: RGBColor = RGBColor(148, 103, 189);
/// Moves by kind: gain in the moves' purple, the forced ones in colours of their own.
fn kind_colour(kind: &str) -> RGBColor {
    match kind {
        "cap" => RGBColor(214, 90, 0),
        "merge" => RGBColor(0, 128, 128),
        "fallback" => RGBColor(120, 60, 20),
        _ => MOVE,
    }
}
const KINDS: [&str; 4] = ["gain", "cap", "merge", "fallback"];
const CORE: RGBColor = RGBColor(110, 110, 110);
const ORACLE: RGBColor = RGBColor(0, 150, 70);

/// The players' lines: players whose RTT never differs share one; in a crowd, one per location
/// (their mean).
fn player_lines(report: &Report, locations: &[String]) -> Vec<(String, Vec<Option<f64>>)> {
    let series = &report.series;
    let mut same: Vec<(Vec<usize>, &Vec<Option<f64>>)> = Vec::new();
    for (i, ys) in series.player_rtt_ms.iter().enumerate() {
        match same
            .iter_mut()
            .find(|(idx, other)| *other == ys && locations[idx[0]] == locations[i])
        {
            Some((idx, _)) => idx.push(i),
            None => same.push((vec![i], ys)),
        }
    }
    if same.len() <= MAX_PLAYER_LINES {
        return same
            .into_iter()
            .map(|(idx, ys)| {
                let names: Vec<&str> = idx.iter().map(|&i| report.players[i].as_str()).collect();
                let who = match names.len() {
                    1..=3 => names.join(", "),
                    n => format!("{} … {}, {n} players", names[0], names[n - 1]),
                };
                (format!("{who} ({})", locations[idx[0]]), ys.clone())
            })
            .collect();
    }
    let mut locs: Vec<&String> = locations.iter().collect();
    locs.sort();
    locs.dedup();
    let n = series.t_s.len();
    locs.into_iter()
        .map(|loc| {
            let idx: Vec<usize> = (0..locations.len())
                .filter(|&i| &locations[i] == loc)
                .collect();
            let ys = (0..n)
                .map(|k| {
                    let v: Vec<f64> = idx
                        .iter()
                        .filter_map(|&i| series.player_rtt_ms[i][k])
                        .collect();
                    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
                })
                .collect();
            (format!("{} players from {loc} (mean)", idx.len()), ys)
        })
        .collect()
}

/// Renders the report as an SVG document.
pub fn render_svg(report: &Report) -> Result<String, PlotError> {
    let series = &report.series;
    let s = &report.summary;
    let locations: Vec<String> = s.players.iter().map(|p| p.location.clone()).collect();
    let lines = player_lines(report, &locations);
    let xs: Vec<f64> = series.t_s.iter().map(|t| t / 60.0).collect();
    let x_max = (s.duration_s / 60.0).max(1.0 / 60.0);
    let data_top = lines
        .iter()
        .flat_map(|(_, ys)| ys.iter().flatten())
        .chain(series.always_core_ms.iter().flatten())
        .fold(s.fairness_cap_ms, |a, &b| a.max(b));
    let y_top = data_top * 1.3;
    let cap = s.fairness_cap_ms;

    let mut keys = vec![Key {
        label: format!(
            "weighted mean, policy: {:.1} ms, {} moves",
            s.policy.weighted_mean_rtt_ms, s.policy.moves
        ),
        colour: BLACK,
        width: 3,
        dashed: false,
    }];
    keys.push(Key {
        label: format!(
            "weighted mean, everyone on the core: {:.1} ms",
            s.always_core.weighted_mean_rtt_ms
        ),
        colour: CORE,
        width: 2,
        dashed: true,
    });
    keys.push(Key {
        label: format!(
            "weighted mean, oracle without hysteresis: {:.1} ms, {} moves",
            s.oracle.weighted_mean_rtt_ms, s.oracle.moves
        ),
        colour: ORACLE,
        width: 2,
        dashed: true,
    });
    for (i, (label, _)) in lines.iter().enumerate() {
        keys.push(Key {
            label: label.clone(),
            colour: PALETTE[i % PALETTE.len()],
            width: 2,
            dashed: false,
        });
    }
    keys.push(Key {
        label: format!("fairness cap: {cap:.0} ms"),
        colour: RED,
        width: 1,
        dashed: true,
    });
    for kind in KINDS {
        if series.moves.iter().any(|m| m.kind == kind) {
            keys.push(Key {
                label: format!("bubble move: {kind} (label: group kind from→to)"),
                colour: kind_colour(kind),
                width: 2,
                dashed: true,
            });
        }
    }
    if !series.outages.is_empty() {
        keys.push(Key {
            label: "site down (shaded)".into(),
            colour: OUTAGE,
            width: 8,
            dashed: false,
        });
    }
    let legend_h = legend_height(&keys);
    // Lanes: the groups by number of moves, the last lane for all the rest.
    let lanes_mode = series.moves.len() > MAX_LABELLED_MOVES;
    let lanes = if lanes_mode {
        let groups: Vec<BubbleId> = series.moves.iter().map(|m| m.group).collect();
        lanes_by(&groups, |g, n| format!("{g} ({n})"), "groups")
    } else {
        Vec::new()
    };
    let lanes_h = if lanes_mode { lanes_height(&lanes) } else { 0 };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT + lanes_h + legend_h))
            .into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, rest) = root.split_vertically(HEIGHT);
        let (lane_area, bottom) = rest.split_vertically(lanes_h);
        let mut chart = ChartBuilder::on(&top)
            .caption(
                format!(
                    "{}: each player's RTT to the site simulating them",
                    s.scenario
                ),
                ("sans-serif", 22),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..y_top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("time (min)")
            .y_desc("RTT (ms)")
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.08))
            .label_style(("sans-serif", 14))
            .x_label_formatter(&|v| {
                if x_max <= 5.0 {
                    format!("{v:.1}")
                } else {
                    format!("{v:.0}")
                }
            })
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;

        // Outages first, shaded over the whole height, each named at its top.
        for (site, from, to) in &series.outages {
            let (a, b) = (from / 60.0, (to / 60.0).min(x_max));
            chart
                .draw_series([Rectangle::new(
                    [(a, 0.0), (b, y_top)],
                    OUTAGE.mix(0.10).filled(),
                )])
                .map_err(err)?;
            chart
                .draw_series([Text::new(
                    format!("{site} down"),
                    (a + 0.004 * x_max, y_top * 0.97),
                    ("sans-serif", 13)
                        .into_font()
                        .color(&OUTAGE)
                        .pos(Pos::new(HPos::Left, VPos::Top)),
                )])
                .map_err(err)?;
        }
        // Moves, under the lines: a dashed line each; a label each in the rows above the data,
        // laid out so that none overlaps another (or, in lanes mode, no label here at all).
        let marks: Vec<Mark> = series
            .moves
            .iter()
            .map(|m| Mark {
                x: m.t_s / 60.0,
                label: m.label(),
                colour: kind_colour(m.kind),
                count: 1,
            })
            .collect();
        let frame = MarkFrame {
            x_max,
            x_per_px: x_max / PLOT_PX,
            data_top,
            y_top,
        };
        draw_marks(&mut chart, &marks, &frame, !lanes_mode, "moves")?;
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, cap), (x_max, cap)],
                8,
                5,
                RED.stroke_width(1),
            ))
            .map_err(err)?;
        for (i, (_, ys)) in lines.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            for seg in steps(&xs, ys) {
                chart
                    .draw_series(LineSeries::new(seg, colour.stroke_width(2)))
                    .map_err(err)?;
            }
        }
        for (ys, colour) in [(&series.always_core_ms, CORE), (&series.oracle_ms, ORACLE)] {
            for seg in steps(&xs, ys) {
                chart
                    .draw_series(DashedLineSeries::new(seg, 7, 4, colour.stroke_width(2)))
                    .map_err(err)?;
            }
        }
        for seg in steps(&xs, &series.policy_ms) {
            chart
                .draw_series(LineSeries::new(seg, BLACK.stroke_width(3)))
                .map_err(err)?;
        }

        // The lanes: one row per group, a tick per move in its kind's colour.
        if lanes_mode {
            draw_lanes(
                &lane_area,
                &format!(
                    "{} moves, one lane per group (most moves first)",
                    series.moves.len()
                ),
                &lanes,
                (76 + 60, WIDTH as i32 - 16),
                |i| {
                    let m = &series.moves[i];
                    (m.t_s / 60.0 / x_max, kind_colour(m.kind))
                },
            )?;
        }

        draw_legend(&bottom, &keys)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}
