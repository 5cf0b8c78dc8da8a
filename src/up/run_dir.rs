//! Directories of one run, each removed with it: the nodes' state dir, the admin token's, and
//! the run's CA.

use std::path::PathBuf;

use anyhow::Context;

/// A directory of this run, removed with it.
pub(super) struct RunDir(pub(super) PathBuf);

impl RunDir {
    pub(super) fn create() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "cellmesh-up-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the state dir {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The admin token of one run, in a file of its own directory (removed with it) that only this
/// user may read: the banner names the file, never the token.
pub(super) struct RunToken {
    pub(super) token: String,
    pub(super) file: PathBuf,
    _dir: RunDir,
}

impl RunToken {
    pub(super) fn create() -> anyhow::Result<Self> {
        let dir = RunDir::create()?;
        let token = format!("{:032x}", rand::random::<u128>());
        let file = dir.0.join("admin-token");
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        std::io::Write::write_all(
            &mut options
                .open(&file)
                .with_context(|| format!("creating {}", file.display()))?,
            token.as_bytes(),
        )
        .with_context(|| format!("writing {}", file.display()))?;
        Ok(Self {
            token,
            file,
            _dir: dir,
        })
    }
}

/// A cluster CA made for one run (its directory removed with it): every sidecar and proxy gets
/// a certificate naming its role, node id and geo, and every mesh link is mutual TLS.
pub(super) struct RunCa(RunDir);

impl RunCa {
    pub(super) fn create() -> anyhow::Result<Self> {
        let dir = RunDir::create()?;
        cellmesh_trust::certs::init(&dir.0.join("ca"), "cellmesh up")?;
        Ok(Self(dir))
    }

    /// Issues `who`'s certificate into a directory named `label`; returns its `mesh_tls` keys.
    pub(super) fn issue(
        &self,
        label: &str,
        who: &cellmesh_trust::Identity,
    ) -> anyhow::Result<cellmesh_trust::MeshTlsConfig> {
        let out = self.0 .0.join(label);
        cellmesh_trust::certs::issue(&self.0 .0.join("ca"), who, &out, 1)?;
        Ok(cellmesh_trust::MeshTlsConfig::in_dir(&out))
    }

    /// Issues a proxy's certificate for players on loopback into `label`; returns its
    /// `client_tls` keys.
    pub(super) fn issue_edge(
        &self,
        label: &str,
    ) -> anyhow::Result<cellmesh_trust::ClientTlsConfig> {
        let out = self.0 .0.join(label);
        let hosts = ["127.0.0.1".to_string(), "localhost".to_string()];
        let issued = cellmesh_trust::certs::issue_edge(&self.0 .0.join("ca"), &hosts, &out, 1)?;
        Ok(cellmesh_trust::ClientTlsConfig {
            cert: issued.cert.display().to_string(),
            key: issued.key.display().to_string(),
        })
    }

    /// What the bots trust: this run's CA.
    pub(super) fn client_tls(&self) -> anyhow::Result<cellmesh_proto::client::ClientTls> {
        let ca = self.0 .0.join("ca").join(cellmesh_trust::certs::CA_CERT);
        cellmesh_proto::client::ClientTls::from_ca_file(&ca).map_err(anyhow::Error::msg)
    }
}
