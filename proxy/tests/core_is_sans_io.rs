//! The proxy's core decides and its driver acts: no file of `src/core/` (its tests aside) names a
//! runtime, a socket, a clock, the file system or the log. Time comes in as `Now`, addresses are
//! values (`core::net`), and what is worth a log line is an `Output::Event`.

use std::path::{Path, PathBuf};

/// What a decision must not reach for.
const NOT_IN_A_DECISION: &[&str] = &[
    "tokio",
    "std::net",
    "std::fs",
    "Instant",
    "SystemTime",
    "thread::sleep",
    "tracing::",
];

fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == "tests" || name == "tests.rs" {
            continue;
        }
        if path.is_dir() {
            sources(&path, found);
        } else if name.ends_with(".rs") {
            found.push(path);
        }
    }
}

#[test]
fn the_core_names_no_runtime_socket_clock_file_or_log() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    sources(&core, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("connection.rs")),
        "the core's files were not found under {}",
        core.display()
    );
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            for banned in NOT_IN_A_DECISION {
                if code.contains(banned) {
                    found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the core reaches for I/O:\n{}",
        found.join("\n")
    );
}
