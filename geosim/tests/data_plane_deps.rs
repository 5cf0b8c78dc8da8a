//! The data plane links no plotting: the simulators' plotting (this crate's, and the balancing
//! simulator's, which draws with its helpers) must not reach the sidecar or the proxy, directly
//! or through `cellmesh-geo-router`.

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

#[test]
fn the_sidecar_and_the_proxy_do_not_depend_on_plotters() {
    for package in ["cellmesh-sidecar", "cellmesh-proxy"] {
        let tree = normal_deps(package);
        assert!(
            tree.starts_with(package),
            "not the tree of {package}:\n{tree}"
        );
        if tree.contains("plotters") {
            let through = cargo_tree(&["-e", "normal", "-p", package, "-i", "plotters"]);
            panic!("{package} depends on plotters, through:\n{through}");
        }
    }
}

/// The check above would see plotters: this crate's own tree names it.
#[test]
fn the_simulator_does_depend_on_plotters() {
    assert!(normal_deps("cellmesh-geosim").contains("plotters"));
}
