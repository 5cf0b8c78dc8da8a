//! The world's shape as the arena walks it: a torus, so distances take the short way round.

use cellmesh_proto::local::Welcome;

/// The world is a torus `w` × `h` metres; a side of zero (no world in `Welcome`) does not wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Torus {
    pub w: f64,
    pub h: f64,
}

/// The shortest signed difference `d` modulo `size`.
pub(super) fn wrap(d: f64, size: f64) -> f64 {
    if size > 0.0 {
        d - (d / size).round() * size
    } else {
        d
    }
}

pub(super) fn normalise(c: f64, size: f64) -> f64 {
    if size > 0.0 {
        // `rem_euclid` can round up to `size` itself for a tiny negative `c`.
        let r = c.rem_euclid(size);
        if r >= size {
            0.0
        } else {
            r
        }
    } else {
        c
    }
}

impl Torus {
    pub(super) fn from_welcome(welcome: &Welcome) -> Self {
        welcome
            .world
            .map(|w| Self {
                w: w.width,
                h: w.height,
            })
            .unwrap_or_default()
    }

    /// From `from` to `to` the short way round.
    pub fn delta(&self, from: (f64, f64), to: (f64, f64)) -> (f64, f64) {
        (wrap(to.0 - from.0, self.w), wrap(to.1 - from.1, self.h))
    }

    pub fn normalise(&self, p: (f64, f64)) -> (f64, f64) {
        (normalise(p.0, self.w), normalise(p.1, self.h))
    }
}
