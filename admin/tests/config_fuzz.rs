//! Whatever the environment and the file say, loading a configuration loads it or says why not:
//! it never panics.
//!
//! `CELLMESH_FUZZ_SECONDS=S` runs batches of fresh cases for S more seconds (each batch prints
//! its seed; `CELLMESH_FUZZ_SEED=HEX` runs that batch again).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cellmesh_admin::config::load_with_env;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Cfg {
    name: String,
    node_id: u32,
    small: u8,
    offset: i64,
    big: u64,
    ratio: f64,
    enabled: bool,
    peers: Vec<String>,
    ports: Vec<u16>,
    mode: Mode,
    limits: BTreeMap<String, u32>,
    world: World,
    motd: Option<String>,
    max_players: Option<u32>,
    extra: Option<Inner>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Grid,
    Bsp,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct World {
    width: f64,
    label: String,
    inner: Inner,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Inner {
    depth: u16,
    tags: Vec<String>,
    strict: bool,
}

impl Default for Cfg {
    fn default() -> Self {
        Self {
            name: "n".into(),
            node_id: 1,
            small: 2,
            offset: -3,
            big: 4,
            ratio: 0.5,
            enabled: true,
            peers: vec!["a:1".into()],
            ports: vec![],
            mode: Mode::Grid,
            limits: BTreeMap::from([("eu".into(), 5)]),
            world: World::default(),
            motd: None,
            max_players: None,
            extra: None,
        }
    }
}

impl Default for World {
    fn default() -> Self {
        Self {
            width: 1024.0,
            label: "w".into(),
            inner: Inner::default(),
        }
    }
}

/// Every key's variable, sections included, and a few that name none.
const VARS: &[&str] = &[
    "CELLMESH_NAME",
    "CELLMESH_NODE_ID",
    "CELLMESH_SMALL",
    "CELLMESH_OFFSET",
    "CELLMESH_BIG",
    "CELLMESH_RATIO",
    "CELLMESH_ENABLED",
    "CELLMESH_PEERS",
    "CELLMESH_PORTS",
    "CELLMESH_MODE",
    "CELLMESH_LIMITS",
    "CELLMESH_LIMITS__EU",
    "CELLMESH_WORLD",
    "CELLMESH_WORLD__WIDTH",
    "CELLMESH_WORLD__LABEL",
    "CELLMESH_WORLD__INNER",
    "CELLMESH_WORLD__INNER__DEPTH",
    "CELLMESH_WORLD__INNER__TAGS",
    "CELLMESH_WORLD__INNER__STRICT",
    "CELLMESH_MOTD",
    "CELLMESH_MAX_PLAYERS",
    "CELLMESH_EXTRA",
    "CELLMESH_EXTRA__DEPTH",
    "CELLMESH_EXTRA__TAGS",
    "CELLMESH_EXTRA__STRICT",
    "CELLMESH_",
    "CELLMESH___",
    "CELLMESH_WORLD__",
    "CELLMESH_NOPE",
    "cellmesh_name",
];

/// Keys as they appear in a file, under their section.
const FILE_KEYS: &[(&str, &str)] = &[
    ("", "name"),
    ("", "node_id"),
    ("", "big"),
    ("", "ratio"),
    ("", "peers"),
    ("", "mode"),
    ("", "motd"),
    ("", "nope"),
    ("world", "width"),
    ("world", "inner"),
    ("world.inner", "depth"),
    ("world.inner", "tags"),
    ("limits", "eu"),
    ("extra", "strict"),
];

/// Texts that tend to break parsers.
const NASTY: &[&str] = &[
    "",
    " ",
    ",",
    ",,",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "+inf",
    "infinity",
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "-1",
    "0x",
    "0x1f",
    "0b2",
    "1_",
    "_1",
    "1__0",
    "1.",
    ".5",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551616",
    "340282366920938463463374607431768211456",
    "[",
    "]",
    "[[",
    "]]",
    "[]",
    "[,]",
    "[1,",
    "{",
    "}",
    "{}",
    "{ a = 1 }",
    "{ depth = 70000 }",
    "{ tags = 1 }",
    "\"",
    "'",
    "\"\"\"",
    "'''",
    "[\"a\"",
    "[\"a\", 1]",
    "[::1]:7200",
    "[::1]:7200,[::2]:7200",
    "a,b,c",
    "true",
    "false",
    "TRUE",
    "grid",
    "bsp",
    "Grid",
    "1979-05-27T07:32:00Z",
    "#",
    "\\",
    "\\u0000",
    "\u{0}",
    "\n",
    "a = 1\nb = 2",
    "v = 1",
    "ü",
    "🦀",
    "\u{202e}",
    "x\u{fffd}",
];

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(NASTY).prop_map(str::to_string),
        2 => any::<String>(),
        2 => "[\\[\\]{}\"',=#\\\\ \n0-9a-zA-Z.eE+_:-]{0,24}",
        1 => any::<i64>().prop_map(|i| i.to_string()),
        1 => any::<u64>().prop_map(|i| i.to_string()),
        1 => any::<f64>().prop_map(|f| f.to_string()),
        1 => any::<u128>().prop_map(|i| i.to_string()),
        1 => prop::collection::vec(prop::sample::select(NASTY), 0..4).prop_map(|v| v.join(",")),
    ]
}

fn env() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec(
        (prop::sample::select(VARS).prop_map(str::to_string), value()),
        0..8,
    )
}

/// A file: text that is nearly TOML, or anything.
fn file() -> impl Strategy<Value = Option<String>> {
    let line = (prop::sample::select(FILE_KEYS), value()).prop_map(|((section, key), v)| {
        if section.is_empty() {
            format!("{key} = {v}\n")
        } else {
            format!("[{section}]\n{key} = {v}\n")
        }
    });
    prop_oneof![
        1 => Just(None),
        3 => prop::collection::vec(line, 0..6).prop_map(|l| Some(l.concat())),
        1 => any::<String>().prop_map(Some),
    ]
}

fn case() -> impl Strategy<Value = (Option<String>, Vec<(String, String)>)> {
    (file(), env())
}

/// The file of this thread's cases.
fn file_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "cellmesh-config-fuzz-{}-{:?}.toml",
        std::process::id(),
        std::thread::current().id()
    ))
}

fn check((text, env): (Option<String>, Vec<(String, String)>)) -> Result<(), TestCaseError> {
    let path = file_path();
    if let Some(text) = &text {
        std::fs::write(&path, text).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    // Loaded or refused, either is fine; a panic fails the case.
    let _ = load_with_env::<Cfg>(text.as_ref().map(|_| path.as_path()), env);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: 1024, ..Config::default() })]

    #[test]
    fn loading_never_panics(c in case()) {
        check(c)?;
    }
}

#[test]
fn loading_never_panics_for_a_while() {
    let Ok(seconds) = std::env::var("CELLMESH_FUZZ_SECONDS") else {
        return;
    };
    let seconds: f64 = seconds.parse().expect("CELLMESH_FUZZ_SECONDS is seconds");
    let deadline = Instant::now() + Duration::try_from_secs_f64(seconds).expect("seconds");
    let replay = std::env::var("CELLMESH_FUZZ_SEED").ok();
    let mut batches = 0u64;
    loop {
        let seed: [u8; 32] = match &replay {
            Some(hex) => parse_seed(hex),
            None => rand_seed(),
        };
        let hex: String = seed.iter().map(|b| format!("{b:02x}")).collect();
        eprintln!("config fuzz batch {batches}: CELLMESH_FUZZ_SEED={hex}");
        let config = Config {
            cases: 1024,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
        if let Err(e) = runner.run(&case(), check) {
            panic!("CELLMESH_FUZZ_SEED={hex}: {e}");
        }
        batches += 1;
        if replay.is_some() || Instant::now() >= deadline {
            break;
        }
    }
    eprintln!("config fuzz: {batches} batches of 1024 cases");
}

/// A fresh seed: std's hasher keys are random per process and per `RandomState`.
fn rand_seed() -> [u8; 32] {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&state.hash_one(i).to_le_bytes());
    }
    seed
}

fn parse_seed(hex: &str) -> [u8; 32] {
    let mut seed = [0u8; 32];
    for (i, b) in seed.iter_mut().enumerate() {
        *b = hex
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .expect("CELLMESH_FUZZ_SEED is 64 hex digits");
    }
    seed
}
