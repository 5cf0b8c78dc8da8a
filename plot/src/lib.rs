//! The drawing every report of the project shares: the figure's width and palette, step lines,
//! labels laid out so that none overlaps another, lanes for crowds of events, dashed marks, the
//! legend, and a chart over a time axis in minutes. The simulators' plots (`cellmesh-geosim`,
//! `cellmesh-balancesim`) and `cellmesh up`'s timeline are drawn with it.

use std::collections::BTreeMap;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// The figure's width; every plot of the project has it.
pub const WIDTH: u32 = 1200;
/// Rows of mark labels above the data.
const LABEL_ROWS: usize = 4;
/// Lanes drawn at most; the keys with fewer items share the last.
const MAX_LANES: usize = 24;
const LANE_H: u32 = 14;
/// Width of one character of a 13-px label, in pixels (a generous estimate).
pub const CHAR_PX: f64 = 7.5;

/// Lines: strong colours, none of them the red, grey, green and black the plots keep for bounds
/// and means, nor the purple of moves.
pub const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(40, 50, 120),
    RGBColor(200, 150, 0),
];

/// Outages, shaded.
pub const OUTAGE: RGBColor = RGBColor(214, 39, 40);

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("drawing the plot: {0}")]
pub struct PlotError(String);

pub fn err<E: std::fmt::Debug>(e: E) -> PlotError {
    PlotError(format!("{e:?}"))
}

/// A sampled series as steps (each value holds until the next sample), split at gaps.
pub fn steps(xs: &[f64], ys: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
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

/// Where each label goes: `Some((row, left, right_anchored))` in x units, or `None` when no row
/// has room (counted as "more"). A label is `(x, width)`: it starts at its move's `x`, or ends there
/// when it would run past `x_max`. Within a row labels keep `gap` apart: none ever overlaps another.
pub fn place_labels(
    labels: &[(f64, f64)],
    x_max: f64,
    rows: usize,
    gap: f64,
) -> Vec<Option<(usize, f64, bool)>> {
    let mut row_end = vec![f64::NEG_INFINITY; rows];
    labels
        .iter()
        .map(|&(x, w)| {
            let right = x + w > x_max;
            let (left, end) = if right { (x - w, x) } else { (x, x + w) };
            let row = (0..rows).find(|&r| row_end[r] + gap <= left)?;
            row_end[row] = end;
            Some((row, left, right))
        })
        .collect()
}

/// Items in lanes, one lane per key (`keys[i]` is item `i`'s), the keys with most items first;
/// past [`MAX_LANES`] the rest share the last lane, named "N more `others`". Each lane is its
/// name (from its key and number of items) and its items.
pub fn lanes_by<K: Ord + Clone>(
    keys: &[K],
    name: impl Fn(&K, usize) -> String,
    others: &str,
) -> Vec<(String, Vec<usize>)> {
    let mut by_key: BTreeMap<K, Vec<usize>> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        by_key.entry(k.clone()).or_default().push(i);
    }
    let mut groups: Vec<(K, Vec<usize>)> = by_key.into_iter().collect();
    groups.sort_by(|(a, x), (b, y)| y.len().cmp(&x.len()).then_with(|| a.cmp(b)));
    let rest: Vec<usize> = groups
        .iter()
        .skip(MAX_LANES - 1)
        .flat_map(|(_, v)| v.iter().copied())
        .collect();
    let more = groups.len().saturating_sub(MAX_LANES - 1);
    groups.truncate(MAX_LANES - 1);
    let mut lanes: Vec<(String, Vec<usize>)> = groups
        .into_iter()
        .map(|(k, v)| (name(&k, v.len()), v))
        .collect();
    if more > 0 {
        lanes.push((format!("{more} more {others}"), rest));
    }
    lanes
}

/// The height the lanes take, their heading included.
pub fn lanes_height(lanes: &[(String, Vec<usize>)]) -> u32 {
    lanes.len() as u32 * LANE_H + 40
}

/// Draws `lanes` under a heading: a row each, named on the left, with a tick per item where
/// `tick(item)` puts it (a fraction of the time axis, spanning `x_px`) in its colour.
pub fn draw_lanes<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    heading: &str,
    lanes: &[(String, Vec<usize>)],
    (left, right): (i32, i32),
    tick: impl Fn(usize) -> (f64, RGBColor),
) -> Result<(), PlotError> {
    let h = LANE_H as i32;
    area.draw(&Text::new(
        heading.to_string(),
        (16, 8),
        ("sans-serif", 14)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Top)),
    ))
    .map_err(err)?;
    for (k, (name, items)) in lanes.iter().enumerate() {
        let y = 30 + k as i32 * h;
        area.draw(&Text::new(
            name.clone(),
            (16, y + h / 2),
            ("sans-serif", 11)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .map_err(err)?;
        area.draw(&PathElement::new(
            [(left, y + h - 1), (right, y + h - 1)],
            BLACK.mix(0.08),
        ))
        .map_err(err)?;
        for &i in items {
            let (at, colour) = tick(i);
            let x = left + (at * f64::from(right - left)) as i32;
            area.draw(&PathElement::new(
                [(x, y + 2), (x, y + h - 3)],
                colour.stroke_width(2),
            ))
            .map_err(err)?;
        }
    }
    Ok(())
}

/// A moment marked on a chart: a dashed vertical line and its label.
pub struct Mark {
    pub x: f64,
    pub label: String,
    pub colour: RGBColor,
    /// How many events it stands for (counted when its label finds no room).
    pub count: usize,
}

/// Where marks go on a chart: its x range and scale, the top of its data, and its top.
pub struct MarkFrame {
    pub x_max: f64,
    /// x units per pixel.
    pub x_per_px: f64,
    pub data_top: f64,
    pub y_top: f64,
}

/// Draws `marks` as dashed lines from the axis to just over the data and, when `labelled`, each
/// label in [`LABEL_ROWS`] rows above the data where [`place_labels`] finds it room; the events
/// of the marks left without a label are counted top right ("+N `what` not labelled").
pub fn draw_marks<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    marks: &[Mark],
    f: &MarkFrame,
    labelled: bool,
    what: &str,
) -> Result<(), PlotError> {
    let placed = if labelled {
        let sizes: Vec<(f64, f64)> = marks
            .iter()
            .map(|m| {
                let w = (m.label.chars().count() as f64 * CHAR_PX + 8.0) * f.x_per_px;
                (m.x, w)
            })
            .collect();
        place_labels(&sizes, f.x_max, LABEL_ROWS, 6.0 * f.x_per_px)
    } else {
        vec![None; marks.len()]
    };
    let mut unlabelled = 0;
    for (m, at) in marks.iter().zip(&placed) {
        chart
            .draw_series(DashedLineSeries::new(
                [(m.x, 0.0), (m.x, f.data_top * 1.12)],
                6,
                3,
                m.colour.stroke_width(if labelled { 2 } else { 1 }),
            ))
            .map_err(err)?;
        let Some((row, left, right)) = *at else {
            unlabelled += m.count;
            continue;
        };
        let pad = 4.0 * f.x_per_px;
        let (tx, anchor) = if right {
            (m.x - pad, HPos::Right)
        } else {
            (left + pad, HPos::Left)
        };
        chart
            .draw_series([Text::new(
                m.label.clone(),
                (tx, f.data_top * (1.24 - 0.045 * row as f64)),
                ("sans-serif", 13)
                    .into_font()
                    .color(&m.colour)
                    .pos(Pos::new(anchor, VPos::Center)),
            )])
            .map_err(err)?;
    }
    if unlabelled > 0 && labelled {
        chart
            .draw_series([Text::new(
                format!("+{unlabelled} {what} not labelled"),
                (f.x_max * 0.995, f.y_top * 0.99),
                ("sans-serif", 12)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Right, VPos::Top)),
            )])
            .map_err(err)?;
    }
    Ok(())
}

/// One legend entry: label, colour, line width, dashed.
pub struct Key {
    pub label: String,
    pub colour: RGBColor,
    pub width: u32,
    pub dashed: bool,
}

/// The height of one legend row.
pub const KEY_ROW: u32 = 22;

/// The height the legend of `keys` takes.
pub fn legend_height(keys: &[Key]) -> u32 {
    keys.len().div_ceil(2) as u32 * KEY_ROW + 24
}

/// The legend, in two columns, on an area under a chart `WIDTH` wide.
pub fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    keys: &[Key],
) -> Result<(), PlotError> {
    let key_rows = keys.len().div_ceil(2).max(1) as u32;
    let col_w = (WIDTH as i32 - 120) / 2;
    for (i, k) in keys.iter().enumerate() {
        let (col, row) = ((i as u32 / key_rows) as i32, (i as u32 % key_rows) as i32);
        let x = 76 + col * col_w;
        let y = 8 + row * KEY_ROW as i32 + KEY_ROW as i32 / 2;
        let style = k.colour.stroke_width(k.width);
        if k.dashed {
            for d in 0..3 {
                let x0 = x + d * 10;
                area.draw(&PathElement::new([(x0, y), (x0 + 6, y)], style))
                    .map_err(err)?;
            }
        } else {
            area.draw(&PathElement::new([(x, y), (x + 26, y)], style))
                .map_err(err)?;
        }
        area.draw(&Text::new(
            k.label.clone(),
            (x + 36, y),
            ("sans-serif", 14)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// A chart over a time axis in minutes.
pub type TimeChart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A chart over a time axis in minutes (to `x_max`), from 0 to `y_top`, captioned, with the
/// project's mesh style: `y_labels` labels on the y axis with `y_decimals` decimals.
pub fn time_chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, plotters::coord::Shift>,
    caption: String,
    x_max: f64,
    y_top: f64,
    y_desc: &str,
    (y_labels, y_decimals): (usize, usize),
) -> Result<TimeChart<'a, DB>, PlotError> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..y_top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time (min)")
        .y_desc(y_desc)
        .y_labels(y_labels)
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
        .y_label_formatter(&|v| format!("{v:.y_decimals$}"))
        .draw()
        .map_err(err)?;
    Ok(chart)
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

    proptest::proptest! {
        /// However many labels and wherever their moves are, no two placed in one row overlap,
        /// and each placed label touches its move's line.
        #[test]
        fn placed_labels_never_overlap(
            labels in proptest::collection::vec((0.0f64..60.0, 0.5f64..12.0), 0..80),
            rows in 1usize..6,
        ) {
            let mut labels = labels;
            labels.sort_by(|a, b| a.0.total_cmp(&b.0));
            let placed = place_labels(&labels, 60.0, rows, 0.2);
            let mut spans: Vec<(usize, f64, f64)> = Vec::new();
            for (&(x, w), p) in labels.iter().zip(&placed) {
                let Some((row, left, right)) = *p else { continue };
                proptest::prop_assert!(row < rows);
                let touches = if right { (left + w - x).abs() < 1e-9 } else { left == x };
                proptest::prop_assert!(touches, "label at {left} does not touch its move at {x}");
                for &(r, a, b) in &spans {
                    proptest::prop_assert!(r != row || left >= b + 0.2 - 1e-9 || left + w + 0.2 <= a + 1e-9,
                        "row {row}: [{left}, {}] overlaps [{a}, {b}]", left + w);
                }
                spans.push((row, left, left + w));
            }
        }
    }

    #[test]
    fn close_moves_are_labelled_on_separate_rows() {
        let placed = place_labels(
            &[(1.0, 5.0), (2.0, 5.0), (3.0, 5.0), (7.0, 2.0)],
            60.0,
            2,
            0.1,
        );
        assert_eq!(placed[0], Some((0, 1.0, false)));
        assert_eq!(placed[1], Some((1, 2.0, false)));
        assert_eq!(placed[2], None, "both rows are taken there");
        assert_eq!(placed[3], Some((0, 7.0, false)));
        // Near the right edge a label ends at its move.
        assert_eq!(
            place_labels(&[(59.0, 5.0)], 60.0, 1, 0.1)[0],
            Some((0, 54.0, true))
        );
    }
}
