//! Exclusive claims: a key (a player's trade escrow, a quest giver's attention) held by at most
//! one entity at a time, cluster-wide, for a lease. A grant carries a fencing token, new with
//! every grant of the key, and the holder's entity epoch: after a handoff the new owner rebinds
//! the claim under the entity's newer epoch, and from then on the old owner's renewals, rebinds
//! and releases (under the older epoch) are refused. A claim whose lease lapses is free.
//!
//! A token is never reused, even by a store that lost its data: each is at least the store's
//! clock in ms (time-floored, like session epochs), so a grant made after a wipe is newer than
//! every grant made before it. Every renewal, rebind and release names the holder's entity as
//! well as the token, and is refused when either differs.
//!
//! Only one store grants a key: that of the key's home geo (`cellmesh_world::homes`); nodes of
//! other geos ask it over the mesh.
//!
//! In the geo's Redis (one Lua script per operation, so two nodes racing for a key see exactly
//! one grant) and in memory for a process on its own. Keys, for geo `G` and claim key `K` (its
//! own hash tag): `cellmesh:G:{claim:K}:holder` (`token:entity:epoch`, the lease as its TTL) and
//! `cellmesh:G:{claim:K}:token` (the key's last token).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::StoreError;

/// Longest claim key, in bytes.
pub const MAX_CLAIM_KEY_LEN: usize = 200;

/// Who holds a claim: an entity, under the epoch its owner holds it at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimHolder {
    pub entity: u64,
    pub entity_epoch: u64,
}

/// A claim granted: the fencing token is new with every grant of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimGrant {
    pub key: String,
    pub holder: ClaimHolder,
    pub token: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    Granted(ClaimGrant),
    /// Another entity holds it (as last written).
    Held {
        by: ClaimHolder,
    },
}

#[async_trait]
pub trait ClaimStore: Send + Sync {
    /// Grants `key` to `holder` for `ttl` if it is free or lapsed. The entity that holds it
    /// already gets it again, under a new token (so a stale release of its earlier grant, still
    /// on its way, frees nothing), if its epoch is not older.
    async fn claim(
        &self,
        key: &str,
        holder: ClaimHolder,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Extends the claim to `ttl` from now if `grant` still holds it (same token, an epoch not
    /// older than the stored one); false otherwise.
    async fn renew(&self, grant: &ClaimGrant, ttl: Duration) -> Result<bool, StoreError>;

    /// After a handoff: the claim is held under `entity_epoch` from now on, if `grant` still
    /// holds it and `entity_epoch` is not older; `None` otherwise. The lease is unchanged.
    async fn rebind(
        &self,
        grant: &ClaimGrant,
        entity_epoch: u64,
    ) -> Result<Option<ClaimGrant>, StoreError>;

    /// Frees the claim if `grant` still holds it; false otherwise.
    async fn release(&self, grant: &ClaimGrant) -> Result<bool, StoreError>;

    /// A rebind whose lease then runs `ttl` from now (the previous owner's renewals stopped).
    async fn rebind_renewed(
        &self,
        grant: &ClaimGrant,
        entity_epoch: u64,
        ttl: Duration,
    ) -> Result<Option<ClaimGrant>, StoreError> {
        let Some(g) = self.rebind(grant, entity_epoch).await? else {
            return Ok(None);
        };
        Ok(self.renew(&g, ttl).await?.then_some(g))
    }
}

/// A claim key is 1 to [`MAX_CLAIM_KEY_LEN`] bytes with no control characters.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() || key.len() > MAX_CLAIM_KEY_LEN || key.chars().any(char::is_control) {
        return Err(StoreError::Corrupt(format!(
            "claim key {key:?}: 1 to {MAX_CLAIM_KEY_LEN} bytes, no control characters"
        )));
    }
    Ok(())
}

pub(crate) fn check(key: &str, ttl: Option<Duration>) -> Result<u64, StoreError> {
    check_key(key)?;
    let ms = ttl.map_or(1, |t| t.as_millis().min(u128::from(u32::MAX)) as u64);
    if ms == 0 {
        return Err(StoreError::Corrupt(format!(
            "claim {key:?}: a lease of 0 ms"
        )));
    }
    Ok(ms)
}

/// The claims of one store, with time as an argument (ms on any monotonic clock): the rules of
/// the Redis scripts below, for the embedded store and the cluster simulator.
#[derive(Debug, Default, Clone)]
pub struct ClaimTable {
    /// key -> (grant, lease expiry ms).
    held: HashMap<String, (ClaimGrant, u64)>,
    /// The last token of each key: tokens never repeat.
    tokens: HashMap<String, u64>,
    /// The wall-clock time (ms) of `now_ms` 0: a token is at least the wall-clock ms.
    origin_ms: u64,
}

impl ClaimTable {
    /// The live grant of `key`, dropping a lapsed one.
    fn live(&mut self, now_ms: u64, key: &str) -> Option<&mut (ClaimGrant, u64)> {
        if self
            .held
            .get(key)
            .is_some_and(|(_, until)| *until <= now_ms)
        {
            self.held.remove(key);
        }
        self.held.get_mut(key)
    }

    /// A table whose `now_ms` 0 is `origin_ms` on the wall clock (ms since the Unix epoch).
    pub fn with_origin(origin_ms: u64) -> Self {
        Self {
            origin_ms,
            ..Self::default()
        }
    }

    fn current(stored: &ClaimGrant, grant: &ClaimGrant) -> bool {
        stored.token == grant.token
            && stored.holder.entity == grant.holder.entity
            && grant.holder.entity_epoch >= stored.holder.entity_epoch
    }

    /// See [`ClaimStore::claim`].
    pub fn claim(
        &mut self,
        now_ms: u64,
        key: &str,
        holder: ClaimHolder,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let until = now_ms + check(key, Some(ttl))?;
        if let Some((g, _)) = self.live(now_ms, key) {
            if g.holder.entity != holder.entity || holder.entity_epoch < g.holder.entity_epoch {
                return Ok(ClaimOutcome::Held { by: g.holder });
            }
        }
        let floor = self.origin_ms + now_ms;
        let token = self.tokens.entry(key.to_string()).or_insert(0);
        *token = (*token + 1).max(floor);
        let grant = ClaimGrant {
            key: key.to_string(),
            holder,
            token: *token,
        };
        self.held.insert(key.to_string(), (grant.clone(), until));
        Ok(ClaimOutcome::Granted(grant))
    }

    /// See [`ClaimStore::renew`].
    pub fn renew(
        &mut self,
        now_ms: u64,
        grant: &ClaimGrant,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let ms = check(&grant.key, Some(ttl))?;
        Ok(match self.live(now_ms, &grant.key) {
            Some((g, lease)) if Self::current(g, grant) => {
                *lease = now_ms + ms;
                true
            }
            _ => false,
        })
    }

    /// See [`ClaimStore::rebind`].
    pub fn rebind(
        &mut self,
        now_ms: u64,
        grant: &ClaimGrant,
        entity_epoch: u64,
    ) -> Result<Option<ClaimGrant>, StoreError> {
        check(&grant.key, None)?;
        Ok(match self.live(now_ms, &grant.key) {
            Some((g, _)) if Self::current(g, grant) && entity_epoch >= g.holder.entity_epoch => {
                g.holder.entity_epoch = entity_epoch;
                Some(g.clone())
            }
            _ => None,
        })
    }

    /// See [`ClaimStore::release`].
    pub fn release(&mut self, now_ms: u64, grant: &ClaimGrant) -> Result<bool, StoreError> {
        check(&grant.key, None)?;
        let current = self
            .live(now_ms, &grant.key)
            .is_some_and(|(g, _)| Self::current(g, grant));
        if current {
            self.held.remove(&grant.key);
        }
        Ok(current)
    }

    /// See [`ClaimStore::rebind_renewed`].
    pub fn rebind_renewed(
        &mut self,
        now_ms: u64,
        grant: &ClaimGrant,
        entity_epoch: u64,
        ttl: Duration,
    ) -> Result<Option<ClaimGrant>, StoreError> {
        let Some(g) = self.rebind(now_ms, grant, entity_epoch)? else {
            return Ok(None);
        };
        Ok(self.renew(now_ms, &g, ttl)?.then_some(g))
    }

    /// Who holds `key` at `now_ms`, if anyone.
    pub fn holder(&mut self, now_ms: u64, key: &str) -> Option<ClaimHolder> {
        self.live(now_ms, key).map(|(g, _)| g.holder)
    }
}

/// Claims in this process's memory (the embedded default).
#[derive(Debug)]
pub struct MemoryClaims {
    table: Mutex<ClaimTable>,
    started: Instant,
}

impl Default for MemoryClaims {
    fn default() -> Self {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            table: Mutex::new(ClaimTable::with_origin(unix_ms)),
            started: Instant::now(),
        }
    }
}

impl MemoryClaims {
    fn table(&self) -> (std::sync::MutexGuard<'_, ClaimTable>, u64) {
        let now = self.started.elapsed().as_millis() as u64;
        (self.table.lock().expect("claims poisoned"), now)
    }
}

#[async_trait]
impl ClaimStore for MemoryClaims {
    async fn claim(
        &self,
        key: &str,
        holder: ClaimHolder,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let (mut t, now) = self.table();
        t.claim(now, key, holder, ttl)
    }

    async fn renew(&self, grant: &ClaimGrant, ttl: Duration) -> Result<bool, StoreError> {
        let (mut t, now) = self.table();
        t.renew(now, grant, ttl)
    }

    async fn rebind(
        &self,
        grant: &ClaimGrant,
        entity_epoch: u64,
    ) -> Result<Option<ClaimGrant>, StoreError> {
        let (mut t, now) = self.table();
        t.rebind(now, grant, entity_epoch)
    }

    async fn release(&self, grant: &ClaimGrant) -> Result<bool, StoreError> {
        let (mut t, now) = self.table();
        t.release(now, grant)
    }
}
