//! Child processes, `cellmesh sidecar` and `cellmesh proxy` among them.
//!
//! Every listener of a launched process binds port 0 and the process reports what it bound in one
//! line on stdout. No port is chosen before the bind, so no other test can take it in between.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::{within, Log, PATIENCE};

/// How `cellmesh sidecar` starts its line on stdout: `… local=A mesh=B admin=C`.
pub const SIDECAR_LISTENING: &str = "cellmesh sidecar listening";
/// How `cellmesh proxy` starts its line on stdout: `… clients=A admin=B`.
pub const PROXY_LISTENING: &str = "cellmesh proxy listening";

/// How `cellmesh director` starts its line on stdout: `… admin=A holder=H`.
pub const DIRECTOR_LISTENING: &str = "cellmesh director listening";

/// A loopback listener on a port the OS picks when the process binds.
const ANY_PORT: &str = "127.0.0.1:0";

/// `cellmesh sidecar` with every listener on port 0 and a state dir of its own (tests run many
/// sidecars with the same node id at once); the caller adds the rest of the configuration, and
/// sets `CELLMESH_STATE_DIR` itself to restart a node in place.
pub fn sidecar_command(bin: impl AsRef<Path>) -> Command {
    let mut cmd = Command::new(bin.as_ref());
    cmd.arg("sidecar")
        .env("CELLMESH_LOCAL_LISTEN", ANY_PORT)
        .env("CELLMESH_MESH_LISTEN", ANY_PORT)
        .env("CELLMESH_ADMIN_LISTEN", ANY_PORT)
        .env(
            STATE_DIR_VAR,
            state_root().join(crate::unique_name("sidecar")),
        );
    cmd
}

const STATE_DIR_VAR: &str = "CELLMESH_STATE_DIR";

/// Where [`sidecar_command`] puts each sidecar's state dir.
fn state_root() -> PathBuf {
    std::env::temp_dir().join("cellmesh-test-state")
}

/// A state dir [`sidecar_command`] chose, removed with the [`SidecarProcess`] it was for.
struct OwnStateDir(PathBuf);

impl OwnStateDir {
    /// The state dir `cmd` was given, if [`sidecar_command`] chose it (one a test chose is the
    /// test's to remove).
    fn of(cmd: &Command) -> Option<Self> {
        cmd.as_std()
            .get_envs()
            .find(|(k, _)| *k == STATE_DIR_VAR)
            .and_then(|(_, v)| v)
            .map(PathBuf::from)
            .filter(|p| p.starts_with(state_root()))
            .map(Self)
    }
}

impl Drop for OwnStateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `cellmesh proxy` with every listener on port 0; the caller adds the rest of the configuration.
pub fn proxy_command(bin: impl AsRef<Path>) -> Command {
    let mut cmd = Command::new(bin.as_ref());
    cmd.arg("proxy")
        .env("CELLMESH_CLIENT_LISTEN", ANY_PORT)
        .env("CELLMESH_ADMIN_LISTEN", ANY_PORT);
    cmd
}

/// `cellmesh director` with its admin listener on port 0; the caller adds the rest of the
/// configuration.
pub fn director_command(bin: impl AsRef<Path>) -> Command {
    let mut cmd = Command::new(bin.as_ref());
    cmd.arg("director").env("CELLMESH_ADMIN_LISTEN", ANY_PORT);
    cmd
}

/// A child process with its stdout and stderr collected as it runs; killed when dropped.
pub struct Process {
    pub name: String,
    pub child: Child,
    pub log: Log,
    readers: Vec<JoinHandle<()>>,
}

/// A process that exited before it reported its addresses.
#[derive(Debug)]
pub struct Exited {
    pub name: String,
    pub status: ExitStatus,
    /// Everything it wrote.
    pub log: String,
}

impl fmt::Display for Exited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} exited with {} before it reported its addresses:\n{}",
            self.name, self.status, self.log
        )
    }
}

impl Process {
    /// Starts `cmd`, collecting what it writes.
    pub fn spawn(name: impl Into<String>, cmd: &mut Command) -> Self {
        let name = name.into();
        let mut child = start(&name, cmd);
        let log = Log::default();
        let readers = vec![
            log.collect(child.stdout.take().expect("stdout is piped")),
            log.collect(child.stderr.take().expect("stderr is piped")),
        ];
        Self {
            name,
            child,
            log,
            readers,
        }
    }

    /// Starts `cmd` and reads its stdout up to the line that starts with `prefix`, within
    /// [`PATIENCE`]; returns the process (still collecting what it writes) and the rest of that
    /// line.
    pub async fn spawn_reporting(
        name: impl Into<String>,
        cmd: &mut Command,
        prefix: &str,
    ) -> Result<(Self, String), Exited> {
        let name = name.into();
        let mut child = start(&name, cmd);
        let log = Log::default();
        let stderr = log.collect(child.stderr.take().expect("stderr is piped"));
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let report = tokio::time::timeout(PATIENCE, async {
            let mut line = Vec::new();
            loop {
                line.clear();
                if let Ok(0) | Err(_) = stdout.read_until(b'\n', &mut line).await {
                    return None;
                }
                let text = String::from_utf8_lossy(&line);
                log.push(&text);
                if let Some(rest) = text.trim_end().strip_prefix(prefix) {
                    return Some(rest.to_string());
                }
            }
        })
        .await;
        let mut process = Self {
            name,
            child,
            log,
            readers: vec![stderr],
        };
        match report {
            Ok(Some(rest)) => {
                // What the reader buffered past the line is read first.
                let rest_of_stdout = process.log.collect(stdout);
                process.readers.push(rest_of_stdout);
                Ok((process, rest))
            }
            Ok(None) => {
                let status = within(
                    &format!("{} to exit after closing stdout", process.name),
                    process.child.wait(),
                )
                .await
                .expect("waiting for the process");
                let log = process.last_words().await;
                Err(Exited {
                    name: process.name,
                    status,
                    log,
                })
            }
            Err(_) => panic!(
                "{} did not report its addresses within {PATIENCE:?}:\n{}",
                process.name,
                process.log.tail()
            ),
        }
    }

    /// Everything the process wrote, once it has exited (its pipes close).
    pub async fn last_words(&mut self) -> String {
        for reader in self.readers.drain(..) {
            let _ = tokio::time::timeout(PATIENCE, reader).await;
        }
        self.log.text()
    }

    /// Sends `signal` (`TERM`, `STOP`, `CONT`, …).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the process runs").to_string();
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{signal} {} failed", self.name);
    }

    /// SIGKILL, and waits until it is gone.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("killing the process");
    }

    /// SIGTERM; asserts a clean exit within [`PATIENCE`] and returns what the process wrote.
    pub async fn terminate(mut self) -> String {
        self.signal("TERM");
        let status = tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} did not exit on SIGTERM:\n{}",
                    self.name,
                    self.log.tail()
                )
            })
            .expect("waiting for the process");
        let log = self.last_words().await;
        assert!(
            status.success(),
            "{} exited with {status}:\n{log}",
            self.name
        );
        log
    }

    /// The end of what the process wrote, under its name.
    pub fn tail(&self) -> String {
        format!("--- {} ---\n{}", self.name, self.log.tail())
    }
}

fn start(name: &str, cmd: &mut Command) -> Child {
    cmd.env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

/// The address after `key=` in a reported line.
fn address(name: &str, report: &str, key: &str) -> SocketAddr {
    report
        .split_whitespace()
        .find_map(|pair| pair.strip_prefix(key)?.strip_prefix('='))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{name} reported no {key} address: {report:?}"))
}

/// A `cellmesh sidecar` process and the addresses it bound.
pub struct SidecarProcess {
    /// Where its game connects.
    pub local: SocketAddr,
    pub mesh: SocketAddr,
    pub admin: SocketAddr,
    pub process: Process,
    _state_dir: Option<OwnStateDir>,
}

impl SidecarProcess {
    /// Starts `cmd` (from [`sidecar_command`]) and reads the addresses it reports; panics with what
    /// it wrote if it exits first.
    pub async fn start(name: impl Into<String>, cmd: &mut Command) -> Self {
        Self::try_start(name, cmd)
            .await
            .unwrap_or_else(|exited| panic!("{exited}"))
    }

    /// Like [`start`](Self::start), but a process that exits before reporting is returned as an
    /// error, for a test that expects some starts to be refused.
    pub async fn try_start(name: impl Into<String>, cmd: &mut Command) -> Result<Self, Exited> {
        let state_dir = OwnStateDir::of(cmd);
        let (process, report) = Process::spawn_reporting(name, cmd, SIDECAR_LISTENING).await?;
        let at = |key| address(&process.name, &report, key);
        Ok(Self {
            local: at("local"),
            mesh: at("mesh"),
            admin: at("admin"),
            process,
            _state_dir: state_dir,
        })
    }
}

/// A `cellmesh proxy` process and the addresses it bound.
pub struct ProxyProcess {
    /// Where clients log in.
    pub clients: SocketAddr,
    pub admin: SocketAddr,
    pub process: Process,
}

impl ProxyProcess {
    /// Starts `cmd` (from [`proxy_command`]) and reads the addresses it reports; panics with what
    /// it wrote if it exits first.
    pub async fn start(name: impl Into<String>, cmd: &mut Command) -> Self {
        let (process, report) = Process::spawn_reporting(name, cmd, PROXY_LISTENING)
            .await
            .unwrap_or_else(|exited| panic!("{exited}"));
        let at = |key| address(&process.name, &report, key);
        Self {
            clients: at("clients"),
            admin: at("admin"),
            process,
        }
    }
}

/// A `cellmesh director` process, its admin address and its name in the director's lease.
pub struct DirectorProcess {
    pub admin: SocketAddr,
    pub holder: String,
    pub process: Process,
}

impl DirectorProcess {
    /// Starts `cmd` (from [`director_command`]) and reads what it reports; panics with what it
    /// wrote if it exits first.
    pub async fn start(name: impl Into<String>, cmd: &mut Command) -> Self {
        let (process, report) = Process::spawn_reporting(name, cmd, DIRECTOR_LISTENING)
            .await
            .unwrap_or_else(|exited| panic!("{exited}"));
        let holder = report
            .split_whitespace()
            .find_map(|pair| pair.strip_prefix("holder="))
            .unwrap_or_else(|| panic!("{} reported no holder: {report:?}", process.name))
            .to_string();
        Self {
            admin: address(&process.name, &report, "admin"),
            holder,
            process,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_line_names_each_address_by_its_key() {
        let report = " local=127.0.0.1:7100 mesh=127.0.0.1:7200 admin=[::1]:9100";
        assert_eq!(address("n", report, "mesh").to_string(), "127.0.0.1:7200");
        assert_eq!(address("n", report, "admin").to_string(), "[::1]:9100");
    }

    #[test]
    #[should_panic(expected = "n reported no clients address")]
    fn a_missing_key_fails_naming_it() {
        address("n", " admin=127.0.0.1:1", "clients");
    }
}
