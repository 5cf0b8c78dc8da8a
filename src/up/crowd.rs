//! Where the arenas and the bots meet: around the corner every cell of a grid touches, or, on a
//! BSP, in a crowd for the director to balance.

use cellmesh_world::geometry::WorldShape;

/// Where everything meets: the corner every cell of a grid touches, across the wrap seam.
pub(super) const MEETING_POINT: (f64, f64) = (0.0, 0.0);
/// Side of the square every arena's NPCs roam, around the meeting point, metres: they cross
/// every border all the time, and so are handed between the nodes.
pub(super) const ARENA_SPREAD: f64 = 300.0;

/// With `--bubbles`, the last geo's own bots gather here, in a region of the first geo's first
/// node (the grid gives node 1 the quadrant at the origin), away from the meeting point: their
/// group is a bubble of its own, simulated far from them until the director moves it.
pub(super) struct Bubble;

impl Bubble {
    /// The middle of region (2, 2) of the default world: nothing of the meeting point's
    /// crowd, two regions away, is grouped with it.
    pub(super) const POINT: (f64, f64) = (20_480.0, 20_480.0);
    pub(super) const ROAM_M: f64 = 100.0;

    /// The gathering bots' location, as their click to screen is kept: apart from the other
    /// bots of their geo.
    pub(super) fn location(geo: &str) -> String {
        format!("{geo} (bubble)")
    }
}

/// A world laid out as a BSP (`--partition bsp`) gets a crowd for the director to balance:
/// every arena stands around the middle of the world, where every line of `Bsp::even` meets,
/// and the bots gather a few chunks away from it, inside one cell. Players walk fast (mounted),
/// so the crowd forms within the first half minute, and each entity is reported to cost a
/// quarter millisecond of a 50 ms tick: 200 gathered bots weigh a whole node.
pub(super) struct Crowd;

impl Crowd {
    const GATHER_OFFSET_M: f64 = 160.0;
    pub(super) const ROAM_M: f64 = 100.0;
    pub(super) const ARENA_SPREAD_M: f64 = 600.0;
    pub(super) const PLAYER_SPEED: f64 = 10.0;
    pub(super) const ENTITY_COST_MS: f32 = 0.25;

    pub(super) fn middle(world: &WorldShape) -> (f64, f64) {
        (world.width / 2.0, world.height / 2.0)
    }

    pub(super) fn gather_point(world: &WorldShape) -> (f64, f64) {
        let (x, y) = Self::middle(world);
        (x - Self::GATHER_OFFSET_M, y - Self::GATHER_OFFSET_M)
    }
}
