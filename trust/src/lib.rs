//! Trust between cellmesh processes: the cluster CA, certificates that name a process's role
//! (and a sidecar's node id and geo), and mutual TLS on every mesh link.
//!
//! - [`identity`]: what a certificate proves, written as DNS names; pure.
//! - [`certs`]: `cellmesh certs init` / `certs issue` (rcgen).
//! - [`tls`]: the `mesh_tls` keys, rustls configurations reloaded when their files change, and
//!   the stream a link runs over.

pub mod certs;
pub mod edge;
pub mod identity;
pub mod tls;

pub use edge::{ClientTlsConfig, EdgeTls};
pub use identity::{Identity, Role};
pub use tls::{MeshStream, MeshTls, MeshTlsConfig};
