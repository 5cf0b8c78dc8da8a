//! The run as an SVG, three panels over one time axis: each node's load with the average and the
//! safety bound, cells added, retiring and deleted marked and labelled above the data; the split
//! lines' positions; and the chunks each epoch moved. The legend is under the panels. Labels and
//! legend come from `cellmesh-plot`, which lay labels out so that none overlaps
//! another.

use plotters::prelude::*;

use cellmesh_plot::{
    draw_legend, draw_marks, err, legend_height, steps, time_chart, Key, Mark, MarkFrame,
    PlotError, PALETTE, WIDTH,
};
use cellmesh_world::partition::Axis;

use super::run::Report;

const LOAD_H: u32 = 470;
const LINES_H: u32 = 330;
const MOVED_H: u32 = 180;
/// The plotting area's width in pixels (the figure less the margins and the y labels).
const PLOT_PX: f64 = (WIDTH - 64 - 2 * 16) as f64;
/// Beyond this many cell events, they are marked without labels.
const MAX_LABELLED_EVENTS: usize = 30;

/// Split lines: dark colours, apart from the nodes' palette.
const LINE_PALETTE: [RGBColor; 8] = [
    RGBColor(0, 120, 60),
    RGBColor(150, 40, 40),
    RGBColor(30, 60, 160),
    RGBColor(130, 50, 140),
    RGBColor(110, 110, 0),
    RGBColor(0, 130, 130),
    RGBColor(100, 100, 100),
    RGBColor(190, 0, 110),
];
/// Crowds' centres: wide and pale, under the lines.
const CROWD: RGBColor = RGBColor(150, 150, 150);
const SAFETY: RGBColor = RGBColor(214, 39, 40);
const MOVED: RGBColor = RGBColor(148, 103, 189);
const EVENT_KINDS: [(&str, &str); 4] = [
    ("added", "cell added (label: +new beside split)"),
    ("retiring", "cell starts retiring"),
    ("retire_called_off", "retirement called off"),
    ("deleted", "retired cell deleted"),
];

fn event_colour(kind: &str) -> RGBColor {
    match kind {
        "added" => RGBColor(0, 150, 70),
        "retiring" => RGBColor(214, 90, 0),
        "retire_called_off" => RGBColor(0, 128, 128),
        _ => RGBColor(120, 60, 20),
    }
}

fn node_colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Renders the report as an SVG document.
pub fn render_svg(report: &Report) -> Result<String, PlotError> {
    let s = &report.summary;
    let series = &report.series;
    let xs: Vec<f64> = series.t_s.iter().map(|t| t / 60.0).collect();
    let x_max = (s.duration_s / 60.0).max(1.0 / 60.0);
    let x_per_px = x_max / PLOT_PX;
    let data_top = series
        .nodes
        .iter()
        .flat_map(|n| n.load.iter().flatten())
        .chain(&series.safety_bound)
        .fold(0.1f64, |a, &b| a.max(b));
    let y_top = data_top * 1.3;

    let mut keys = Vec::new();
    let by_node: std::collections::BTreeMap<_, _> = s.nodes.iter().map(|n| (n.node, n)).collect();
    for (i, n) in series.nodes.iter().enumerate() {
        let Some(end) = by_node.get(&n.node) else {
            continue;
        };
        keys.push(Key {
            label: format!(
                "node {} ({} at the end): load {:.2}, {} entities",
                n.node, end.state, end.load_end, end.entities_end
            ),
            colour: node_colour(i),
            width: 2,
            dashed: false,
        });
    }
    keys.push(Key {
        label: format!(
            "average load over the cells not retiring: {:.2} at the end",
            s.avg_load_end
        ),
        colour: BLACK,
        width: 2,
        dashed: true,
    });
    keys.push(Key {
        label: format!(
            "safety bound: no line grows a cell at or over it ({:.2} at the end)",
            s.safety_bound_end
        ),
        colour: SAFETY,
        width: 2,
        dashed: true,
    });
    for (kind, label) in EVENT_KINDS {
        if report.cell_events.iter().any(|e| e.kind == kind) {
            keys.push(Key {
                label: label.into(),
                colour: event_colour(kind),
                width: 2,
                dashed: true,
            });
        }
    }
    for (i, l) in series.lines.iter().enumerate() {
        keys.push(Key {
            label: l.label(),
            colour: LINE_PALETTE[i % LINE_PALETTE.len()],
            width: 2,
            dashed: l.axis == Some(Axis::Y),
        });
    }
    for c in &series.crowds {
        if c.x.iter().any(Option::is_some) {
            keys.push(Key {
                label: format!("crowd {:?}: centre x (solid), y (dashed)", c.name),
                colour: CROWD,
                width: 6,
                dashed: false,
            });
        }
    }
    keys.push(Key {
        label: "chunks moved by one epoch".into(),
        colour: MOVED,
        width: 3,
        dashed: false,
    });
    let legend_h = legend_height(&keys);

    let marks: Vec<Mark> = report
        .cell_events
        .iter()
        .map(|e| Mark {
            x: e.at_s / 60.0,
            label: e.label(),
            colour: event_colour(e.kind),
            count: 1,
        })
        .collect();
    let labelled = marks.len() <= MAX_LABELLED_EVENTS;

    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (WIDTH, LOAD_H + LINES_H + MOVED_H + legend_h))
                .into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (load_area, rest) = root.split_vertically(LOAD_H);
        let (lines_area, rest) = rest.split_vertically(LINES_H);
        let (moved_area, legend_area) = rest.split_vertically(MOVED_H);

        // Load: events under the lines, then the bound, the average and the nodes.
        let mut chart = time_chart(
            &load_area,
            format!(
                "{}: each node's load (smoothed, as it reports it)",
                s.scenario
            ),
            x_max,
            y_top,
            "load (share of the tick)",
            (10, 2),
        )?;
        let frame = MarkFrame {
            x_max,
            x_per_px,
            data_top,
            y_top,
        };
        draw_marks(&mut chart, &marks, &frame, labelled, "cell events")?;
        let bound: Vec<Option<f64>> = series.safety_bound.iter().map(|v| Some(*v)).collect();
        for seg in steps(&xs, &bound) {
            chart
                .draw_series(DashedLineSeries::new(seg, 8, 5, SAFETY.stroke_width(2)))
                .map_err(err)?;
        }
        for (i, n) in series.nodes.iter().enumerate() {
            for seg in steps(&xs, &n.load) {
                chart
                    .draw_series(LineSeries::new(seg, node_colour(i).stroke_width(2)))
                    .map_err(err)?;
            }
        }
        let avg: Vec<Option<f64>> = series.avg_load.iter().map(|v| Some(*v)).collect();
        for seg in steps(&xs, &avg) {
            chart
                .draw_series(DashedLineSeries::new(seg, 6, 4, BLACK.stroke_width(2)))
                .map_err(err)?;
        }

        // Split lines: x lines solid, y lines dashed; events as unlabelled marks.
        let side = s.chunks.0.max(s.chunks.1) as f64;
        let mut chart = time_chart(
            &lines_area,
            "split lines: where each sits (chunks along its axis)".into(),
            x_max,
            side,
            "line position (chunks)",
            (8, 0),
        )?;
        let frame = MarkFrame {
            x_max,
            x_per_px,
            data_top: side / 1.12,
            y_top: side,
        };
        draw_marks(&mut chart, &marks, &frame, false, "cell events")?;
        for c in &series.crowds {
            let (wx, wy) = (s.chunks.0 as f64, s.chunks.1 as f64);
            for (ys, dashed, width) in [(&c.x, false, wx), (&c.y, true, wy)] {
                // A crowd crossing the seam jumps from one edge to the other: no line across.
                let mut ys = ys.clone();
                for k in (1..ys.len()).rev() {
                    if let (Some(a), Some(b)) = (ys[k - 1], ys[k]) {
                        if (a - b).abs() > width / 2.0 {
                            ys[k] = None;
                        }
                    }
                }
                let style = CROWD.mix(0.45).stroke_width(6);
                for seg in steps(&xs, &ys) {
                    if dashed {
                        chart
                            .draw_series(DashedLineSeries::new(seg, 10, 6, style))
                            .map_err(err)?;
                    } else {
                        chart
                            .draw_series(LineSeries::new(seg, style))
                            .map_err(err)?;
                    }
                }
            }
        }
        for (i, l) in series.lines.iter().enumerate() {
            let colour = LINE_PALETTE[i % LINE_PALETTE.len()].stroke_width(2);
            let ys: Vec<Option<f64>> = l.at.iter().map(|v| v.map(|v| v as f64)).collect();
            for seg in steps(&xs, &ys) {
                if l.axis == Some(Axis::Y) {
                    chart
                        .draw_series(DashedLineSeries::new(seg, 7, 4, colour))
                        .map_err(err)?;
                } else {
                    chart
                        .draw_series(LineSeries::new(seg, colour))
                        .map_err(err)?;
                }
            }
        }

        // Chunks moved: one bar per epoch.
        let most = s.max_chunks_moved_in_an_epoch.max(1) as f64;
        let mut chart = time_chart(
            &moved_area,
            format!(
                "chunks moved per epoch: {} over {} epochs, each a mass handoff",
                s.chunks_moved, s.epochs
            ),
            x_max,
            most * 1.15,
            "chunks",
            (4, 0),
        )?;
        let frame = MarkFrame {
            x_max,
            x_per_px,
            data_top: most * 1.15 / 1.12,
            y_top: most * 1.15,
        };
        draw_marks(&mut chart, &marks, &frame, false, "cell events")?;
        for e in report.epochs.iter().filter(|e| e.chunks_moved > 0) {
            let x = e.at_s / 60.0;
            chart
                .draw_series([PathElement::new(
                    [(x, 0.0), (x, e.chunks_moved as f64)],
                    MOVED.stroke_width(3),
                )])
                .map_err(err)?;
        }

        draw_legend(&legend_area, &keys)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}
