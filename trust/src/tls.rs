//! Mutual TLS for mesh links: the `mesh_tls` keys, the rustls configurations built from them,
//! reloading when the files change (or on SIGHUP), and the stream a link runs over.
//!
//! Both ends present a certificate of the cluster CA; TLS 1.3 only. The listener accepts any
//! certificate of the CA and hands back the [`Identity`] it proves, which the `LinkHello` must
//! then agree with. The dialler names what it expects to reach: `sidecar.cellmesh` for any
//! sidecar, `node-N.sidecar.cellmesh` for node N.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use rustls::client::WebPkiServerVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::identity::Identity;

/// The `mesh_tls` section of a process's configuration: paths of PEM files. All three or none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshTlsConfig {
    /// The cluster CA's certificate(s): every peer's certificate must chain to one. Several
    /// certificates in the file are all trusted (a CA rotation's overlap).
    pub ca: String,
    /// This process's certificate (and any intermediates), as issued by `cellmesh certs issue`.
    pub cert: String,
    /// Its private key (PKCS#8, SEC1 or PKCS#1 PEM).
    pub key: String,
}

impl MeshTlsConfig {
    /// Whether the section is set; an error if only part of it is.
    pub fn enabled(&self) -> anyhow::Result<bool> {
        let set = [&self.ca, &self.cert, &self.key]
            .iter()
            .filter(|s| !s.is_empty())
            .count();
        match set {
            0 => Ok(false),
            3 => Ok(true),
            _ => bail!(
                "mesh_tls needs all of ca, cert and key (CELLMESH_MESH_TLS__CA, __CERT, __KEY) or none"
            ),
        }
    }

    /// The section for the files `certs issue` wrote into `dir`.
    pub fn in_dir(dir: &Path) -> MeshTlsConfig {
        let at = |f: &str| dir.join(f).display().to_string();
        MeshTlsConfig {
            ca: at(crate::certs::CA_CERT),
            cert: at(crate::certs::CERT),
            key: at(crate::certs::KEY),
        }
    }
}

/// The rustls configurations of one reading of the files.
pub struct Loaded {
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
    /// What this process's own certificate proves.
    pub own: Identity,
}

/// The files' modification times and sizes: a change in any is a reason to read them again.
type Stamp = Vec<Option<(SystemTime, u64)>>;

/// A process's mesh TLS: the current [`Loaded`], read again when its files change.
pub struct MeshTls {
    paths: [PathBuf; 3],
    current: RwLock<Arc<Loaded>>,
    files: Watched,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn stamp(paths: &[PathBuf]) -> Stamp {
    paths
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
}

/// The stamp of a set of files when they were last read.
pub(crate) struct Watched(Mutex<Stamp>);

impl Watched {
    /// Taken before the files are first read, so that a change while reading is seen next time.
    pub(crate) fn new(paths: &[PathBuf]) -> Self {
        Self(Mutex::new(stamp(paths)))
    }

    /// Whether the files changed since the last call (always, with `force`); records their stamp.
    pub(crate) fn changed(&self, paths: &[PathBuf], force: bool) -> bool {
        let now = stamp(paths);
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !force && *last == now {
            return false;
        }
        *last = now;
        true
    }
}

/// The DNS names of a certificate's subject alternative names.
fn names_of(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push((*d).to_owned());
            }
        }
    }
    Ok(names)
}

/// What a verified peer certificate proves.
pub fn identity_of(cert: &CertificateDer<'_>) -> Result<Identity, String> {
    let names = names_of(cert)?;
    Identity::from_names(names.iter().map(String::as_str))
}

fn load(paths: &[PathBuf; 3]) -> anyhow::Result<Loaded> {
    let [ca, cert, key] = paths;
    let mut roots = RootCertStore::empty();
    let cas = CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading mesh_tls.ca {}", ca.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading mesh_tls.ca {}", ca.display()))?;
    if cas.is_empty() {
        bail!("mesh_tls.ca {} holds no certificate", ca.display());
    }
    for c in cas {
        roots
            .add(c)
            .with_context(|| format!("mesh_tls.ca {} is not a CA certificate", ca.display()))?;
    }
    let roots = Arc::new(roots);
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading mesh_tls.cert {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading mesh_tls.cert {}", cert.display()))?;
    let Some(leaf) = chain.first() else {
        bail!("mesh_tls.cert {} holds no certificate", cert.display());
    };
    let names = names_of(leaf)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("mesh_tls.cert {}", cert.display()))?;
    let own = Identity::from_names(names.iter().map(String::as_str))
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("mesh_tls.cert {}", cert.display()))?;
    let key_der = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading mesh_tls.key {}", key.display()))?;

    let provider = provider();
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .context("building the peer verifier")?;
    let server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3")?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain.clone(), key_der.clone_key())
        .with_context(|| {
            format!(
                "mesh_tls.key {} does not fit mesh_tls.cert {}",
                key.display(),
                cert.display()
            )
        })?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .context("building the server verifier")?;
    let client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3")?
        .with_webpki_verifier(server_verifier)
        .with_client_auth_cert(chain, key_der)
        .context("mesh_tls.cert and key")?;
    Ok(Loaded {
        server: Arc::new(server),
        client: Arc::new(client),
        own,
    })
}

impl MeshTls {
    /// Reads the files of `cfg` (which must be [`enabled`](MeshTlsConfig::enabled)).
    pub fn load(cfg: &MeshTlsConfig) -> anyhow::Result<Arc<MeshTls>> {
        let paths = [
            PathBuf::from(&cfg.ca),
            PathBuf::from(&cfg.cert),
            PathBuf::from(&cfg.key),
        ];
        let files = Watched::new(&paths);
        let loaded = load(&paths)?;
        Ok(Arc::new(MeshTls {
            paths,
            current: RwLock::new(Arc::new(loaded)),
            files,
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
        }))
    }

    /// The configurations new connections use now.
    pub fn current(&self) -> Arc<Loaded> {
        self.current.read().expect("mesh tls lock").clone()
    }

    /// What this process's certificate proves.
    pub fn own(&self) -> Identity {
        self.current().own.clone()
    }

    /// Successful reloads and failed ones since start.
    pub fn reloads(&self) -> (u64, u64) {
        (
            self.reloads.load(Ordering::Relaxed),
            self.reload_failures.load(Ordering::Relaxed),
        )
    }

    /// Reads the files again if they changed since the last reading (or always, with `force`).
    /// `Ok(true)`: new connections use them from now on; links already up keep theirs. A set of
    /// files that does not load (half-written, a key that does not fit) leaves the last good one
    /// in use and is tried again at the next change. `expected`, when given, is what the new
    /// certificate must still prove: a process never changes its identity by a file change.
    pub fn reload(&self, force: bool, expected: Option<&Identity>) -> anyhow::Result<bool> {
        if !self.files.changed(&self.paths, force) {
            return Ok(false);
        }
        let result = load(&self.paths).and_then(|loaded| {
            if let Some(want) = expected {
                if &loaded.own != want {
                    bail!(
                        "the new certificate proves {} where this process is {want}",
                        loaded.own
                    );
                }
            }
            Ok(loaded)
        });
        match result {
            Ok(loaded) => {
                *self.current.write().expect("mesh tls lock") = Arc::new(loaded);
                self.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) => {
                self.reload_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Reloads on SIGHUP and whenever the files change (looked at every `every`), until `stop`.
    pub fn spawn_reloader(
        self: &Arc<Self>,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        let expected = self.own();
        watch(every, stop, move |force| {
            match tls.reload(force, Some(&expected)) {
                Ok(true) => tracing::info!(
                    identity = %expected,
                    "mesh TLS files read again: new connections use them"
                ),
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    error = %format!("{e:#}"),
                    "mesh TLS files changed but do not load; the previous ones stay in use"
                ),
            }
        })
    }

    /// The listening side's handshake: the peer must present a certificate of the CA.
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<(MeshStream, Identity)> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.current().server.clone());
        let tls = acceptor.accept(tcp).await?;
        let id = peer_identity(tls.get_ref().1.peer_certificates())?;
        Ok((MeshStream::Tls(Box::new(tls.into())), id))
    }

    /// The dialling side's handshake, expecting a peer whose certificate carries `name`.
    pub async fn connect(&self, tcp: TcpStream, name: &str) -> io::Result<(MeshStream, Identity)> {
        let server_name = ServerName::try_from(name.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let connector = tokio_rustls::TlsConnector::from(self.current().client.clone());
        let tls = connector.connect(server_name, tcp).await?;
        let id = peer_identity(tls.get_ref().1.peer_certificates())?;
        Ok((MeshStream::Tls(Box::new(tls.into())), id))
    }
}

/// Calls `reload(force)` every `every` (`force` false) and at once on SIGHUP (`force` true),
/// until `stop`.
pub(crate) fn watch(
    every: Duration,
    stop: tokio_util::sync::CancellationToken,
    mut reload: impl FnMut(bool) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            #[cfg(unix)]
            let hangup = async {
                match hup.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hangup = std::future::pending::<()>();
            let force = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => false,
                _ = hangup => true,
            };
            reload(force);
        }
    })
}

fn peer_identity(certs: Option<&[CertificateDer<'static>]>) -> io::Result<Identity> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or_else(|| io::Error::new(io::ErrorKind::PermissionDenied, "no peer certificate"))?;
    identity_of(leaf).map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))
}

/// A mesh connection: TLS, or plain TCP on loopback when `mesh_tls` is not set.
pub enum MeshStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl AsyncRead for MeshStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MeshStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MeshStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MeshStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MeshStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MeshStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MeshStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MeshStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MeshStream::Plain(s) => s.is_write_vectored(),
            MeshStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MeshStream::Plain(s) => Pin::new(s).poll_flush(cx),
            MeshStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MeshStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MeshStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Whether `listen` (`host:port`) binds loopback only: the one place a mesh listener may run
/// without `mesh_tls`. A name other than `localhost` is not loopback.
pub fn is_loopback_listen(listen: &str) -> bool {
    let host = match listen.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => listen,
    };
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// The refusal for a mesh listener without `mesh_tls` that binds more than loopback.
pub fn require_tls_off_loopback(
    key: &str,
    listen: &str,
    tls: &MeshTlsConfig,
) -> anyhow::Result<()> {
    if !tls.enabled()? && !is_loopback_listen(listen) {
        bail!(
            "{key} {listen} is not loopback, and mesh_tls is not set: anyone who reaches it could join the mesh. \
             Set mesh_tls.ca, mesh_tls.cert and mesh_tls.key (CELLMESH_MESH_TLS__CA/__CERT/__KEY; \
             `cellmesh certs init` and `certs issue` make them), or bind 127.0.0.1"
        );
    }
    Ok(())
}
