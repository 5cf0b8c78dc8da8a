//! Crates are cut by what they link: the pure world (this crate) and the simulators built on it
//! link no async runtime and no store client, and the data plane (the sidecar and the proxy)
//! links no simulator, plotting or bench code; nor does the `cellmesh` binary built without its
//! `up` and `tools` features, as the container image is; and the first `up` builds no simulator.

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

/// The normal dependencies of `package` on this machine's target (offline, only the crates a
/// build here fetched are at hand; plotting would come in on every target alike).
fn normal_deps(package: &str) -> String {
    cargo_tree(&["-e", "normal", "-p", package])
}

/// The crate names of a `cargo tree` listing.
fn names(tree: &str) -> impl Iterator<Item = &str> {
    tree.lines().filter_map(|line| {
        let name = line.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
        name.split_whitespace().next()
    })
}

/// Crates (by name) in `package`'s normal dependency tree.
fn crates_in(package: &str) -> Vec<String> {
    let tree = normal_deps(package);
    assert!(
        tree.starts_with(package),
        "not the tree of {package}:\n{tree}"
    );
    names(&tree).map(str::to_owned).collect()
}

/// Fails, naming the path by which it came in, when `package` depends on any of `banned`.
fn assert_links_none(package: &str, banned: &[&str]) {
    let crates = crates_in(package);
    for b in banned {
        if crates.iter().any(|c| c == b) {
            let through = cargo_tree(&["-e", "normal", "-p", package, "-i", b]);
            panic!("{package} depends on {b}, through:\n{through}");
        }
    }
}

/// Simulators, plotting and the bench harness: none belongs in a process players depend on.
const NOT_IN_THE_DATA_PLANE: &[&str] = &[
    "plotters",
    "cellmesh-plot",
    "cellmesh-sim",
    "cellmesh-geosim",
    "cellmesh-balancesim",
    "cellmesh-benches",
    "criterion",
];

/// An async runtime and store clients: none belongs in pure logic.
const NOT_IN_PURE_LOGIC: &[&str] = &["tokio", "mongodb", "redis", "cellmesh-stores"];

#[test]
fn the_sidecar_and_the_proxy_link_no_simulator_plotting_or_bench() {
    for package in ["cellmesh-sidecar", "cellmesh-proxy"] {
        assert_links_none(package, NOT_IN_THE_DATA_PLANE);
    }
}

/// The director is a process the world depends on: no tool, and not the `cellmesh` command's
/// crate (which links the tools with its `tools` feature). The simulator drives the director's
/// core, never the other way round.
#[test]
fn the_director_links_no_simulator_plotting_bench_or_command_line() {
    assert_links_none("cellmesh-director", NOT_IN_THE_DATA_PLANE);
    assert_links_none("cellmesh-director", &["cellmesh"]);
    let crates = crates_in("cellmesh-director");
    for needed in ["cellmesh-world", "cellmesh-stores", "cellmesh-admin"] {
        assert!(crates.iter().any(|c| c == needed), "{needed} in {crates:?}");
    }
}

/// The `cellmesh` binary as the container image builds it (without the `tools` feature, with
/// the store clients) runs the sidecar, the proxy and the director: none of the tools come with
/// it.
#[test]
fn the_binary_built_for_production_links_no_simulator_plotting_or_bench() {
    const PRODUCTION: [&str; 7] = [
        "-e",
        "normal",
        "-p",
        "cellmesh",
        "--no-default-features",
        "--features",
        "redis,mongodb",
    ];
    let tree = cargo_tree(&PRODUCTION);
    assert!(
        tree.starts_with("cellmesh "),
        "not cellmesh's tree:\n{tree}"
    );
    for b in NOT_IN_THE_DATA_PLANE {
        if names(&tree).any(|c| c == *b) {
            let through = cargo_tree(&[&PRODUCTION[..], &["-i", b]].concat());
            panic!("cellmesh without its tools depends on {b}, through:\n{through}");
        }
    }
    // With the tools (as the tests build it), it does: the check sees what it looks for.
    let tools = cargo_tree(&["-e", "normal", "-p", "cellmesh", "--features", "tools"]);
    assert!(names(&tools).any(|c| c == "cellmesh-sim"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dockerfile = std::fs::read_to_string(root.join("docker/Dockerfile")).unwrap();
    assert!(
        dockerfile.contains("--no-default-features --features redis,mongodb"),
        "the image must build cellmesh without its tools and with the store clients"
    );
    assert!(names(&tree).any(|c| c == "mongodb") && names(&tree).any(|c| c == "redis"));
}

/// What `cargo run --release -- up` builds first (the default features) runs on the in-memory
/// stores: the Redis and MongoDB clients, the two largest dependencies, are left out of it, and
/// so are the simulators and the load generator, which `up` does not run.
#[test]
fn the_first_run_builds_no_store_client_simulator_or_bench() {
    let tree = cargo_tree(&["-e", "normal,build", "-p", "cellmesh"]);
    assert!(
        names(&tree).any(|c| c == "cellmesh-plot"),
        "the default build has `up` and its plot:\n{tree}"
    );
    let not_run_by_up = [
        "cellmesh-sim",
        "cellmesh-geosim",
        "cellmesh-balancesim",
        "cellmesh-benches",
    ];
    for &b in ["mongodb", "redis", "bson"].iter().chain(&not_run_by_up) {
        if names(&tree).any(|c| c == b) {
            let through = cargo_tree(&["-e", "normal,build", "-p", "cellmesh", "-i", b]);
            panic!("cellmesh's default build depends on {b}, through:\n{through}");
        }
    }
}

#[test]
fn the_world_and_the_policy_simulators_link_no_runtime_and_no_store() {
    for package in [
        "cellmesh-world",
        "cellmesh-plot",
        "cellmesh-geosim",
        "cellmesh-balancesim",
    ] {
        assert_links_none(package, NOT_IN_PURE_LOGIC);
    }
}

/// The checks above would see what they look for: these trees name it.
#[test]
fn the_checks_see_what_they_look_for() {
    assert!(crates_in("cellmesh-geosim").iter().any(|c| c == "plotters"));
    assert!(crates_in("cellmesh-stores").iter().any(|c| c == "mongodb"));
    assert!(crates_in("cellmesh-sidecar").iter().any(|c| c == "tokio"));
    assert!(crates_in("cellmesh-sim")
        .iter()
        .any(|c| c == "cellmesh-director"));
}
