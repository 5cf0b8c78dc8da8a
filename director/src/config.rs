//! The director's configuration: TOML with `CELLMESH_*` overrides (see `cellmesh_admin::config`).

use cellmesh_world::balance::LoadConfig;
use cellmesh_world::bubbles::{Params, Sites};
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
    /// Bubble placement across geos (docs/geo.md#bubbles): set, the director moves the regions
    /// around each group of players to the geo nearest them, in place of balancing load.
    pub bubbles: Option<BubbleConfig>,
}

/// The geo-aware director's settings.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BubbleConfig {
    /// The geos, core first, by the names the nodes publish (`geo`): the core is where a
    /// bubble falls back to when its geo has no live node.
    pub sites: Vec<String>,
    /// The placement policy's parameters (hysteresis, dwell, fairness cap, RTT filter).
    pub params: Params,
}

impl BubbleConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.sites.len() >= 2,
            "bubbles.sites lists {} geo(s): bubble placement needs the core and at least one \
             other geo, core first",
            self.sites.len()
        );
        self.to_sites()?;
        self.params
            .validate()
            .map_err(|e| anyhow::anyhow!("bubbles.params: {e}"))
    }

    pub fn to_sites(&self) -> anyhow::Result<Sites> {
        let (core, others) = self
            .sites
            .split_first()
            .ok_or_else(|| anyhow::anyhow!("bubbles.sites is empty: list the geos, core first"))?;
        Sites::new(core.clone(), others.iter().cloned())
            .map_err(|e| anyhow::anyhow!("bubbles.sites: {e}"))
    }
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
            bubbles: None,
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
        if let Some(b) = &self.bubbles {
            b.validate()?;
        }
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
    fn bubbles_need_the_core_and_another_geo_and_valid_parameters() {
        let with = |sites: &[&str], params: Params| DirectorConfig {
            topology_url: "mongodb://h/db".into(),
            bubbles: Some(BubbleConfig {
                sites: sites.iter().map(|s| s.to_string()).collect(),
                params,
            }),
            ..DirectorConfig::default()
        };
        assert!(with(&["paris", "hongkong"], Params::default())
            .validate()
            .is_ok());
        let e = with(&["paris"], Params::default()).validate().unwrap_err();
        assert!(e.to_string().contains("bubbles.sites"), "{e}");
        let e = with(&["paris", "paris"], Params::default())
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let bad = Params {
            dwell_ms: 0,
            evaluate_every_ms: 0,
            ..Params::default()
        };
        let e = with(&["paris", "hongkong"], bad).validate().unwrap_err();
        assert!(e.to_string().contains("evaluate_every_ms"), "{e}");
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
