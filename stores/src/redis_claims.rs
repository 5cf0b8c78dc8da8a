//! The exclusive claims in a geo's Redis, beside its session directory: two Lua scripts keep each
//! grant and its fencing token atomic (see `claims` for the rules they implement).

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::Script;

use super::claims::{check, ClaimGrant, ClaimHolder, ClaimOutcome, ClaimStore};
use super::redis::RedisDirectory;
use super::StoreError;

/// KEYS: holder, token. ARGV: entity, epoch, ttl ms. Returns `{1, token, entity, epoch}` when
/// granted, `{0, token, entity, epoch}` of the holder otherwise. (Ids and epochs travel as
/// strings: Lua's numbers are doubles.) A token is the last one plus one, and at least the
/// server's clock in ms: a Redis that lost the key never gives an old token again. (Ms since
/// 1970 fit a double exactly.)
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local v = redis.call('GET', KEYS[1])
        if v then
            local t, e, ep = string.match(v, '^(%d+):(%d+):(%d+)$')
            if e ~= ARGV[1] or #ARGV[2] < #ep or (#ARGV[2] == #ep and ARGV[2] < ep) then
                return {0, t, e, ep}
            end
        end
        local now = redis.call('TIME')
        local floor = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
        local last = tonumber(redis.call('GET', KEYS[2]) or '0')
        local t = string.format('%.0f', math.max(last + 1, floor))
        redis.call('SET', KEYS[2], t)
        redis.call('SET', KEYS[1], t .. ':' .. ARGV[1] .. ':' .. ARGV[2], 'PX', ARGV[3])
        return {1, t, ARGV[1], ARGV[2]}
        ",
    )
});

/// KEYS: holder. ARGV: token, epoch, op (`renew`, `rebind`, `release`), ttl ms or new epoch,
/// entity. Returns 1 when `token` still holds the claim for that entity under an epoch not newer
/// than ARGV[2] (and, for a rebind, not newer than the new one), 0 otherwise.
static FENCED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local function older(a, b) return #a < #b or (#a == #b and a < b) end
        local v = redis.call('GET', KEYS[1])
        if not v then return 0 end
        local t, e, ep = string.match(v, '^(%d+):(%d+):(%d+)$')
        if t ~= ARGV[1] or e ~= ARGV[5] or older(ARGV[2], ep) then return 0 end
        if ARGV[3] == 'renew' then
            redis.call('PEXPIRE', KEYS[1], ARGV[4])
        elseif ARGV[3] == 'rebind' then
            if older(ARGV[4], ep) then return 0 end
            redis.call('SET', KEYS[1], t .. ':' .. e .. ':' .. ARGV[4], 'KEEPTTL')
        else
            redis.call('DEL', KEYS[1])
        end
        return 1
        ",
    )
});

impl RedisDirectory {
    fn claim_keys(&self, key: &str) -> (String, String) {
        (
            format!("{}{{claim:{key}}}:holder", self.prefix),
            format!("{}{{claim:{key}}}:token", self.prefix),
        )
    }

    async fn fenced(&self, grant: &ClaimGrant, op: &str, arg: u64) -> Result<bool, StoreError> {
        let (holder, _) = self.claim_keys(&grant.key);
        let mut conn = self.conn.clone();
        let n: i64 = FENCED
            .key(holder)
            .arg(grant.token.to_string())
            .arg(grant.holder.entity_epoch.to_string())
            .arg(op)
            .arg(arg.to_string())
            .arg(grant.holder.entity.to_string())
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.error(op, e))?;
        Ok(n == 1)
    }
}

#[async_trait]
impl ClaimStore for RedisDirectory {
    async fn claim(
        &self,
        key: &str,
        holder: ClaimHolder,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let ms = check(key, Some(ttl))?;
        let (h, t) = self.claim_keys(key);
        let mut conn = self.conn.clone();
        let (granted, token, entity, epoch): (i64, String, String, String) = CLAIM
            .key(h)
            .key(t)
            .arg(holder.entity.to_string())
            .arg(holder.entity_epoch.to_string())
            .arg(ms)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.error("claim", e))?;
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| StoreError::Corrupt(format!("claim {key:?}: {s:?} is no number")))
        };
        let by = ClaimHolder {
            entity: num(&entity)?,
            entity_epoch: num(&epoch)?,
        };
        Ok(if granted == 1 {
            ClaimOutcome::Granted(ClaimGrant {
                key: key.to_string(),
                holder: by,
                token: num(&token)?,
            })
        } else {
            ClaimOutcome::Held { by }
        })
    }

    async fn renew(&self, grant: &ClaimGrant, ttl: Duration) -> Result<bool, StoreError> {
        let ms = check(&grant.key, Some(ttl))?;
        self.fenced(grant, "renew", ms).await
    }

    async fn rebind(
        &self,
        grant: &ClaimGrant,
        entity_epoch: u64,
    ) -> Result<Option<ClaimGrant>, StoreError> {
        check(&grant.key, None)?;
        Ok(self
            .fenced(grant, "rebind", entity_epoch)
            .await?
            .then(|| ClaimGrant {
                holder: ClaimHolder {
                    entity_epoch,
                    ..grant.holder
                },
                ..grant.clone()
            }))
    }

    async fn release(&self, grant: &ClaimGrant) -> Result<bool, StoreError> {
        check(&grant.key, None)?;
        self.fenced(grant, "release", 0).await
    }
}
