//! The data plane links no plotting: the balancing simulator's plotting lives in this crate, and
//! neither the sidecar nor the proxy may depend on it, nor on plotters by any other way.

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

/// The normal dependencies of `package`.
fn normal_deps(package: &str) -> String {
    cargo_tree(&["-e", "normal", "-p", package])
}

#[test]
fn the_sidecar_and_the_proxy_depend_neither_on_the_simulator_nor_on_plotters() {
    for package in ["cellmesh-sidecar", "cellmesh-proxy"] {
        let tree = normal_deps(package);
        assert!(
            tree.starts_with(package),
            "not the tree of {package}:\n{tree}"
        );
        for dep in ["cellmesh-balancesim", "plotters"] {
            if tree.contains(dep) {
                let through = cargo_tree(&["-e", "normal", "-p", package, "-i", dep]);
                panic!("{package} depends on {dep}, through:\n{through}");
            }
        }
    }
}

/// The check above would see them: this crate's own tree names plotters, and the balancer it
/// drives lives in `cellmesh-geo-router`, which the data plane links, without them.
#[test]
fn the_simulator_does_depend_on_plotters_and_the_balancer_does_not() {
    let tree = normal_deps("cellmesh-balancesim");
    assert!(tree.starts_with("cellmesh-balancesim") && tree.contains("plotters"));
    let router = normal_deps("cellmesh-geo-router");
    assert!(router.starts_with("cellmesh-geo-router"));
    assert!(!router.contains("plotters") && !router.contains("cellmesh-balancesim"));
}
