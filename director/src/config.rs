//! The director's configuration: TOML with `CELLMESH_*` overrides (see `cellmesh_admin::config`).

use cellmesh_world::balance::LoadConfig;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DirectorConfig {
    /// The topology store holding the partition, the node leases and their load reports
    /// (`mongodb://…`). Required: a director balances a cluster's world.
    pub topology_url: String,
    pub admin_listen: String,
    /// Bearer token for every admin path but `/live`, `/ready` and `/metrics` (clients send
    /// `Authorization: Bearer <admin_token>`); empty: open, allowed only with `admin_listen` on
    /// loopback. The live map also sends it to the nodes' admin ports: a cluster shares one.
    pub admin_token: String,
    /// Prefix of this director's lease holder name (a pid and a random suffix follow).
    pub name: String,
    /// The director's lease: renewed every quarter of it (at most every half second); a standby
    /// takes over once it lapses.
    pub lease_ms: u64,
    /// How often a standby asks for the lease.
    pub standby_poll_ms: u64,
    /// Decisions kept for `/state` (the moves, and each line's changes of reason).
    pub decisions_kept: usize,
    /// The balancer's parameters.
    pub balance: LoadConfig,
}

impl Default for DirectorConfig {
    fn default() -> Self {
        Self {
            topology_url: String::new(),
            admin_listen: "127.0.0.1:7400".into(),
            admin_token: String::new(),
            name: "director".into(),
            lease_ms: 5_000,
            standby_poll_ms: 250,
            decisions_kept: 512,
            balance: LoadConfig::default(),
        }
    }
}

impl DirectorConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.topology_url.is_empty(),
            "topology_url is not set: the director needs the cluster's topology store \
             (mongodb://host:port/database; CELLMESH_TOPOLOGY_URL)"
        );
        anyhow::ensure!(
            (500..=cellmesh_stores::topology::MAX_LEASE_TTL.as_millis() as u64)
                .contains(&self.lease_ms),
            "lease_ms {} must be between 500 and {}",
            self.lease_ms,
            cellmesh_stores::topology::MAX_LEASE_TTL.as_millis()
        );
        anyhow::ensure!(
            self.standby_poll_ms >= 10 && self.standby_poll_ms <= self.lease_ms,
            "standby_poll_ms {} must be between 10 and lease_ms ({})",
            self.standby_poll_ms,
            self.lease_ms
        );
        self.balance.validate()?;
        cellmesh_admin::guard::require_token_off_loopback(&self.admin_listen, &self.admin_token)?;
        Ok(())
    }

    /// The configuration as it may be shown: the store's password and the admin token hidden.
    pub fn shown(&self) -> Self {
        Self {
            topology_url: cellmesh_stores::redact_url(&self.topology_url),
            admin_token: cellmesh_admin::guard::shown_token(&self.admin_token),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_director_without_a_store_or_with_a_bad_lease_is_refused_with_the_key_named() {
        let e = DirectorConfig::default()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("topology_url"), "{e}");
        let cfg = DirectorConfig {
            topology_url: "mongodb://h/db".into(),
            lease_ms: 100,
            ..DirectorConfig::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("lease_ms"));
        let cfg = DirectorConfig {
            topology_url: "mongodb://h/db".into(),
            balance: LoadConfig {
                safety_ratio: -1.0,
                ..LoadConfig::default()
            },
            ..DirectorConfig::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("balance."));
        let cfg = DirectorConfig {
            topology_url: "mongodb://u:pw@h/db".into(),
            ..DirectorConfig::default()
        };
        assert!(cfg.validate().is_ok());
        assert!(!cfg.shown().topology_url.contains("pw"));
    }

    #[test]
    fn an_admin_port_off_loopback_needs_a_token_and_shows_it_masked() {
        let open = DirectorConfig {
            topology_url: "mongodb://h/db".into(),
            admin_listen: "0.0.0.0:7400".into(),
            ..DirectorConfig::default()
        };
        let e = open.validate().unwrap_err().to_string();
        assert!(
            e.contains("admin_token") && e.contains("CELLMESH_ADMIN_TOKEN"),
            "{e}"
        );
        let guarded = DirectorConfig {
            admin_token: "ops".into(),
            ..open
        };
        guarded.validate().unwrap();
        assert_eq!(guarded.shown().admin_token, "***");
    }
}
