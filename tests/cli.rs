//! The `cellmesh` command line as a process: bad arguments are usage errors, and what it prints
//! keeps secrets.

use std::process::{Command, Output};

use support::CELLMESH;

mod support;

/// `cellmesh ARGS` with `vars` as its only `CELLMESH_*` variables.
fn cellmesh(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(CELLMESH);
    cmd.args(args).env("NO_COLOR", "1");
    for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("CELLMESH_")) {
        cmd.env_remove(name);
    }
    cmd.envs(vars.iter().copied());
    cmd.output().expect("running cellmesh")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_negative_duration_is_a_usage_error_naming_the_flag() {
    for (args, flag) in [
        (&["up", "--duration", "-1"][..], "--duration"),
        (&["up", "--duration=-1"], "--duration"),
        (&["up", "--duration", "NaN"], "--duration"),
        (&["up", "--chaos=1e300"], "--chaos"),
        (&["bots", "--duration=-1"], "--duration"),
    ] {
        let out = cellmesh(args, &[]);
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}

#[test]
fn a_token_valid_past_the_end_of_time_is_refused_without_a_panic() {
    let out = cellmesh(
        &["token", "--account", "ada", "--ttl", &u64::MAX.to_string()],
        &[],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--ttl"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

const SECRETS: &[(&str, &str)] = &[
    ("CELLMESH_TOKEN_SECRET", "s3cret"),
    (
        "CELLMESH_DIRECTORY_URL",
        "redis://:dir-pw@redis.internal:6379/0",
    ),
    (
        "CELLMESH_PLAYERS_URL",
        "mongodb://app:players-pw@m1:27017,m2:27017/game?authSource=admin",
    ),
    ("CELLMESH_TOPOLOGY_URL", "mongodb://ops:topo-pw@m1/topology"),
    ("CELLMESH_ADMIN_TOKEN", "admin-pw"),
];

#[test]
fn print_config_shows_no_secret() {
    for process in ["sidecar", "proxy", "director"] {
        let out = cellmesh(&[process, "--print-config"], SECRETS);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{process}: {}", text(&out.stderr));
        assert!(
            stdout.contains("admin_token = \"***\""),
            "{process}:\n{stdout}"
        );
        for secret in ["s3cret", "dir-pw", "players-pw", "topo-pw", "admin-pw"] {
            assert!(
                !stdout.contains(secret),
                "{process} shows {secret}:\n{stdout}"
            );
        }
    }
    let sidecar = text(&cellmesh(&["sidecar", "--print-config"], SECRETS).stdout);
    for shown in [
        "directory_url = \"redis://:***@redis.internal:6379/0\"",
        "players_url = \"mongodb://app:***@m1:27017,m2:27017/game?authSource=admin\"",
        "topology_url = \"mongodb://ops:***@m1/topology\"",
    ] {
        assert!(sidecar.contains(shown), "{shown} missing:\n{sidecar}");
    }
    let proxy = text(&cellmesh(&["proxy", "--print-config"], SECRETS).stdout);
    assert!(proxy.contains("token_secret = \"***\""), "{proxy}");
}

#[test]
fn print_config_shows_the_public_default_secret() {
    let proxy = text(&cellmesh(&["proxy", "--print-config"], &[]).stdout);
    let default = cellmesh_proxy::config::DEFAULT_TOKEN_SECRET;
    assert!(
        proxy.contains(&format!("token_secret = \"{default}\"")),
        "{proxy}"
    );
}

#[test]
fn help_shows_no_secret_from_the_environment() {
    for process in ["token", "bots"] {
        let out = cellmesh(&[process, "--help"], SECRETS);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(!stdout.contains("s3cret"), "{process} --help:\n{stdout}");
    }
}

#[test]
fn bench_names_its_scenarios_when_given_none_or_an_unknown_one() {
    let out = cellmesh(&["bench", "hops"], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for name in [
        "hop",
        "fanout",
        "transport",
        "edge",
        "handoff",
        "memory",
        "overload",
        "capacity",
    ] {
        assert!(stderr.contains(name), "{name} not named: {stderr}");
    }

    let out = cellmesh(&["bench"], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--all"), "{stderr}");
}
