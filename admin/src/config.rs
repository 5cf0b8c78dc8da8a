//! Configuration: one TOML file per process, every key overridable by a `CELLMESH_*` environment
//! variable, and defaults that run a local cluster with nothing set.
//!
//! The variable for a key is `CELLMESH_` followed by its path in upper case, sections joined by
//! a double underscore: `admin_listen` is `CELLMESH_ADMIN_LISTEN`, `world.width` is
//! `CELLMESH_WORLD__WIDTH`. A value is read by the type of its key:
//!
//! - a string takes the text as it is: `CELLMESH_TOKEN_SECRET=20240601` is the string
//!   `20240601`, and quotes are part of the string;
//! - an integer, a float (an integer also) or a boolean (`true`, `false`) must read as one;
//! - an array is a TOML array (`[1, 2]`); an array of strings is also a comma-separated list
//!   (`10.0.0.1:7200,10.0.0.2:7200`; empty: none);
//! - a section takes an inline TOML table (`{ width = 65536.0 }`), merged into it before the
//!   variables of its own keys.
//!
//! A value that does not read as its key's type is an error naming the variable, the key and the
//! type. The keys are those of the configuration type, an unset `Option` included (read by the
//! type it holds). Variables that name no key are ignored: one environment may serve several
//! processes, each with keys of its own.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::Serialize;

use schema::Kind;

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
    let defaults = toml::Value::try_from(T::default()).context("serialising the defaults")?;
    let mut value = defaults.clone();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let from_file: toml::Value =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        merge(&mut value, from_file);
    }
    let keys = keys::<T>(&defaults);
    let mut set: Vec<(&Key, String, String)> = env
        .into_iter()
        .filter_map(|(name, raw)| Some((keys.get(&name)?, name, raw)))
        .collect();
    // A section's variable first, so that its keys' own variables override it.
    set.sort_by_key(|(key, _, _)| key.path.len());
    for (key, name, raw) in set {
        let v = convert(key.kind, &raw).map_err(|expected| {
            anyhow::anyhow!(
                "{name}={raw}: expected {expected} for {}",
                key.path.join(".")
            )
        })?;
        set_at(&mut value, &key.path, v);
    }
    // toml ends its message with the key on a line of its own (`in `rate.account_burst``): one
    // line reads better after the context.
    value.try_into().map_err(|e: toml::de::Error| {
        anyhow::anyhow!(
            "invalid configuration: {}",
            e.to_string().trim_end().replace('\n', " ")
        )
    })
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

/// A key a variable may set.
#[derive(Debug)]
struct Key {
    path: Vec<String>,
    kind: Kind,
}

/// Every key of `T` by the name of its variable: the keys of the defaults, typed by their values,
/// and those the type declares besides (an unset `Option`), typed by what it asks for.
fn keys<T: DeserializeOwned>(defaults: &toml::Value) -> HashMap<String, Key> {
    let mut kinds = schema::probe::<T>();
    kinds.retain(|path, _| !path.is_empty() && !path.iter().any(|s| s == schema::ELEMENT));
    kinds_of_defaults(defaults, &mut Vec::new(), &mut kinds);
    kinds
        .into_iter()
        .map(|(path, kind)| {
            let name = format!("CELLMESH_{}", path.join("__").to_uppercase());
            (name, Key { path, kind })
        })
        .collect()
}

fn kinds_of_defaults(
    value: &toml::Value,
    path: &mut Vec<String>,
    kinds: &mut BTreeMap<Vec<String>, Kind>,
) {
    let toml::Value::Table(t) = value else {
        return;
    };
    for (k, v) in t {
        path.push(k.clone());
        let kind = match v {
            toml::Value::String(_) => Kind::String,
            toml::Value::Integer(_) => Kind::Integer,
            toml::Value::Float(_) => Kind::Float,
            toml::Value::Boolean(_) => Kind::Bool,
            toml::Value::Array(a) => Kind::Array {
                // An empty default says nothing of its elements; the type does.
                strings: matches!(kinds.get(path), Some(Kind::Array { strings: true }))
                    || (!a.is_empty() && a.iter().all(toml::Value::is_str)),
            },
            toml::Value::Table(_) => Kind::Table,
            toml::Value::Datetime(_) => Kind::Any,
        };
        kinds.insert(path.clone(), kind);
        kinds_of_defaults(v, path, kinds);
        path.pop();
    }
}

/// Reads `raw` as a value of `kind`; the error says what was expected.
fn convert(kind: Kind, raw: &str) -> Result<toml::Value, &'static str> {
    use toml::Value as V;
    let as_toml = || raw.parse::<toml::Value>().ok();
    match kind {
        Kind::String => Ok(V::String(raw.to_string())),
        Kind::Integer => match raw.trim().parse::<i64>() {
            Ok(i) => Ok(V::Integer(i)),
            // TOML's own forms: `1_000`, `0x1f`.
            Err(_) => match as_toml() {
                Some(V::Integer(i)) => Ok(V::Integer(i)),
                _ => Err("an integer"),
            },
        },
        Kind::Float => match raw.trim().parse::<f64>() {
            Ok(f) => Ok(V::Float(f)),
            Err(_) => match as_toml() {
                Some(V::Float(f)) => Ok(V::Float(f)),
                Some(V::Integer(i)) => Ok(V::Float(i as f64)),
                _ => Err("a number"),
            },
        },
        Kind::Bool => match raw.trim() {
            "true" => Ok(V::Boolean(true)),
            "false" => Ok(V::Boolean(false)),
            _ => Err("true or false"),
        },
        Kind::Array { strings } => match as_toml() {
            Some(a @ V::Array(_)) => Ok(a),
            // What starts like a TOML array of strings is one with a mistake, not a list item
            // (an IPv6 address such as `[::1]:7200` is one).
            _ if strings && !looks_like_toml_array(raw) => Ok(V::Array(
                raw.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| V::String(s.to_string()))
                    .collect(),
            )),
            _ if strings => Err("a TOML array of strings or a comma-separated list"),
            _ => Err("a TOML array such as [1, 2]"),
        },
        Kind::Table => match as_toml() {
            Some(t @ V::Table(_)) => Ok(t),
            _ => Err("an inline TOML table such as { key = 1 }"),
        },
        Kind::Any => Ok(as_toml().unwrap_or_else(|| V::String(raw.to_string()))),
    }
}

fn looks_like_toml_array(raw: &str) -> bool {
    let mut rest = raw.trim_start().strip_prefix('[').map(str::trim_start);
    matches!(
        rest.as_mut().and_then(|r| r.chars().next()),
        Some('"' | '\'' | ']')
    )
}

/// Sets the key at `path` to `v` (a table is merged into the section there), adding the sections
/// on the way that are not there (an unset `Option`).
fn set_at(root: &mut toml::Value, path: &[String], v: toml::Value) {
    let Some((last, sections)) = path.split_last() else {
        return;
    };
    let mut here = root;
    for s in sections {
        let toml::Value::Table(t) = here else {
            // Something else than a section (from the file): deserialising names it.
            return;
        };
        here = t
            .entry(s.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let toml::Value::Table(t) = here else {
        return;
    };
    match t.get_mut(last) {
        Some(slot @ toml::Value::Table(_)) if v.is_table() => merge(slot, v),
        _ => {
            t.insert(last.clone(), v);
        }
    }
}

/// What a configuration type asks for, learnt by deserialising it from a probe that answers every
/// question with a placeholder and notes the question: the keys of its structs (`Option`s
/// included, set or not) and the kind of value each takes.
mod schema {
    use std::cell::RefCell;
    use std::collections::{BTreeMap, BTreeSet};

    use serde::de::value::Error;
    use serde::de::{
        self, DeserializeOwned, DeserializeSeed, Deserializer, EnumAccess, IntoDeserializer,
        MapAccess, SeqAccess, VariantAccess, Visitor,
    };

    /// The kind of value a key takes.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Kind {
        String,
        Integer,
        Float,
        Bool,
        Array {
            strings: bool,
        },
        Table,
        /// Anything, or not known.
        Any,
    }

    /// The path segment of an array's elements.
    pub(super) const ELEMENT: &str = "[]";

    /// Deepest nesting probed: a recursive type would recurse for ever.
    const MAX_DEPTH: usize = 32;

    /// Passes at most: each leaves out one more key.
    const MAX_PASSES: usize = 64;

    pub(super) type Kinds = BTreeMap<Vec<String>, Kind>;

    #[derive(Default)]
    struct State {
        kinds: Kinds,
        /// Keys whose placeholder was refused (a `SocketAddr` refuses ""), left out of the next
        /// pass so that it reaches the keys after them.
        refused: BTreeSet<Vec<String>>,
    }

    /// The keys of `T` and their kinds. A key the probe cannot build stays of the kind it was
    /// asked as, or [`Kind::Any`] if it was not asked at all.
    pub(super) fn probe<T: DeserializeOwned>() -> Kinds {
        let state = RefCell::new(State::default());
        for _ in 0..MAX_PASSES {
            let refused = state.borrow().refused.len();
            let probe = Probe {
                path: Vec::new(),
                depth: 0,
                state: &state,
            };
            if T::deserialize(probe).is_ok() || state.borrow().refused.len() == refused {
                break;
            }
        }
        state.into_inner().kinds
    }

    struct Probe<'a> {
        path: Vec<String>,
        /// Types entered to get here: keys, and `Option`s and newtypes around them.
        depth: usize,
        state: &'a RefCell<State>,
    }

    impl<'a> Probe<'a> {
        fn record(&self, kind: Kind) {
            self.state
                .borrow_mut()
                .kinds
                .insert(self.path.clone(), kind);
        }

        fn child(&self, segment: &str) -> Probe<'a> {
            let mut path = self.path.clone();
            path.push(segment.to_string());
            Probe {
                path,
                depth: self.depth + 1,
                state: self.state,
            }
        }

        /// This key, one type further in (an `Option`'s content, a newtype's).
        fn deeper(self) -> Result<Self, Error> {
            if self.depth >= MAX_DEPTH {
                return Err(de::Error::custom("too deep"));
            }
            Ok(Probe {
                depth: self.depth + 1,
                ..self
            })
        }

        fn is_refused(&self) -> bool {
            self.state.borrow().refused.contains(&self.path)
        }

        /// Deserialises the key of this probe with `seed`, noting it if it is refused.
        fn key<'de, S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, Error> {
            if self.depth > MAX_DEPTH {
                self.refuse();
                return Err(de::Error::custom("too deep"));
            }
            let (path, state) = (self.path.clone(), self.state);
            seed.deserialize(self).inspect_err(|_| {
                let key = Probe {
                    path,
                    depth: 0,
                    state,
                };
                key.refuse();
            })
        }

        /// Leaves this key out of the next pass, unless one inside it already is (the error
        /// rises through every key around the one that refused).
        fn refuse(&self) {
            let mut state = self.state.borrow_mut();
            if !state.refused.iter().any(|r| r.starts_with(&self.path)) {
                state.refused.insert(self.path.clone());
            }
        }

        fn elements<'de, V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Array { strings: false });
            let element = self.child(ELEMENT);
            let elements_path = element.path.clone();
            let r = visitor.visit_seq(Elements { element, left: len });
            if self.state.borrow().kinds.get(&elements_path) == Some(&Kind::String) {
                self.record(Kind::Array { strings: true });
            }
            r
        }
    }

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = Error;

        fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Any);
            visitor.visit_unit()
        }
        fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Bool);
            visitor.visit_bool(false)
        }
        fn deserialize_i8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_i16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_i128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_u16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Integer);
            visitor.visit_u8(1)
        }
        fn deserialize_u128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_u64(visitor)
        }
        fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_f64(visitor)
        }
        fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Float);
            visitor.visit_f64(0.0)
        }
        fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::String);
            visitor.visit_char('x')
        }
        fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::String);
            visitor.visit_str("")
        }
        fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_str(visitor)
        }
        fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record(Kind::Any);
            visitor.visit_bytes(&[])
        }
        fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_bytes(visitor)
        }
        fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            // Unset or not, the key takes what the `Option` holds.
            visitor.visit_some(self.deeper()?)
        }
        fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_any(visitor)
        }
        fn deserialize_unit_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            visitor: V,
        ) -> Result<V::Value, Error> {
            self.deserialize_any(visitor)
        }
        fn deserialize_newtype_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            visitor: V,
        ) -> Result<V::Value, Error> {
            visitor.visit_newtype_struct(self.deeper()?)
        }
        fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.elements(1, visitor)
        }
        fn deserialize_tuple<V: Visitor<'de>>(
            self,
            len: usize,
            visitor: V,
        ) -> Result<V::Value, Error> {
            self.elements(len, visitor)
        }
        fn deserialize_tuple_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            len: usize,
            visitor: V,
        ) -> Result<V::Value, Error> {
            self.elements(len, visitor)
        }
        fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.deserialize_struct("", &[], visitor)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Error> {
            self.record(Kind::Table);
            // Every key is known even if a placeholder for an earlier one is refused.
            for field in fields {
                let path = self.child(field).path;
                self.state
                    .borrow_mut()
                    .kinds
                    .entry(path)
                    .or_insert(Kind::Any);
            }
            visitor.visit_map(Fields {
                probe: self,
                fields: fields.iter(),
                next: None,
            })
        }
        fn deserialize_enum<V: Visitor<'de>>(
            self,
            _name: &'static str,
            variants: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Error> {
            // A unit variant, the usual in a configuration, is its name.
            self.record(Kind::String);
            let name = *variants
                .first()
                .ok_or_else(|| <Error as de::Error>::custom("no variants"))?;
            let payload = self.child(name);
            visitor.visit_enum(Variant { name, payload })
        }
        fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.visit_str("")
        }
        fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.visit_unit()
        }
    }

    struct Elements<'a> {
        element: Probe<'a>,
        left: usize,
    }

    impl<'de> SeqAccess<'de> for Elements<'_> {
        type Error = Error;

        fn next_element_seed<S: DeserializeSeed<'de>>(
            &mut self,
            seed: S,
        ) -> Result<Option<S::Value>, Error> {
            if self.left == 0 {
                return Ok(None);
            }
            self.left -= 1;
            let element = Probe {
                path: self.element.path.clone(),
                ..self.element
            };
            element.key(seed).map(Some)
        }
    }

    struct Fields<'a> {
        probe: Probe<'a>,
        fields: std::slice::Iter<'static, &'static str>,
        next: Option<&'static str>,
    }

    impl<'de> MapAccess<'de> for Fields<'_> {
        type Error = Error;

        fn next_key_seed<S: DeserializeSeed<'de>>(
            &mut self,
            seed: S,
        ) -> Result<Option<S::Value>, Error> {
            let Some(field) = self.fields.find(|f| !self.probe.child(f).is_refused()) else {
                return Ok(None);
            };
            self.next = Some(field);
            seed.deserialize(IntoDeserializer::<Error>::into_deserializer(*field))
                .map(Some)
        }

        fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Error> {
            let field = self
                .next
                .take()
                .ok_or_else(|| <Error as de::Error>::custom("value before key"))?;
            self.probe.child(field).key(seed)
        }
    }

    struct Variant<'a> {
        name: &'static str,
        payload: Probe<'a>,
    }

    impl<'de, 'a> EnumAccess<'de> for Variant<'a> {
        type Error = Error;
        type Variant = Probe<'a>;

        fn variant_seed<S: DeserializeSeed<'de>>(
            self,
            seed: S,
        ) -> Result<(S::Value, Probe<'a>), Error> {
            let v = seed.deserialize(IntoDeserializer::<Error>::into_deserializer(self.name))?;
            Ok((v, self.payload))
        }
    }

    impl<'de> VariantAccess<'de> for Probe<'_> {
        type Error = Error;

        fn unit_variant(self) -> Result<(), Error> {
            Ok(())
        }
        fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, Error> {
            self.key(seed)
        }
        fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
            self.elements(len, visitor)
        }
        fn struct_variant<V: Visitor<'de>>(
            self,
            fields: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Error> {
            self.deserialize_struct("", fields, visitor)
        }
    }
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
    #[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Rate {
        account_burst: u32,
        strict: bool,
    }
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Cfg {
        admin_listen: String,
        token_secret: String,
        peers: Vec<String>,
        ports: Vec<u16>,
        world: World,
        rate: Rate,
        max_players: Option<u32>,
        motd: Option<String>,
        extra: Option<Rate>,
    }
    impl Default for Cfg {
        fn default() -> Self {
            Self {
                admin_listen: "127.0.0.1:9100".into(),
                token_secret: "dev".into(),
                peers: vec![],
                ports: vec![7100],
                world: World::default(),
                rate: Rate::default(),
                max_players: None,
                motd: None,
                extra: None,
            }
        }
    }

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load_env(vars: &[(&str, &str)]) -> anyhow::Result<Cfg> {
        load_with_env(None, env(vars))
    }

    #[test]
    fn defaults_file_then_env() {
        let dir = std::env::temp_dir().join(format!("cellmesh-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "admin_listen = \"0.0.0.0:1\"\n[world]\nwidth = 64.0\n").unwrap();
        let vars = env(&[
            ("CELLMESH_WORLD__NAME", "big world"),
            ("CELLMESH_PEERS", "[\"a:1\", \"b:2\"]"),
            ("OTHER", "x"),
        ]);
        let c: Cfg = load_with_env(Some(&f), vars).unwrap();
        assert_eq!(c.admin_listen, "0.0.0.0:1");
        assert_eq!(c.world.width, 64.0);
        assert_eq!(c.world.name, "big world");
        assert_eq!(c.peers, vec!["a:1", "b:2"]);
        let d: Cfg = load_with_env(None, Vec::new()).unwrap();
        assert_eq!(d, Cfg::default());
    }

    #[test]
    fn a_string_key_takes_the_text_as_it_is() {
        for raw in [
            "20240601",
            "true",
            "\"quoted\"",
            "[1, 2]",
            " spaced ",
            "",
            "1.5",
            "ünï",
        ] {
            let c = load_env(&[("CELLMESH_TOKEN_SECRET", raw)]).unwrap();
            assert_eq!(c.token_secret, raw);
        }
    }

    #[test]
    fn numbers_and_booleans_are_read_by_their_key() {
        let c = load_env(&[
            ("CELLMESH_RATE__ACCOUNT_BURST", " 7 "),
            ("CELLMESH_RATE__STRICT", "true"),
            ("CELLMESH_WORLD__WIDTH", "1024"),
        ])
        .unwrap();
        assert_eq!((c.rate.account_burst, c.rate.strict), (7, true));
        assert_eq!(c.world.width, 1024.0);
        let c = load_env(&[("CELLMESH_RATE__ACCOUNT_BURST", "1_000")]).unwrap();
        assert_eq!(c.rate.account_burst, 1000);
    }

    #[test]
    fn a_value_of_the_wrong_type_names_the_variable_the_key_and_the_type() {
        let err = load_env(&[("CELLMESH_RATE__ACCOUNT_BURST", "lots")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CELLMESH_RATE__ACCOUNT_BURST=lots: expected an integer for rate.account_burst"
        );
        let err = load_env(&[("CELLMESH_WORLD__WIDTH", "wide")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CELLMESH_WORLD__WIDTH=wide: expected a number for world.width"
        );
        let err = load_env(&[("CELLMESH_RATE__STRICT", "yes")]).unwrap_err();
        assert!(err
            .to_string()
            .contains("expected true or false for rate.strict"));
        let err = load_env(&[("CELLMESH_PORTS", "7100,7101")]).unwrap_err();
        assert!(err.to_string().contains("expected a TOML array"), "{err}");
        let err = load_env(&[("CELLMESH_PEERS", "[\"a:1\", \"b")]).unwrap_err();
        assert!(err.to_string().contains("for peers"), "{err}");
    }

    #[test]
    fn a_value_out_of_range_names_the_key() {
        let err = load_env(&[("CELLMESH_RATE__ACCOUNT_BURST", "99999999999")]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("invalid configuration: "), "{msg}");
        assert!(msg.contains("rate.account_burst"), "{msg}");
        assert!(msg.contains("99999999999"), "{msg}");
    }

    #[test]
    fn an_array_of_strings_is_also_a_comma_separated_list() {
        let peers = |raw: &str| load_env(&[("CELLMESH_PEERS", raw)]).unwrap().peers;
        assert_eq!(peers("a:1,b:2"), vec!["a:1", "b:2"]);
        assert_eq!(peers(" a:1 , b:2 ,"), vec!["a:1", "b:2"]);
        assert_eq!(peers("a:1"), vec!["a:1"]);
        assert_eq!(peers(""), Vec::<String>::new());
        assert_eq!(
            peers("[::1]:7200,[::2]:7200"),
            vec!["[::1]:7200", "[::2]:7200"]
        );
        assert_eq!(peers("['x,y', \"z\"]"), vec!["x,y", "z"]);
        let c = load_env(&[("CELLMESH_PORTS", "[1, 2]")]).unwrap();
        assert_eq!(c.ports, vec![1, 2]);
    }

    #[test]
    fn an_unset_option_is_set_by_its_variable() {
        let c = load_env(&[
            ("CELLMESH_MAX_PLAYERS", "12"),
            ("CELLMESH_MOTD", "42"),
            ("CELLMESH_EXTRA__ACCOUNT_BURST", "3"),
        ])
        .unwrap();
        assert_eq!(c.max_players, Some(12));
        assert_eq!(c.motd.as_deref(), Some("42"));
        assert_eq!(
            c.extra,
            Some(Rate {
                account_burst: 3,
                strict: false
            })
        );
        let err = load_env(&[("CELLMESH_MAX_PLAYERS", "many")]).unwrap_err();
        assert!(
            err.to_string()
                .contains("expected an integer for max_players"),
            "{err}"
        );
    }

    #[test]
    fn keys_after_one_the_probe_cannot_build_and_recursive_ones_are_typed() {
        #[derive(Debug, Default, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        struct Odd {
            addr: Option<std::net::SocketAddr>,
            motd: Option<String>,
            list: Option<List>,
        }
        #[derive(Debug, Default, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        struct List {
            label: Option<String>,
            next: Option<Box<List>>,
        }
        let c: Odd = load_with_env(
            None,
            env(&[
                ("CELLMESH_ADDR", "127.0.0.1:1"),
                ("CELLMESH_MOTD", "20240601"),
                ("CELLMESH_LIST__NEXT__LABEL", "7"),
            ]),
        )
        .unwrap();
        assert_eq!(c.addr, Some("127.0.0.1:1".parse().unwrap()));
        assert_eq!(c.motd.as_deref(), Some("20240601"));
        let next = c.list.and_then(|l| l.next).unwrap();
        assert_eq!(next.label.as_deref(), Some("7"));
    }

    #[test]
    fn a_section_takes_an_inline_table_under_its_keys_variables() {
        let c = load_env(&[
            ("CELLMESH_WORLD__NAME", "mine"),
            ("CELLMESH_WORLD", "{ width = 8.0, name = \"theirs\" }"),
        ])
        .unwrap();
        assert_eq!((c.world.width, c.world.name.as_str()), (8.0, "mine"));
        let err = load_env(&[("CELLMESH_WORLD", "big")]).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("inline TOML table such as { key = 1 } for world"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let dir = std::env::temp_dir().join(format!("cellmesh-cfg2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "[world]\nwidht = 1.0\n").unwrap();
        let err = load_with_env::<Cfg>(Some(&f), Vec::new()).unwrap_err();
        assert!(format!("{err:#}").contains("widht"), "{err:#}");
        // A variable that names no key may be another process's.
        load_env(&[("CELLMESH_WORLD__WIDHT", "1.0"), ("CELLMESH_NODE_ID", "x")]).unwrap();
    }
}
