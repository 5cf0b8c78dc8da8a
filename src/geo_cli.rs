//! `cellmesh geo …`: tools for multi-geo placement.

use std::path::{Path, PathBuf};

use cellmesh_geosim as geosim;

#[derive(clap::Args, Debug)]
pub struct GeoArgs {
    #[command(subcommand)]
    pub command: GeoCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum GeoCommand {
    /// Run a bubble-placement scenario in virtual time: a timeline of the decisions with their
    /// reasons, and a summary against always-core and an oracle without hysteresis.
    Simulate {
        /// Scenario file (TOML), e.g. one of geosim/scenarios/.
        scenario: PathBuf,
        /// Print the summary and timeline as JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Also draw the players' RTT over time, moves marked, into this SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
}

pub fn run(args: GeoArgs) -> anyhow::Result<()> {
    match args.command {
        GeoCommand::Simulate {
            scenario,
            json,
            svg,
        } => simulate(&scenario, json, svg.as_deref()),
    }
}

fn simulate(path: &Path, json: bool, svg: Option<&Path>) -> anyhow::Result<()> {
    crate::scenario_cli::Simulator {
        run: |text| {
            let scenario = geosim::Scenario::from_toml(text)?;
            Ok(geosim::run(&scenario)?)
        },
        svg: |report| Ok(geosim::render_svg(report)?),
        text: geosim::Report::render_text,
    }
    .simulate(path, json, svg)
}
