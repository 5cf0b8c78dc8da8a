//! `cellmesh partition`: show the committed partition, plan a new one, and commit it by
//! compare-and-set on the epoch it replaces.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use cellmesh_stores::topology::{self, Commit, NodeEntry, TopologyStore};
use cellmesh_world::geometry::{ChunkOffset, ChunkRect, WorldShape};
use cellmesh_world::partition::{
    Bsp, BspEntryKind, Grid, Layout, Neighbour, NodeId, Partition, Transfer,
};
use serde_json::json;

/// Widest region table printed; larger grids are listed per node only (or in `--json`).
const MAX_TABLE_COLS: u32 = 32;
/// Most regions a plan may have.
const MAX_REGIONS: i64 = 1 << 20;
/// Most chunks on a side of the world a plan may have.
const MAX_CHUNKS_PER_SIDE: i64 = 1 << 24;
/// Side of the owner map printed for a BSP, in samples.
const MAP_SAMPLES: i64 = 16;

#[derive(clap::Args, Debug)]
pub struct PartitionArgs {
    /// Topology store: `memory` (this process only: nothing persists) or `mongodb://host:port/db`.
    #[arg(
        long,
        global = true,
        env = "CELLMESH_TOPOLOGY_URL",
        default_value = "memory"
    )]
    pub store: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// List neighbours within this many chunks (the ghost band: view radius 5 + release margin
    /// 1 + interaction band 1).
    #[arg(long, global = true, default_value_t = 7)]
    pub radius: u32,
    #[command(subcommand)]
    pub command: PartitionCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum PartitionCommand {
    /// The committed epoch, its region → node table, which node owns what, leases and neighbours.
    Show,
    /// Plan a partition and print it with its diff against the committed one.
    Plan(PlanArgs),
}

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Regions as COLSxROWS, e.g. `16x16` (default: the world's region grid; a BSP without it
    /// gets one cell per node).
    #[arg(long, value_parser = parse_grid)]
    pub grid: Option<(u32, u32)>,
    /// Node ids that share the world, in compact blocks of regions (or one BSP cell each).
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<NodeId>,
    /// The owner of every region instead, row by row (`y = 0` first); only `--nodes` may appear.
    #[arg(long, value_delimiter = ',')]
    pub table: Option<Vec<NodeId>>,
    #[arg(long, value_enum, default_value_t = Kind::Grid)]
    pub kind: Kind,
    /// World size in metres, `W` or `WxH` (default: the committed partition's world, else the
    /// default 131072 m square).
    #[arg(long, value_parser = parse_world, allow_negative_numbers = true)]
    pub world: Option<(f64, f64)>,
    #[arg(long, value_parser = parse_metres, allow_negative_numbers = true)]
    pub chunk_size: Option<f64>,
    #[arg(long, value_parser = parse_metres, allow_negative_numbers = true)]
    pub region_size: Option<f64>,
    /// Write the plan as the next epoch, unless someone committed since it was read.
    #[arg(long)]
    pub commit: bool,
    /// Lay the world out anew for `--nodes`. Without it, a plan of the committed layout's kind
    /// (and grid) for other nodes moves as little as it can: gone nodes' cells go to their
    /// neighbours, new nodes take their share from those owning most, and nothing else moves.
    #[arg(long)]
    pub fresh: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Grid,
    Bsp,
}

fn parse_grid(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("expected COLSxROWS such as 16x16, got `{s}`");
    let (c, r) = s.split_once(['x', 'X', '×']).ok_or_else(bad)?;
    Ok((
        c.trim().parse().map_err(|_| bad())?,
        r.trim().parse().map_err(|_| bad())?,
    ))
}

fn parse_world(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("expected metres as W or WxH such as 131072x65536, got `{s}`");
    let side = |v: &str| {
        v.trim()
            .parse::<f64>()
            .map_err(|_| bad())
            .and_then(in_range)
    };
    match s.split_once(['x', 'X', '×']) {
        Some((w, h)) => Ok((side(w)?, side(h)?)),
        None => side(s).map(|w| (w, w)),
    }
}

/// Longest length a flag takes, in metres: more is a typo.
const MAX_METRES: f64 = 1e9;

fn parse_metres(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .map_err(|_| format!("expected metres such as 32 or 8192, got `{s}`"))
        .and_then(in_range)
}

/// Refuses lengths that are not a number of metres above 0 and at most [`MAX_METRES`].
fn in_range(metres: f64) -> Result<f64, String> {
    if metres > 0.0 && metres <= MAX_METRES {
        Ok(metres)
    } else {
        Err(format!(
            "expected metres above 0 and at most {MAX_METRES}, got {metres}"
        ))
    }
}

/// Runs `cellmesh partition …` against the store named by `--store`.
pub async fn run(args: PartitionArgs) -> anyhow::Result<()> {
    if matches!(args.store.as_str(), "memory" | "") {
        eprintln!(
            "note: the embedded `memory` store keeps nothing once this command exits; pass \
             --store mongodb://… or set CELLMESH_TOPOLOGY_URL to use the cluster's"
        );
    }
    let store = topology::open(&args.store)
        .await
        .context("opening the topology store")?;
    let now_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    let result = execute(&args, store.as_ref(), now_unix_ms).await;
    store.close().await;
    // A closed pipe (`| head`) is an error to report, not a panic.
    std::io::stdout().lock().write_all(result?.as_bytes())?;
    Ok(())
}

/// Does what `args` ask against `store` and returns what to print.
pub async fn execute(
    args: &PartitionArgs,
    store: &dyn TopologyStore,
    now_unix_ms: u64,
) -> anyhow::Result<String> {
    let current = store.partition().await.context("reading the partition")?;
    match &args.command {
        PartitionCommand::Show => {
            let nodes = store.nodes().await.context("reading the node leases")?;
            show(current.as_ref(), &nodes, now_unix_ms, args)
        }
        PartitionCommand::Plan(plan_args) => {
            let plan = build_plan(current.as_ref(), plan_args)?;
            let transfers = match &current {
                Some(c) => c.diff(&plan)?,
                None => Vec::new(),
            };
            let committed = if plan_args.commit {
                let expected = current.as_ref().map_or(0, Partition::epoch);
                match store
                    .commit_partition(expected, &plan)
                    .await
                    .context("committing")?
                {
                    Commit::Committed => true,
                    Commit::Fenced { .. } => bail!("the store fenced a plain commit"),
                    Commit::Stale { current_epoch } => bail!(
                        "epoch {current_epoch} was committed while this plan was made from epoch \
                         {expected}; nothing written: plan again"
                    ),
                }
            } else {
                false
            };
            plan_output(current.as_ref(), &plan, &transfers, committed, args)
        }
    }
}

/// The partition `args` describe, as the epoch after `current`.
fn build_plan(current: Option<&Partition>, args: &PlanArgs) -> anyhow::Result<Partition> {
    let mut shape = current.map_or_else(WorldShape::default, |p| *p.shape());
    if let Some((width, height)) = args.world {
        (shape.width, shape.height) = (width, height);
    }
    if let Some(chunk) = args.chunk_size {
        shape.chunk_size = chunk;
    }
    if let Some(region) = args.region_size {
        shape.region_size = region;
    }
    shape.validate().context("world")?;
    // Areas are counted in chunks, in i64: a world of tiny chunks would overflow them.
    if shape.chunks_x().max(shape.chunks_y()) > MAX_CHUNKS_PER_SIDE {
        bail!(
            "a world of {}×{} chunks is more than the {MAX_CHUNKS_PER_SIDE} a side may have: \
             take larger chunks (--chunk-size) or a smaller world (--world)",
            shape.chunks_x(),
            shape.chunks_y()
        );
    }
    if let Some(c) = current.filter(|c| c.shape() != &shape) {
        bail!(
            "the committed partition (epoch {}) is for a {} world; a plan keeps the world (this \
             one is {})",
            c.epoch(),
            describe_world(c.shape()),
            describe_world(&shape)
        );
    }
    let (cols, rows) = args.grid.map_or_else(
        || (shape.regions_x(), shape.regions_y()),
        |(c, r)| (c.into(), r.into()),
    );
    // The region table is built whole: a world of tiny regions would not fit in memory.
    if cols.saturating_mul(rows) > MAX_REGIONS {
        bail!(
            "a grid of {cols}×{rows} regions is more than the {MAX_REGIONS} a plan may have: \
             take larger regions (--region-size) or fewer (--grid)"
        );
    }
    let (cols, rows) = (u32::try_from(cols)?, u32::try_from(rows)?);
    if let Some(c) = current.filter(|_| !args.fresh && args.table.is_none()) {
        let same_kind = match (c.layout(), args.kind) {
            (Layout::Grid(g), Kind::Grid) => {
                args.grid.is_none() || (g.cols(), g.rows()) == (cols, rows)
            }
            (Layout::Bsp(_), Kind::Bsp) => args.grid.is_none(),
            _ => false,
        };
        if same_kind {
            let plan = c.replanned(&args.nodes)?;
            plan.check_nodes(&args.nodes)?;
            return Ok(plan);
        }
    }
    let grid = || match &args.table {
        Some(table) => Grid::new(&shape, cols, rows, table.clone()),
        None => Grid::even(&shape, cols, rows, &args.nodes),
    };
    let layout = match args.kind {
        Kind::Grid => Layout::Grid(grid()?),
        Kind::Bsp if args.grid.is_none() && args.table.is_none() => {
            Layout::Bsp(Bsp::even(&shape, &args.nodes)?)
        }
        Kind::Bsp => Layout::Bsp(Bsp::from_grid(&grid()?)?),
    };
    let epoch = current.map_or(0, Partition::epoch) + 1;
    let plan = Partition::new(shape, epoch, layout)?;
    plan.check_nodes(&args.nodes)?;
    Ok(plan)
}

fn describe_world(s: &WorldShape) -> String {
    format!(
        "{} × {} m ({} × {} chunks of {} m)",
        s.width,
        s.height,
        s.chunks_x(),
        s.chunks_y(),
        s.chunk_size
    )
}

fn show(
    current: Option<&Partition>,
    leases: &[NodeEntry],
    now_unix_ms: u64,
    args: &PartitionArgs,
) -> anyhow::Result<String> {
    let Some(p) = current else {
        if args.json {
            let nodes: Vec<_> = leases.iter().map(lease_json).collect();
            return Ok(format!(
                "{:#}\n",
                json!({ "epoch": 0, "partition": null, "leases": nodes })
            ));
        }
        return Ok("no partition committed yet (epoch 0)\n".into());
    };
    if args.json {
        let mut nodes = nodes_json(p, args.radius)?;
        for n in &mut nodes {
            let id = n["node"].as_u64();
            let entry = leases.iter().find(|e| Some(u64::from(e.lease.node)) == id);
            n["lease"] = entry.map_or(json!(null), lease_json);
        }
        let others: Vec<_> = leases
            .iter()
            .filter(|e| !p.nodes().contains(&e.lease.node))
            .map(lease_json)
            .collect();
        let out = json!({
            "epoch": p.epoch(),
            "partition": p,
            "nodes": nodes,
            "leases_without_area": others,
        });
        return Ok(format!("{out:#}\n"));
    }
    let mut out = describe(p);
    nodes_table(&mut out, p, Some((leases, now_unix_ms)));
    neighbours_table(&mut out, p, args.radius)?;
    Ok(out)
}

fn plan_output(
    current: Option<&Partition>,
    plan: &Partition,
    transfers: &[Transfer],
    committed: bool,
    args: &PartitionArgs,
) -> anyhow::Result<String> {
    let moved: i64 = transfers.iter().map(|t| t.area.area()).sum();
    if args.json {
        let out = json!({
            "current_epoch": current.map_or(0, Partition::epoch),
            "plan": plan,
            "nodes": nodes_json(plan, args.radius)?,
            "transfers": transfers,
            "chunks_changing_hands": moved,
            "committed": committed,
        });
        return Ok(format!("{out:#}\n"));
    }
    let mut out = String::from("plan: ");
    out.push_str(&describe(plan));
    nodes_table(&mut out, plan, None);
    neighbours_table(&mut out, plan, args.radius)?;
    let _ = writeln!(out);
    match current {
        None => {
            let _ = writeln!(
                out,
                "nothing committed yet: every chunk gets its first owner"
            );
        }
        Some(c) if transfers.is_empty() => {
            let _ = writeln!(out, "against epoch {}: no chunk changes hands", c.epoch());
        }
        Some(c) => {
            let total = c.shape().world_rect().area();
            let _ = writeln!(
                out,
                "against epoch {}: {moved} chunks change hands ({:.1}% of the world)",
                c.epoch(),
                100.0 * moved as f64 / total as f64
            );
            let _ = writeln!(
                out,
                "  {:>6}  {:>6}  {:>10}  area (chunks)",
                "from", "to", "chunks"
            );
            for t in transfers {
                let _ = writeln!(
                    out,
                    "  {:>6}  {:>6}  {:>10}  {}",
                    t.from,
                    t.to,
                    t.area.area(),
                    t.area
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "{}",
        if committed {
            format!("committed: epoch {}", plan.epoch())
        } else {
            "not committed (pass --commit to write it)".into()
        }
    );
    Ok(out)
}

/// Header, and the region table (grid) or the tree and an owner map (BSP).
fn describe(p: &Partition) -> String {
    let s = p.shape();
    let mut out = String::new();
    match p.layout() {
        Layout::Grid(g) => {
            let (rw, rh) = g.region_chunks();
            let _ = writeln!(
                out,
                "epoch {}, grid of {}×{} regions of {}×{} chunks ({} × {} m)",
                p.epoch(),
                g.cols(),
                g.rows(),
                rw,
                rh,
                rw as f64 * s.chunk_size,
                rh as f64 * s.chunk_size
            );
            let _ = writeln!(out, "world {}\n", describe_world(s));
            if g.cols() > MAX_TABLE_COLS {
                let _ = writeln!(out, "(region table too wide to print; see --json)");
            } else {
                let _ = writeln!(out, "region → node (x across, y down)");
                let _ = write!(out, "{:>6}", "");
                for x in 0..g.cols() {
                    let _ = write!(out, "{x:>5}");
                }
                let _ = writeln!(out);
                for y in 0..g.rows() {
                    let _ = write!(out, "{y:>6}");
                    for x in 0..g.cols() {
                        let _ = write!(out, "{:>5}", g.owner_of_region(x, y));
                    }
                    let _ = writeln!(out);
                }
            }
        }
        Layout::Bsp(b) => {
            let _ = writeln!(
                out,
                "epoch {}, bsp of {} cells, depth {}",
                p.epoch(),
                b.leaf_count(),
                b.depth()
            );
            let _ = writeln!(out, "world {}\n", describe_world(s));
            for e in b.entries() {
                let what = match e.kind {
                    BspEntryKind::Split { axis, at } => format!("split {axis} at {at}"),
                    BspEntryKind::Leaf { node } => format!("cell → node {node}"),
                };
                let indent = "  ".repeat(e.depth);
                let _ = writeln!(out, "  #{:<4} {indent}{what:<24} {}", e.index, e.rect);
            }
            let (sx, sy) = (s.chunks_x().min(MAP_SAMPLES), s.chunks_y().min(MAP_SAMPLES));
            let _ = writeln!(out, "\nowner map ({sx}×{sy} samples, x across, y down)");
            for y in 0..sy {
                let _ = write!(out, "  ");
                for x in 0..sx {
                    let chunk = cellmesh_world::geometry::ChunkPos {
                        x: x * s.chunks_x() / sx,
                        y: y * s.chunks_y() / sy,
                    };
                    let _ = write!(out, "{:>5}", p.owner_of_chunk(chunk));
                }
                let _ = writeln!(out);
            }
        }
    }
    out
}

fn nodes_table(out: &mut String, p: &Partition, leases: Option<(&[NodeEntry], u64)>) {
    let total = p.shape().world_rect().area() as f64;
    let _ = writeln!(out);
    let _ = write!(
        out,
        "{:>6}  {:>6}  {:>10}  {:>6}",
        "node", "areas", "chunks", "share"
    );
    if leases.is_some() {
        let _ = write!(out, "  {:<34}  mesh / admin", "lease");
    }
    let _ = writeln!(out);
    let mut ids = p.nodes();
    if let Some((entries, _)) = leases {
        ids.extend(entries.iter().map(|e| e.lease.node));
        ids.sort_unstable();
        ids.dedup();
    }
    for node in ids {
        let area = p.area_of(node);
        let chunks: i64 = area.iter().map(ChunkRect::area).sum();
        let _ = write!(
            out,
            "{node:>6}  {:>6}  {chunks:>10}  {:>5.1}%",
            area.len(),
            100.0 * chunks as f64 / total
        );
        if let Some((entries, now)) = leases {
            let entry = entries.iter().find(|e| e.lease.node == node);
            let lease = match entry {
                None => "none".to_string(),
                // Live by the store's clock; the time left is read against this machine's.
                Some(e) if e.live => format!(
                    "epoch {}, {} for ~{:.1} s",
                    e.lease.epoch,
                    e.lease.holder,
                    e.lease.expires_unix_ms.saturating_sub(now) as f64 / 1000.0
                ),
                Some(e) => format!("epoch {}, lapsed", e.lease.epoch),
            };
            let addrs = entry
                .and_then(|e| e.record.as_ref())
                .map_or("-".to_string(), |r| {
                    format!("{} / {} ({})", r.mesh_addr, r.admin_addr, r.geo)
                });
            let _ = write!(out, "  {lease:<34}  {addrs}");
        }
        let _ = writeln!(out);
    }
}

fn neighbours_table(out: &mut String, p: &Partition, radius: u32) -> anyhow::Result<()> {
    let s = p.shape();
    let _ = writeln!(
        out,
        "\nneighbours within {radius} chunks (offset in whole worlds: W = {} m, H = {} m)",
        s.width, s.height
    );
    for node in p.nodes() {
        let list: Vec<String> = p
            .neighbours(node, radius)?
            .iter()
            .map(|n| format!("{} {}", n.node, offset_text(n.offset, s)))
            .collect();
        let list = if list.is_empty() {
            "-".to_string()
        } else {
            list.join(" · ")
        };
        let _ = writeln!(out, "{node:>6}  {list}");
    }
    Ok(())
}

/// `(0,0)`, `(-W,0)`, `(+W,-H)`, …: offsets are whole worlds.
fn offset_text(o: ChunkOffset, s: &WorldShape) -> String {
    let part = |v: i64, n: i64, unit: &str| match v / n {
        0 => "0".to_string(),
        1 => format!("+{unit}"),
        -1 => format!("-{unit}"),
        k => format!("{k:+}{unit}"),
    };
    format!(
        "({},{})",
        part(o.x, s.chunks_x(), "W"),
        part(o.y, s.chunks_y(), "H")
    )
}

fn nodes_json(p: &Partition, radius: u32) -> anyhow::Result<Vec<serde_json::Value>> {
    let total = p.shape().world_rect().area() as f64;
    p.nodes()
        .into_iter()
        .map(|node| {
            let area = p.area_of(node);
            let chunks: i64 = area.iter().map(ChunkRect::area).sum();
            let neighbours: Vec<Neighbour> = p.neighbours(node, radius)?;
            Ok(json!({
                "node": node,
                "chunks": chunks,
                "share": chunks as f64 / total,
                "area": area,
                "neighbours": neighbours,
            }))
        })
        .collect()
}

fn lease_json(e: &NodeEntry) -> serde_json::Value {
    json!({
        "node": e.lease.node,
        "holder": e.lease.holder,
        "epoch": e.lease.epoch,
        "expires_unix_ms": e.lease.expires_unix_ms,
        "live": e.live,
        "record": e.record,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_stores::topology::memory::MemoryTopology;
    use clap::Parser;

    /// The command line as `cellmesh` mounts it.
    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Top,
    }

    #[derive(clap::Subcommand)]
    enum Top {
        Partition(PartitionArgs),
    }

    fn parse(line: &str) -> PartitionArgs {
        let words = std::iter::once("cellmesh").chain(line.split_whitespace());
        match Cli::try_parse_from(words)
            .unwrap_or_else(|e| panic!("{line}: {e}"))
            .command
        {
            Top::Partition(a) => a,
        }
    }

    const NOW: u64 = 1_800_000_000_000;
    const SMALL: &str = "--world 2048 --chunk-size 32 --region-size 1024";

    async fn exec(store: &MemoryTopology, line: &str) -> anyhow::Result<String> {
        execute(&parse(line), store, NOW).await
    }

    #[test]
    fn arguments_parse() {
        let a = parse("partition plan --grid 4x2 --nodes 1,2,3 --kind bsp --commit --json");
        assert!(a.json && a.store == "memory");
        let PartitionCommand::Plan(p) = a.command else {
            panic!("not a plan")
        };
        assert_eq!(
            (p.grid, p.nodes, p.kind, p.commit),
            (Some((4, 2)), vec![1, 2, 3], Kind::Bsp, true)
        );
        assert_eq!(parse_world("1024x512"), Ok((1024.0, 512.0)));
        for bad in ["-1", "0", "NaN", "inf", "1e10", "1024x-512", "1024xnan"] {
            assert!(parse_world(bad).is_err(), "{bad}");
        }
        for bad in ["-32", "0", "nan", "-inf", "1e300", ""] {
            assert!(parse_metres(bad).is_err(), "{bad}");
        }
        let negative = [
            "cellmesh",
            "partition",
            "plan",
            "--nodes",
            "1",
            "--chunk-size",
            "-32",
        ];
        let err = Cli::try_parse_from(negative).err().expect("refused");
        assert!(err.to_string().contains("--chunk-size"), "{err}");
        assert!(parse_grid("4by2").unwrap_err().contains("COLSxROWS"));
        let no_nodes = Cli::try_parse_from(["cellmesh", "partition", "plan", "--grid", "2x2"]);
        assert!(no_nodes.is_err());
    }

    #[tokio::test]
    async fn plan_commit_show_and_replan() {
        let store = MemoryTopology::default();
        let shown = exec(&store, "partition show").await.unwrap();
        assert!(shown.contains("no partition committed yet"), "{shown}");

        let out = exec(
            &store,
            &format!("partition plan --grid 2x1 --nodes 1,2 {SMALL}"),
        )
        .await
        .unwrap();
        assert!(
            out.contains("epoch 1, grid of 2×1 regions of 32×64 chunks"),
            "{out}"
        );
        assert!(out.contains("not committed"), "{out}");
        // Node 1 meets node 2 on both sides, and itself across the y seam.
        let expected = "     1  1 (0,-H) · 1 (0,+H) · 2 (-W,-H) · 2 (-W,0) · 2 (-W,+H) · 2 (0,-H) · 2 (0,0) · 2 (0,+H)\n";
        assert!(out.contains(expected), "{out}");
        assert_eq!(store.partition().await.unwrap(), None);

        let out = exec(
            &store,
            &format!("partition plan --grid 2x1 --nodes 1,2 {SMALL} --commit"),
        )
        .await
        .unwrap();
        assert!(out.contains("committed: epoch 1"), "{out}");

        let shown = exec(&store, "partition show").await.unwrap();
        assert!(
            shown.contains("epoch 1, grid of 2×1") && shown.contains("50.0%"),
            "{shown}"
        );

        // A BSP with a third node: the diff names what changes hands.
        let out = exec(&store, "partition plan --kind bsp --nodes 1,2,3 --commit")
            .await
            .unwrap();
        assert!(out.contains("plan: epoch 2, bsp of 3 cells"), "{out}");
        assert!(
            out.contains("against epoch 1:") && out.contains("committed: epoch 2"),
            "{out}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&exec(&store, "partition show --json").await.unwrap()).unwrap();
        assert_eq!(json["epoch"], 2);
        assert_eq!(json["nodes"].as_array().unwrap().len(), 3);
        assert!(json["partition"]["layout"]["bsp"].is_object());
    }

    #[tokio::test]
    async fn a_replan_for_other_nodes_moves_only_their_share_unless_fresh() {
        let store = MemoryTopology::default();
        exec(
            &store,
            "partition plan --grid 16x16 --nodes 1,2,3,4 --commit",
        )
        .await
        .unwrap();
        let moved = |out: &str| -> f64 {
            let json: serde_json::Value = serde_json::from_str(out).unwrap();
            let all = 4096.0 * 4096.0;
            json["chunks_changing_hands"].as_f64().unwrap() / all
        };
        let without_4 = exec(&store, "partition plan --nodes 1,2,3 --json")
            .await
            .unwrap();
        assert_eq!(moved(&without_4), 0.25, "node 4's quarter only");
        let fresh = exec(&store, "partition plan --nodes 1,2,3 --fresh --json")
            .await
            .unwrap();
        assert!(moved(&fresh) > 0.5, "laid out anew: {}", moved(&fresh));
        let with_5 = exec(&store, "partition plan --nodes 1,2,3,4,5 --json")
            .await
            .unwrap();
        let share = moved(&with_5);
        assert!((0.19..=0.2).contains(&share), "a fifth for node 5: {share}");
    }

    #[tokio::test]
    async fn bad_plans_name_the_bad_value() {
        let store = MemoryTopology::default();
        let e = exec(
            &store,
            &format!("partition plan --grid 3x1 --nodes 1 {SMALL}"),
        )
        .await
        .unwrap_err();
        assert!(format!("{e:#}").contains("64/3 chunks"), "{e:#}");
        let e = exec(
            &store,
            &format!("partition plan --grid 2x1 --nodes 1,2 --table 1,9 {SMALL}"),
        )
        .await
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("region (1, 0) names node 9"),
            "{e:#}"
        );
        let e = exec(&store, "partition plan --nodes 1 --world 1000")
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("world width"), "{e:#}");
        for (too_many, what) in [
            ("--grid 4294967295x4294967295", "regions is more than"),
            ("--chunk-size 1 --region-size 1", "regions is more than"),
            (
                "--world 1e9 --chunk-size 1 --region-size 1",
                "chunks is more than",
            ),
            (
                "--world 1e9 --chunk-size 0.001 --region-size 1",
                "chunks is more than",
            ),
        ] {
            let e = exec(&store, &format!("partition plan --nodes 1 {too_many}"))
                .await
                .unwrap_err();
            assert!(format!("{e:#}").contains(what), "{e:#}");
        }
        exec(
            &store,
            &format!("partition plan --nodes 1 {SMALL} --commit"),
        )
        .await
        .unwrap();
        let e = exec(&store, "partition plan --nodes 1 --world 4096")
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("a plan keeps the world"), "{e:#}");
    }
}
