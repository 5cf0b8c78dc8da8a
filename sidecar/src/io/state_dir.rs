//! The node's state dir (`state_dir`): a lock that says a live process on this host runs as the
//! node, and the last lease grant a process of this host got for it (`node-N.lock`,
//! `node-N.lease`). A node that takes a free node id (`node_id_auto`) looks here first for the id
//! its last process ran as.
//!
//! The kernel releases the lock when its process dies, `kill -9` included. So a process holding
//! it knows that whoever got the recorded grant is dead, and may take that grant over at once
//! instead of waiting it out. That holds only while the dir belongs to one host: it is never
//! shared between hosts nor copied.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Write};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use anyhow::Context;
use cellmesh_stores::topology::Lease;
use cellmesh_world::partition::NodeId;

/// This process's hold on a node's state dir: the lock goes when it is dropped.
#[derive(Debug)]
pub(crate) struct StateDir {
    dir: PathBuf,
    node: NodeId,
    _lock: File,
}

impl StateDir {
    /// Creates `dir` if need be and locks it for `node`; fails if another live process holds it.
    pub(crate) fn lock(dir: &Path, node: NodeId) -> anyhow::Result<Self> {
        match Self::try_lock(dir, node)? {
            Some(state) => Ok(state),
            None => anyhow::bail!(
                "another sidecar on this host runs as node {node}: {} is locked",
                Self::lock_path(dir, node).display()
            ),
        }
    }

    /// [`lock`](Self::lock), but `None` if another live process holds the lock: for a node
    /// looking for a free id, that one is taken.
    pub(crate) fn try_lock(dir: &Path, node: NodeId) -> anyhow::Result<Option<Self>> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating state_dir {}", dir.display()))?;
        let path = Self::lock_path(dir, node);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Ok(None),
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
        Ok(Some(Self {
            dir: dir.to_path_buf(),
            node,
            _lock: lock,
        }))
    }

    /// The node ids in `ids` that `dir` holds a recorded grant of, the latest recorded first:
    /// where a node that takes a free id looks first after a restart in place. A dir that is
    /// missing or cannot be read has none.
    pub(crate) fn recorded(dir: &Path, ids: RangeInclusive<NodeId>) -> Vec<NodeId> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "cannot list state_dir; taking a node id as if it were empty");
                return Vec::new();
            }
        };
        let mut found: Vec<(std::time::SystemTime, NodeId)> = entries
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name();
                let node: NodeId = name
                    .to_str()?
                    .strip_prefix("node-")?
                    .strip_suffix(".lease")?
                    .parse()
                    .ok()?;
                let at = e.metadata().and_then(|m| m.modified()).ok()?;
                ids.contains(&node).then_some((at, node))
            })
            .collect();
        // Latest first; equal times by id.
        found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        found.into_iter().map(|(_, node)| node).collect()
    }

    fn lock_path(dir: &Path, node: NodeId) -> PathBuf {
        dir.join(format!("node-{node}.lock"))
    }

    fn lease_path(&self) -> PathBuf {
        self.dir.join(format!("node-{}.lease", self.node))
    }

    /// The last grant recorded, if any. One that cannot be read is only a lost shortcut: it is
    /// ignored with a warning, and the lease is asked for as if there were none.
    pub(crate) fn last_lease(&self) -> Option<Lease> {
        let path = self.lease_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the last node lease; asking for a new one");
                return None;
            }
        };
        match serde_json::from_str::<Lease>(&text) {
            Ok(lease) if lease.node == self.node => Some(lease),
            Ok(lease) => {
                tracing::warn!(path = %path.display(), node = lease.node, "the last node lease recorded is another node's; asking for a new one");
                None
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "the last node lease recorded is corrupt; asking for a new one");
                None
            }
        }
    }

    /// Records `lease` as the last grant: written to a temporary file, synced, and renamed over
    /// the old record, so a crash leaves one record or the other, never a torn one.
    pub(crate) fn record(&self, lease: &Lease) -> std::io::Result<()> {
        let tmp = self.dir.join(format!("node-{}.lease.tmp", self.node));
        let mut file = File::create(&tmp)?;
        file.write_all(&serde_json::to_vec(lease)?)?;
        file.sync_all()?;
        std::fs::rename(&tmp, self.lease_path())?;
        // The rename reaches the disk with the directory. Should it not, a restart finds the
        // older record, which no longer matches the store's grant: it waits out the lease.
        if let Ok(dir) = File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(node: NodeId, epoch: u64) -> Lease {
        Lease {
            node,
            holder: format!("sidecar-{node}-1-00000000000000ab"),
            epoch,
            expires_unix_ms: 1_800_000_010_000,
            ids_floor_unix_ms: 1_800_000_000_000,
        }
    }

    #[test]
    fn the_last_grant_is_read_back_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::lock(&dir.path().join("nested/state"), 4).unwrap();
        assert_eq!(state.last_lease(), None);
        state.record(&lease(4, 7)).unwrap();
        assert_eq!(state.last_lease(), Some(lease(4, 7)));
        state.record(&lease(4, 8)).unwrap();
        assert_eq!(state.last_lease(), Some(lease(4, 8)));
        // Nothing is left of the write but the record.
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("nested/state"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["node-4.lease", "node-4.lock"]);
    }

    #[test]
    fn an_unusable_record_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::lock(dir.path(), 4).unwrap();
        let path = dir.path().join("node-4.lease");
        for corrupt in ["", "{\"node\": 4, \"holder\"", "not json", "{\"node\": 4}"] {
            std::fs::write(&path, corrupt).unwrap();
            assert_eq!(state.last_lease(), None, "{corrupt:?}");
        }
        // Another node's grant is no grant of this one.
        std::fs::write(&path, serde_json::to_vec(&lease(5, 3)).unwrap()).unwrap();
        assert_eq!(state.last_lease(), None);
        // Unreadable: a directory where the record should be.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert_eq!(state.last_lease(), None);
        // A record can still be written once the obstacle is gone.
        std::fs::remove_dir(&path).unwrap();
        state.record(&lease(4, 9)).unwrap();
        assert_eq!(state.last_lease(), Some(lease(4, 9)));
    }

    #[test]
    fn one_process_per_node_and_dir_until_it_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateDir::lock(dir.path(), 4).unwrap();
        let e = StateDir::lock(dir.path(), 4).unwrap_err().to_string();
        assert!(
            e.contains("another sidecar on this host runs as node 4")
                && e.contains("node-4.lock is locked"),
            "{e}"
        );
        // Other nodes have locks of their own.
        let _other = StateDir::lock(dir.path(), 5).unwrap();
        drop(first);
        StateDir::lock(dir.path(), 4).unwrap();
    }

    #[test]
    fn the_recorded_ids_come_latest_first_within_the_range() {
        let dir = tempfile::tempdir().unwrap();
        assert!(StateDir::recorded(&dir.path().join("missing"), 0..=1023).is_empty());
        for node in [2, 7, 5] {
            let state = StateDir::lock(dir.path(), node).unwrap();
            state.record(&lease(node, 1)).unwrap();
            // Distinct modification times, whatever the file system's resolution.
            let at = std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::from_secs(1_800_000_000 + u64::from(node % 5));
            File::options()
                .write(true)
                .open(dir.path().join(format!("node-{node}.lease")))
                .unwrap()
                .set_modified(at)
                .unwrap();
        }
        // A lock without a record, and names that are no record.
        StateDir::lock(dir.path(), 9).unwrap();
        for name in ["node-x.lease", "node-3.lease.tmp", "other"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        // Modified at 2, 0 and 2 seconds past the base: 2 and 7 tie, the lower id first.
        assert_eq!(StateDir::recorded(dir.path(), 0..=1023), [2, 7, 5]);
        assert_eq!(StateDir::recorded(dir.path(), 3..=6), [5]);
    }

    #[test]
    fn a_lock_held_elsewhere_is_no_error_for_a_node_looking_for_a_free_id() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateDir::try_lock(dir.path(), 4).unwrap().expect("free");
        assert!(StateDir::try_lock(dir.path(), 4).unwrap().is_none());
        drop(first);
        assert!(StateDir::try_lock(dir.path(), 4).unwrap().is_some());
    }
}
