//! `cellmesh sim`: the deterministic cluster simulator from the command line. Runs seeds of a
//! scenario (or of all of them) in virtual time and reports the runs that broke an invariant,
//! with the trace of the last steps of the first one. A failing seed reproduces its run.

use clap::Args;

#[derive(Debug, Args)]
pub struct SimArgs {
    /// Scenario to run (default: every scenario of the suite). `--list` names them.
    #[arg(long)]
    pub scenario: Option<String>,
    /// Run this one seed and print its report (with its trace, see `--trace`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seeds per scenario, from 1.
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// Steps of trace kept for a report.
    #[arg(long, default_value_t = 60)]
    pub trace: usize,
    /// List the scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Run the scenarios with handoffs that miss no tick, as `cellmesh up --zero-tick-handoffs`:
    /// avatars released like NPCs, and the sidecars' own handoffs asked of the games (`Offload`).
    #[arg(long)]
    pub zero_tick_handoffs: bool,
}

/// Runs what `args` asks; an error if a run broke an invariant.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.list {
        for s in cellmesh_sim::catalogue() {
            println!("{}", s.name);
        }
        return Ok(());
    }
    let mut scenarios = match &args.scenario {
        Some(name) => vec![cellmesh_sim::named(name).ok_or_else(|| {
            anyhow::anyhow!("no scenario called {name:?} (`cellmesh sim --list` names them)")
        })?],
        None => cellmesh_sim::catalogue(),
    };
    for s in &mut scenarios {
        s.zero_tick_handoffs |= args.zero_tick_handoffs;
    }
    if let Some(seed) = args.seed {
        let mut failed = 0;
        for s in &scenarios {
            let r = cellmesh_sim::run_traced(s, seed, Some(args.trace));
            failed += usize::from(!r.ok());
            println!("{r}");
        }
        anyhow::ensure!(failed == 0, "{failed} run(s) broke an invariant");
        return Ok(());
    }
    let mut failed = Vec::new();
    let mut runs = 0;
    for s in &scenarios {
        let mut bad = 0;
        let mut balance = Vec::new();
        let mut commands = cellmesh_sim::CommandFigures::default();
        let mut trades = cellmesh_sim::TradeFigures::default();
        let mut dens = cellmesh_sim::DenFigures::default();
        for seed in 1..=args.seeds {
            let r = cellmesh_sim::run(s, seed);
            runs += 1;
            balance.extend(r.balance.clone());
            commands.add(&r.stats.commands);
            trades.add(&r.stats.trades);
            dens.add(&r.stats.dens);
            if !r.ok() {
                bad += 1;
                failed.push(r);
            }
        }
        println!(
            "{:<12} {} seeds, {} broke an invariant",
            s.name, args.seeds, bad
        );
        if !balance.is_empty() {
            let runs: Vec<&cellmesh_sim::Balance> = balance.iter().collect();
            println!("             {}", cellmesh_sim::summarise(&runs));
        }
        if trades.started > 0 {
            println!("             {trades}");
        }
        if commands.sent > 0 {
            println!("             {commands}");
        }
        if dens.stocked > 0 {
            println!("             {dens}");
        }
    }
    if let Some(first) = failed.first() {
        for r in &failed {
            println!(
                "  {} seed {}: {}",
                r.scenario,
                r.seed,
                r.violations.first().map(String::as_str).unwrap_or("")
            );
        }
        println!("\n{first}");
        anyhow::bail!("{} of {runs} runs broke an invariant", failed.len());
    }
    println!("{runs} runs, every invariant held");
    Ok(())
}
