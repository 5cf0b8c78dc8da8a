//! In-memory stores: the embedded default for `cellmesh up` and unit tests. Same semantics as the
//! real stores, leases included.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{
    CheckpointStore, EdgeBoard, FarRtt, MasterEntry, PlayerRecord, PlayerRecords, SessionDirectory,
    SessionEntry, StoreError,
};

#[derive(Default)]
pub struct MemoryDirectory {
    inner: Mutex<HashMap<String, Slot>>,
}

#[derive(Default)]
struct Slot {
    /// Highest epoch ever handed out; survives expiry so epochs never repeat.
    epoch: u64,
    live: Option<(SessionEntry, Instant)>,
    master: Option<MasterEntry>,
}

impl Slot {
    fn current(&self, now: Instant) -> Option<SessionEntry> {
        self.live.filter(|(_, until)| *until > now).map(|(e, _)| e)
    }
}

#[async_trait]
impl SessionDirectory for MemoryDirectory {
    async fn register_above(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        floor: u64,
    ) -> Result<u64, StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        let slot = map.entry(account.to_string()).or_default();
        slot.epoch = slot.epoch.max(floor) + 1;
        let entry = SessionEntry {
            gateway_node,
            session_epoch: slot.epoch,
        };
        slot.live = Some((entry, Instant::now() + lease));
        Ok(slot.epoch)
    }

    async fn register_moved(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        moved_from: u64,
    ) -> Result<Option<u64>, StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        let slot = map.entry(account.to_string()).or_default();
        if slot.epoch > moved_from {
            return Ok(None);
        }
        slot.epoch = moved_from + 1;
        let entry = SessionEntry {
            gateway_node,
            session_epoch: slot.epoch,
        };
        slot.live = Some((entry, Instant::now() + lease));
        Ok(Some(slot.epoch))
    }

    async fn lookup(&self, account: &str) -> Result<Option<SessionEntry>, StoreError> {
        let map = self.inner.lock().expect("directory lock poisoned");
        Ok(map.get(account).and_then(|s| s.current(Instant::now())))
    }

    async fn renew(
        &self,
        account: &str,
        session_epoch: u64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        let now = Instant::now();
        match map.get_mut(account) {
            Some(slot)
                if slot
                    .current(now)
                    .is_some_and(|e| e.session_epoch == session_epoch) =>
            {
                if let Some((_, until)) = slot.live.as_mut() {
                    *until = now + lease;
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn release(&self, account: &str, session_epoch: u64) -> Result<bool, StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        match map.get_mut(account) {
            Some(slot)
                if slot
                    .current(Instant::now())
                    .is_some_and(|e| e.session_epoch == session_epoch) =>
            {
                slot.live = None;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn master(&self, account: &str) -> Result<Option<MasterEntry>, StoreError> {
        let map = self.inner.lock().expect("directory lock poisoned");
        Ok(map.get(account).and_then(|s| s.master))
    }

    async fn set_master(&self, account: &str, entry: MasterEntry) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        let slot = map.entry(account.to_string()).or_default();
        if entry.replaces(slot.master.as_ref()) {
            slot.master = Some(entry);
        }
        Ok(())
    }

    async fn clear_master(
        &self,
        account: &str,
        entity_id: u64,
        entity_epoch: u64,
    ) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("directory lock poisoned");
        if let Some(slot) = map.get_mut(account) {
            if slot
                .master
                .is_some_and(|m| m.entity_id == entity_id && m.entity_epoch == entity_epoch)
            {
                slot.master = None;
            }
        }
        Ok(())
    }
}

#[derive(Default)]
pub struct MemoryPlayers {
    inner: Mutex<HashMap<String, PlayerRecord>>,
}

#[async_trait]
impl PlayerRecords for MemoryPlayers {
    async fn load(&self, account: &str) -> Result<Option<PlayerRecord>, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("players lock poisoned")
            .get(account)
            .cloned())
    }

    async fn save(&self, record: &PlayerRecord) -> Result<(), StoreError> {
        self.inner
            .lock()
            .expect("players lock poisoned")
            .insert(record.account.clone(), record.clone());
        Ok(())
    }
}

/// One process's checkpoints: entity id -> checkpoint.
type Kept = std::collections::BTreeMap<u64, Vec<u8>>;

/// Checkpoints by process (node, lease epoch), then by entity.
#[derive(Default)]
pub struct MemoryCheckpoints {
    inner: Mutex<HashMap<(u32, u64), Kept>>,
}

#[async_trait]
impl CheckpointStore for MemoryCheckpoints {
    async fn write(
        &self,
        node: u32,
        lease_epoch: u64,
        put: Vec<(u64, Vec<u8>)>,
        remove: Vec<u64>,
    ) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("checkpoint lock poisoned");
        let kept = map.entry((node, lease_epoch)).or_default();
        for id in remove {
            kept.remove(&id);
        }
        kept.extend(put);
        Ok(())
    }

    async fn load(&self, node: u32, lease_epoch: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let map = self.inner.lock().expect("checkpoint lock poisoned");
        Ok(map
            .get(&(node, lease_epoch))
            .map(|k| k.iter().map(|(id, c)| (*id, c.clone())).collect())
            .unwrap_or_default())
    }

    async fn drop_all(&self, node: u32, lease_epoch: u64) -> Result<(), StoreError> {
        let mut map = self.inner.lock().expect("checkpoint lock poisoned");
        map.remove(&(node, lease_epoch));
        Ok(())
    }

    async fn processes(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        let map = self.inner.lock().expect("checkpoint lock poisoned");
        let mut all: Vec<(u32, u64)> = map
            .iter()
            .filter(|(_, kept)| !kept.is_empty())
            .map(|(k, _)| *k)
            .collect();
        all.sort_unstable();
        Ok(all)
    }
}

type FarRtts = HashMap<String, (FarRtt, Instant)>;

/// A geo's [`EdgeBoard`] in memory, expiry included.
#[derive(Default)]
pub struct MemoryBoard {
    hints: Mutex<HashMap<String, (Vec<u8>, Instant)>>,
    /// (account, nonce) -> until when it is remembered used.
    nonces: Mutex<HashMap<(String, Vec<u8>), Instant>>,
    /// account -> measuring geo -> (figure, expiry).
    rtts: Mutex<HashMap<String, FarRtts>>,
}

#[async_trait]
impl EdgeBoard for MemoryBoard {
    async fn put_hint(
        &self,
        account: &str,
        sealed: &[u8],
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut hints = self.hints.lock().expect("board lock poisoned");
        hints.retain(|_, (_, until)| *until > now);
        hints.insert(account.to_string(), (sealed.to_vec(), now + ttl));
        Ok(())
    }

    async fn take_hint(&self, account: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let taken = self
            .hints
            .lock()
            .expect("board lock poisoned")
            .remove(account);
        Ok(taken
            .filter(|(_, until)| *until > Instant::now())
            .map(|(h, _)| h))
    }

    async fn use_nonce(
        &self,
        account: &str,
        nonce: &[u8],
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut used = self.nonces.lock().expect("board lock poisoned");
        used.retain(|_, until| *until > now);
        Ok(used
            .insert((account.to_string(), nonce.to_vec()), now + ttl)
            .is_none())
    }

    async fn put_far_rtt(
        &self,
        account: &str,
        geo: &str,
        rtt: FarRtt,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut all = self.rtts.lock().expect("board lock poisoned");
        let now = Instant::now();
        // Forget the expired entries of whoever is touched, so the map does not grow for good.
        all.retain(|_, by_geo| {
            by_geo.retain(|_, (_, until)| *until > now);
            !by_geo.is_empty()
        });
        all.entry(account.to_string())
            .or_default()
            .insert(geo.to_string(), (rtt, now + ttl));
        Ok(())
    }

    async fn far_rtts(&self, account: &str) -> Result<Vec<(String, FarRtt)>, StoreError> {
        let now = Instant::now();
        let all = self.rtts.lock().expect("board lock poisoned");
        let mut out: Vec<(String, FarRtt)> = all
            .get(account)
            .into_iter()
            .flatten()
            .filter(|(_, (_, until))| *until > now)
            .map(|(geo, (rtt, _))| (geo.clone(), *rtt))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}
