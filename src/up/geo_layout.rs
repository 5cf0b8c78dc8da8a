//! The geos of a run and the delays between them: which geo each node is in, and how far a bot
//! of one geo is from another geo's proxy.

/// Delays between the default geos' cities, one way, roughly what the fibre gives (ms).
const KNOWN_ONE_WAY_MS: [(&str, &str, u64); 6] = [
    ("paris", "montreal", 45),
    ("paris", "hongkong", 110),
    ("paris", "sydney", 140),
    ("montreal", "hongkong", 120),
    ("montreal", "sydney", 110),
    ("hongkong", "sydney", 60),
];

/// The one-way delay between two geos [`KNOWN_ONE_WAY_MS`] knows, either way round.
pub fn known_one_way_ms(a: &str, b: &str) -> Option<u64> {
    KNOWN_ONE_WAY_MS
        .iter()
        .find(|(x, y, _)| (*x == a && *y == b) || (*x == b && *y == a))
        .map(|(_, _, ms)| *ms)
}

/// The delay between geos nobody named a figure for.
const DEFAULT_ONE_WAY_MS: u64 = 45;

/// A run over several geos: nodes in blocks per geo, each geo with its own claims, checkpoints
/// and proxy; the directory of accounts (homed in the core geo, the first), player records and
/// topology shared. Latency between geos is shaped
/// in-process on the sidecars' peer links, and between bots and proxies by relays (the kernel
/// does not see it, so the proxies judge by their pings).
pub(super) struct GeoLayout {
    pub(super) names: Vec<String>,
    /// The geo of each node, by node id - 1.
    of_node: Vec<usize>,
    /// `one_way_ms[a][b]`: between geos `a` and `b` (unused on the diagonal).
    pub(super) one_way_ms: Vec<Vec<u64>>,
}

impl GeoLayout {
    pub(super) fn new(names: &[String], nodes: usize, delays: &[u64]) -> anyhow::Result<Self> {
        let names: Vec<String> = if names.is_empty() {
            vec!["local".into()]
        } else {
            names.to_vec()
        };
        anyhow::ensure!(
            nodes >= names.len(),
            "--geos {} needs at least as many nodes (--nodes {nodes})",
            names.len()
        );
        let of_node = (0..nodes).map(|i| i * names.len() / nodes).collect();
        let one_way_ms = delay_matrix(&names, delays)?;
        Ok(Self {
            names,
            of_node,
            one_way_ms,
        })
    }

    pub(super) fn several(&self) -> bool {
        self.names.len() > 1
    }

    pub(super) fn geo_of(&self, node: u32) -> usize {
        self.of_node[node as usize - 1]
    }

    /// A bot of `location` to a proxy of `geo`, one way.
    pub(super) fn to_proxy(&self, location: usize, geo: usize) -> cellmesh_proto::shaping::OneWay {
        if location == geo {
            cellmesh_proto::shaping::OneWay::ms(2, 1)
        } else {
            cellmesh_proto::shaping::OneWay::ms(self.one_way_ms[location][geo], 3)
        }
    }

    /// How the delays read in a title: one figure, or each pair's.
    pub(super) fn describe_delays(&self) -> String {
        let n = self.names.len();
        let pairs: Vec<(usize, usize)> = (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .collect();
        let first = pairs.first().map(|&(a, b)| self.one_way_ms[a][b]);
        if pairs
            .iter()
            .all(|&(a, b)| Some(self.one_way_ms[a][b]) == first)
        {
            return first.map_or_else(String::new, |ms| format!("{ms} ms one way"));
        }
        let each: Vec<String> = pairs
            .iter()
            .map(|&(a, b)| {
                format!(
                    "{}–{} {}",
                    self.names[a], self.names[b], self.one_way_ms[a][b]
                )
            })
            .collect();
        format!("{} ms one way", each.join(", "))
    }
}

/// The symmetric matrix of one-way delays between `names` from the figures given: none, one for
/// every pair, or the upper triangle row by row.
fn delay_matrix(names: &[String], delays: &[u64]) -> anyhow::Result<Vec<Vec<u64>>> {
    let n = names.len();
    let pairs = n * n.saturating_sub(1) / 2;
    anyhow::ensure!(
        delays.len() <= 1 || delays.len() == pairs,
        "--geo-delay-ms takes one delay for every pair of geos, or {pairs} for {n} geos (the \
         upper triangle of the matrix: 1–2, 1–3, …, 2–3, …); {} were given",
        delays.len()
    );
    let mut m = vec![vec![0; n]; n];
    let mut k = 0;
    for a in 0..n {
        for b in a + 1..n {
            let ms = match delays {
                [] => known_one_way_ms(&names[a], &names[b]).unwrap_or(DEFAULT_ONE_WAY_MS),
                [one] => *one,
                each => each[k],
            };
            k += 1;
            m[a][b] = ms;
            m[b][a] = ms;
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn geo_delays_are_one_for_all_the_upper_triangle_or_the_cities_figures() {
        let three = names(&["paris", "montreal", "hongkong"]);
        let m = delay_matrix(&three, &[]).unwrap();
        assert_eq!(m, [[0, 45, 110], [45, 0, 120], [110, 120, 0]]);
        assert_eq!(
            delay_matrix(&three, &[30]).unwrap(),
            [[0, 30, 30], [30, 0, 30], [30, 30, 0]]
        );
        assert_eq!(
            delay_matrix(&three, &[10, 20, 30]).unwrap(),
            [[0, 10, 20], [10, 0, 30], [20, 30, 0]]
        );
        let e = delay_matrix(&three, &[10, 20]).unwrap_err().to_string();
        assert!(e.contains("or 3 for 3 geos"), "{e}");
        // Names it does not know: the default.
        let m = delay_matrix(&names(&["a", "paris"]), &[]).unwrap();
        assert_eq!(m[0][1], DEFAULT_ONE_WAY_MS);
        let layout = GeoLayout::new(&three, 4, &[]).unwrap();
        assert_eq!(
            layout.describe_delays(),
            "paris–montreal 45, paris–hongkong 110, montreal–hongkong 120 ms one way"
        );
        assert_eq!(
            layout.to_proxy(2, 0),
            cellmesh_proto::shaping::OneWay::ms(110, 3)
        );
    }
}
