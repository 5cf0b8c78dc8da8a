//! The run as an SVG: players' RTT over time, the weighted means of the policy and its two
//! yardsticks, the fairness cap, and the moves.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::run::Report;

/// Beyond this many lines of players, lines are drawn per location (their mean).
const MAX_PLAYER_LINES: usize = 8;

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 560;

/// Players' lines: strong colours, none of them the red, grey, green and black of the cap and the
/// means, nor the purple of moves.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(40, 50, 120),
    RGBColor(200, 150, 0),
];
const MOVE: RGBColor = RGBColor(148, 103, 189);
const CORE: RGBColor = RGBColor(110, 110, 110);
const ORACLE: RGBColor = RGBColor(0, 150, 70);

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("drawing the plot: {0}")]
pub struct PlotError(String);

fn err<E: std::fmt::Debug>(e: E) -> PlotError {
    PlotError(format!("{e:?}"))
}

/// A sampled series as steps (each value holds until the next sample), split at gaps.
fn steps(xs: &[f64], ys: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
    let mut out = vec![Vec::new()];
    for (k, (x, y)) in xs.iter().zip(ys).enumerate() {
        match y {
            Some(y) => {
                let seg = out.last_mut().expect("never empty");
                seg.push((*x, *y));
                if let Some(next) = xs.get(k + 1) {
                    seg.push((*next, *y));
                }
            }
            None if out.last().is_some_and(|s| !s.is_empty()) => out.push(Vec::new()),
            None => {}
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

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

/// One legend entry: label, colour, line width, dashed.
struct Key {
    label: String,
    colour: RGBColor,
    width: u32,
    dashed: bool,
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
    if !series.moves.is_empty() {
        keys.push(Key {
            label: "bubble move or merge".into(),
            colour: MOVE,
            width: 2,
            dashed: true,
        });
    }
    const KEY_ROW: u32 = 22;
    let key_rows = keys.len().div_ceil(2) as u32;
    let legend_h = key_rows * KEY_ROW + 24;

    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT + legend_h)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, bottom) = root.split_vertically(HEIGHT);
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

        // Moves first, under everything else. Labels of close moves are staggered, and those
        // near the right edge are written to the left of their line.
        for (i, (t, label)) in series.moves.iter().enumerate() {
            let x = t / 60.0;
            chart
                .draw_series(DashedLineSeries::new(
                    [(x, 0.0), (x, data_top * 1.12)],
                    6,
                    3,
                    MOVE.stroke_width(2),
                ))
                .map_err(err)?;
            let right = x > x_max * 0.75;
            let anchor = if right { HPos::Right } else { HPos::Left };
            let nudge = if right { -0.005 } else { 0.005 } * x_max;
            let font = ("sans-serif", 13)
                .into_font()
                .color(&MOVE)
                .pos(Pos::new(anchor, VPos::Center));
            chart
                .draw_series([Text::new(
                    label.clone(),
                    (x + nudge, data_top * (1.22 - 0.05 * (i % 3) as f64)),
                    font,
                )])
                .map_err(err)?;
        }
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

        // The legend, in two columns under the chart.
        let col_w = (WIDTH as i32 - 120) / 2;
        for (i, k) in keys.iter().enumerate() {
            let (col, row) = ((i as u32 / key_rows) as i32, (i as u32 % key_rows) as i32);
            let x = 76 + col * col_w;
            let y = 8 + row * KEY_ROW as i32 + KEY_ROW as i32 / 2;
            let style = k.colour.stroke_width(k.width);
            if k.dashed {
                for d in 0..3 {
                    let x0 = x + d * 10;
                    bottom
                        .draw(&PathElement::new([(x0, y), (x0 + 6, y)], style))
                        .map_err(err)?;
                }
            } else {
                bottom
                    .draw(&PathElement::new([(x, y), (x + 26, y)], style))
                    .map_err(err)?;
            }
            bottom
                .draw(&Text::new(
                    k.label.clone(),
                    (x + 36, y),
                    ("sans-serif", 14)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                ))
                .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_is_drawn_as_steps_split_at_gaps() {
        let xs = [0.0, 1.0, 2.0, 3.0, 4.0];
        let ys = [None, Some(1.0), None, Some(2.0), Some(3.0)];
        assert_eq!(
            steps(&xs, &ys),
            vec![
                vec![(1.0, 1.0), (2.0, 1.0)],
                vec![(3.0, 2.0), (4.0, 2.0), (4.0, 3.0)]
            ]
        );
        assert!(steps(&xs, &[None; 5]).is_empty());
    }
}
