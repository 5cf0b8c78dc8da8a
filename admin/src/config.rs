//! Configuration: one TOML file per process, every key overridable by a `CELLMESH_*` environment
//! variable, and defaults that run a local cluster with nothing set.
//!
//! The variable for a key is `CELLMESH_` followed by its path in upper case, sections joined by
//! a double underscore: `admin_listen` is `CELLMESH_ADMIN_LISTEN`, `world.width` is
//! `CELLMESH_WORLD__WIDTH`. Values are read as TOML (`8192`, `true`, `["a","b"]`) and fall back
//! to a plain string.

use std::path::Path;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Loads `T` from its defaults, then `file` (if any), then the environment.
pub fn load<T>(file: Option<&Path>) -> anyhow::Result<T>
where
    T: Serialize + DeserializeOwned + Default,
{
    load_with_env(file, std::env::vars())
}

/// [`load`] with an explicit environment, for tests.
pub fn load_with_env<T>(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> anyhow::Result<T>
where
    T: Serialize + DeserializeOwned + Default,
{
    let mut value = toml::Value::try_from(T::default()).context("serialising the defaults")?;
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let from_file: toml::Value =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        merge(&mut value, from_file);
    }
    let env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("CELLMESH_"))
        .collect();
    apply_env(&mut value, "CELLMESH_", &env);
    value.try_into().context("invalid configuration")
}

/// Merges `from` into `into`, key by key.
fn merge(into: &mut toml::Value, from: toml::Value) {
    match (into, from) {
        (toml::Value::Table(a), toml::Value::Table(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    // Keys absent from the defaults (an unset `Option`, a map) are taken as they
                    // are; config structs use `deny_unknown_fields`, so a typo is still named.
                    None => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

fn apply_env(value: &mut toml::Value, prefix: &str, env: &[(String, String)]) {
    if let toml::Value::Table(t) = value {
        for (k, v) in t.iter_mut() {
            let name = format!("{prefix}{}", k.to_uppercase());
            if let toml::Value::Table(_) = v {
                apply_env(v, &format!("{name}__"), env);
                continue;
            }
            if let Some((_, raw)) = env.iter().find(|(n, _)| *n == name) {
                *v = parse_env_value(raw);
            }
        }
    }
}

fn parse_env_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct World {
        width: f64,
        name: String,
    }
    impl Default for World {
        fn default() -> Self {
            Self {
                width: 131072.0,
                name: "w".into(),
            }
        }
    }
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Cfg {
        admin_listen: String,
        peers: Vec<String>,
        world: World,
    }
    impl Default for Cfg {
        fn default() -> Self {
            Self {
                admin_listen: "127.0.0.1:9100".into(),
                peers: vec![],
                world: World::default(),
            }
        }
    }

    #[test]
    fn defaults_file_then_env() {
        let dir = std::env::temp_dir().join(format!("cellmesh-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "admin_listen = \"0.0.0.0:1\"\n[world]\nwidth = 64.0\n").unwrap();
        let env = vec![
            ("CELLMESH_WORLD__NAME".to_string(), "big world".to_string()),
            (
                "CELLMESH_PEERS".to_string(),
                "[\"a:1\", \"b:2\"]".to_string(),
            ),
            ("OTHER".to_string(), "x".to_string()),
        ];
        let c: Cfg = load_with_env(Some(&f), env).unwrap();
        assert_eq!(c.admin_listen, "0.0.0.0:1");
        assert_eq!(c.world.width, 64.0);
        assert_eq!(c.world.name, "big world");
        assert_eq!(c.peers, vec!["a:1", "b:2"]);
        let d: Cfg = load_with_env(None, Vec::new()).unwrap();
        assert_eq!(d, Cfg::default());
    }

    #[test]
    fn unknown_key_and_bad_type_are_named() {
        let dir = std::env::temp_dir().join(format!("cellmesh-cfg2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "[world]\nwidht = 1.0\n").unwrap();
        let err = load_with_env::<Cfg>(Some(&f), Vec::new()).unwrap_err();
        assert!(format!("{err:#}").contains("widht"), "{err:#}");
        let env = vec![("CELLMESH_WORLD__WIDTH".to_string(), "wide".to_string())];
        let err = load_with_env::<Cfg>(None, env).unwrap_err();
        assert!(
            format!("{err:#}").contains("invalid configuration"),
            "{err:#}"
        );
    }
}
