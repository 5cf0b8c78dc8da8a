//! The servers baselines run against that are not cellmesh: `redis-server` and HAProxy, each
//! started by the bench on a free loopback port, waited for, and killed when dropped. Their
//! output goes to a log file in a temporary directory, quoted when they fail to start.

use std::fs::File;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use tempfile::TempDir;
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// How long a started server gets to answer.
const STARTUP: Duration = Duration::from_secs(10);
/// Bytes of a failed server's log quoted in the error.
const LOG_TAIL: usize = 2000;

/// A `redis-server` child.
#[cfg(feature = "redis")]
pub struct RedisServer {
    pub url: String,
    // Killed before its directory goes.
    _child: Child,
    _dir: TempDir,
}

/// Starts `redis-server` on a free loopback port, without persistence, and waits for its PING.
#[cfg(feature = "redis")]
pub async fn start_redis() -> anyhow::Result<RedisServer> {
    let dir = tempfile::tempdir().context("a directory for redis-server")?;
    let port = free_port()?.to_string();
    let log = dir.path().join("redis-server.log");
    let dir_arg = dir.path().to_string_lossy().into_owned();
    let args = [
        "--bind",
        "127.0.0.1",
        "--port",
        &port,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &dir_arg,
    ];
    let mut child = spawn(
        "redis-server",
        &args,
        &log,
        "install it (apt-get install redis-server) or pass --redis URL",
    )?;
    let url = format!("redis://127.0.0.1:{port}/");
    wait_ready(&mut child, "redis-server", &log, || redis_answers(&url)).await?;
    Ok(RedisServer {
        url,
        _child: child,
        _dir: dir,
    })
}

/// Whether the Redis at `url` answers PING.
#[cfg(feature = "redis")]
pub async fn redis_answers(url: &str) -> bool {
    let ping = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), ping).await,
        Ok(Ok(pong)) if pong == "PONG"
    )
}

/// An HAProxy child forwarding TCP from `addr` to one backend.
pub struct Haproxy {
    pub addr: SocketAddr,
    _child: Child,
    _dir: TempDir,
}

/// HAProxy's configuration: TCP mode, one thread, one frontend on `listen` forwarding every
/// connection to `backend`.
pub fn haproxy_config(listen: SocketAddr, backend: SocketAddr) -> String {
    format!(
        "global
    nbthread 1

defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s

frontend edge
    bind {listen}
    default_backend gateway

backend gateway
    server gateway {backend}
"
    )
}

/// Starts `haproxy` in the foreground forwarding a free loopback port to `backend`, and waits
/// until that port accepts a connection (which reaches `backend` and is closed at once).
pub async fn start_haproxy(backend: SocketAddr) -> anyhow::Result<Haproxy> {
    let dir = tempfile::tempdir().context("a directory for haproxy")?;
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let cfg = dir.path().join("haproxy.cfg");
    std::fs::write(&cfg, haproxy_config(addr, backend))
        .with_context(|| format!("writing {}", cfg.display()))?;
    let log = dir.path().join("haproxy.log");
    let cfg_arg = cfg.to_string_lossy().into_owned();
    let mut child = spawn(
        "haproxy",
        &["-f", &cfg_arg, "-db"],
        &log,
        "install it (apt-get install haproxy)",
    )?;
    wait_ready(&mut child, "haproxy", &log, || async {
        TcpStream::connect(addr).await.is_ok()
    })
    .await?;
    Ok(Haproxy {
        addr,
        _child: child,
        _dir: dir,
    })
}

/// A loopback port nothing listens on now.
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `program` with its output going to `log`; a missing program is an error saying what
/// to do about it (`missing`).
fn spawn(program: &str, args: &[&str], log: &Path, missing: &str) -> anyhow::Result<Child> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                anyhow!("`{program}` is not installed: {missing}")
            } else {
                anyhow!(e).context(format!("starting {program}"))
            }
        })
}

/// Polls `ready` until it holds; fails with the log if the child exits first or takes too long.
async fn wait_ready<F, Fut>(
    child: &mut Child,
    name: &str,
    log: &Path,
    mut ready: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + STARTUP;
    loop {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("{name} exited ({status}) at start: {}", log_tail(log));
        }
        if ready().await {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{name} did not answer within {} s: {}",
            STARTUP.as_secs(),
            log_tail(log)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let text = text.trim();
    if text.is_empty() {
        return "it wrote nothing".into();
    }
    let start = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| text.len() - i <= LOG_TAIL)
        .unwrap_or(0);
    format!("it wrote:\n{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_forwards_tcp_from_the_frontend_to_the_one_backend() {
        let cfg = haproxy_config(
            "127.0.0.1:4000".parse().unwrap(),
            "127.0.0.1:5000".parse().unwrap(),
        );
        let lines: Vec<&str> = cfg.lines().map(str::trim).collect();
        for want in [
            "nbthread 1",
            "mode tcp",
            "bind 127.0.0.1:4000",
            "default_backend gateway",
            "server gateway 127.0.0.1:5000",
        ] {
            assert!(lines.contains(&want), "{want:?} missing from:\n{cfg}");
        }
        assert!(lines.iter().any(|l| l.starts_with("timeout client ")));
        assert!(lines.iter().any(|l| l.starts_with("timeout server ")));
        assert!(lines.iter().any(|l| l.starts_with("timeout connect ")));
    }

    #[tokio::test]
    async fn a_missing_program_says_how_to_get_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = spawn(
            "cellmesh-no-such-program",
            &[],
            &dir.path().join("log"),
            "install it",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "`cellmesh-no-such-program` is not installed: install it"
        );
    }
}
