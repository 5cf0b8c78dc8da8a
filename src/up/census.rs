//! The census: every real each node writes, against what the games spawned and despawned, read
//! once the world has come to rest.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use cellmesh_arena::Census;

use super::node::NodeRun;

/// One census: the reals every node writes, against what the games spawned and despawned.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct CensusRead {
    pub(super) lost: BTreeSet<u64>,
    pub(super) duplicated: BTreeSet<u64>,
    pub(super) alive: usize,
    /// Reals frozen for a handoff (in flight).
    frozen: usize,
}

fn census(nodes: &[NodeRun], games: &Census) -> CensusRead {
    let report = games.report();
    let mut held: BTreeMap<u64, Vec<cellmesh_sidecar::Real>> = BTreeMap::new();
    for n in nodes {
        for r in n.sidecar.reals() {
            held.entry(r.id).or_default().push(r);
        }
    }
    // Lost: alive in the games, and no node writes it (unfrozen).
    let lost = report
        .alive
        .iter()
        .filter(|id| held.get(id).is_none_or(|rs| rs.iter().all(|r| r.frozen)))
        .chain(report.lost().iter())
        .copied()
        .collect();
    let frozen = held.values().flatten().filter(|r| r.frozen).count();
    // Two writers: two nodes writing it unfrozen, or two games holding it.
    let duplicated = held
        .iter()
        .filter(|(_, rs)| rs.iter().filter(|r| !r.frozen).count() > 1)
        .map(|(id, _)| *id)
        .chain(report.duplicated())
        .collect();
    CensusRead {
        lost,
        duplicated,
        alive: report.alive.len(),
        frozen,
    }
}

/// The census of a world at rest: it waits until no node has a real frozen for a handoff and two
/// reads 300 ms apart agree (at most 10 s). Returns the last read, and whether the world came to
/// rest.
pub(super) async fn at_rest(nodes: &[NodeRun], games: &Census) -> (CensusRead, bool) {
    let rest_deadline = Instant::now() + Duration::from_secs(10);
    let mut previous = census(nodes, games);
    let census_at_rest = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = census(nodes, games);
        if now.frozen == 0 && now == previous {
            previous = now;
            break true;
        }
        previous = now;
        if Instant::now() >= rest_deadline {
            break false;
        }
    };
    let (lost, duplicated): (Vec<u64>, Vec<u64>) = (
        previous.lost.iter().copied().collect(),
        previous.duplicated.iter().copied().collect(),
    );
    if !lost.is_empty() || !duplicated.is_empty() {
        tracing::error!(
            ?lost,
            ?duplicated,
            "the census found entities lost or doubled"
        );
    }
    (previous, census_at_rest)
}
