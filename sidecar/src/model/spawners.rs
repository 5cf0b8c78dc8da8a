//! Region-owned spawners, as one node keeps them: the game's spawn points, which of them this node
//! stocks under its partition, the claims asked for their next stock, and the stocks granted and
//! handed to the game but not spawned yet. Pure: time and the partition come in as arguments.
//!
//! A point's stock is one entity at a time, cluster-wide: it holds the claim `spawner:<key>` from
//! the grant on (an ordinary claim, carried with the stock through handoffs and freed when it
//! despawns). Only the node owning the point's chunk asks for that claim; a node that no longer
//! owns it stops asking, and one that gains it asks until the store grants it (which it does only
//! once the previous stock is gone). Each ask names the stock it would create, an id derived from
//! (key, generation) with a generation never used before for the key, so two grants never share
//! an id.

use std::collections::BTreeMap;

use cellmesh_world::geometry::{Pos, WorldShape};
use cellmesh_world::partition::{NodeId, Partition};
use cellmesh_world::spawners::{spawn_id, SpawnPoint, SpawnerError, Spawners};

/// The claim key of spawn point `key`. Games may not claim keys with this prefix.
pub const CLAIM_PREFIX: &str = "spawner:";
/// The lease of a stock's claim: long enough to outlive a restore of the node holding the stock
/// (its successor rebinds the claim), short enough that a stock lost with its node is replaced
/// within this long.
pub const CLAIM_TTL_MS: u64 = 30_000;
/// How soon a point whose claim another stock holds is asked for again.
pub const HELD_RETRY_MS: u64 = 3_000;
/// How long a stock granted, and released (the point went to another node) before the game
/// spawned it, may still be spawned: a `Spawn` may be on its way already.
pub const RELEASE_GRACE_MS: u64 = 2_000;

pub fn claim_key(key: &str) -> String {
    format!("{CLAIM_PREFIX}{key}")
}

/// A stock granted to this node and handed to the game, not spawned yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Awaited {
    pub key: String,
    pub generation: u64,
    /// The point is no longer this node's since (the id is given up `RELEASE_GRACE_MS` later).
    pub released_at: Option<u64>,
}

/// A claim for a point's next stock, on its way to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub key: String,
    pub generation: u64,
    pub id: u64,
}

#[derive(Debug, Default)]
pub struct SpawnerBook {
    points: Spawners,
    positions: BTreeMap<String, Pos>,
    /// The points this node stocks, with when their claim is asked for next.
    owned: BTreeMap<String, u64>,
    awaited: BTreeMap<u64, Awaited>,
    asked: BTreeMap<u64, Asked>,
    last_generation: u64,
}

impl SpawnerBook {
    /// The game's spawn points, replacing any before: the points this node stocked and no longer
    /// does. On an error nothing changes.
    pub fn declare(
        &mut self,
        shape: &WorldShape,
        points: Vec<SpawnPoint>,
        partition: &Partition,
        me: NodeId,
        now: u64,
    ) -> Result<Vec<String>, SpawnerError> {
        let positions = points
            .iter()
            .map(|p| (p.key.clone(), shape.normalise(p.pos)))
            .collect();
        self.points = Spawners::new(shape, points)?;
        self.positions = positions;
        let owned = self.points.owned_by(partition, me);
        Ok(self.own(owned, now))
    }

    /// The partition changed: the points this node no longer stocks.
    pub fn replanned(&mut self, new: &Partition, me: NodeId, now: u64) -> Vec<String> {
        if self.points.is_empty() {
            return Vec::new();
        }
        let owned = self.points.owned_by(new, me);
        self.own(owned, now)
    }

    fn own(&mut self, owned: Vec<String>, now: u64) -> Vec<String> {
        let released: Vec<String> = self
            .owned
            .keys()
            .filter(|k| !owned.contains(k))
            .cloned()
            .collect();
        self.owned.retain(|k, _| owned.contains(k));
        for k in owned {
            self.owned.entry(k).or_insert(now);
        }
        for a in self.awaited.values_mut() {
            if released.contains(&a.key) && a.released_at.is_none() {
                a.released_at = Some(now);
            }
        }
        released
    }

    pub fn owns(&self, key: &str) -> bool {
        self.owned.contains_key(key)
    }

    pub fn owned_count(&self) -> usize {
        self.owned.len()
    }

    pub fn position(&self, key: &str) -> Option<Pos> {
        self.positions.get(key).copied()
    }

    /// The points whose claim is due at `now`.
    pub fn due(&self, now: u64) -> Vec<String> {
        self.owned
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// `key`'s claim is asked for again at `at` (if the point is still this node's).
    pub fn retry(&mut self, key: &str, at: u64) {
        if let Some(next) = self.owned.get_mut(key) {
            *next = at;
        }
    }

    /// A claim for `key`'s next stock goes out: the stock it names. The generation is above every
    /// one this node used, and starts from the wall clock (with the node's id in its low bits),
    /// so that neither another node nor this one after a restart uses it again.
    pub fn ask(&mut self, key: &str, unix_ms: u64, node: NodeId) -> Asked {
        let fresh = (unix_ms << 10) | u64::from(node & 0x3ff);
        let generation = fresh.max(self.last_generation + 1);
        self.last_generation = generation;
        let id = spawn_id(key, generation);
        let a = Asked {
            key: key.to_string(),
            generation,
            id,
        };
        self.asked.insert(id, a.clone());
        self.retry(key, u64::MAX);
        a
    }

    /// The store answered the claim naming stock `id`.
    pub fn answered(&mut self, id: u64) -> Option<Asked> {
        self.asked.remove(&id)
    }

    /// The claim naming `a.id` was granted and the stock handed to the game.
    pub fn granted(&mut self, a: Asked) {
        self.awaited.insert(
            a.id,
            Awaited {
                key: a.key,
                generation: a.generation,
                released_at: None,
            },
        );
    }

    pub fn is_awaited(&self, id: u64) -> bool {
        self.awaited.contains_key(&id)
    }

    /// The game spawned `id`: true when it was a stock handed to it.
    pub fn spawned(&mut self, id: u64) -> bool {
        self.awaited.remove(&id).is_some()
    }

    /// Stocks released longer than the grace ago and never spawned: given up (their claims go).
    pub fn overdue(&mut self, now: u64) -> Vec<(u64, Awaited)> {
        let ids: Vec<u64> = self
            .awaited
            .iter()
            .filter(|(_, a)| a.released_at.is_some_and(|t| now >= t + RELEASE_GRACE_MS))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.awaited.remove(&id).map(|a| (id, a)))
            .collect()
    }

    /// The game went away: its points are forgotten until it declares them again. The stocks it
    /// never spawned, to give up.
    pub fn clear(&mut self) -> Vec<(u64, Awaited)> {
        self.points = Spawners::default();
        self.positions.clear();
        self.owned.clear();
        self.asked.clear();
        std::mem::take(&mut self.awaited).into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_world::partition::{Grid, Layout};

    fn shape() -> WorldShape {
        WorldShape {
            width: 512.0,
            height: 256.0,
            chunk_size: 32.0,
            region_size: 256.0,
        }
    }

    /// Node 1 west of x = 256 m, node 2 east, or (flipped) the other way round.
    fn partition(epoch: u64, flipped: bool) -> Partition {
        let ids: &[NodeId] = if flipped { &[2, 1] } else { &[1, 2] };
        let grid = Grid::even(&shape(), 2, 1, ids).unwrap();
        Partition::new(shape(), epoch, Layout::Grid(grid)).unwrap()
    }

    fn points() -> Vec<SpawnPoint> {
        vec![
            SpawnPoint {
                key: "den".into(),
                pos: Pos { x: 256.0, y: 100.0 },
            },
            SpawnPoint {
                key: "ore".into(),
                pos: Pos { x: 10.0, y: 10.0 },
            },
        ]
    }

    #[test]
    fn each_point_is_asked_for_by_its_owner_only_and_follows_a_replan() {
        let (p1, p2) = (partition(1, false), partition(2, true));
        let mut a = SpawnerBook::default();
        let mut b = SpawnerBook::default();
        assert!(a.declare(&shape(), points(), &p1, 1, 0).unwrap().is_empty());
        assert!(b.declare(&shape(), points(), &p1, 2, 0).unwrap().is_empty());
        // The den on the border line is node 2's chunk; the ore node 1's.
        assert_eq!(a.due(0), ["ore"]);
        assert_eq!(b.due(0), ["den"]);
        let asked = b.ask("den", 1_000, 2);
        assert_eq!(asked.id, spawn_id("den", asked.generation));
        assert!(b.due(5_000).is_empty(), "asked: not again until answered");
        let answered = b.answered(asked.id).unwrap();
        b.granted(answered);
        assert!(b.is_awaited(asked.id));
        // The re-plan swaps the halves: node 2 releases the den, node 1 gains it.
        assert_eq!(b.replanned(&p2, 2, 100), ["den"]);
        assert_eq!(a.replanned(&p2, 1, 100), ["ore"]);
        assert_eq!(a.due(100), ["den"]);
        // The stock not spawned yet may still be for the grace, then is given up.
        assert!(b.overdue(100 + RELEASE_GRACE_MS - 1).is_empty());
        let gone = b.overdue(100 + RELEASE_GRACE_MS);
        assert_eq!(gone.len(), 1);
        assert!(!b.is_awaited(asked.id));
    }

    #[test]
    fn generations_never_repeat_on_a_node_even_when_its_clock_steps_back() {
        let mut b = SpawnerBook::default();
        b.declare(&shape(), points(), &partition(1, false), 2, 0)
            .unwrap();
        let first = b.ask("den", 5_000, 2);
        let second = b.ask("den", 4_000, 2);
        assert!(second.generation > first.generation);
        assert_ne!(first.id, second.id);
        // Another node at the same instant: another generation.
        let mut a = SpawnerBook::default();
        assert_ne!(a.ask("den", 5_000, 1).generation, first.generation);
    }

    #[test]
    fn a_bad_declaration_changes_nothing_and_a_new_one_releases_what_it_drops() {
        let p = partition(1, false);
        let mut a = SpawnerBook::default();
        a.declare(&shape(), points(), &p, 1, 0).unwrap();
        let dup = vec![points()[1].clone(), points()[1].clone()];
        assert!(a.declare(&shape(), dup, &p, 1, 0).is_err());
        assert!(a.owns("ore"));
        assert_eq!(
            a.declare(&shape(), points()[..1].to_vec(), &p, 1, 0)
                .unwrap(),
            ["ore"]
        );
        assert!(!a.owns("ore"));
    }
}
