//! The live map of the world (pure): what each node shows of itself ([`NodeMap`], a sidecar's
//! `/api/node-map`) and the whole world put together from the partition, the nodes' load reports
//! and those samples ([`WorldMap`], `/api/world` on the director's and `cellmesh up`'s admin
//! port, drawn by the `/map` page).
//!
//! Nothing here reads a clock or a socket: the caller gathers the parts and passes them in.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::balance::CellReport;
use crate::partition::{NodeId, Partition};

/// Entities a node puts in its sample at most; past it, every k-th entity by id is shown.
pub const NODE_SAMPLE_MAX: usize = 2000;
/// Entities a world map shows at most: "a few thousand", sampled evenly over the nodes' samples.
pub const WORLD_SAMPLE_MAX: usize = 4000;
/// How long a handoff stays on the map (an arrow of the last second).
pub const HANDOFF_SHOWN_MS: u64 = 1000;

/// What an entity is, for its dot's colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntityKind {
    /// A player's own avatar.
    Avatar,
    /// Owned by a player, not the avatar (a pet, a projectile).
    Owned,
    /// Nobody's: an NPC.
    Npc,
}

/// One entity on the map, in metres.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapEntity {
    pub id: u64,
    pub x: f64,
    pub y: f64,
    pub kind: EntityKind,
    /// The node that owns it (filled in by [`WorldMap::compose`]; a node's own sample leaves it
    /// to the node field of its [`NodeMap`]).
    #[serde(default)]
    pub node: NodeId,
}

/// A handoff this node completed: the entity stood at (x, y) when `to` took it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapHandoff {
    pub entity: u64,
    pub x: f64,
    pub y: f64,
    pub from: NodeId,
    pub to: NodeId,
    /// How long ago, when the sample was taken.
    pub age_ms: u64,
}

/// One node's part of the map: its real entities (sampled) and its handoffs of the last second.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeMap {
    pub node: NodeId,
    pub geo: String,
    pub partition_epoch: u64,
    /// Real entities the node holds (the sample may show fewer).
    pub entities_total: u64,
    pub entities: Vec<MapEntity>,
    pub handoffs: Vec<MapHandoff>,
}

/// Keeps at most `max` of `items`, evenly spread (every k-th), in their order.
pub fn sample_evenly<T>(items: Vec<T>, max: usize) -> Vec<T> {
    let n = items.len();
    if n <= max {
        return items;
    }
    if max == 0 {
        return Vec::new();
    }
    // Item i is kept when it starts a new one of `max` equal steps over `n`.
    items
        .into_iter()
        .enumerate()
        .filter(|(i, _)| (i * max) / n != ((i + 1) * max) / n)
        .map(|(_, t)| t)
        .collect()
}

/// A cell of the partition: a rectangle of the world in metres, its node and that node's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapCell {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
    pub node: NodeId,
    pub geo: String,
    /// The node's smoothed load (share of its tick budget); `None` until it reported.
    pub load: Option<f64>,
}

/// A bubble: the area a geo other than the core geo simulates (docs/geo.md), as the
/// rectangles of its nodes' cells.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapBubble {
    /// The geo (site) that simulates it.
    pub site: String,
    pub nodes: Vec<NodeId>,
    /// The centre of its largest rectangle, where the page writes the site's name.
    pub label_x: f64,
    pub label_y: f64,
    /// Its cells, as indices into [`WorldMap::cells`].
    pub cells: Vec<usize>,
}

/// One node as the map lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapNode {
    pub node: NodeId,
    pub geo: String,
    pub load: Option<f64>,
    /// Real entities, from its load report or its sample.
    pub entities: u64,
    /// Whether its sample answered this time.
    pub sampled: bool,
}

/// The whole world, as `/api/world` serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorldMap {
    pub width: f64,
    pub height: f64,
    pub chunk_size: f64,
    pub partition_epoch: u64,
    /// The geo whose nodes are not bubbles (the first geo of the world's nodes, by name, unless
    /// the caller names one).
    pub core_geo: String,
    pub cells: Vec<MapCell>,
    pub nodes: Vec<MapNode>,
    /// Real entities over all nodes that answered (the dots may be fewer).
    pub entities_total: u64,
    pub entities: Vec<MapEntity>,
    pub handoffs: Vec<MapHandoff>,
    pub bubbles: Vec<MapBubble>,
}

/// What [`WorldMap::compose`] puts together.
pub struct MapParts<'a> {
    pub partition: &'a Partition,
    /// The nodes' latest load reports.
    pub loads: &'a BTreeMap<NodeId, CellReport>,
    /// Each known node's geo.
    pub geos: &'a BTreeMap<NodeId, String>,
    /// The samples of the nodes that answered.
    pub samples: Vec<NodeMap>,
    /// The core geo; `None` takes the first geo by name.
    pub core_geo: Option<String>,
    /// Dots at most.
    pub max_entities: usize,
}

impl WorldMap {
    pub fn compose(parts: MapParts<'_>) -> WorldMap {
        let MapParts {
            partition,
            loads,
            geos,
            samples,
            core_geo,
            max_entities,
        } = parts;
        let shape = partition.shape();
        let size = shape.chunk_size;
        let mut geos = geos.clone();
        for s in &samples {
            geos.entry(s.node).or_insert_with(|| s.geo.clone());
        }
        let geo_of = |n: NodeId| geos.get(&n).cloned().unwrap_or_default();
        let load_of = |n: NodeId| loads.get(&n).map(|r| r.load);
        let cells: Vec<MapCell> = partition
            .cells()
            .map(|(r, node)| MapCell {
                x: r.x0 as f64 * size,
                y: r.y0 as f64 * size,
                w: (r.x1 - r.x0) as f64 * size,
                h: (r.y1 - r.y0) as f64 * size,
                node,
                geo: geo_of(node),
                load: load_of(node),
            })
            .collect();
        let core_geo = core_geo.unwrap_or_else(|| {
            cells
                .iter()
                .map(|c| c.geo.clone())
                .filter(|g| !g.is_empty())
                .min()
                .unwrap_or_default()
        });

        let mut nodes: Vec<MapNode> = partition
            .members()
            .into_iter()
            .map(|node| {
                let sample = samples.iter().find(|s| s.node == node);
                MapNode {
                    node,
                    geo: geo_of(node),
                    load: load_of(node),
                    entities: sample.map(|s| s.entities_total).unwrap_or_else(|| {
                        loads.get(&node).map(|r| u64::from(r.entities)).unwrap_or(0)
                    }),
                    sampled: sample.is_some(),
                }
            })
            .collect();
        nodes.sort_by_key(|n| n.node);

        let entities_total = samples.iter().map(|s| s.entities_total).sum();
        let mut entities = Vec::new();
        let mut handoffs = Vec::new();
        for s in samples {
            entities.extend(s.entities.into_iter().map(|mut e| {
                e.node = s.node;
                e
            }));
            handoffs.extend(
                s.handoffs
                    .into_iter()
                    .filter(|h| h.age_ms <= HANDOFF_SHOWN_MS),
            );
        }
        entities.sort_by_key(|e| e.id);
        let entities = sample_evenly(entities, max_entities);
        handoffs.sort_by_key(|h| (h.age_ms, h.entity));

        let mut by_site: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, c) in cells.iter().enumerate() {
            if !c.geo.is_empty() && c.geo != core_geo {
                by_site.entry(c.geo.clone()).or_default().push(i);
            }
        }
        let bubbles = by_site
            .into_iter()
            .map(|(site, idx)| {
                let largest = idx
                    .iter()
                    .map(|&i| &cells[i])
                    .max_by(|a, b| (a.w * a.h).total_cmp(&(b.w * b.h)))
                    .expect("a site is listed only with a cell");
                let mut members: Vec<NodeId> = idx.iter().map(|&i| cells[i].node).collect();
                members.sort_unstable();
                members.dedup();
                MapBubble {
                    site,
                    nodes: members,
                    label_x: largest.x + largest.w / 2.0,
                    label_y: largest.y + largest.h / 2.0,
                    cells: idx,
                }
            })
            .collect();

        WorldMap {
            width: shape.width,
            height: shape.height,
            chunk_size: size,
            partition_epoch: partition.epoch(),
            core_geo,
            cells,
            nodes,
            entities_total,
            entities,
            handoffs,
            bubbles,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::WorldShape;
    use crate::partition::{Grid, Layout};

    fn shape() -> WorldShape {
        WorldShape {
            width: 1024.0,
            height: 1024.0,
            chunk_size: 32.0,
            region_size: 512.0,
        }
    }

    /// A 2×2 grid of regions: nodes 1 and 2 in `eu` (left), 3 and 4 in `us` (right).
    fn partition() -> Partition {
        let grid = Grid::new(&shape(), 2, 2, vec![1, 3, 2, 4]).expect("grid");
        Partition::new(shape(), 7, Layout::Grid(grid)).expect("partition")
    }

    fn geos() -> BTreeMap<NodeId, String> {
        [(1, "eu"), (2, "eu"), (3, "us"), (4, "us")]
            .into_iter()
            .map(|(n, g)| (n, g.to_string()))
            .collect()
    }

    fn sample(node: NodeId, ids: std::ops::Range<u64>) -> NodeMap {
        NodeMap {
            node,
            geo: String::new(),
            partition_epoch: 7,
            entities_total: ids.end - ids.start,
            entities: ids
                .map(|id| MapEntity {
                    id,
                    x: id as f64,
                    y: 1.0,
                    kind: EntityKind::Npc,
                    node: 0,
                })
                .collect(),
            handoffs: vec![
                MapHandoff {
                    entity: node.into(),
                    x: 1.0,
                    y: 2.0,
                    from: node,
                    to: 1,
                    age_ms: 200,
                },
                MapHandoff {
                    entity: 100 + u64::from(node),
                    x: 1.0,
                    y: 2.0,
                    from: node,
                    to: 1,
                    age_ms: HANDOFF_SHOWN_MS + 1,
                },
            ],
        }
    }

    #[test]
    fn every_cell_is_drawn_with_its_node_geo_and_load() {
        let loads: BTreeMap<NodeId, CellReport> = [(
            3,
            CellReport {
                load: 0.5,
                entities: 9,
                ..CellReport::default()
            },
        )]
        .into_iter()
        .collect();
        let map = WorldMap::compose(MapParts {
            partition: &partition(),
            loads: &loads,
            geos: &geos(),
            samples: vec![],
            core_geo: None,
            max_entities: 10,
        });
        assert_eq!(map.partition_epoch, 7);
        assert_eq!(map.cells.len(), 4);
        let area: f64 = map.cells.iter().map(|c| c.w * c.h).sum();
        assert_eq!(area, 1024.0 * 1024.0, "the cells tile the torus");
        let c3 = map
            .cells
            .iter()
            .find(|c| c.node == 3)
            .expect("node 3's cell");
        assert_eq!((c3.x, c3.y, c3.w, c3.h), (512.0, 0.0, 512.0, 512.0));
        assert_eq!((c3.geo.as_str(), c3.load), ("us", Some(0.5)));
        assert_eq!(map.cells.iter().find(|c| c.node == 1).unwrap().load, None);
        let n3 = map.nodes.iter().find(|n| n.node == 3).unwrap();
        assert_eq!((n3.entities, n3.sampled), (9, false));
    }

    #[test]
    fn a_geo_other_than_the_core_is_a_bubble_with_its_site() {
        let map = WorldMap::compose(MapParts {
            partition: &partition(),
            loads: &BTreeMap::new(),
            geos: &geos(),
            samples: vec![],
            core_geo: None,
            max_entities: 10,
        });
        assert_eq!(map.core_geo, "eu");
        assert_eq!(map.bubbles.len(), 1);
        let b = &map.bubbles[0];
        assert_eq!((b.site.as_str(), b.nodes.clone()), ("us", vec![3, 4]));
        assert!(b.cells.iter().all(|&i| map.cells[i].geo == "us"));
        assert_eq!(b.label_x, 768.0);

        let one_geo: BTreeMap<NodeId, String> = (1..=4).map(|n| (n, "eu".into())).collect();
        let map = WorldMap::compose(MapParts {
            partition: &partition(),
            loads: &BTreeMap::new(),
            geos: &one_geo,
            samples: vec![],
            core_geo: None,
            max_entities: 10,
        });
        assert!(map.bubbles.is_empty(), "one geo has no bubble");
    }

    #[test]
    fn entities_are_sampled_past_the_cap_and_old_handoffs_dropped() {
        let map = WorldMap::compose(MapParts {
            partition: &partition(),
            loads: &BTreeMap::new(),
            geos: &geos(),
            samples: vec![sample(1, 0..30), sample(2, 30..40)],
            core_geo: None,
            max_entities: 10,
        });
        assert_eq!(map.entities_total, 40);
        assert_eq!(map.entities.len(), 10);
        assert!(map.entities.windows(2).all(|w| w[0].id < w[1].id));
        // Spread over the whole range, not the first ten.
        assert!(map.entities.iter().any(|e| e.id >= 30 && e.node == 2));
        assert!(map.entities.iter().all(|e| (e.node == 1) == (e.id < 30)));
        assert_eq!(map.handoffs.len(), 2, "{:?}", map.handoffs);
        assert!(map.handoffs.iter().all(|h| h.age_ms <= HANDOFF_SHOWN_MS));
        let n1 = map.nodes.iter().find(|n| n.node == 1).unwrap();
        assert_eq!((n1.entities, n1.sampled), (30, true));
    }

    #[test]
    fn sampling_evenly_keeps_the_cap_and_the_ends_spread() {
        for n in [0usize, 1, 5, 10, 11, 99, 1000, 4001] {
            for max in [0usize, 1, 3, 10, 4000] {
                let kept = sample_evenly((0..n).collect::<Vec<_>>(), max);
                assert_eq!(kept.len(), n.min(max), "n {n} max {max}");
                assert!(kept.windows(2).all(|w| w[0] < w[1]));
                if n > max && max > 1 {
                    let step = n / max;
                    assert!(kept.windows(2).all(|w| w[1] - w[0] <= step + 1));
                }
            }
        }
    }
}
