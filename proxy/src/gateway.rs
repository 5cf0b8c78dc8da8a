//! Choosing a gateway for a new session: round-robin over the links that are up.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::link::{Link, LinkConn};

/// The configured gateways, one link each.
#[derive(Debug)]
pub(crate) struct Gateways {
    links: Vec<Arc<Link>>,
    next: AtomicUsize,
}

impl Gateways {
    pub(crate) fn new(addrs: &[String]) -> Self {
        Self {
            links: addrs.iter().map(|a| Arc::new(Link::new(a))).collect(),
            next: AtomicUsize::new(0),
        }
    }

    pub(crate) fn links(&self) -> &[Arc<Link>] {
        &self.links
    }

    /// The next link that is up, and its live connection.
    pub(crate) fn pick(&self) -> Option<(Arc<Link>, Arc<LinkConn>)> {
        let len = self.links.len();
        if len == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % len;
        (0..len)
            .map(|i| &self.links[(start + i) % len])
            .find_map(|link| link.conn().map(|c| (link.clone(), c)))
    }

    pub(crate) fn any_up(&self) -> bool {
        self.links.iter().any(|l| l.conn().is_some())
    }
}
