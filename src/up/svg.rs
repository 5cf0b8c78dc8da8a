//! `--svg`: the run drawn on exit (see [`plot`]).

use std::path::Path;

use anyhow::Context;

use super::plot;
use super::summary::Figures;
use super::UpOptions;

/// Draws the run of `figures`, `duration_s` long, into `path`.
pub(super) fn write(
    path: &Path,
    opts: &UpOptions,
    duration_s: f64,
    figures: Figures,
) -> anyhow::Result<()> {
    let geos = &figures.geos;
    let subtitle = if geos.several() {
        format!(
            "geos {} · {}",
            geos.names.join(", "),
            geos.describe_delays()
        )
    } else {
        String::new()
    };
    let timeline = plot::Timeline {
        title: format!(
            "cellmesh up: click to screen by bot location, {} nodes, {} bots",
            opts.nodes, opts.bots
        ),
        subtitle,
        duration_s,
        click_to_screen: figures.bot_stats.click_to_screen.series(),
        bridged: figures.bridged_over_time,
        handovers: figures.handover_marks,
        kills: figures.kill_marks,
    };
    let svg = plot::render_svg(&timeline).context("drawing the run")?;
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
