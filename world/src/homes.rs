//! The home geo of a key that must be unique world-wide (a claim key): the one geo whose store
//! grants it. Every node of the world computes the same home from the same list of the world's
//! geos, so no two stores ever grant one key.
//!
//! Rendezvous hashing (highest random weight) over the geos: each key goes to the geo with the
//! highest hash of (geo, key). Adding a geo moves only the keys the new geo wins; the order the
//! geos are listed in does not matter. The hash is FNV-1a 64, fixed here: a home must not change
//! with a compiler or a library version.

/// FNV-1a 64 over the parts, each followed by a 0xff separator (so ("ab","c") ≠ ("a","bc")).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for part in parts {
        for &b in part.iter().chain(std::iter::once(&0xff)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    // FNV's low bits mix poorly: finish with a 64-bit avalanche (splitmix64's).
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The home of `key` among `geos` (the world's geos, in any order); `None` for no geos. A tie of
/// hashes goes to the lower name, so the answer never depends on the order.
pub fn home_geo<'a, S: AsRef<str>>(key: &str, geos: &'a [S]) -> Option<&'a str> {
    geos.iter().map(AsRef::as_ref).max_by(|a, b| {
        let (ha, hb) = (
            fnv1a(&[a.as_bytes(), key.as_bytes()]),
            fnv1a(&[b.as_bytes(), key.as_bytes()]),
        );
        ha.cmp(&hb).then_with(|| b.cmp(a))
    })
}

/// Whether two nodes' lists of the world's geos give every key the same home: the same geos,
/// in any order. An empty list (not configured) is not compared.
pub fn same_homes<S: AsRef<str>>(a: &[S], b: &[S]) -> bool {
    if a.is_empty() || b.is_empty() {
        return true;
    }
    fn set<S: AsRef<str>>(l: &[S]) -> std::collections::BTreeSet<&str> {
        l.iter().map(AsRef::as_ref).collect()
    }
    set(a) == set(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: [&str; 2] = ["paris", "montreal"];

    #[test]
    fn a_key_has_one_home_whatever_the_order_of_the_geos() {
        for i in 0..500 {
            let key = format!("trade:bot{i}");
            let a = home_geo(&key, &TWO);
            let b = home_geo(&key, &["montreal", "paris"]);
            assert_eq!(a, b, "{key}");
            assert!(a.is_some_and(|g| TWO.contains(&g)));
        }
        assert_eq!(home_geo::<&str>("k", &[]), None);
        assert_eq!(home_geo("k", &["solo"]), Some("solo"));
    }

    #[test]
    fn keys_spread_over_the_geos() {
        let geos = ["paris", "montreal", "hongkong"];
        let mut count = std::collections::BTreeMap::new();
        for i in 0..3000 {
            *count
                .entry(home_geo(&format!("trade:bot{i}"), &geos).unwrap())
                .or_insert(0) += 1;
        }
        for g in geos {
            let n = count.get(g).copied().unwrap_or(0);
            assert!((800..1200).contains(&n), "{g}: {n} of 3000 ({count:?})");
        }
    }

    #[test]
    fn a_new_geo_takes_keys_only_for_itself() {
        let three = ["paris", "montreal", "hongkong"];
        let mut moved = 0;
        for i in 0..2000 {
            let key = format!("den:{i}");
            let before = home_geo(&key, &TWO).unwrap();
            let after = home_geo(&key, &three).unwrap();
            if before != after {
                assert_eq!(after, "hongkong", "{key} moved between two old geos");
                moved += 1;
            }
        }
        assert!((450..900).contains(&moved), "{moved} of 2000 moved");
    }

    #[test]
    fn two_lists_give_the_same_homes_only_with_the_same_geos() {
        assert!(same_homes(&["paris", "montreal"], &["montreal", "paris"]));
        assert!(!same_homes(&["paris", "montreal"], &["paris", "sydney"]));
        assert!(!same_homes(&["paris", "montreal"], &["paris"]));
        assert!(same_homes::<&str>(&[], &["paris"]), "not configured");
    }

    #[test]
    fn the_home_of_a_key_is_fixed() {
        // A home is part of the stores' contract: it must not change between builds. These were
        // computed by an independent implementation of the same hash.
        let homes: Vec<&str> = (0..8)
            .map(|i| home_geo(&format!("trade:bot{i}"), &TWO).unwrap())
            .collect();
        let (p, m) = ("paris", "montreal");
        assert_eq!(homes, [m, p, m, m, m, m, m, p]);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
