//! `cellmesh certs …`: the cluster CA and the certificates of its processes (mesh TLS).

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
        #[arg(long, value_parser = ["sidecar", "proxy", "director"])]
        role: String,
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
            node,
            geo,
            out,
            days,
        } => {
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
    }
    Ok(())
}
