//! The director is a process players depend on: it links no simulator, plotting or bench code,
//! and not the `cellmesh` command's crate (which links them with its `tools` feature). The
//! simulator drives the director's core, never the other way round.

use std::path::Path;
use std::process::Command;

/// Runs `cargo tree --offline` from the workspace root with `args` and returns its output;
/// panics with its stderr if it fails.
fn cargo_tree(args: &[&str]) -> String {
    // The cargo running these tests, so that the toolchain and registry cache are the same.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(&cargo)
        .current_dir(&root)
        .args(["tree", "--offline"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {cargo} tree: {e}"));
    assert!(
        out.status.success(),
        "cargo tree {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The crate names of a `cargo tree` listing.
fn names(tree: &str) -> Vec<String> {
    tree.lines()
        .filter_map(|line| {
            let name = line.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
            name.split_whitespace().next().map(str::to_owned)
        })
        .collect()
}

/// Crates (by name) in `package`'s normal dependency tree.
fn crates_in(package: &str) -> Vec<String> {
    let tree = cargo_tree(&["-e", "normal", "-p", package]);
    assert!(
        tree.starts_with(package),
        "not the tree of {package}:\n{tree}"
    );
    names(&tree)
}

const NOT_IN_THE_DIRECTOR: &[&str] = &[
    "cellmesh",
    "cellmesh-sim",
    "cellmesh-geosim",
    "cellmesh-balancesim",
    "cellmesh-benches",
    "plotters",
    "criterion",
];

#[test]
fn the_director_links_no_simulator_plotting_bench_or_command_line() {
    let crates = crates_in("cellmesh-director");
    for banned in NOT_IN_THE_DIRECTOR {
        if crates.iter().any(|c| c == banned) {
            let through = cargo_tree(&["-e", "normal", "-p", "cellmesh-director", "-i", banned]);
            panic!("cellmesh-director depends on {banned}, through:\n{through}");
        }
    }
    // The tree is the director's: the balancer and the stores are in it.
    for needed in ["cellmesh-world", "cellmesh-stores", "cellmesh-admin"] {
        assert!(crates.iter().any(|c| c == needed), "{needed} in {crates:?}");
    }
}

/// The check above would see what it looks for: the simulator's tree holds the director.
#[test]
fn the_simulator_drives_the_director() {
    assert!(crates_in("cellmesh-sim")
        .iter()
        .any(|c| c == "cellmesh-director"));
}
