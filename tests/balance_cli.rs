//! `cellmesh balance simulate` as an engineer runs it, on every shipped scenario.

use std::path::Path;
use std::process::Command;

#[test]
fn every_shipped_scenario_simulates_to_text_json_and_svg() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("balancesim/scenarios");
    let out_dir = tempfile::tempdir().unwrap();
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        seen += 1;
        let svg = out_dir.path().join("plot.svg");
        let text = Command::new(env!("CARGO_BIN_EXE_cellmesh"))
            .args(["balance", "simulate"])
            .arg(&path)
            .arg("--svg")
            .arg(&svg)
            .output()
            .unwrap();
        assert!(
            text.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&text.stderr)
        );
        let stdout = String::from_utf8_lossy(&text.stdout);
        assert!(
            stdout.contains("timeline")
                && stdout.contains("summary")
                && stdout.contains("chunks moved"),
            "{}: {stdout}",
            path.display()
        );
        let plot = std::fs::read_to_string(&svg).unwrap();
        assert!(
            plot.starts_with("<svg") && plot.contains("</svg>") && plot.contains("<polyline"),
            "{}",
            path.display()
        );
        std::fs::remove_file(&svg).unwrap();

        let json = Command::new(env!("CARGO_BIN_EXE_cellmesh"))
            .args(["balance", "simulate"])
            .arg(&path)
            .arg("--json")
            .output()
            .unwrap();
        assert!(json.status.success());
        let v: serde_json::Value = serde_json::from_slice(&json.stdout)
            .unwrap_or_else(|e| panic!("{}: --json is not JSON: {e}", path.display()));
        let summary = v
            .get("summary")
            .unwrap_or_else(|| panic!("{}: {v}", path.display()));
        assert!(
            summary.get("chunks_moved").is_some_and(|c| c.is_i64()),
            "{summary}"
        );
        assert!(summary.get("max_over_avg_end").is_some(), "{summary}");
        let epochs = v["epochs"].as_array().expect("epochs");
        let moved: i64 = epochs
            .iter()
            .map(|e| e["chunks_moved"].as_i64().unwrap())
            .sum();
        assert_eq!(
            summary["chunks_moved"].as_i64(),
            Some(moved),
            "{}",
            path.display()
        );
    }
    assert_eq!(seen, 5, "the five shipped scenarios");

    let missing = Command::new(env!("CARGO_BIN_EXE_cellmesh"))
        .args(["balance", "simulate", "no-such.toml"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no-such.toml"));
}
