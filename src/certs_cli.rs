//! `cellmesh certs …`: the cluster CA and the certificates of its processes (mesh TLS), and the
//! proxies' certificates for players' connections (`client_tls`).

use std::path::PathBuf;

use cellmesh_trust::{certs, Identity, Role};

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    #[command(subcommand)]
    pub command: CertsCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum CertsCommand {
    /// Make a cluster CA in DIR: ca.pem (every process trusts it) and ca.key (keep it with
    /// whoever issues; no process needs it).
    Init {
        dir: PathBuf,
        /// A name for the CA, shown in its certificate.
        #[arg(long, default_value = "cluster")]
        name: String,
    },
    /// Issue a process's certificate, signed by the CA in --ca, into --out (cert.pem, key.pem and
    /// a copy of ca.pem: what its mesh_tls.cert, .key and .ca point at).
    Issue {
        /// The CA directory made by `certs init`.
        #[arg(long)]
        ca: PathBuf,
        /// `edge`: a proxy's certificate for players' connections (`client_tls`), naming the
        /// hosts clients dial (--host).
        #[arg(long, value_parser = ["sidecar", "proxy", "director", "edge"])]
        role: String,
        /// With --role edge: a DNS name or IP address clients dial the proxy by (repeat).
        #[arg(long)]
        host: Vec<String>,
        /// A sidecar's node id. Without it the certificate lets its holder be any node (for a
        /// fleet with node_id_auto, whose nodes take their id at start).
        #[arg(long)]
        node: Option<u32>,
        /// The geo the process runs in; its hellos must then name this geo.
        #[arg(long)]
        geo: Option<String>,
        #[arg(long)]
        out: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = certs::CERT_DAYS)]
        days: i64,
    },
    /// Make whatever is missing of a cluster's trust in DIR and keep the rest: the CA (DIR/ca),
    /// each process's certificate, and random secrets. For deployments that make their own at
    /// first start and keep them in a volume (the compose files).
    Ensure {
        dir: PathBuf,
        /// A sidecar's certificate in DIR/node-N: `N` or `N@GEO` (repeat).
        #[arg(long, value_name = "N[@GEO]")]
        sidecar: Vec<String>,
        /// A proxy's certificate in DIR/LABEL: `LABEL` or `LABEL@GEO` (repeat).
        #[arg(long, value_name = "LABEL[@GEO]")]
        proxy: Vec<String>,
        /// A director's certificate in DIR/LABEL: `LABEL` or `LABEL@GEO` (repeat).
        #[arg(long, value_name = "LABEL[@GEO]")]
        director: Vec<String>,
        /// A proxy's certificate for players' connections in DIR/LABEL:
        /// `LABEL=HOST[,HOST...]`, the hosts clients dial it by (repeat).
        #[arg(long, value_name = "LABEL=HOSTS")]
        edge: Vec<String>,
        /// A random 256-bit secret, as hex, in DIR/NAME (repeat).
        #[arg(long, value_name = "NAME")]
        secret: Vec<String>,
        /// Hand what the processes read (not the CA's key) to this user: `UID:GID`.
        #[arg(long, value_name = "UID:GID")]
        owner: Option<String>,
    },
}

/// `N` / `N@GEO`, or `LABEL` / `LABEL@GEO`.
fn split_geo(spec: &str) -> (&str, Option<&str>) {
    match spec.split_once('@') {
        Some((a, g)) => (a, Some(g)),
        None => (spec, None),
    }
}

fn ensure_list(
    sidecars: &[String],
    proxies: &[String],
    directors: &[String],
) -> anyhow::Result<Vec<(String, Identity)>> {
    let mut out = Vec::new();
    for spec in sidecars {
        let (n, geo) = split_geo(spec);
        let node: u32 = n
            .parse()
            .map_err(|_| anyhow::anyhow!("--sidecar {spec:?}: expected N or N@GEO"))?;
        let who = Identity::new(Role::Sidecar, Some(node), geo).map_err(anyhow::Error::msg)?;
        out.push((format!("node-{node}"), who));
    }
    for (role, specs) in [(Role::Proxy, proxies), (Role::Director, directors)] {
        for spec in specs {
            let (label, geo) = split_geo(spec);
            let who = Identity::new(role, None, geo).map_err(anyhow::Error::msg)?;
            out.push((label.to_owned(), who));
        }
    }
    Ok(out)
}

/// `LABEL=HOST[,HOST...]` of `--edge`.
fn edge_list(specs: &[String]) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    specs
        .iter()
        .map(|spec| {
            let (label, hosts) = spec
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--edge {spec:?}: expected LABEL=HOST[,HOST...]"))?;
            let hosts: Vec<String> = hosts
                .split(',')
                .filter(|h| !h.is_empty())
                .map(str::to_owned)
                .collect();
            anyhow::ensure!(!hosts.is_empty(), "--edge {spec:?}: name at least one host");
            Ok((label.to_owned(), hosts))
        })
        .collect()
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    match args.command {
        CertsCommand::Init { dir, name } => {
            certs::init(&dir, &name)?;
            println!(
                "made a CA in {}: {} (trusted by every process), {} (for `certs issue` only)",
                dir.display(),
                certs::CA_CERT,
                certs::CA_KEY
            );
        }
        CertsCommand::Issue {
            ca,
            role,
            host,
            node,
            geo,
            out,
            days,
        } => {
            if role == "edge" {
                anyhow::ensure!(
                    node.is_none() && geo.is_none(),
                    "--role edge takes --host, not --node or --geo"
                );
                let issued = certs::issue_edge(&ca, &host, &out, days)?;
                println!(
                    "issued an edge certificate for {} for {days} days: client_tls.cert {}, client_tls.key {}; clients trust {}",
                    host.join(", "),
                    issued.cert.display(),
                    issued.key.display(),
                    issued.ca.display()
                );
                return Ok(());
            }
            anyhow::ensure!(host.is_empty(), "--host is for --role edge");
            let role = Role::parse(&role).expect("clap checked the role");
            let who = Identity::new(role, node, geo.as_deref()).map_err(anyhow::Error::msg)?;
            let issued = certs::issue(&ca, &who, &out, days)?;
            println!(
                "issued {who} for {days} days: mesh_tls.cert {}, mesh_tls.key {}, mesh_tls.ca {}",
                issued.cert.display(),
                issued.key.display(),
                issued.ca.display()
            );
        }
        CertsCommand::Ensure {
            dir,
            sidecar,
            proxy,
            director,
            edge,
            secret,
            owner,
        } => {
            let owner = owner
                .map(|o| -> anyhow::Result<(u32, u32)> {
                    let (u, g) = o
                        .split_once(':')
                        .ok_or_else(|| anyhow::anyhow!("--owner {o:?}: expected UID:GID"))?;
                    Ok((u.parse()?, g.parse()?))
                })
                .transpose()?;
            let list = ensure_list(&sidecar, &proxy, &director)?;
            let edges = edge_list(&edge)?;
            let made = certs::ensure(&dir, &list, &edges, &secret, owner)?;
            println!(
                "{}: CA {}, issued [{}], secrets made [{}]",
                dir.display(),
                if made.ca_made { "made" } else { "kept" },
                made.issued.join(", "),
                made.secrets_made.join(", ")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ensure_makes_what_is_missing_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let list = ensure_list(&["1@eu".into(), "2".into()], &["proxy@eu".into()], &[]).unwrap();
        assert_eq!(list[0].0, "node-1");
        assert_eq!(list[0].1.geo.as_deref(), Some("eu"));
        let secrets = vec!["token-secret".to_string()];
        let edges = edge_list(&["proxy-edge=proxy,127.0.0.1".into()]).unwrap();
        assert_eq!(edges[0].1, ["proxy", "127.0.0.1"]);
        let first = certs::ensure(dir.path(), &list, &edges, &secrets, None).unwrap();
        assert!(first.ca_made);
        assert_eq!(first.issued, ["node-1", "node-2", "proxy", "proxy-edge"]);
        let secret = std::fs::read_to_string(dir.path().join("token-secret")).unwrap();
        assert_eq!(secret.len(), 64);
        let cert = std::fs::read(dir.path().join("node-1").join(certs::CERT)).unwrap();

        let again = certs::ensure(dir.path(), &list, &edges, &secrets, None).unwrap();
        assert!(!again.ca_made && again.issued.is_empty() && again.secrets_made.is_empty());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("token-secret")).unwrap(),
            secret
        );
        assert_eq!(
            std::fs::read(dir.path().join("node-1").join(certs::CERT)).unwrap(),
            cert
        );
        // A node added later gets its certificate from the same CA.
        let more = ensure_list(&["3@eu".into()], &[], &[]).unwrap();
        assert_eq!(
            certs::ensure(dir.path(), &more, &[], &[], None)
                .unwrap()
                .issued,
            ["node-3"]
        );
        assert!(ensure_list(&["x".into()], &[], &[]).is_err());
        assert!(edge_list(&["no-hosts=".into()]).is_err());
        assert!(edge_list(&["no-equals".into()]).is_err());
        assert!(ensure_list(&[], &["p@not a geo".into()], &[]).is_err());
    }
}
