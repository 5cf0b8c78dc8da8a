//! An independent count of every entity the arenas of one run hold, to check the mesh against:
//! a handoff must neither lose an entity nor leave two arenas simulating it.
//!
//! The arenas record what they did (spawn, despawn, adopt, evict); nothing here asks the
//! sidecars. A handoff in flight shows for a moment as held twice (the target adopted, the source
//! has not yet been told to evict), so read the report once the world is quiet.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Shared by every arena of a run (`Arc<Census>` in each `ArenaConfig`). Holders are labelled by
/// the arena's node id from `Welcome`.
#[derive(Debug, Default)]
pub struct Census {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    spawned: BTreeSet<u64>,
    despawned: BTreeSet<u64>,
    holders: BTreeMap<u64, Vec<u32>>,
    /// The account of every player avatar spawned.
    avatars: BTreeMap<u64, String>,
    /// The id of every command an arena applied (see `combat`), and how many came twice.
    commands_applied: BTreeSet<u64>,
    commands_twice: u64,
    commands_minted: u64,
    /// Accounts in a trade now, with the arena that opened it (see `trade`).
    trading: BTreeMap<String, u32>,
    trades_opened: u64,
    /// Trades opened while one of their players was in another: must stay 0.
    trades_overlapping: u64,
    /// Every claim an arena was granted and holds, as the arenas see it: key -> (arena, holder
    /// entity). A claim is let go here no later than its holder's sidecar lets it go: when the
    /// game releases it, is told it is lost, or its holder despawns, leaves or its arena stops.
    claims: BTreeMap<String, (u32, u64)>,
    claims_granted: u64,
    /// Grants of a key while another entity held it: two holders of one claim, must stay 0.
    claims_overlapping: u64,
    /// The den of every den NPC spawned (see `ArenaConfig::dens`).
    stock_keys: BTreeMap<u64, String>,
    dens_stocked: u64,
    /// Den NPCs that appeared (spawned or adopted) while another NPC of their den was held by
    /// an arena: must stay 0.
    dens_stocked_twice: u64,
}

impl Inner {
    /// Whether another NPC of `id`'s den is alive and held by an arena now.
    fn den_stocked_elsewhere(&self, id: u64) -> bool {
        let Some(key) = self.stock_keys.get(&id) else {
            return false;
        };
        self.stock_keys.iter().any(|(other, k)| {
            *other != id
                && k == key
                && !self.despawned.contains(other)
                && self.holders.get(other).is_some_and(|h| !h.is_empty())
        })
    }
}

/// What the census saw, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CensusReport {
    /// Spawned and not despawned: each of these must be held by exactly one arena.
    pub alive: BTreeSet<u64>,
    /// Every id held now, with the arenas holding it.
    pub holders: BTreeMap<u64, Vec<u32>>,
}

impl CensusReport {
    /// Ids held by more than one arena: two writers.
    pub fn duplicated(&self) -> Vec<u64> {
        self.holders
            .iter()
            .filter(|(_, h)| h.len() > 1)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Ids alive but held by no arena.
    pub fn lost(&self) -> Vec<u64> {
        self.alive
            .iter()
            .filter(|id| self.holders.get(id).is_none_or(|h| h.is_empty()))
            .copied()
            .collect()
    }
}

impl Census {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves consistent sets: keep counting.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `holder` created `id`.
    pub fn spawned(&self, id: u64, holder: u32) {
        let mut c = self.lock();
        c.spawned.insert(id);
        hold(&mut c.holders, id, holder);
    }

    /// `holder` stocked den `key` with NPC `id`.
    pub fn spawned_stock(&self, key: &str, id: u64, holder: u32) {
        self.spawned(id, holder);
        let mut c = self.lock();
        c.stock_keys.insert(id, key.to_string());
        c.dens_stocked += 1;
        if c.den_stocked_elsewhere(id) {
            c.dens_stocked_twice += 1;
        }
    }

    /// Den NPCs spawned, and how many appeared while their den had another: (stocked, twice).
    pub fn dens(&self) -> (u64, u64) {
        let c = self.lock();
        (c.dens_stocked, c.dens_stocked_twice)
    }

    /// `holder` created `id`, the avatar of `account`.
    pub fn spawned_avatar(&self, id: u64, holder: u32, account: &str) {
        self.spawned(id, holder);
        self.lock().avatars.insert(id, account.to_string());
    }

    /// The avatars alive in the world (spawned, not despawned), by account: one each.
    pub fn avatars(&self) -> BTreeMap<String, Vec<u64>> {
        let c = self.lock();
        let mut by: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (id, account) in &c.avatars {
            if !c.despawned.contains(id) {
                by.entry(account.clone()).or_default().push(*id);
            }
        }
        by
    }

    /// `holder` despawned `id`: it is gone from the world.
    pub fn despawned(&self, id: u64, holder: u32) {
        let mut c = self.lock();
        c.despawned.insert(id);
        release(&mut c.holders, id, holder);
        c.claims.retain(|_, (_, entity)| *entity != id);
    }

    /// Arena `arena` was granted claim `key` for its entity `entity`. False, and counted, when
    /// another entity holds the key: two holders of one claim.
    pub fn claim_granted(&self, key: &str, arena: u32, entity: u64) -> bool {
        let mut c = self.lock();
        c.claims_granted += 1;
        let twice = c.claims.get(key).is_some_and(|(_, e)| *e != entity);
        if twice {
            c.claims_overlapping += 1;
        }
        c.claims.insert(key.to_string(), (arena, entity));
        !twice
    }

    /// `entity` let claim `key` go (released it, or was told it is lost).
    pub fn claim_freed(&self, key: &str, entity: u64) {
        let mut c = self.lock();
        if c.claims.get(key).is_some_and(|(_, e)| *e == entity) {
            c.claims.remove(key);
        }
    }

    /// Claims granted, and of those granted while another entity held the key (must be 0).
    pub fn claims(&self) -> (u64, u64) {
        let c = self.lock();
        (c.claims_granted, c.claims_overlapping)
    }

    /// `holder` took `id` over from another arena.
    pub fn adopted(&self, id: u64, holder: u32) {
        let mut c = self.lock();
        let was_held = c.holders.get(&id).is_some_and(|h| !h.is_empty());
        hold(&mut c.holders, id, holder);
        // A den NPC back from nowhere (restored after its node died) while its den was stocked
        // again meanwhile.
        if !was_held && c.den_stocked_elsewhere(id) {
            c.dens_stocked_twice += 1;
        }
    }

    /// `holder` let `id` go to another arena. Its claims are not counted from here on (a
    /// handoff may carry them to the next owner, whose game never hears of them).
    pub fn evicted(&self, id: u64, holder: u32) {
        let mut c = self.lock();
        release(&mut c.holders, id, holder);
        c.claims.retain(|_, (_, entity)| *entity != id);
    }

    /// `holder` stopped: it holds nothing any more (its entities live on only if another arena
    /// adopts them).
    pub fn release_holder(&self, holder: u32) {
        let mut c = self.lock();
        c.holders.retain(|_, h| {
            h.retain(|&x| x != holder);
            !h.is_empty()
        });
        // Its trades end with it (their claims lapse in the store).
        c.trading.retain(|_, opener| *opener != holder);
        c.claims.retain(|_, (arena, _)| *arena != holder);
    }

    /// `opener` opened a trade between `accounts` (both escrows granted). False, and counted,
    /// when one of them is in another trade already: two holders of one claim.
    pub fn trade_opened(&self, accounts: [&str; 2], opener: u32) -> bool {
        let mut c = self.lock();
        c.trades_opened += 1;
        if accounts.iter().any(|a| c.trading.contains_key(*a)) {
            c.trades_overlapping += 1;
            return false;
        }
        for a in accounts {
            c.trading.insert(a.to_string(), opener);
        }
        true
    }

    /// The trade between `accounts` ended (before its claims are released).
    pub fn trade_closed(&self, accounts: [&str; 2]) {
        let mut c = self.lock();
        for a in accounts {
            c.trading.remove(a);
        }
    }

    /// Trades opened, and of those opened while a player was in another (must be 0).
    pub fn trades(&self) -> (u64, u64) {
        let c = self.lock();
        (c.trades_opened, c.trades_overlapping)
    }

    /// A fresh id for a command an arena sends: unique in the run, even across a game's restart
    /// (whose random source starts again from the same seed).
    pub fn next_command_id(&self) -> u64 {
        let mut inner = self.lock();
        inner.commands_minted += 1;
        inner.commands_minted
    }

    /// An arena applied the command with this id.
    pub fn command_applied(&self, id: u64) {
        let mut inner = self.lock();
        if !inner.commands_applied.insert(id) {
            inner.commands_twice += 1;
        }
    }

    /// Commands applied, and how many of them were applied twice (must be 0).
    pub fn commands(&self) -> (usize, u64) {
        let inner = self.lock();
        (inner.commands_applied.len(), inner.commands_twice)
    }

    /// Whether a game despawned `id` (a client seeing it vanish saw something real).
    pub fn is_despawned(&self, id: u64) -> bool {
        self.lock().despawned.contains(&id)
    }

    pub fn report(&self) -> CensusReport {
        let c = self.lock();
        CensusReport {
            alive: c.spawned.difference(&c.despawned).copied().collect(),
            holders: c.holders.clone(),
        }
    }
}

fn hold(holders: &mut BTreeMap<u64, Vec<u32>>, id: u64, holder: u32) {
    let h = holders.entry(id).or_default();
    if !h.contains(&holder) {
        h.push(holder);
    }
}

fn release(holders: &mut BTreeMap<u64, Vec<u32>>, id: u64, holder: u32) {
    if let Some(h) = holders.get_mut(&id) {
        h.retain(|&x| x != holder);
        if h.is_empty() {
            holders.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avatars_are_counted_per_account_until_despawned() {
        let c = Census::default();
        c.spawned_avatar(1, 10, "alice");
        c.spawned_avatar(2, 11, "alice");
        c.spawned_avatar(3, 10, "bob");
        c.spawned(4, 10);
        assert_eq!(c.avatars()["alice"], vec![1, 2]);
        c.despawned(1, 10);
        c.despawned(3, 10);
        assert_eq!(
            c.avatars(),
            BTreeMap::from([("alice".to_string(), vec![2])])
        );
    }

    #[test]
    fn a_claim_granted_while_another_entity_holds_it_is_counted_twice_held() {
        let c = Census::default();
        assert!(c.claim_granted("trade:a", 1, 100));
        assert!(c.claim_granted("trade:a", 1, 100), "its holder again");
        assert!(!c.claim_granted("trade:a", 2, 200), "another entity");
        assert_eq!(c.claims(), (3, 1));
        // Freed by its holder, its holder's despawn, evict or arena: free for the next one.
        c.claim_freed("trade:a", 100);
        c.claim_freed("trade:a", 200);
        assert!(c.claim_granted("trade:b", 1, 100));
        c.despawned(100, 1);
        assert!(c.claim_granted("trade:b", 2, 200));
        c.evicted(200, 2);
        assert!(c.claim_granted("trade:b", 3, 300));
        c.release_holder(3);
        assert!(c.claim_granted("trade:b", 1, 400));
        assert_eq!(c.claims(), (7, 1));
    }

    #[test]
    fn a_clean_handoff_leaves_one_holder() {
        let c = Census::default();
        c.spawned(1, 10);
        c.spawned(2, 10);
        c.adopted(1, 20);
        assert_eq!(c.report().duplicated(), vec![1], "both hold it mid-handoff");
        c.evicted(1, 10);
        let r = c.report();
        assert_eq!(r.holders.get(&1), Some(&vec![20]));
        assert!(r.duplicated().is_empty());
        assert!(r.lost().is_empty());
        assert_eq!(r.alive, BTreeSet::from([1, 2]));
    }

    #[test]
    fn an_evict_without_adopt_is_a_loss_and_a_despawn_is_not() {
        let c = Census::default();
        c.spawned(1, 10);
        c.spawned(2, 10);
        c.evicted(1, 10);
        c.despawned(2, 10);
        let r = c.report();
        assert_eq!(r.lost(), vec![1]);
        assert_eq!(r.alive, BTreeSet::from([1]));
        assert!(r.holders.is_empty());
    }

    #[test]
    fn a_replayed_adopt_counts_once_and_a_stopped_arena_holds_nothing() {
        let c = Census::default();
        c.spawned(1, 10);
        c.evicted(1, 10);
        c.adopted(1, 20);
        c.adopted(1, 20);
        assert_eq!(c.report().holders.get(&1), Some(&vec![20]));
        c.release_holder(20);
        assert_eq!(c.report().lost(), vec![1]);
    }
}
