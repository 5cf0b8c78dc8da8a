//! The session directory in the geo's Redis.
//!
//! Keys, for geo `G` and account `A` (the account is the hash tag, so one script's keys share a
//! slot on Redis Cluster):
//! - `cellmesh:G:{A}:session`: hash `{node, epoch}` with the lease as its TTL, so a dead gateway's
//!   sessions vanish by themselves;
//! - `cellmesh:G:{A}:session_epoch`: the account's last epoch, kept for [`EPOCH_KEEP`];
//! - `cellmesh:G:{A}:master`: hash `{node, lease, id, epoch}`, the process simulating the
//!   account's avatar, kept [`CHECKPOINT_KEEP`] past its last write;
//! - `cellmesh:G:{A}:hint`: a handover hint for the account's next login in this geo (the sealed
//!   cookie), with its TTL;
//! - `cellmesh:G:{A}:far_rtt`: hash geo -> the RTT that geo's proxy measured to the account's
//!   client (JSON), expiring as a whole after its last write;
//! - `cellmesh:G:{node-N-L}:checkpoints`: hash entity id -> checkpoint of the process that held
//!   node `N` under lease epoch `L`, kept [`CHECKPOINT_KEEP`] past its last write (a process
//!   that died with nobody left to restore it leaves nothing behind for good).
//!
//! An epoch is `max(last + 1, the server's unix time in microseconds)`. The time floor keeps
//! epochs strictly greater than any handed out before even when the counter is gone: expired, or
//! lost with the writes a failover to a replica dropped (Redis replicates asynchronously).
//! Repeating an epoch would let a displaced session's stale frames pass the fence. It assumes
//! fewer than one login of an account per microsecond, and replica clocks that agree to well
//! within a second. (A millisecond floor was not enough: two logins within one millisecond around
//! a lost counter got the same epoch.)
//!
//! Every write is one Lua script, so register, renew and release are atomic against each other
//! and against concurrent logins of the same account on other gateways.

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};

use super::{
    redact_url, valid_geo, CheckpointStore, EdgeBoard, FarRtt, MasterEntry, SessionDirectory,
    SessionEntry, StoreError,
};

/// Bound on `connect`: reaching the server and getting its answer to a PING.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on one command; a stalled Redis surfaces as `Unavailable` instead of a hung session.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnection attempts after a lost connection before a command fails.
const RECONNECT_RETRIES: usize = 3;
/// Longest lease written: Redis rejects expiry times beyond i64 milliseconds, and a rejected
/// PEXPIRE inside the register script would leave a session that never expires.
const MAX_LEASE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How long an account's last epoch is kept after its last login: past it, the time floor alone
/// keeps new epochs greater.
pub const EPOCH_KEEP: Duration = Duration::from_secs(30 * 24 * 3600);

/// How long a process's checkpoints outlive its last write.
pub const CHECKPOINT_KEEP: Duration = Duration::from_secs(24 * 3600);

/// KEYS: session, last epoch. ARGV: node, lease ms, epoch keep ms, floor. Returns the new
/// epoch. (Numbers stay below 2^53, exact in Lua's doubles, until the year 2255.)
static REGISTER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local t = redis.call('TIME')
        local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
        local last = tonumber(redis.call('GET', KEYS[2]) or '0')
        local epoch = math.max(last + 1, floor, tonumber(ARGV[4]) + 1)
        local shown = string.format('%.0f', epoch)
        redis.call('SET', KEYS[2], shown, 'PX', ARGV[3])
        redis.call('HSET', KEYS[1], 'node', ARGV[1], 'epoch', shown)
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return epoch
        ",
    )
});

/// KEYS: session, last epoch. ARGV: node, lease ms, epoch keep ms, moved-from epoch. As
/// [`REGISTER`] above the moved-from epoch, unless a later login took an epoch after it: then
/// nothing is written and 0 is returned.
static REGISTER_MOVED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local last = tonumber(redis.call('GET', KEYS[2]) or '0')
        local moved_from = tonumber(ARGV[4])
        if last > moved_from then
            return 0
        end
        local t = redis.call('TIME')
        local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
        local epoch = math.max(moved_from + 1, floor)
        local shown = string.format('%.0f', epoch)
        redis.call('SET', KEYS[2], shown, 'PX', ARGV[3])
        redis.call('HSET', KEYS[1], 'node', ARGV[1], 'epoch', shown)
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return epoch
        ",
    )
});

/// KEYS: session. ARGV: epoch, lease ms. Returns 1 if the epoch was current and the lease renewed.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then
            redis.call('PEXPIRE', KEYS[1], ARGV[2])
            return 1
        end
        return 0
        ",
    )
});

/// KEYS: session. ARGV: epoch. Returns 1 if the epoch was current and the entry removed.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then
            redis.call('DEL', KEYS[1])
            return 1
        end
        return 0
        ",
    )
});

/// KEYS: master. ARGV: node, lease epoch, entity id, entity epoch, keep ms. A later epoch of the
/// same entity already written wins (see [`MasterEntry::replaces`]).
static SET_MASTER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local cur = redis.call('HMGET', KEYS[1], 'id', 'epoch')
        if cur[1] == ARGV[3] and tonumber(cur[2]) > tonumber(ARGV[4]) then
            return 0
        end
        redis.call('HSET', KEYS[1], 'node', ARGV[1], 'lease', ARGV[2], 'id', ARGV[3], 'epoch', ARGV[4])
        redis.call('PEXPIRE', KEYS[1], ARGV[5])
        return 1
        ",
    )
});

/// KEYS: master. ARGV: entity id, entity epoch. Deletes the record if it still names them.
static CLEAR_MASTER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local cur = redis.call('HMGET', KEYS[1], 'id', 'epoch')
        if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
            return redis.call('DEL', KEYS[1])
        end
        return 0
        ",
    )
});

/// The session directory of one geo, in that geo's Redis.
#[derive(Clone)]
pub struct RedisDirectory {
    pub(super) conn: ConnectionManager,
    /// `cellmesh:<geo>:`; every key of this directory starts with it.
    pub(super) prefix: String,
    /// For error messages: the URL without its password.
    url: String,
}

impl RedisDirectory {
    /// Connects to the Redis at `url` (`redis://host:port[/db]`) and checks that it answers.
    /// The connection is re-established by itself if it drops later.
    pub async fn connect(url: &str, geo: &str) -> Result<Self, StoreError> {
        if !valid_geo(geo) {
            return Err(StoreError::InvalidGeo(geo.to_string()));
        }
        let shown = redact_url(url);
        let client =
            redis::Client::open(url).map_err(|e| StoreError::BadUrl(format!("{shown}: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(RECONNECT_RETRIES);
        let unavailable = |why: String| StoreError::Unavailable(format!("redis at {shown}: {why}"));
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let mut conn = ConnectionManager::new_with_config(client, config).await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            Ok::<_, RedisError>(conn)
        })
        .await
        .map_err(|_| unavailable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
        .map_err(|e| unavailable(e.to_string()))?;
        Ok(Self {
            conn,
            prefix: format!("cellmesh:{geo}:"),
            url: shown,
        })
    }

    fn session_key(&self, account: &str) -> String {
        format!("{}{{{account}}}:session", self.prefix)
    }

    fn epoch_key(&self, account: &str) -> String {
        format!("{}{{{account}}}:session_epoch", self.prefix)
    }

    fn master_key(&self, account: &str) -> String {
        format!("{}{{{account}}}:master", self.prefix)
    }

    fn hint_key(&self, account: &str) -> String {
        format!("{}{{{account}}}:hint", self.prefix)
    }

    fn nonce_key(&self, account: &str, nonce: &[u8]) -> String {
        let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}{{{account}}}:used:{hex}", self.prefix)
    }

    fn far_rtt_key(&self, account: &str) -> String {
        format!("{}{{{account}}}:far_rtt", self.prefix)
    }

    fn checkpoints_key(&self, node: u32, lease_epoch: u64) -> String {
        format!("{}{{node-{node}-{lease_epoch}}}:checkpoints", self.prefix)
    }

    pub(super) fn error(&self, op: &str, e: RedisError) -> StoreError {
        if e.kind() == redis::ErrorKind::UnexpectedReturnType || e.kind() == redis::ErrorKind::Parse
        {
            StoreError::Corrupt(format!("redis at {}: {op}: {e}", self.url))
        } else {
            StoreError::Unavailable(format!("redis at {}: {op}: {e}", self.url))
        }
    }
}

/// Lease in whole milliseconds, rounded up so a sub-millisecond lease does not delete the entry.
fn lease_ms(lease: Duration) -> u64 {
    let micros = lease.min(MAX_LEASE).as_micros();
    u64::try_from(micros.div_ceil(1000)).expect("MAX_LEASE fits in u64 milliseconds")
}

#[async_trait]
impl SessionDirectory for RedisDirectory {
    async fn register_above(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        floor: u64,
    ) -> Result<u64, StoreError> {
        // Lua reads numbers as doubles: a floor past 2^53 would round, and is no epoch anyway.
        if floor >= 1 << 53 {
            return Err(StoreError::Corrupt(format!(
                "session epoch floor {floor} is out of range"
            )));
        }
        REGISTER
            .key(self.session_key(account))
            .key(self.epoch_key(account))
            .arg(gateway_node)
            .arg(lease_ms(lease))
            .arg(lease_ms(EPOCH_KEEP))
            .arg(floor)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("register", e))
    }

    async fn register_moved(
        &self,
        account: &str,
        gateway_node: u32,
        lease: Duration,
        moved_from: u64,
    ) -> Result<Option<u64>, StoreError> {
        if moved_from >= 1 << 53 {
            return Err(StoreError::Corrupt(format!(
                "session epoch {moved_from} is out of range"
            )));
        }
        let epoch: u64 = REGISTER_MOVED
            .key(self.session_key(account))
            .key(self.epoch_key(account))
            .arg(gateway_node)
            .arg(lease_ms(lease))
            .arg(lease_ms(EPOCH_KEEP))
            .arg(moved_from)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("register_moved", e))?;
        Ok((epoch > 0).then_some(epoch))
    }

    async fn lookup(&self, account: &str) -> Result<Option<SessionEntry>, StoreError> {
        let (node, epoch): (Option<u32>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.session_key(account))
            .arg("node")
            .arg("epoch")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("lookup", e))?;
        match (node, epoch) {
            (Some(gateway_node), Some(session_epoch)) => Ok(Some(SessionEntry {
                gateway_node,
                session_epoch,
            })),
            (None, None) => Ok(None),
            _ => Err(StoreError::Corrupt(format!(
                "redis at {}: session of `{account}` lacks its node or epoch",
                self.url
            ))),
        }
    }

    async fn renew(
        &self,
        account: &str,
        session_epoch: u64,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        RENEW
            .key(self.session_key(account))
            .arg(session_epoch)
            .arg(lease_ms(lease))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("renew", e))
    }

    async fn release(&self, account: &str, session_epoch: u64) -> Result<bool, StoreError> {
        RELEASE
            .key(self.session_key(account))
            .arg(session_epoch)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("release", e))
    }

    async fn master(&self, account: &str) -> Result<Option<MasterEntry>, StoreError> {
        type Fields = (Option<u32>, Option<u64>, Option<u64>, Option<u64>);
        let fields: Fields = redis::cmd("HMGET")
            .arg(self.master_key(account))
            .arg(&["node", "lease", "id", "epoch"])
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("master", e))?;
        match fields {
            (Some(node), Some(lease_epoch), Some(entity_id), Some(entity_epoch)) => {
                Ok(Some(MasterEntry {
                    node,
                    lease_epoch,
                    entity_id,
                    entity_epoch,
                }))
            }
            (None, None, None, None) => Ok(None),
            _ => Err(StoreError::Corrupt(format!(
                "redis at {}: the master record of `{account}` lacks a field",
                self.url
            ))),
        }
    }

    async fn set_master(&self, account: &str, entry: MasterEntry) -> Result<(), StoreError> {
        SET_MASTER
            .key(self.master_key(account))
            .arg(entry.node)
            .arg(entry.lease_epoch)
            .arg(entry.entity_id)
            .arg(entry.entity_epoch)
            .arg(lease_ms(CHECKPOINT_KEEP))
            .invoke_async::<u32>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| self.error("set_master", e))
    }

    async fn clear_master(
        &self,
        account: &str,
        entity_id: u64,
        entity_epoch: u64,
    ) -> Result<(), StoreError> {
        CLEAR_MASTER
            .key(self.master_key(account))
            .arg(entity_id)
            .arg(entity_epoch)
            .invoke_async::<u32>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| self.error("clear_master", e))
    }
}

#[async_trait]
impl EdgeBoard for RedisDirectory {
    async fn put_hint(
        &self,
        account: &str,
        sealed: &[u8],
        ttl: Duration,
    ) -> Result<(), StoreError> {
        redis::cmd("SET")
            .arg(self.hint_key(account))
            .arg(sealed)
            .arg("PX")
            .arg(lease_ms(ttl).max(1))
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("put_hint", e))
    }

    async fn take_hint(&self, account: &str) -> Result<Option<Vec<u8>>, StoreError> {
        redis::cmd("GETDEL")
            .arg(self.hint_key(account))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("take_hint", e))
    }

    async fn use_nonce(
        &self,
        account: &str,
        nonce: &[u8],
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        // SET NX: of two proxies racing with the same cookie, one gets OK, the other nil.
        let set: Option<String> = redis::cmd("SET")
            .arg(self.nonce_key(account, nonce))
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(lease_ms(ttl).max(1))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("use_nonce", e))?;
        Ok(set.is_some())
    }

    async fn put_far_rtt(
        &self,
        account: &str,
        geo: &str,
        rtt: FarRtt,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let key = self.far_rtt_key(account);
        let json = serde_json::to_string(&rtt).expect("an RTT serialises");
        redis::pipe()
            .atomic()
            .hset(&key, geo, json)
            .ignore()
            .pexpire(&key, lease_ms(ttl).max(1) as i64)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("put_far_rtt", e))
    }

    async fn far_rtts(&self, account: &str) -> Result<Vec<(String, FarRtt)>, StoreError> {
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.far_rtt_key(account))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("far_rtts", e))?;
        let mut out = all
            .into_iter()
            .map(|(geo, json)| {
                serde_json::from_str(&json)
                    .map(|rtt| (geo, rtt))
                    .map_err(|e| {
                        StoreError::Corrupt(format!("redis at {}: far rtt: {e}", self.url))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

#[async_trait]
impl CheckpointStore for RedisDirectory {
    async fn write(
        &self,
        node: u32,
        lease_epoch: u64,
        put: Vec<(u64, Vec<u8>)>,
        remove: Vec<u64>,
    ) -> Result<(), StoreError> {
        let key = self.checkpoints_key(node, lease_epoch);
        let mut pipe = redis::pipe();
        pipe.atomic();
        if !remove.is_empty() {
            pipe.cmd("HDEL").arg(&key).arg(&remove).ignore();
        }
        if !put.is_empty() {
            pipe.cmd("HSET").arg(&key);
            for (id, c) in &put {
                pipe.arg(id).arg(c.as_slice());
            }
            pipe.ignore();
        }
        pipe.cmd("PEXPIRE")
            .arg(&key)
            .arg(lease_ms(CHECKPOINT_KEEP))
            .ignore();
        pipe.query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("write checkpoints", e))
    }

    async fn load(&self, node: u32, lease_epoch: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let mut all: Vec<(u64, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.checkpoints_key(node, lease_epoch))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("load checkpoints", e))?;
        all.sort_unstable_by_key(|(id, _)| *id);
        Ok(all)
    }

    async fn drop_all(&self, node: u32, lease_epoch: u64) -> Result<(), StoreError> {
        redis::cmd("DEL")
            .arg(self.checkpoints_key(node, lease_epoch))
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| self.error("drop checkpoints", e))
    }

    async fn processes(&self) -> Result<Vec<(u32, u64)>, StoreError> {
        // SCAN walks the keyspace in steps, never blocking the server as KEYS would.
        let pattern = format!("{}{{node-*}}:checkpoints", self.prefix);
        let mut conn = self.conn.clone();
        let mut cursor: u64 = 0;
        let mut all = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(|e| self.error("list checkpoints", e))?;
            for key in keys {
                let process = key
                    .strip_prefix(&self.prefix)
                    .and_then(|k| k.strip_prefix("{node-"))
                    .and_then(|k| k.strip_suffix("}:checkpoints"))
                    .and_then(|k| k.split_once('-'))
                    .and_then(|(n, l)| Some((n.parse().ok()?, l.parse().ok()?)));
                all.extend(process);
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        all.sort_unstable();
        all.dedup();
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geo_names_cannot_reach_into_other_geos_keys() {
        assert!(valid_geo("eu-west.1_a"));
        for bad in ["", "eu:session", "eu*", "eu west", "e{u}", "é"] {
            assert!(!valid_geo(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn lease_rounds_up_to_whole_milliseconds() {
        assert_eq!(lease_ms(Duration::ZERO), 0);
        assert_eq!(lease_ms(Duration::from_micros(1)), 1);
        assert_eq!(lease_ms(Duration::from_millis(300)), 300);
        assert_eq!(lease_ms(Duration::MAX), lease_ms(MAX_LEASE));
        assert!(lease_ms(MAX_LEASE) < i64::MAX as u64 / 2);
    }
}
