//! What every part of the node shares while it handles one input: the time, the configuration,
//! the metrics and the outbox. A part's handler borrows it beside its own state, so what the
//! handler touches is written in its signature.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use cellmesh_proto::local::SidecarMessage;
use cellmesh_proto::mesh::{mesh_message, MeshMessage};

use super::{LinkId, Now, Output, StoreRequest};
use crate::config::SidecarConfig;
use crate::metrics::Metrics;

/// What the node queued and has not handed to the driver yet.
#[derive(Default)]
pub(crate) struct Outbox {
    pub to_game: Vec<SidecarMessage>,
    pub to_links: BTreeMap<LinkId, Vec<MeshMessage>>,
    pub(super) pending: VecDeque<Output>,
    /// Claim store calls, routed by the core to the store of each key's home geo once the
    /// handler is done (see `claim_homes`).
    pub(super) claim_calls: Vec<StoreRequest>,
    pub(super) ready: bool,
    /// Why the node exits, once what is queued is out.
    pub(super) exit: Option<String>,
}

/// The shared context of one input's handling.
pub(crate) struct Context {
    pub config: Arc<SidecarConfig>,
    pub metrics: Metrics,
    /// The time of the input being handled.
    pub now: Now,
    pub out: Outbox,
    /// Something changed since the last publish.
    pub dirty: bool,
}

impl Context {
    pub(super) fn new(config: Arc<SidecarConfig>, metrics: Metrics, now: Now) -> Self {
        Self {
            config,
            metrics,
            now,
            out: Outbox::default(),
            dirty: true,
        }
    }

    pub(crate) fn queue_for_link(&mut self, link: LinkId, body: mesh_message::Body) {
        self.out.to_links.entry(link).or_default().push(body.into());
    }

    pub(crate) fn emit(&mut self, output: Output) {
        self.out.pending.push_back(output);
    }

    pub(crate) fn store(&mut self, request: StoreRequest) {
        self.out.pending.push_back(Output::Store(request));
    }

    /// A call to the claim store of the key's home geo.
    pub(crate) fn claim_call(&mut self, request: StoreRequest) {
        self.out.claim_calls.push(request);
    }

    pub(crate) fn set_ready(&mut self, ready: bool) {
        if self.out.ready != ready {
            self.out.ready = ready;
            self.out.pending.push_back(Output::Ready(ready));
        }
    }
}
