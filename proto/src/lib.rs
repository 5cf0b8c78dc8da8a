//! cellmesh wire protocols.
//!
//! - [`local`]: game server <-> its sidecar (README.md#how-a-game-server-adopts-the-local-protocol).
//! - [`mesh`]: proxy <-> sidecar and sidecar <-> sidecar.
//! - [`edge`]: player client <-> geo-edge proxy.
//!
//! Every protocol uses the same framing ([`codec::FrameCodec`]): a 4-byte big-endian length and
//! one protobuf message. [`sdk`] is the Rust SDK for game servers; [`client`] is the edge client
//! used by bots and tests; [`keys`] are the key rings every signed credential names its key in;
//! [`token`] signs and checks the edge login tokens; [`attest`] the attach attestations; [`cookie`] seals and
//! opens the handover hint cookies and [`ticket`] the RTT probe tickets (README.md#geos-bridge-first-hand-over-later).

pub mod attest;
pub mod batch;
pub mod client;
pub mod codec;
pub mod cookie;
pub mod keys;
pub mod sdk;
pub mod shaping;
pub mod ticket;
pub mod token;

/// Version of every cellmesh protocol; a peer with another major version is refused by name.
pub const PROTOCOL_MAJOR: u32 = 1;
pub const PROTOCOL_MINOR: u32 = 8;

#[allow(clippy::all, missing_docs)]
pub mod local {
    include!(concat!(env!("OUT_DIR"), "/cellmesh.local.rs"));

    impl ProtocolVersion {
        pub fn current() -> Self {
            Self {
                major: crate::PROTOCOL_MAJOR,
                minor: crate::PROTOCOL_MINOR,
            }
        }
    }
    impl From<game_message::Body> for GameMessage {
        fn from(body: game_message::Body) -> Self {
            Self { body: Some(body) }
        }
    }
    impl From<sidecar_message::Body> for SidecarMessage {
        fn from(body: sidecar_message::Body) -> Self {
            Self { body: Some(body) }
        }
    }
    impl Vec3 {
        pub fn xy(x: f64, y: f64) -> Self {
            Self { x, y, z: 0.0 }
        }
    }
}

#[allow(clippy::all, missing_docs)]
pub mod mesh {
    include!(concat!(env!("OUT_DIR"), "/cellmesh.mesh.rs"));

    impl ProtocolVersion {
        pub fn current() -> Self {
            Self {
                major: crate::PROTOCOL_MAJOR,
                minor: crate::PROTOCOL_MINOR,
            }
        }
    }
    impl From<mesh_message::Body> for MeshMessage {
        fn from(body: mesh_message::Body) -> Self {
            Self { body: Some(body) }
        }
    }
    impl MeshFrame {
        pub fn one(body: mesh_message::Body) -> Self {
            Self {
                messages: vec![body.into()],
            }
        }
    }
}

#[allow(clippy::all, missing_docs)]
pub mod edge {
    include!(concat!(env!("OUT_DIR"), "/cellmesh.edge.rs"));

    impl ProtocolVersion {
        pub fn current() -> Self {
            Self {
                major: crate::PROTOCOL_MAJOR,
                minor: crate::PROTOCOL_MINOR,
            }
        }
    }
    impl From<client_message::Body> for ClientMessage {
        fn from(body: client_message::Body) -> Self {
            Self { body: Some(body) }
        }
    }
    impl From<server_message::Body> for ServerMessage {
        fn from(body: server_message::Body) -> Self {
            Self { body: Some(body) }
        }
    }
    impl ClientFrame {
        pub fn one(body: client_message::Body) -> Self {
            Self {
                messages: vec![body.into()],
            }
        }
    }
    impl ServerFrame {
        pub fn one(body: server_message::Body) -> Self {
            Self {
                messages: vec![body.into()],
            }
        }
    }
    impl Kick {
        pub fn new(reason: KickReason, detail: impl Into<String>) -> Self {
            Self {
                reason: reason as i32,
                detail: detail.into(),
                retry_after_ms: 0,
            }
        }

        /// `SERVER_FULL`: no gateway admits new sessions; retry after `retry_after_ms`.
        pub fn server_full(detail: impl Into<String>, retry_after_ms: u32) -> Self {
            Self {
                retry_after_ms,
                ..Self::new(KickReason::ServerFull, detail)
            }
        }
    }
}
