//! `cellmesh bench`: the cluster load generator. Runs the chosen scenarios over real loopback
//! sockets with the real sidecar and proxy code, each beside its baseline in the same run, prints
//! a table per scenario and writes every figure to `--json FILE`.
//!
//! It never fails on speed: it fails when a scenario could not run or, with `--check`, when the
//! report misses a figure.

use std::path::PathBuf;

use anyhow::Context;
use cellmesh_benches::load::{self, report, Options, Scenario};
use clap::Args;
use serde_json::{json, Map, Value};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Scenarios to run: hop, fanout, transport, edge, handoff, memory, overload,
    /// capacity.
    #[arg(value_name = "SCENARIO", value_parser = parse_scenario)]
    pub scenarios: Vec<Scenario>,
    /// Run every scenario.
    #[arg(long)]
    pub all: bool,
    /// Small runs of every scenario, for a smoke test (figures are noisier).
    #[arg(long)]
    pub quick: bool,
    /// Write every figure, its baseline and its ratio here as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Fail unless every figure of every scenario run was filled.
    #[arg(long)]
    pub check: bool,
    /// A Redis for the pub/sub baseline; without one the bench starts `redis-server` itself.
    #[arg(long, env = "CELLMESH_BENCH_REDIS_URL")]
    pub redis: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn parse_scenario(s: &str) -> Result<Scenario, String> {
    Scenario::parse(s).ok_or_else(|| {
        let names: Vec<_> = Scenario::ALL.iter().map(|s| s.name()).collect();
        format!("no scenario {s:?}; one of {}", names.join(", "))
    })
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut scenarios = if args.all {
        Scenario::ALL.to_vec()
    } else {
        args.scenarios.clone()
    };
    scenarios.sort();
    scenarios.dedup();
    anyhow::ensure!(
        !scenarios.is_empty(),
        "name the scenarios to run, or say --all"
    );
    let opts = Options {
        quick: args.quick,
        seed: args.seed,
        exe: std::env::current_exe().context("finding the cellmesh executable")?,
        redis_url: args.redis.clone(),
    };
    let mut report = Map::new();
    report.insert(
        "machine".into(),
        json!({
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
        }),
    );
    report.insert("quick".into(), json!(args.quick));
    let mut failed = Vec::new();
    for s in &scenarios {
        eprintln!("bench {} …", s.name());
        match load::run(*s, &opts).await {
            Ok(section) => {
                print!("{}", report::table(s.name(), &section));
                report.insert(s.name().into(), section);
            }
            Err(e) => {
                eprintln!("bench {} failed: {e:#}", s.name());
                failed.push(s.name());
            }
        }
    }
    let report = Value::Object(report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(failed.is_empty(), "scenarios failed: {}", failed.join(", "));
    if args.check {
        let names: Vec<_> = scenarios.iter().map(|s| s.name()).collect();
        let gaps = report::missing(&report, &names);
        anyhow::ensure!(
            gaps.is_empty(),
            "the report misses figures:\n  {}",
            gaps.join("\n  ")
        );
    }
    Ok(())
}
