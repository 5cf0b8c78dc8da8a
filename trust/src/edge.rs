//! TLS for players' connections to a proxy (`client_tls`): a server certificate naming the hosts
//! clients dial, no client certificate (a player proves who they are with their login token).
//! Read again when the files change or on SIGHUP, as the mesh's.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{bail, Context};
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use crate::tls::{provider, watch, MeshStream, Watched};

/// The `client_tls` section of the proxy's configuration: PEM files. Both or neither.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientTlsConfig {
    /// The certificate clients see (and any intermediates): `cellmesh certs issue --role edge`,
    /// or one of a public CA for the proxy's public names.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

impl ClientTlsConfig {
    /// Whether the section is set; an error if only half of it is.
    pub fn enabled(&self) -> anyhow::Result<bool> {
        match (self.cert.is_empty(), self.key.is_empty()) {
            (true, true) => Ok(false),
            (false, false) => Ok(true),
            _ => bail!(
                "client_tls needs both cert and key (CELLMESH_CLIENT_TLS__CERT, __KEY) or neither"
            ),
        }
    }
}

/// The proxy's TLS for clients: the current server configuration, read again on change.
pub struct EdgeTls {
    paths: [PathBuf; 2],
    current: RwLock<Arc<ServerConfig>>,
    files: Watched,
}

fn load(paths: &[PathBuf; 2]) -> anyhow::Result<ServerConfig> {
    let [cert, key] = paths;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<_, _>>())
        .with_context(|| format!("reading client_tls.cert {}", cert.display()))?;
    if chain.is_empty() {
        bail!("client_tls.cert {} holds no certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading client_tls.key {}", key.display()))?;
    ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("client_tls.key does not fit client_tls.cert")
}

impl EdgeTls {
    /// Reads the files of `cfg` (which must be [`enabled`](ClientTlsConfig::enabled)).
    pub fn load(cfg: &ClientTlsConfig) -> anyhow::Result<Arc<EdgeTls>> {
        let paths = [PathBuf::from(&cfg.cert), PathBuf::from(&cfg.key)];
        let files = Watched::new(&paths);
        let config = load(&paths)?;
        Ok(Arc::new(EdgeTls {
            paths,
            current: RwLock::new(Arc::new(config)),
            files,
        }))
    }

    /// Reads the files again if they changed (or always, with `force`); files that do not load
    /// leave the last good ones in use.
    pub fn reload(&self, force: bool) -> anyhow::Result<bool> {
        if !self.files.changed(&self.paths, force) {
            return Ok(false);
        }
        let config = load(&self.paths)?;
        *self.current.write().expect("edge tls lock") = Arc::new(config);
        Ok(true)
    }

    /// Reloads on SIGHUP and whenever the files change (looked at every `every`), until `stop`.
    pub fn spawn_reloader(
        self: &Arc<Self>,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        watch(every, stop, move |force| match tls.reload(force) {
            Ok(true) => tracing::info!("client TLS files read again: new connections use them"),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                error = %format!("{e:#}"),
                "client TLS files changed but do not load; the previous ones stay in use"
            ),
        })
    }

    /// The server side of a client's handshake.
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<MeshStream> {
        let config = self.current.read().expect("edge tls lock").clone();
        let tls = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await?;
        Ok(MeshStream::Tls(Box::new(tls.into())))
    }
}
