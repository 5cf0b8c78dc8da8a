//! The world is a torus: every position wraps in x and y, and every difference is the shortest
//! one around the world. Nothing gameplay-facing computes a raw difference.

use serde::{Deserialize, Serialize};

/// A position in metres, x and y on the torus (z is carried along, never wrapped).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Pos {
    pub x: f64,
    pub y: f64,
}

/// A chunk coordinate, always normalised into `[0, chunks_x) × [0, chunks_y)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkPos {
    pub x: i64,
    pub y: i64,
}

/// A region coordinate on the world's region grid ([`WorldShape::region_size`]), always
/// normalised into `[0, regions_x) × [0, regions_y)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionPos {
    pub x: i64,
    pub y: i64,
}

/// A rectangle of whole chunks, `[x0, x1) × [y0, y1)` in chunk coordinates.
///
/// Areas of a partition lie inside `[0, chunks_x] × [0, chunks_y]`; a rectangle translated by a
/// [`ChunkOffset`] may lie outside it, standing for the same chunks seen across the seam.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub struct ChunkRect {
    pub x0: i64,
    pub y0: i64,
    pub x1: i64,
    pub y1: i64,
}

/// A translation by whole worlds, in chunks: each component is a multiple of the world's size in
/// chunks on that axis. Adding it to a foreign area's coordinates puts that area next to ours.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub struct ChunkOffset {
    pub x: i64,
    pub y: i64,
}

impl ChunkRect {
    pub const fn new(x0: i64, y0: i64, x1: i64, y1: i64) -> Self {
        Self { x0, y0, x1, y1 }
    }

    pub fn width(&self) -> i64 {
        (self.x1 - self.x0).max(0)
    }

    pub fn height(&self) -> i64 {
        (self.y1 - self.y0).max(0)
    }

    /// Number of chunks.
    pub fn area(&self) -> i64 {
        self.width() * self.height()
    }

    pub fn is_empty(&self) -> bool {
        self.x1 <= self.x0 || self.y1 <= self.y0
    }

    pub fn contains(&self, c: ChunkPos) -> bool {
        (self.x0..self.x1).contains(&c.x) && (self.y0..self.y1).contains(&c.y)
    }

    /// The chunks in both, or `None` if they share none.
    pub fn intersection(&self, other: &ChunkRect) -> Option<ChunkRect> {
        let r = ChunkRect {
            x0: self.x0.max(other.x0),
            y0: self.y0.max(other.y0),
            x1: self.x1.min(other.x1),
            y1: self.y1.min(other.y1),
        };
        (!r.is_empty()).then_some(r)
    }

    pub fn translated(&self, o: ChunkOffset) -> ChunkRect {
        ChunkRect {
            x0: self.x0 + o.x,
            y0: self.y0 + o.y,
            x1: self.x1 + o.x,
            y1: self.y1 + o.y,
        }
    }

    /// Chebyshev distance between the nearest chunks of two non-empty rectangles in the plane
    /// (no wrapping): 0 if they overlap, 1 if they touch.
    pub fn distance(&self, other: &ChunkRect) -> i64 {
        axis_distance(self.x0, self.x1, other.x0, other.x1)
            .max(axis_distance(self.y0, self.y1, other.y0, other.y1))
    }

    /// Every chunk of the rectangle, row by row.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkPos> + '_ {
        (self.y0..self.y1).flat_map(move |y| (self.x0..self.x1).map(move |x| ChunkPos { x, y }))
    }
}

impl std::fmt::Display for ChunkRect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {})×[{}, {})", self.x0, self.x1, self.y0, self.y1)
    }
}

/// Distance between the nearest cells of `[a0, a1)` and `[b0, b1)` on a line.
fn axis_distance(a0: i64, a1: i64, b0: i64, b1: i64) -> i64 {
    0.max(b0 - a1 + 1).max(a0 - b1 + 1)
}

/// The `k` for which `[b0, b1) + k·n` lies within `d` of `[a0, a1)` on a line.
fn axis_wraps_within(
    a0: i64,
    a1: i64,
    b0: i64,
    b1: i64,
    n: i64,
    d: i64,
) -> std::ops::RangeInclusive<i64> {
    // b0 + k·n <= a1 - 1 + d  and  b1 + k·n >= a0 + 1 - d
    let hi = (a1 - 1 + d - b0).div_euclid(n);
    let lo = -((b1 - a0 - 1 + d).div_euclid(n));
    lo..=hi
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GeometryError {
    #[error("{name} must be finite and positive, got {value}")]
    NotPositive { name: &'static str, value: f64 },
    #[error("{name} ({value} m) is not a whole number of {unit_name} ({unit} m)")]
    NotMultiple {
        name: &'static str,
        value: f64,
        unit_name: &'static str,
        unit: f64,
    },
    #[error("position ({x}, {y}) is not finite")]
    NotFinite { x: f64, y: f64 },
    #[error("radius of {radius} chunks exceeds the world ({chunks_x}×{chunks_y} chunks)")]
    RadiusTooLarge {
        radius: i64,
        chunks_x: i64,
        chunks_y: i64,
    },
}

/// The shape of the world. Defaults: 131 072 m square, 32 m chunks, 8 192 m regions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorldShape {
    pub width: f64,
    pub height: f64,
    pub chunk_size: f64,
    pub region_size: f64,
}

impl Default for WorldShape {
    fn default() -> Self {
        Self {
            width: 131_072.0,
            height: 131_072.0,
            chunk_size: 32.0,
            region_size: 8_192.0,
        }
    }
}

fn is_multiple(value: f64, unit: f64) -> bool {
    let n = value / unit;
    (n - n.round()).abs() < 1e-9 && n.round() >= 1.0
}

impl WorldShape {
    /// Checks that sizes are positive and whole multiples of each other.
    pub fn validate(&self) -> Result<(), GeometryError> {
        for (name, value) in [
            ("world width", self.width),
            ("world height", self.height),
            ("chunk size", self.chunk_size),
            ("region size", self.region_size),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(GeometryError::NotPositive { name, value });
            }
        }
        for (name, value, unit_name, unit) in [
            ("world width", self.width, "chunks", self.chunk_size),
            ("world height", self.height, "chunks", self.chunk_size),
            ("region size", self.region_size, "chunks", self.chunk_size),
            ("world width", self.width, "regions", self.region_size),
            ("world height", self.height, "regions", self.region_size),
        ] {
            if !is_multiple(value, unit) {
                return Err(GeometryError::NotMultiple {
                    name,
                    value,
                    unit_name,
                    unit,
                });
            }
        }
        Ok(())
    }

    pub fn chunks_x(&self) -> i64 {
        (self.width / self.chunk_size).round() as i64
    }

    pub fn chunks_y(&self) -> i64 {
        (self.height / self.chunk_size).round() as i64
    }

    pub fn regions_x(&self) -> i64 {
        (self.width / self.region_size).round() as i64
    }

    pub fn regions_y(&self) -> i64 {
        (self.height / self.region_size).round() as i64
    }

    /// Chunks along one side of a region.
    pub fn region_chunks(&self) -> i64 {
        (self.region_size / self.chunk_size).round() as i64
    }

    /// The whole world as one rectangle of chunks.
    pub fn world_rect(&self) -> ChunkRect {
        ChunkRect::new(0, 0, self.chunks_x(), self.chunks_y())
    }

    /// [`normalise`](Self::normalise), refusing NaN and infinite coordinates (which have no place
    /// on the torus and would otherwise land silently in chunk 0).
    pub fn checked_normalise(&self, p: Pos) -> Result<Pos, GeometryError> {
        if p.x.is_finite() && p.y.is_finite() {
            Ok(self.normalise(p))
        } else {
            Err(GeometryError::NotFinite { x: p.x, y: p.y })
        }
    }

    /// [`chunk_of`](Self::chunk_of), refusing NaN and infinite coordinates.
    pub fn checked_chunk_of(&self, p: Pos) -> Result<ChunkPos, GeometryError> {
        self.checked_normalise(p).map(|n| self.chunk_of(n))
    }

    /// Wraps a position onto `[0, W) × [0, H)`; exact for any finite input, however far out.
    pub fn normalise(&self, p: Pos) -> Pos {
        Pos {
            x: wrap(p.x, self.width),
            y: wrap(p.y, self.height),
        }
    }

    /// Shortest signed difference `b - a` around the torus, each axis in `[-size/2, size/2)`.
    pub fn delta(&self, a: Pos, b: Pos) -> (f64, f64) {
        (
            signed_wrap(b.x - a.x, self.width),
            signed_wrap(b.y - a.y, self.height),
        )
    }

    pub fn distance(&self, a: Pos, b: Pos) -> f64 {
        let (dx, dy) = self.delta(a, b);
        dx.hypot(dy)
    }

    /// The chunk holding a position (after normalisation).
    pub fn chunk_of(&self, p: Pos) -> ChunkPos {
        let n = self.normalise(p);
        self.normalise_chunk(ChunkPos {
            x: (n.x / self.chunk_size).floor() as i64,
            y: (n.y / self.chunk_size).floor() as i64,
        })
    }

    pub fn normalise_chunk(&self, c: ChunkPos) -> ChunkPos {
        ChunkPos {
            x: c.x.rem_euclid(self.chunks_x()),
            y: c.y.rem_euclid(self.chunks_y()),
        }
    }

    pub fn normalise_region(&self, r: RegionPos) -> RegionPos {
        RegionPos {
            x: r.x.rem_euclid(self.regions_x()),
            y: r.y.rem_euclid(self.regions_y()),
        }
    }

    /// The region holding a position (after normalisation).
    pub fn region_of(&self, p: Pos) -> RegionPos {
        self.region_of_chunk(self.chunk_of(p))
    }

    /// The region holding a chunk (after normalisation).
    pub fn region_of_chunk(&self, c: ChunkPos) -> RegionPos {
        let c = self.normalise_chunk(c);
        let side = self.region_chunks();
        RegionPos {
            x: c.x / side,
            y: c.y / side,
        }
    }

    /// The chunks of a region (after normalisation).
    pub fn region_rect(&self, r: RegionPos) -> ChunkRect {
        let r = self.normalise_region(r);
        let side = self.region_chunks();
        ChunkRect::new(r.x * side, r.y * side, (r.x + 1) * side, (r.y + 1) * side)
    }

    /// A rectangle in metres: `(x, y, width, height)`, as the local protocol's `Rect`.
    pub fn rect_metres(&self, r: &ChunkRect) -> (f64, f64, f64, f64) {
        let c = self.chunk_size;
        (
            r.x0 as f64 * c,
            r.y0 as f64 * c,
            r.width() as f64 * c,
            r.height() as f64 * c,
        )
    }

    /// An offset in metres.
    pub fn offset_metres(&self, o: ChunkOffset) -> (f64, f64) {
        (o.x as f64 * self.chunk_size, o.y as f64 * self.chunk_size)
    }

    /// Chebyshev distance in chunks between the nearest chunks of two non-empty rectangles on the
    /// torus: the smallest [`ChunkRect::distance`] over every copy of `b` shifted by whole worlds.
    pub fn rect_distance(&self, a: &ChunkRect, b: &ChunkRect) -> i64 {
        // The metric splits by axis, so the nearest copy is found on each axis alone.
        let axis = |a0: i64, a1: i64, b0: i64, b1: i64, n: i64| {
            let k = (a0 - b0).div_euclid(n);
            (k - 1..=k + 2)
                .map(|k| axis_distance(a0, a1, b0 + k * n, b1 + k * n))
                .min()
                .unwrap_or(0)
        };
        let dx = axis(a.x0, a.x1, b.x0, b.x1, self.chunks_x());
        let dy = axis(a.y0, a.y1, b.y0, b.y1, self.chunks_y());
        dx.max(dy)
    }

    /// Every copy of `b`, shifted by whole worlds, that lies within `radius` chunks of `a`
    /// ([`ChunkRect::distance`]), as the offset of that copy. In a small world `b` can be near
    /// `a` across several seams at once, so one rectangle can come back with several offsets.
    ///
    /// `radius` must not exceed the world's larger side in chunks: a wider band would only
    /// repeat the whole world around itself.
    pub fn rect_offsets_within(
        &self,
        a: &ChunkRect,
        b: &ChunkRect,
        radius: i64,
    ) -> Result<Vec<ChunkOffset>, GeometryError> {
        let (nx, ny) = (self.chunks_x(), self.chunks_y());
        if !(0..=nx.max(ny)).contains(&radius) {
            return Err(GeometryError::RadiusTooLarge {
                radius,
                chunks_x: nx,
                chunks_y: ny,
            });
        }
        let xs = axis_wraps_within(a.x0, a.x1, b.x0, b.x1, nx, radius);
        let ys = axis_wraps_within(a.y0, a.y1, b.y0, b.y1, ny, radius);
        Ok(ys
            .flat_map(|ky| {
                xs.clone().map(move |kx| ChunkOffset {
                    x: kx * nx,
                    y: ky * ny,
                })
            })
            .collect())
    }

    /// Shortest signed chunk difference `b - a` around the torus.
    pub fn chunk_delta(&self, a: ChunkPos, b: ChunkPos) -> (i64, i64) {
        (
            signed_wrap_i(b.x - a.x, self.chunks_x()),
            signed_wrap_i(b.y - a.y, self.chunks_y()),
        )
    }

    /// Chebyshev distance in chunks around the torus: the metric of the view radius.
    pub fn chunk_distance(&self, a: ChunkPos, b: ChunkPos) -> i64 {
        let (dx, dy) = self.chunk_delta(a, b);
        dx.abs().max(dy.abs())
    }

    /// Every chunk within Chebyshev `radius` of `center`, each once, even when the square wraps
    /// onto itself in a small world.
    pub fn chunks_within(&self, center: ChunkPos, radius: i64) -> Vec<ChunkPos> {
        let (cx, cy) = (self.chunks_x(), self.chunks_y());
        let span = |n: i64| -> std::ops::RangeInclusive<i64> {
            if 2 * radius + 1 >= n {
                0..=n - 1
            } else {
                -radius..=radius
            }
        };
        let (xs, ys) = (span(cx), span(cy));
        let wrap_all_x = 2 * radius + 1 >= cx;
        let wrap_all_y = 2 * radius + 1 >= cy;
        let mut out =
            Vec::with_capacity(((2 * radius + 1).min(cx) * (2 * radius + 1).min(cy)) as usize);
        for dy in ys {
            for dx in xs.clone() {
                let x = if wrap_all_x { dx } else { center.x + dx };
                let y = if wrap_all_y { dy } else { center.y + dy };
                out.push(self.normalise_chunk(ChunkPos { x, y }));
            }
        }
        out
    }
}

fn wrap(v: f64, size: f64) -> f64 {
    // Most positions are already on the world; the division below is the slow part.
    if (0.0..size).contains(&v) {
        return v;
    }
    let r = v.rem_euclid(size);
    // rem_euclid can round up to `size` itself for tiny negative inputs.
    if r >= size {
        0.0
    } else {
        r
    }
}

fn signed_wrap(d: f64, size: f64) -> f64 {
    let r = wrap(d, size);
    if r >= size / 2.0 {
        r - size
    } else {
        r
    }
}

fn signed_wrap_i(d: i64, size: i64) -> i64 {
    let r = d.rem_euclid(size);
    if r * 2 >= size {
        r - size
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn small() -> WorldShape {
        WorldShape {
            width: 320.0,
            height: 160.0,
            chunk_size: 32.0,
            region_size: 160.0,
        }
    }

    #[test]
    fn validation_names_the_bad_value() {
        assert!(WorldShape::default().validate().is_ok());
        let bad = WorldShape {
            width: 100.0,
            ..WorldShape::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("world width") && e.contains("100"), "{e}");
        let nan = WorldShape {
            chunk_size: f64::NAN,
            ..WorldShape::default()
        };
        assert!(nan
            .validate()
            .unwrap_err()
            .to_string()
            .contains("chunk size"));
    }

    #[test]
    fn far_positions_wrap_without_overflow() {
        let w = WorldShape::default();
        for v in [1e12, -1e12, -0.0, -1e-300, 131_072.0 * 7.0 + 5.0] {
            let n = w.normalise(Pos { x: v, y: v });
            assert!((0.0..w.width).contains(&n.x), "{v} -> {}", n.x);
        }
        assert_eq!(
            w.chunk_of(Pos { x: -1.0, y: 0.0 }),
            ChunkPos { x: 4095, y: 0 }
        );
    }

    #[test]
    fn seam_deltas_are_short() {
        let w = small();
        let (dx, dy) = w.delta(Pos { x: 310.0, y: 5.0 }, Pos { x: 2.0, y: 155.0 });
        assert_eq!((dx, dy), (12.0, -10.0));
        assert_eq!(
            w.chunk_distance(ChunkPos { x: 9, y: 0 }, ChunkPos { x: 0, y: 4 }),
            1
        );
    }

    #[test]
    fn chunks_within_wraps_and_dedups() {
        let w = small(); // 10 x 5 chunks
        let c = w.chunks_within(ChunkPos { x: 0, y: 0 }, 1);
        assert_eq!(c.len(), 9);
        assert!(c.contains(&ChunkPos { x: 9, y: 4 }));
        let all = w.chunks_within(ChunkPos { x: 3, y: 2 }, 5);
        let mut dedup = all.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(all.len(), dedup.len());
        assert_eq!(all.len(), 50);
    }

    proptest! {
        #[test]
        fn delta_antisymmetric_and_bounded(ax in -1e7f64..1e7, ay in -1e7f64..1e7, bx in -1e7f64..1e7, by in -1e7f64..1e7) {
            let w = small();
            let (a, b) = (Pos { x: ax, y: ay }, Pos { x: bx, y: by });
            let (dx, dy) = w.delta(a, b);
            let (ex, ey) = w.delta(b, a);
            prop_assert!(dx.abs() <= w.width / 2.0 && dy.abs() <= w.height / 2.0);
            // Antisymmetric up to the half-world tie and float rounding.
            prop_assert!((dx + ex).abs() < 1e-6 || (dx.abs() - w.width / 2.0).abs() < 1e-6);
            prop_assert!((dy + ey).abs() < 1e-6 || (dy.abs() - w.height / 2.0).abs() < 1e-6);
            let n = w.normalise(a);
            prop_assert_eq!(w.normalise(n), n);
        }

        #[test]
        fn chunks_within_matches_distance(cx in 0i64..10, cy in 0i64..5, r in 0i64..7) {
            let w = small();
            let c = ChunkPos { x: cx, y: cy };
            let got = w.chunks_within(c, r);
            for x in 0..10 {
                for y in 0..5 {
                    let p = ChunkPos { x, y };
                    prop_assert_eq!(got.contains(&p), w.chunk_distance(c, p) <= r);
                }
            }
        }
    }
}
