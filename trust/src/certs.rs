//! The cluster CA and the certificates it issues (`cellmesh certs init` / `certs issue`).
//!
//! A CA directory holds `ca.pem` (the certificate every process trusts) and `ca.key` (kept by
//! whoever issues; never handed to a process). An issued directory holds `cert.pem`, `key.pem`
//! and a copy of `ca.pem`: what the `mesh_tls` keys of one process point at. Keys are ECDSA P-256;
//! private keys are written readable by their owner only.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

use crate::identity::Identity;

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const CERT: &str = "cert.pem";
pub const KEY: &str = "key.pem";

/// How long a CA made by [`init`] is valid.
pub const CA_DAYS: i64 = 3650;
/// How long an issued certificate is valid unless said otherwise: rotation is routine (a file
/// change is picked up without a restart), so a leaf lives months, not years.
pub const CERT_DAYS: i64 = 90;
/// Issued certificates start this long before they were made, for hosts whose clocks lag.
const CLOCK_SKEW: Duration = Duration::minutes(10);

/// Paths of one process's mesh TLS files, as written by [`issue`].
#[derive(Debug, Clone)]
pub struct Issued {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Makes a new CA in `dir` (created if missing). Refuses to replace one that is there: a new CA
/// is a rotation (see the security docs), not an accident.
pub fn init(dir: &Path, name: &str) -> anyhow::Result<()> {
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    if cert_path.exists() || key_path.exists() {
        bail!(
            "{} already holds a CA ({CA_CERT}/{CA_KEY}); remove it first, or init another directory to rotate",
            dir.display()
        );
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let key = KeyPair::generate().context("generating the CA key")?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("cellmesh cluster CA {name}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + Duration::days(CA_DAYS);
    let cert = params.self_signed(&key).context("signing the CA")?;
    write_private(&key_path, &key.serialize_pem())?;
    write(&cert_path, &cert.pem())?;
    Ok(())
}

/// Issues a certificate for `who`, signed by the CA in `ca_dir`, into `out` (created if
/// missing): `cert.pem`, `key.pem` and a copy of the CA's `ca.pem`.
pub fn issue(ca_dir: &Path, who: &Identity, out: &Path, days: i64) -> anyhow::Result<Issued> {
    let sans = who
        .names()
        .into_iter()
        .map(|n| Ok(SanType::DnsName(n.try_into()?)))
        .collect::<Result<_, rcgen::Error>>()
        .context("naming the certificate")?;
    // Every holder both dials and (a sidecar) is dialled.
    let usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    issue_with(ca_dir, &format!("cellmesh {who}"), sans, usages, out, days)
}

/// Issues a proxy's certificate for players' connections (`client_tls`): a server certificate
/// naming the hosts clients dial (DNS names or IP addresses), signed by the CA in `ca_dir`.
pub fn issue_edge(
    ca_dir: &Path,
    hosts: &[String],
    out: &Path,
    days: i64,
) -> anyhow::Result<Issued> {
    if hosts.is_empty() {
        bail!("an edge certificate names at least one host clients dial");
    }
    let sans = hosts
        .iter()
        .map(|h| match h.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(h.clone().try_into()?)),
        })
        .collect::<Result<_, rcgen::Error>>()
        .context("naming the certificate")?;
    let name = format!("cellmesh edge {}", hosts.join(" "));
    issue_with(
        ca_dir,
        &name,
        sans,
        vec![ExtendedKeyUsagePurpose::ServerAuth],
        out,
        days,
    )
}

fn issue_with(
    ca_dir: &Path,
    common_name: &str,
    sans: Vec<SanType>,
    usages: Vec<ExtendedKeyUsagePurpose>,
    out: &Path,
    days: i64,
) -> anyhow::Result<Issued> {
    if days <= 0 {
        bail!("a certificate must be valid for at least one day (got {days})");
    }
    let ca_pem = fs::read_to_string(ca_dir.join(CA_CERT))
        .with_context(|| format!("reading {}", ca_dir.join(CA_CERT).display()))?;
    let ca_key_pem = fs::read_to_string(ca_dir.join(CA_KEY))
        .with_context(|| format!("reading {}", ca_dir.join(CA_KEY).display()))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).context("reading the CA key")?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).context("reading the CA certificate")?;

    let key = KeyPair::generate().context("generating the key")?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name.to_string());
    params.subject_alt_names = sans;
    params.extended_key_usages = usages;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + Duration::days(days);
    let cert = params.signed_by(&key, &issuer).context("signing")?;

    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let issued = Issued {
        ca: out.join(CA_CERT),
        cert: out.join(CERT),
        key: out.join(KEY),
    };
    // The key first, the certificate last: a process that reloads on a change of either never
    // pairs a new certificate with an old key for longer than one write.
    write_private(&issued.key, &key.serialize_pem())?;
    if issued.ca != ca_dir.join(CA_CERT) {
        write(&issued.ca, &ca_pem)?;
    }
    write(&issued.cert, &cert.pem())?;
    Ok(issued)
}

/// Writes through a temporary file and a rename, so a reader never sees half a file.
fn write_mode(path: &Path, text: &str, mode: Option<u32>) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if let Some(mode) = mode {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    write_mode(path, text, None)
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    write_mode(path, text, Some(0o600))
}

/// What [`ensure`] made on this call.
#[derive(Debug, Default)]
pub struct Ensured {
    pub ca_made: bool,
    pub issued: Vec<String>,
    pub secrets_made: Vec<String>,
}

/// Makes whatever of a cluster's trust is missing in `dir`, and leaves the rest alone: the CA in
/// `dir/ca` (its key stays there, readable by its owner only), one certificate per identity in
/// `dir/<label>`, and one random 256-bit secret (hex) per name in `dir/<name>`. For a deployment
/// that makes its own at first start and keeps them in a volume (the compose files): nothing is
/// shipped, and a restart finds what the first start made. With `owner`, what the processes read
/// (the issued directories and the secrets, not the CA's key) is handed to that uid and gid.
pub fn ensure(
    dir: &Path,
    identities: &[(String, Identity)],
    edges: &[(String, Vec<String>)],
    secrets: &[String],
    owner: Option<(u32, u32)>,
) -> anyhow::Result<Ensured> {
    let mut made = Ensured::default();
    let ca = dir.join("ca");
    if !ca.join(CA_CERT).exists() {
        init(&ca, "cluster")?;
        made.ca_made = true;
    }
    for (label, who) in identities {
        crate::identity::check_label("label", label).map_err(anyhow::Error::msg)?;
        let out = dir.join(label);
        if made.ca_made || !out.join(CERT).exists() {
            issue(&ca, who, &out, CERT_DAYS)?;
            made.issued.push(label.clone());
        }
        chown(&out, owner)?;
        for f in [CA_CERT, CERT, KEY] {
            chown(&out.join(f), owner)?;
        }
    }
    for (label, hosts) in edges {
        crate::identity::check_label("label", label).map_err(anyhow::Error::msg)?;
        let out = dir.join(label);
        if made.ca_made || !out.join(CERT).exists() {
            issue_edge(&ca, hosts, &out, CERT_DAYS)?;
            made.issued.push(label.clone());
        }
        chown(&out, owner)?;
        for f in [CA_CERT, CERT, KEY] {
            chown(&out.join(f), owner)?;
        }
    }
    for name in secrets {
        crate::identity::check_label("secret name", name).map_err(anyhow::Error::msg)?;
        let path = dir.join(name);
        if !path.exists() {
            let mut bytes = [0u8; 32];
            getrandom(&mut bytes)?;
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            write_private(&path, &hex)?;
            made.secrets_made.push(name.clone());
        }
        chown(&path, owner)?;
    }
    Ok(made)
}

/// 32 random bytes from the system's generator, through the key generator's own source (ring).
fn getrandom(out: &mut [u8]) -> anyhow::Result<()> {
    use rustls::crypto::ring::default_provider;
    default_provider()
        .secure_random
        .fill(out)
        .map_err(|_| anyhow::anyhow!("the system's random generator failed"))
}

fn chown(path: &Path, owner: Option<(u32, u32)>) -> anyhow::Result<()> {
    #[cfg(unix)]
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .with_context(|| format!("handing {} to {uid}:{gid}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = (path, owner);
    Ok(())
}
