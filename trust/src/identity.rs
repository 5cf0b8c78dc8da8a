//! Who a mesh certificate says its holder is: a role, a sidecar's node id, and a geo, written as
//! DNS names under `cellmesh` in the certificate's subject alternative names.
//!
//! | holder | names |
//! |---|---|
//! | sidecar node 3 of geo `eu` | `sidecar.cellmesh`, `node-3.sidecar.cellmesh`, `eu.geo.cellmesh` |
//! | any sidecar of geo `eu` (a fleet with `node_id_auto`) | `sidecar.cellmesh`, `eu.geo.cellmesh` |
//! | proxy of geo `eu` | `proxy.cellmesh`, `eu.geo.cellmesh` |
//! | director | `director.cellmesh` |
//!
//! DNS names, not URIs, so that a dialler checks the role with TLS's own server-name check: every
//! mesh dialler asks for `sidecar.cellmesh`, so only a sidecar's certificate answers. What the
//! other side then says in its `LinkHello` (its node id, its geo) must agree with what its
//! certificate proves ([`Identity::check_claim`]), on both ends.

use std::fmt;

/// The suffix of every name a mesh certificate carries.
pub const DOMAIN: &str = "cellmesh";

/// The processes that hold mesh certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Sidecar,
    Proxy,
    Director,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Sidecar => "sidecar",
            Role::Proxy => "proxy",
            Role::Director => "director",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "sidecar" => Some(Role::Sidecar),
            "proxy" => Some(Role::Proxy),
            "director" => Some(Role::Director),
            _ => None,
        }
    }

    /// The name every holder of the role carries: what a dialler asks for when any holder will do.
    pub fn server_name(self) -> String {
        format!("{}.{DOMAIN}", self.as_str())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a certificate proves about its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    /// A sidecar's node id; none for the other roles. A sidecar certificate without one proves
    /// "a sidecar of this cluster", any node: for fleets whose nodes take their id at start
    /// (`node_id_auto`), where no certificate can name it ahead.
    pub node: Option<u32>,
    /// The geo the holder runs in, when the certificate names one.
    pub geo: Option<String>,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.role)?;
        if let Some(n) = self.node {
            write!(f, " node {n}")?;
        }
        if let Some(g) = &self.geo {
            write!(f, " of geo {g:?}")?;
        }
        Ok(())
    }
}

/// A name part must be a DNS label: a geo named otherwise cannot be written into a certificate.
pub fn check_label(what: &str, s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {s:?} cannot be named in a certificate: use 1-63 letters, digits or '-' (not first or last)"
        ))
    }
}

/// The name that proves sidecar node `node`: what its peers dial it as.
pub fn sidecar_node_name(node: u32) -> String {
    format!("node-{node}.sidecar.{DOMAIN}")
}

impl Identity {
    pub fn new(role: Role, node: Option<u32>, geo: Option<&str>) -> Result<Identity, String> {
        if role != Role::Sidecar && node.is_some() {
            return Err(format!("a {role} certificate names no node id"));
        }
        if let Some(g) = geo {
            check_label("geo", g)?;
        }
        Ok(Identity {
            role,
            node,
            geo: geo.map(str::to_owned),
        })
    }

    /// The subject alternative names that say this identity.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![self.role.server_name()];
        if let Some(n) = self.node {
            names.push(sidecar_node_name(n));
        }
        if let Some(g) = &self.geo {
            names.push(format!("{g}.geo.{DOMAIN}"));
        }
        names
    }

    /// Reads an identity back from a certificate's DNS names; names outside `cellmesh` are
    /// ignored. Exactly one role, at most one node (sidecars only, and then exactly one) and at
    /// most one geo, or the certificate proves nothing.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Identity, String> {
        let mut roles = Vec::new();
        let mut nodes = Vec::new();
        let mut geos = Vec::new();
        let suffix = format!(".{DOMAIN}");
        for name in names {
            let Some(rest) = name.strip_suffix(&suffix) else {
                continue;
            };
            if let Some(role) = Role::parse(rest) {
                roles.push(role);
            } else if let Some(node) = rest
                .strip_suffix(".sidecar")
                .and_then(|n| n.strip_prefix("node-"))
            {
                let id = node
                    .parse::<u32>()
                    .map_err(|_| format!("{name:?} names no node id"))?;
                nodes.push(id);
            } else if let Some(geo) = rest.strip_suffix(".geo") {
                geos.push(geo.to_owned());
            }
        }
        let role = match roles.as_slice() {
            [r] => *r,
            [] => return Err("the certificate names no cellmesh role".into()),
            _ => return Err("the certificate names more than one cellmesh role".into()),
        };
        let node = match nodes.as_slice() {
            [] => None,
            [n] => Some(*n),
            _ => return Err("the certificate names more than one node".into()),
        };
        let geo = match geos.as_slice() {
            [] => None,
            [g] => Some(g.clone()),
            _ => return Err("the certificate names more than one geo".into()),
        };
        Identity::new(role, node, geo.as_deref())
    }

    /// Whether a peer that proved `self` may say, in its hello, that it is `role` (node `node`
    /// for a sidecar) of `geo`. The error is the reason given to the peer and logged.
    pub fn check_claim(&self, role: Role, node: Option<u32>, geo: &str) -> Result<(), String> {
        if role != self.role {
            return Err(format!(
                "the hello says {role} but the certificate proves {self}"
            ));
        }
        if role == Role::Sidecar && self.node.is_some() && node != self.node {
            let said = node.map_or("no node".to_string(), |n| format!("node {n}"));
            return Err(format!(
                "the hello says sidecar {said} but the certificate proves {self}"
            ));
        }
        if let Some(g) = &self.geo {
            if g != geo {
                return Err(format!(
                    "the hello says geo {geo:?} but the certificate proves {self}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_reads_back_from_its_names() {
        for id in [
            Identity::new(Role::Sidecar, Some(3), Some("eu")).unwrap(),
            Identity::new(Role::Sidecar, Some(0), None).unwrap(),
            Identity::new(Role::Sidecar, None, Some("eu")).unwrap(),
            Identity::new(Role::Proxy, None, Some("us-west")).unwrap(),
            Identity::new(Role::Director, None, None).unwrap(),
        ] {
            let names = id.names();
            let mut with_others = vec!["localhost", "example.org"];
            with_others.extend(names.iter().map(String::as_str));
            assert_eq!(Identity::from_names(with_others).unwrap(), id);
        }
    }

    #[test]
    fn ambiguous_or_empty_names_prove_nothing() {
        assert!(Identity::from_names(["localhost"]).is_err());
        assert!(Identity::from_names(["proxy.cellmesh", "sidecar.cellmesh"]).is_err());
        assert!(Identity::from_names([
            "sidecar.cellmesh",
            "node-1.sidecar.cellmesh",
            "node-2.sidecar.cellmesh"
        ])
        .is_err());
        assert!(Identity::from_names(["proxy.cellmesh", "node-1.sidecar.cellmesh"]).is_err());
        assert!(Identity::from_names(["sidecar.cellmesh", "node-x.sidecar.cellmesh"]).is_err());
        assert!(Identity::new(Role::Proxy, None, Some("eu.evil")).is_err());
    }

    #[test]
    fn a_hello_must_say_what_the_certificate_proves() {
        let node3 = Identity::new(Role::Sidecar, Some(3), Some("eu")).unwrap();
        assert!(node3.check_claim(Role::Sidecar, Some(3), "eu").is_ok());
        let e = node3.check_claim(Role::Sidecar, Some(2), "eu").unwrap_err();
        assert!(e.contains("node 2") && e.contains("node 3"), "{e}");
        assert!(node3.check_claim(Role::Proxy, None, "eu").is_err());
        assert!(node3.check_claim(Role::Sidecar, Some(3), "us").is_err());
        let proxy = Identity::new(Role::Proxy, None, None).unwrap();
        assert!(proxy.check_claim(Role::Proxy, None, "any").is_ok());
        assert!(proxy.check_claim(Role::Sidecar, Some(1), "any").is_err());
        let any_node = Identity::new(Role::Sidecar, None, Some("eu")).unwrap();
        assert!(any_node.check_claim(Role::Sidecar, Some(7), "eu").is_ok());
        assert!(any_node.check_claim(Role::Sidecar, Some(7), "us").is_err());
    }
}
