//! A `cellmesh up` run as an SVG (`--svg`): the click-to-screen time by bot location over time
//! (the median and 99th percentile of each second), the sessions bridged to another geo (right
//! axis), every handover as a mark labelled with its player and cause, and killed nodes shaded
//! until their fresh process was up. The labels are laid out like `geo simulate --svg`'s, never
//! overlapping; past [`MAX_LABELLED_HANDOVERS`] the handovers go into one lane per route instead.

use std::collections::BTreeMap;

use cellmesh_plot::{
    draw_lanes, draw_legend, draw_marks, err, lanes_by, lanes_height, legend_height, place_labels,
    steps, Key, Mark, MarkFrame, PlotError, CHAR_PX, OUTAGE, PALETTE, WIDTH,
};
use cellmesh_proxy::HandoverCause;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::bots::Bin;

const HEIGHT: u32 = 560;
/// Beyond this many handovers, they are drawn in lanes rather than labelled one by one.
pub const MAX_LABELLED_HANDOVERS: usize = 30;
/// Points drawn per line at most: longer runs merge neighbouring seconds.
const MAX_POINTS: usize = 600;
/// The plotting area's left edge and width in pixels (margins and both axes' labels less).
const PLOT_LEFT: i32 = 16 + 60;
const PLOT_PX: f64 = (WIDTH - 2 * 16 - 2 * 60) as f64;
const BRIDGED: RGBColor = RGBColor(110, 110, 110);

/// One handover, as the handing-over proxy recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct HandoverMark {
    /// Since the run started (s).
    pub t_s: f64,
    pub account: String,
    pub from: String,
    pub to: String,
    pub because: HandoverCause,
}

/// Handovers close enough in time to share one line and one label: same route, same cause.
#[derive(Debug, Clone, PartialEq)]
struct HandoverGroup<'a> {
    t_s: f64,
    marks: Vec<&'a HandoverMark>,
}

impl HandoverGroup<'_> {
    fn label(&self) -> String {
        let h = self.marks[0];
        let who = match self.marks.as_slice() {
            [one] => one.account.clone(),
            [a, b] => format!("{}, {}", a.account, b.account),
            [a, rest @ ..] => format!("{} +{}", a.account, rest.len()),
            [] => String::new(),
        };
        format!("{who} {} {}→{}", cause_name(h.because), h.from, h.to)
    }
}

/// Groups handovers (in time order) that fall within `within_s` of their group's first and share
/// its route and cause.
fn group_handovers(handovers: &[HandoverMark], within_s: f64) -> Vec<HandoverGroup<'_>> {
    let mut sorted: Vec<&HandoverMark> = handovers.iter().collect();
    sorted.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
    let mut groups: Vec<HandoverGroup> = Vec::new();
    for h in sorted {
        let joins = groups
            .iter_mut()
            .rev()
            .take_while(|g| h.t_s - g.t_s <= within_s)
            .find(|g| {
                let first = g.marks[0];
                (first.from.as_str(), first.to.as_str(), first.because)
                    == (h.from.as_str(), h.to.as_str(), h.because)
            });
        match joins {
            Some(g) => g.marks.push(h),
            None => groups.push(HandoverGroup {
                t_s: h.t_s,
                marks: vec![h],
            }),
        }
    }
    groups
}

/// A node killed (`--chaos`), from the kill to its fresh process being up.
#[derive(Debug, Clone, PartialEq)]
pub struct KillMark {
    pub node: u32,
    /// Its geo, on a run of several.
    pub geo: Option<String>,
    pub from_s: f64,
    pub to_s: f64,
}

/// What a run's plot shows.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    pub title: String,
    /// A line under the title (the geos and their delays); none when empty.
    pub subtitle: String,
    pub duration_s: f64,
    /// Each bot location's seconds.
    pub click_to_screen: BTreeMap<String, Vec<Bin>>,
    /// Sessions bridged to another geo, sampled (s, count).
    pub bridged: Vec<(f64, u64)>,
    pub handovers: Vec<HandoverMark>,
    pub kills: Vec<KillMark>,
}

fn cause_name(c: HandoverCause) -> &'static str {
    match c {
        HandoverCause::SettledCrossing => "settled",
        HandoverCause::MaxBridge => "max-bridge",
        HandoverCause::Operator => "operator",
    }
}

fn cause_colour(c: HandoverCause) -> RGBColor {
    match c {
        HandoverCause::SettledCrossing => RGBColor(148, 103, 189),
        HandoverCause::MaxBridge => RGBColor(214, 90, 0),
        HandoverCause::Operator => RGBColor(0, 128, 128),
    }
}

const CAUSES: [HandoverCause; 3] = [
    HandoverCause::SettledCrossing,
    HandoverCause::MaxBridge,
    HandoverCause::Operator,
];

/// At most [`MAX_POINTS`] bins: runs of neighbouring ones merged (the median of their medians,
/// the highest of their 99th percentiles).
fn thinned(bins: &[Bin]) -> Vec<Bin> {
    let k = bins.len().div_ceil(MAX_POINTS).max(1);
    bins.chunks(k)
        .map(|run| {
            let mut p50: Vec<f64> = run.iter().map(|b| b.p50_ms).collect();
            p50.sort_by(f64::total_cmp);
            Bin {
                t_s: run[0].t_s,
                p50_ms: p50[(p50.len() - 1) / 2],
                p99_ms: run.iter().map(|b| b.p99_ms).fold(0.0, f64::max),
                samples: run.iter().map(|b| b.samples).sum(),
            }
        })
        .collect()
}

/// A line's points on the time axis, with a gap wherever a second had no sample.
fn with_gaps(bins: &[Bin], value: impl Fn(&Bin) -> f64) -> (Vec<f64>, Vec<Option<f64>>) {
    let step = bins
        .windows(2)
        .map(|w| w[1].t_s - w[0].t_s)
        .fold(f64::INFINITY, f64::min);
    let mut xs = Vec::with_capacity(bins.len() + 1);
    let mut ys = Vec::with_capacity(bins.len() + 1);
    for (i, b) in bins.iter().enumerate() {
        if i > 0 && b.t_s - bins[i - 1].t_s > step * 1.5 {
            xs.push(bins[i - 1].t_s + step);
            ys.push(None);
        }
        xs.push(b.t_s);
        ys.push(Some(value(b)));
    }
    if let Some(last) = bins.last() {
        // The last bin holds until its end (a lone one for a second).
        xs.push(last.t_s + if step.is_finite() { step } else { 1.0 });
        ys.push(None);
    }
    (xs, ys)
}

/// The legend: each location's two lines, the bridged sessions, each cause of handover, and the
/// kills.
fn legend_keys(
    t: &Timeline,
    series: &[(&String, Vec<Bin>)],
    clipped: bool,
    bridged_top: u64,
) -> Vec<Key> {
    let mut keys = Vec::new();
    for (i, (loc, bins)) in series.iter().enumerate() {
        let samples: usize = bins.iter().map(|b| b.samples).sum();
        let name = if loc.is_empty() { "bots" } else { loc.as_str() };
        keys.push(Key {
            label: format!("from {name}: median of each second ({samples} samples)"),
            colour: PALETTE[i % PALETTE.len()],
            width: 2,
            dashed: false,
        });
        keys.push(Key {
            label: format!(
                "from {name}: 99th percentile of each second{}",
                if clipped { " (cut at the top)" } else { "" }
            ),
            colour: PALETTE[i % PALETTE.len()],
            width: 1,
            dashed: true,
        });
    }
    if !t.bridged.is_empty() {
        keys.push(Key {
            label: format!("sessions bridged to another geo (right axis), peak {bridged_top}"),
            colour: BRIDGED,
            width: 2,
            dashed: false,
        });
    }
    for cause in CAUSES {
        let n = t.handovers.iter().filter(|h| h.because == cause).count();
        if n > 0 {
            keys.push(Key {
                label: format!(
                    "handover: {}, {n} (label: player cause from→to)",
                    cause_name(cause)
                ),
                colour: cause_colour(cause),
                width: 2,
                dashed: true,
            });
        }
    }
    if !t.kills.is_empty() {
        keys.push(Key {
            label: "node killed, until its fresh process was up (shaded)".into(),
            colour: OUTAGE,
            width: 8,
            dashed: false,
        });
    }
    keys
}

/// Shades each kill until its node's fresh process was up, and names it at the top where it has
/// room.
fn draw_kills<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    kills: &[KillMark],
    per: f64,
    x_max: f64,
    x_per_px: f64,
    y_top: f64,
) -> Result<(), PlotError> {
    let kill_labels: Vec<String> = kills
        .iter()
        .map(|k| match &k.geo {
            Some(g) => format!("node {} ({g}) killed", k.node),
            None => format!("node {} killed", k.node),
        })
        .collect();
    let kill_sizes: Vec<(f64, f64)> = kills
        .iter()
        .zip(&kill_labels)
        .map(|(k, l)| {
            (
                k.from_s / per,
                (l.chars().count() as f64 * CHAR_PX * 0.9 + 8.0) * x_per_px,
            )
        })
        .collect();
    let kill_placed = place_labels(&kill_sizes, x_max, 1, 4.0 * x_per_px);
    for ((k, label), at) in kills.iter().zip(&kill_labels).zip(&kill_placed) {
        let (a, b) = (k.from_s / per, (k.to_s / per).min(x_max));
        chart
            .draw_series([Rectangle::new(
                [(a, 0.0), (b.max(a + 0.5 * x_per_px), y_top)],
                OUTAGE.mix(0.12).filled(),
            )])
            .map_err(err)?;
        if let Some((_, left, right)) = *at {
            let (x, anchor) = if right {
                (a - 2.0 * x_per_px, HPos::Right)
            } else {
                (left + 2.0 * x_per_px, HPos::Left)
            };
            chart
                .draw_series([Text::new(
                    label.clone(),
                    (x, y_top * 0.99),
                    ("sans-serif", 12)
                        .into_font()
                        .color(&OUTAGE)
                        .pos(Pos::new(anchor, VPos::Top)),
                )])
                .map_err(err)?;
        }
    }
    Ok(())
}

/// Click to screen by location: the medians solid, the 99th percentiles dashed, both cut at
/// `data_top`.
fn draw_click_to_screen<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    series: &[(&String, Vec<Bin>)],
    per: f64,
    data_top: f64,
) -> Result<(), PlotError> {
    for (i, (_, bins)) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let (xs, p99) = with_gaps(bins, |b| b.p99_ms.min(data_top));
        let xs: Vec<f64> = xs.iter().map(|s| s / per).collect();
        for seg in steps(&xs, &p99) {
            chart
                .draw_series(DashedLineSeries::new(seg, 5, 3, colour.stroke_width(1)))
                .map_err(err)?;
        }
        let (_, p50) = with_gaps(bins, |b| b.p50_ms.min(data_top));
        for seg in steps(&xs, &p50) {
            chart
                .draw_series(LineSeries::new(seg, colour.stroke_width(2)))
                .map_err(err)?;
        }
    }
    Ok(())
}

/// Renders the run as an SVG document.
pub fn render_svg(t: &Timeline) -> Result<String, PlotError> {
    let minutes = t.duration_s > 300.0;
    let (unit, per) = if minutes { ("min", 60.0) } else { ("s", 1.0) };
    let x_max = (t.duration_s / per).max(1.0 / per);
    let series: Vec<(&String, Vec<Bin>)> = t
        .click_to_screen
        .iter()
        .map(|(loc, bins)| (loc, thinned(bins)))
        .collect();
    // The scale follows the medians: a kill's 99th percentile of seconds must not flatten them.
    let p50_top = series
        .iter()
        .flat_map(|(_, b)| b.iter().map(|b| b.p50_ms))
        .fold(1.0, f64::max);
    let p99_top = series
        .iter()
        .flat_map(|(_, b)| b.iter().map(|b| b.p99_ms))
        .fold(1.0, f64::max);
    let data_top = p99_top.min(p50_top * 4.0);
    let clipped = p99_top > data_top;
    let y_top = data_top * 1.3;
    let bridged_top = t.bridged.iter().map(|(_, n)| *n).max().unwrap_or(0);

    let keys = legend_keys(t, &series, clipped, bridged_top);
    let legend_h = legend_height(&keys);
    let lanes_mode = t.handovers.len() > MAX_LABELLED_HANDOVERS;
    // Lanes: the routes by number of handovers, the last lane for all the rest.
    let lanes = if lanes_mode {
        let routes: Vec<(&str, &str)> = t
            .handovers
            .iter()
            .map(|h| (h.from.as_str(), h.to.as_str()))
            .collect();
        lanes_by(&routes, |(a, b), n| format!("{a}→{b} ({n})"), "routes")
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
        let mut top = top.titled(&t.title, ("sans-serif", 22)).map_err(err)?;
        if !t.subtitle.is_empty() {
            top = top.titled(&t.subtitle, ("sans-serif", 14)).map_err(err)?;
        }
        let mut chart = ChartBuilder::on(&top)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .right_y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..y_top)
            .map_err(err)?
            .set_secondary_coord(0.0..x_max, 0.0..(bridged_top.max(1) as f64 * 1.3));
        chart
            .configure_mesh()
            .x_desc(format!("time ({unit})"))
            .y_desc("click to screen (ms)")
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.08))
            .label_style(("sans-serif", 14))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;
        if !t.bridged.is_empty() {
            chart
                .configure_secondary_axes()
                .y_desc("bridged sessions")
                .label_style(("sans-serif", 14))
                .y_label_formatter(&|v| format!("{v:.0}"))
                .draw()
                .map_err(err)?;
        }
        let x_per_px = x_max / PLOT_PX;

        // Kills first, shaded over the whole height, each named at its top where it has room.
        draw_kills(&mut chart, &t.kills, per, x_max, x_per_px, y_top)?;

        // Handovers: a dashed line each, and a label each in the rows above the data (none in
        // lanes mode). Those a few pixels apart on one route share both.
        let groups = group_handovers(&t.handovers, 4.0 * x_per_px * per);
        let marks: Vec<Mark> = groups
            .iter()
            .map(|g| Mark {
                x: g.t_s / per,
                label: g.label(),
                colour: cause_colour(g.marks[0].because),
                count: g.marks.len(),
            })
            .collect();
        let frame = MarkFrame {
            x_max,
            x_per_px,
            data_top,
            y_top,
        };
        draw_marks(&mut chart, &marks, &frame, !lanes_mode, "handovers")?;

        // Bridged sessions, as steps on the right axis.
        if !t.bridged.is_empty() {
            let xs: Vec<f64> = t.bridged.iter().map(|(s, _)| s / per).collect();
            let ys: Vec<Option<f64>> = t.bridged.iter().map(|(_, n)| Some(*n as f64)).collect();
            for seg in steps(&xs, &ys) {
                chart
                    .draw_secondary_series(LineSeries::new(seg, BRIDGED.stroke_width(2)))
                    .map_err(err)?;
            }
        }
        // Click to screen by location: the medians solid, the 99th percentiles dashed.
        draw_click_to_screen(&mut chart, &series, per, data_top)?;

        // The lanes: one row per route, a tick per handover in its cause's colour.
        if lanes_mode {
            draw_lanes(
                &lane_area,
                &format!(
                    "{} handovers, one lane per route (most first)",
                    t.handovers.len()
                ),
                &lanes,
                (PLOT_LEFT, PLOT_LEFT + PLOT_PX as i32),
                |i| {
                    let h = &t.handovers[i];
                    (h.t_s / per / x_max, cause_colour(h.because))
                },
            )?;
        }
        draw_legend(&bottom, &keys)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bins(from_s: u32, to_s: u32, p50: f64) -> Vec<Bin> {
        (from_s..to_s)
            .map(|s| Bin {
                t_s: f64::from(s),
                p50_ms: p50,
                p99_ms: p50 * 2.0,
                samples: 10,
            })
            .collect()
    }

    fn handover(t_s: f64, account: &str, because: HandoverCause) -> HandoverMark {
        HandoverMark {
            t_s,
            account: account.into(),
            from: "paris".into(),
            to: "montreal".into(),
            because,
        }
    }

    fn timeline(handovers: Vec<HandoverMark>) -> Timeline {
        Timeline {
            title: "up --geos 2".into(),
            subtitle: "paris–montreal 45 ms one way".into(),
            duration_s: 60.0,
            click_to_screen: [
                ("paris".to_string(), bins(0, 60, 20.0)),
                ("montreal".to_string(), bins(0, 60, 110.0)),
            ]
            .into(),
            bridged: (0..60u32)
                .map(|s| (f64::from(s), u64::from(s / 10)))
                .collect(),
            handovers,
            kills: vec![KillMark {
                node: 3,
                geo: Some("montreal".into()),
                from_s: 20.0,
                to_s: 23.5,
            }],
        }
    }

    #[test]
    fn every_handover_is_labelled_with_its_player_and_cause_and_kills_are_shaded() {
        let t = timeline(vec![
            handover(12.0, "bot-3", HandoverCause::SettledCrossing),
            handover(12.5, "bot-7", HandoverCause::MaxBridge),
            handover(40.0, "bot-9", HandoverCause::SettledCrossing),
            // At one moment, on one route: one line, one label.
            handover(50.0, "bot-10", HandoverCause::MaxBridge),
            handover(50.1, "bot-11", HandoverCause::MaxBridge),
            handover(50.1, "bot-12", HandoverCause::MaxBridge),
        ]);
        let svg = render_svg(&t).expect("renders");
        for label in [
            "bot-3 settled paris→montreal",
            "bot-7 max-bridge paris→montreal",
            "bot-9 settled paris→montreal",
            "bot-10 +2 max-bridge paris→montreal",
            "handover: settled, 2",
            "handover: max-bridge, 4",
            "node 3 (montreal) killed",
            "from paris: median of each second (600 samples)",
            "from montreal: 99th percentile of each second",
            "peak 5",
        ] {
            assert!(svg.contains(label), "no `{label}` in the plot");
        }
        assert!(!svg.contains("not labelled"), "three labels fit");
        assert!(!svg.contains("one lane per route"));
    }

    #[test]
    fn a_crowd_of_handovers_goes_into_lanes_per_route() {
        let mut h: Vec<HandoverMark> = (0..40)
            .map(|i| handover(f64::from(i), &format!("bot-{i}"), HandoverCause::MaxBridge))
            .collect();
        h[5].to = "hongkong".into();
        let svg = render_svg(&timeline(h)).expect("renders");
        assert!(svg.contains("40 handovers, one lane per route"));
        assert!(svg.contains("paris→montreal (39)"));
        assert!(svg.contains("paris→hongkong (1)"));
        assert!(
            !svg.contains("bot-12 max-bridge"),
            "no labels in lanes mode"
        );
    }

    #[test]
    fn handovers_group_by_moment_route_and_cause() {
        let mut back = handover(10.5, "bot-4", HandoverCause::MaxBridge);
        back.to = "paris".into();
        back.from = "montreal".into();
        let h = [
            handover(10.0, "bot-1", HandoverCause::MaxBridge),
            back,
            handover(10.2, "bot-2", HandoverCause::MaxBridge),
            handover(10.4, "bot-3", HandoverCause::SettledCrossing),
            handover(11.5, "bot-5", HandoverCause::MaxBridge),
        ];
        let labels: Vec<String> = group_handovers(&h, 1.0)
            .iter()
            .map(HandoverGroup::label)
            .collect();
        assert_eq!(
            labels,
            [
                "bot-1, bot-2 max-bridge paris→montreal",
                "bot-3 settled paris→montreal",
                "bot-4 max-bridge montreal→paris",
                "bot-5 max-bridge paris→montreal",
            ]
        );
    }

    #[test]
    fn long_runs_are_thinned_and_gaps_stay_gaps() {
        let long = bins(0, 3_600, 30.0);
        let thin = thinned(&long);
        assert!(thin.len() <= MAX_POINTS, "{}", thin.len());
        assert_eq!(thin[0].samples, 60, "six seconds each");
        let mut gap = bins(0, 3, 10.0);
        gap.extend(bins(10, 12, 20.0));
        let (xs, ys) = with_gaps(&gap, |b| b.p50_ms);
        assert_eq!(xs, [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0]);
        assert_eq!(
            ys,
            [
                Some(10.0),
                Some(10.0),
                Some(10.0),
                None,
                Some(20.0),
                Some(20.0),
                None
            ]
        );
    }
}
