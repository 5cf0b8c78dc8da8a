//! `cellmesh balance …`: tools for the load balancer.

use std::path::{Path, PathBuf};

use cellmesh_balancesim as balancesim;

#[derive(clap::Args, Debug)]
pub struct BalanceArgs {
    #[command(subcommand)]
    pub command: BalanceCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum BalanceCommand {
    /// Run a load balancing scenario in virtual time: a timeline of the balancer's decisions with
    /// their reasons, the chunks each epoch moved, and a summary.
    Simulate {
        /// Scenario file (TOML), e.g. one of balancesim/scenarios/.
        scenario: PathBuf,
        /// Print the report (summary, timeline, epochs, series) as JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Also draw each node's load, the split lines and the chunks moved over time into this
        /// SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
}

pub fn run(args: BalanceArgs) -> anyhow::Result<()> {
    match args.command {
        BalanceCommand::Simulate {
            scenario,
            json,
            svg,
        } => simulate(&scenario, json, svg.as_deref()),
    }
}

fn simulate(path: &Path, json: bool, svg: Option<&Path>) -> anyhow::Result<()> {
    crate::scenario_cli::Simulator {
        run: |text| {
            let scenario = balancesim::Scenario::from_toml(text)?;
            Ok(balancesim::run(&scenario)?)
        },
        svg: |report| Ok(balancesim::render_svg(report)?),
        text: balancesim::Report::render_text,
    }
    .simulate(path, json, svg)
}
