//! Valid encodings the fuzzer starts from: frame bodies of every message kind of each protocol,
//! with strings, payloads, nested and repeated fields set, and login tokens and hint cookies.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use bytes::Bytes;
use cellmesh_proto::cookie::{self, HintCookie};
use cellmesh_proto::{edge, local, mesh, token};
use prost::Message;

fn bodies<M: Message>(frames: Vec<M>) -> Vec<Vec<u8>> {
    frames.iter().map(Message::encode_to_vec).collect()
}

fn payload(n: usize) -> Bytes {
    (0..n).map(|i| i as u8).collect::<Vec<u8>>().into()
}

pub fn game_frames() -> Vec<Vec<u8>> {
    use local::game_message::Body as B;
    use local::*;
    let audience = Some(Audience {
        kind: AudienceKind::Accounts as i32,
        accounts: vec!["ada".into(), "bob".into()],
    });
    let component = Component {
        r#type: 3,
        payload: payload(12),
        audience: audience.clone(),
    };
    let all = vec![
        B::Hello(Hello {
            version: Some(ProtocolVersion::current()),
            tick_rate_hz: 20,
            game: "arena 0.1".into(),
        }),
        B::Spawn(Spawn {
            entity_id: 1 << 40,
            position: Some(Vec3::xy(1.5, -2.0)),
            components: vec![component.clone(), Component::default()],
            owner_account: "ada".into(),
            is_master: true,
            parent_id: 9,
        }),
        B::Update(Update {
            entity_id: 7,
            position: Some(Vec3::xy(f64::MAX, f64::NAN)),
            changed: vec![component.clone()],
            removed_types: vec![1, 2, 300, u32::MAX],
        }),
        B::Despawn(Despawn { entity_id: 7 }),
        B::Event(Event {
            entity_id: 7,
            r#type: 2,
            payload: payload(5),
            audience,
        }),
        B::Send(Send {
            accounts: vec!["ada".into(), "ünïcode".into()],
            r#type: 1,
            payload: payload(40),
        }),
        B::ChunkEvent(ChunkEvent {
            chunk_x: -3,
            chunk_y: i64::MAX,
            r#type: 4,
            payload: payload(3),
            durable: true,
        }),
        B::Snapshot(Snapshot {
            entity_id: 7,
            entity_epoch: 3,
            state: payload(64),
        }),
        B::Adopted(Adopted {
            entity_id: 7,
            entity_epoch: 4,
        }),
        B::Load(Load {
            tick_ms: 3.5,
            budget_ms: 50.0,
            entity_count: 1000,
        }),
        B::TickEnd(TickEnd { tick: u64::MAX }),
        B::Health(Health {
            ok: false,
            detail: "slow".into(),
        }),
        B::ReserveIds(ReserveIds {
            request_id: 1,
            count: 64,
        }),
        B::CheckpointState(CheckpointState {
            entity_id: 7,
            entity_epoch: 5,
            state: payload(16),
        }),
        B::Release(Release {
            entity_id: 7,
            entity_epoch: 5,
            state: payload(16),
            attachments: vec![Snapshot {
                entity_id: 8,
                entity_epoch: 5,
                state: payload(4),
            }],
            last_input_seq: 41,
            input_session_epoch: 3,
        }),
        B::Command(Command {
            target_entity: 7,
            r#type: 3,
            payload: payload(8),
            request_id: 11,
            from_entity: 9,
        }),
        B::CommandReply(CommandReply {
            request_id: 11,
            refused: true,
            payload: payload(2),
            detail: "busy".into(),
        }),
        B::Claim(Claim {
            key: "trade:ada".into(),
            holder_entity: 7,
            ttl_ms: 5_000,
            request_id: 12,
        }),
        B::ClaimRelease(ClaimRelease {
            key: "trade:ada".into(),
            holder_entity: 7,
        }),
        B::DeclareSpawners(DeclareSpawners {
            points: vec![
                SpawnPoint {
                    key: "den:wolves".into(),
                    x: 256.0,
                    y: 128.0,
                },
                SpawnPoint {
                    key: "ore:3".into(),
                    x: -1.5,
                    y: 2e9,
                },
            ],
        }),
    ];
    let mut frames: Vec<GameFrame> = all
        .iter()
        .map(|b| GameFrame {
            messages: vec![b.clone().into()],
        })
        .collect();
    frames.push(GameFrame {
        messages: all.into_iter().map(Into::into).collect(),
    });
    frames.push(GameFrame::default());
    bodies(frames)
}

pub fn sidecar_frames() -> Vec<Vec<u8>> {
    use local::sidecar_message::Body as B;
    use local::*;
    let component = Component {
        r#type: 3,
        payload: payload(12),
        audience: None,
    };
    let adopt = Adopt {
        entity_id: 7,
        entity_epoch: 2,
        position: Some(Vec3::xy(3.0, 4.0)),
        state: payload(20),
        owner_account: "ada".into(),
        is_master: true,
        attachments: vec![Adopt {
            entity_id: 8,
            attachments: vec![Adopt {
                entity_id: 9,
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    let rect = Rect {
        x: 0.0,
        y: 0.0,
        width: 512.0,
        height: 256.0,
    };
    let all = vec![
        B::Welcome(Welcome {
            version: Some(ProtocolVersion::current()),
            node_id: 3,
            world: Some(WorldShape {
                width: 1024.0,
                height: 1024.0,
                chunk_size: 32.0,
                region_size: 256.0,
            }),
            owned_area: vec![rect, rect],
            partition_epoch: 6,
            tick_phase: Some(TickPhase {
                origin_unix_ms: 0,
                tick_rate_hz: 30,
            }),
            handoff_margin_chunks: 1,
        }),
        B::PlayerJoin(PlayerJoin {
            account: "ada".into(),
            session_epoch: 2,
            last_position: Some(Vec3::xy(1.0, 2.0)),
        }),
        B::PlayerLeave(PlayerLeave {
            account: "ada".into(),
            session_epoch: 2,
            reason: "bye".into(),
        }),
        B::Input(Input {
            account: "ada".into(),
            session_epoch: 2,
            seq: 10,
            payload: payload(8),
        }),
        B::Freeze(Freeze {
            entity_id: 7,
            entity_epoch: 2,
        }),
        B::Adopt(adopt),
        B::Evict(Evict { entity_id: 7 }),
        B::Thaw(Thaw {
            entity_id: 7,
            reason: "refused".into(),
        }),
        B::GhostEnter(GhostEnter {
            entity_id: 7,
            position: Some(Vec3::xy(-1.0, 0.5)),
            components: vec![component.clone()],
        }),
        B::GhostUpdate(GhostUpdate {
            entity_id: 7,
            position: None,
            changed: vec![component],
            removed_types: vec![5, 6],
        }),
        B::GhostLeave(GhostLeave { entity_id: 7 }),
        B::ChunkEvent(ChunkEvent {
            chunk_x: 1,
            chunk_y: -1,
            r#type: 2,
            payload: payload(4),
            durable: false,
        }),
        B::PartitionChanged(PartitionChanged {
            partition_epoch: 7,
            owned_area: vec![rect],
        }),
        B::Error(Error {
            code: ErrorCode::NotOwner as i32,
            detail: "not yours".into(),
            fatal: true,
            entity_id: 7,
        }),
        B::IdsReserved(IdsReserved {
            request_id: 1,
            ids: vec![1, 2, 3, u64::MAX],
        }),
        B::Checkpoint(Checkpoint {
            entity_ids: vec![7, 8, 9],
        }),
        B::CommandIn(CommandIn {
            target: 7,
            from_entity: 9,
            from_account: "ada".into(),
            r#type: 3,
            payload: payload(8),
            request_id: 1,
            from_node: 2,
        }),
        B::CommandResult(CommandResult {
            request_id: 11,
            target: 7,
            ok: false,
            error: CommandError::EntityGone as i32,
            payload: payload(1),
            detail: "no node holds entity 7".into(),
        }),
        B::ClaimResult(ClaimResult {
            request_id: 12,
            key: "trade:ada".into(),
            outcome: ClaimOutcome::ClaimHeld as i32,
            holder_entity: 7,
            held_by: 9,
            token: 0,
            detail: String::new(),
        }),
        B::ClaimLost(ClaimLost {
            key: "trade:bob".into(),
            holder_entity: 7,
            reason: "lease lapsed".into(),
        }),
        B::SpawnerOwned(SpawnerOwned {
            key: "den:wolves".into(),
            entity_id: 1 << 62 | 5,
            generation: 3,
            position: Some(Vec3::xy(256.0, 128.0)),
        }),
        B::SpawnerReleased(SpawnerReleased {
            key: "den:wolves".into(),
            reason: "its chunk went to node 2".into(),
        }),
    ];
    let mut frames: Vec<SidecarFrame> = all
        .iter()
        .map(|b| SidecarFrame {
            messages: vec![b.clone().into()],
        })
        .collect();
    frames.push(SidecarFrame {
        messages: all.into_iter().map(Into::into).collect(),
    });
    bodies(frames)
}

pub fn mesh_frames() -> Vec<Vec<u8>> {
    use mesh::mesh_message::Body as B;
    use mesh::*;
    let pos = Some(MeshVec3 {
        x: 1.0,
        y: -2.0,
        z: 0.5,
    });
    let owned = OwnedComponent {
        r#type: 2,
        payload: payload(9),
        audience: 2,
        accounts: vec!["ada".into()],
    };
    let offer = HandoffOffer {
        entity_id: 7,
        entity_epoch: 3,
        partition_epoch: 2,
        position: pos,
        state: payload(32),
        owner_account: "ada".into(),
        is_master: true,
        attachments: vec![HandoffPart {
            entity_id: 8,
            position: pos,
            state: payload(4),
            owner_account: "ada".into(),
            is_master: false,
            parent_id: 7,
            components: vec![owned.clone()],
        }],
        components: vec![owned],
        gateway_node: 2,
        session_epoch: 4,
        successor: true,
        unseen: true,
        last_input_seq: 99,
        state_unix_ms: 1_700_000_000_000,
        command_cursors: vec![CommandCursor {
            target: 7,
            origin_node: 3,
            origin_incarnation: 2,
            last_seq: 40,
        }],
        claims: vec![HeldClaim {
            key: "trade:ada".into(),
            holder_entity: 7,
            token: 4,
            entity_epoch: 2,
            ttl_ms: 5_000,
        }],
    };
    let chunks = vec![ChunkRef { x: -1, y: 2 }, ChunkRef { x: i64::MIN, y: 0 }];
    let all = vec![
        B::Hello(LinkHello {
            version: Some(ProtocolVersion::current()),
            role: PeerRole::Sidecar as i32,
            id: "3".into(),
            geo: "eu-west".into(),
            partition_epoch: 5,
            node_id: 3,
            lease_epoch: 2,
            world_geos: vec!["eu-west".into(), "us-east".into()],
        }),
        B::Heartbeat(Heartbeat { sent_unix_ms: 17 }),
        B::Attach(Attach {
            session_id: 1,
            account: "ada".into(),
            remote_addr: "203.0.113.7:5000".into(),
            moved: true,
            moved_from_epoch: 12345,
            attestation: "a1.1700000060000.00".into(),
            handover: Some(mesh::HandoverHint {
                session_epoch: 41,
                last_position: Some(MeshVec3 {
                    x: 1.0,
                    y: 2.0,
                    z: 0.0,
                }),
                issued_unix_ms: NOW_MS,
                source: "cookie".into(),
            }),
        }),
        B::Where(mesh::SessionWhere {
            session_id: 1,
            geo: "montreal".into(),
            region: 7,
            position: Some(MeshVec3 {
                x: 3.0,
                y: 4.0,
                z: 0.0,
            }),
        }),
        B::Attached(Attached {
            session_id: 1,
            session_epoch: 2,
            gateway_node: 3,
            world_width: 1024.0,
            world_height: 1024.0,
            chunk_size: 32.0,
        }),
        B::Detach(Detach {
            session_id: 1,
            kick_reason: 3,
            detail: "displaced".into(),
            retry_after_ms: 0,
        }),
        B::Detach(Detach {
            session_id: 2,
            kick_reason: 14,
            detail: "the server is full".into(),
            retry_after_ms: 1000,
        }),
        B::Input(SessionInput {
            session_id: 1,
            seq: 2,
            payload: payload(6),
        }),
        B::ToClient(ToClient {
            session_id: 1,
            server_frame: payload(30),
        }),
        B::Rtt(SessionRtt {
            session_id: 1,
            rtt_ms_p50: 20.5,
            rtt_ms_min: 18.0,
            far: vec![GeoRtt {
                geo: "montreal".into(),
                rtt_ms_p50: 92.0,
                rtt_ms_min: 90.5,
            }],
        }),
        B::Refused(LinkRefused {
            reason: "major 2".into(),
        }),
        B::Admission(Admission {
            open: false,
            reason: "tick_overrun".into(),
            retry_after_ms: 5000,
        }),
        B::Subscribe(Subscribe {
            chunks: chunks.clone(),
        }),
        B::Unsubscribe(Unsubscribe { chunks }),
        B::EntityState(EntityState {
            entity_id: 7,
            entity_epoch: 2,
            full: true,
            position: pos,
            components: vec![PublicComponent {
                r#type: 1,
                payload: payload(10),
            }],
            removed_types: vec![3],
            owner_account: "ada".into(),
            is_master: true,
            parent_id: 0,
        }),
        B::EntityGone(EntityGone {
            entity_id: 7,
            entity_epoch: 0,
            position: pos,
        }),
        B::EntityEvent(EntityEvent {
            entity_id: 7,
            r#type: 1,
            payload: payload(3),
        }),
        B::PlayerJoin(PeerPlayerJoin {
            account: "ada".into(),
            session_epoch: 2,
            last_position: pos,
            gateway_node: 1,
            hops: 1,
        }),
        B::PlayerLeave(PeerPlayerLeave {
            account: "ada".into(),
            session_epoch: 2,
            reason: "bye".into(),
        }),
        B::ForwardInput(ForwardInput {
            account: "ada".into(),
            session_epoch: 2,
            seq: 3,
            payload: payload(5),
            entity_epoch: 2,
            hops: 1,
            entity_id: 7,
        }),
        B::Anchor(Anchor {
            account: "ada".into(),
            session_epoch: 2,
            entity_id: 7,
            position: pos,
            entity_epoch: 2,
        }),
        B::Routed(Routed {
            pieces: vec![RoutedPiece {
                kind: PieceKind::PieceEvent as i32,
                encoded: payload(12),
                recipients: vec![
                    Recipient {
                        account: "ada".into(),
                        session_epoch: 2,
                    },
                    Recipient {
                        account: "bob".into(),
                        session_epoch: 1,
                    },
                ],
                audience: 2,
            }],
        }),
        B::SessionMoved(SessionMoved {
            account: "ada".into(),
            session_epoch: 3,
            gateway_node: 2,
            new_avatar: true,
        }),
        B::SessionEnded(SessionEnded {
            account: "ada".into(),
            session_epoch: 3,
        }),
        B::HandoffOffer(offer.clone()),
        B::HandoffAck(HandoffAck {
            entity_id: 7,
            entity_epoch: 3,
            adopt_timing: Some(AdoptTiming { game_ms: 41 }),
        }),
        B::HandoffRefused(HandoffRefused {
            entity_id: 7,
            entity_epoch: 3,
            reason: "full".into(),
        }),
        B::EntityMoved(EntityMoved {
            entity_id: 7,
            entity_epoch: 3,
            owner_node: 2,
            holders: vec![1, 4],
        }),
        B::PartitionAck(PartitionAck { partition_epoch: 8 }),
        B::RestoreQuery(RestoreQuery {
            node: 2,
            lease_epoch: 5,
        }),
        B::RestoreReport(RestoreReport {
            node: 2,
            lease_epoch: 5,
            held: vec![RealHeld {
                entity_id: 7,
                entity_epoch: 3,
                owner_node: 0,
                owner_lease: 5,
            }],
            offered: vec![offer],
            last: true,
            in_doubt: vec![7],
        }),
        B::RestoreResolved(RestoreResolved {
            entity_id: 7,
            entity_epoch: 3,
            owner_node: 1,
        }),
        B::RestoreDone(RestoreDone {
            node: 2,
            lease_epoch: 5,
        }),
        B::EntityCommand(EntityCommand {
            target: 7,
            entity_epoch: 3,
            origin_node: 2,
            origin_incarnation: 5,
            seq: 41,
            prev_seq: 40,
            request_id: 11,
            from_entity: 9,
            from_account: "ada".into(),
            r#type: 3,
            payload: payload(8),
            hops: 1,
        }),
        B::EntityCommandResult(EntityCommandResult {
            origin_incarnation: 5,
            request_id: 11,
            target: 7,
            error: 3,
            payload: payload(2),
            detail: "refused".into(),
        }),
        B::Locate(Locate { entity: 7 }),
        B::Located(Located {
            entity: 7,
            found: true,
            owner: 3,
            entity_epoch: 4,
        }),
        B::ClaimCall(ClaimCall {
            call: 9,
            op: Some(claim_call::Op::Claim(ClaimAsk {
                key: "trade:ada".into(),
                holder_entity: 7,
                entity_epoch: 2,
                ttl_ms: 5_000,
            })),
        }),
        B::ClaimCall(ClaimCall {
            call: 10,
            op: Some(claim_call::Op::Rebind(ClaimRebind {
                grant: Some(HeldClaim {
                    key: "trade:bob".into(),
                    holder_entity: 7,
                    token: 1_800_000_000_000,
                    entity_epoch: 2,
                    ttl_ms: 5_000,
                }),
                entity_epoch: 3,
            })),
        }),
        B::ClaimAnswer(ClaimAnswer {
            call: 9,
            results: vec![
                ClaimCallResult {
                    ok: true,
                    token: 1_800_000_000_001,
                    ..Default::default()
                },
                ClaimCallResult {
                    error: "refused: home geo us unreachable".into(),
                    held_by_entity: 8,
                    held_by_epoch: 1,
                    ..Default::default()
                },
            ],
        }),
    ];
    let mut frames: Vec<MeshFrame> = all.iter().map(|b| MeshFrame::one(b.clone())).collect();
    frames.push(MeshFrame {
        messages: all.into_iter().map(Into::into).collect(),
    });
    bodies(frames)
}

pub fn client_frames() -> Vec<Vec<u8>> {
    use edge::client_message::Body as B;
    use edge::*;
    let all = vec![
        B::Hello(Box::new(ClientHello {
            version: Some(ProtocolVersion::current()),
            token: token::sign(b"k", "ada", 1_700_000_000),
            cookie: cookies()[0].clone().into(),
            probe_ticket: b"probe".to_vec().into(),
            claim: "ada.1700000000.k1".into(),
            proof: vec![7; token::PROOF_LEN].into(),
        })),
        B::Input(ClientInput {
            seq: 1,
            payload: payload(16),
        }),
        B::Ping(Ping { nonce: 5 }),
        B::Pong(Pong { nonce: u64::MAX }),
        B::Bye(Bye {}),
        B::Cookie(edge::CookieResponse {
            cookie: cookies()[1].clone().into(),
        }),
    ];
    let mut frames: Vec<ClientFrame> = all.iter().map(|b| ClientFrame::one(b.clone())).collect();
    frames.push(ClientFrame {
        messages: all.into_iter().map(Into::into).collect(),
    });
    bodies(frames)
}

pub fn server_frames() -> Vec<Vec<u8>> {
    use edge::server_message::Body as B;
    use edge::*;
    let delta = EntityDelta {
        entity_id: 7,
        kind: DeltaKind::Appear as i32,
        position: Some(Vec3 {
            x: 1.0,
            y: 2.0,
            z: 3.0,
        }),
        components: vec![ComponentData {
            r#type: 1,
            payload: payload(8),
        }],
        removed_types: vec![2, 3],
        owner_account: "ada".into(),
    };
    let all = vec![
        B::Welcome(Welcome {
            version: Some(ProtocolVersion::current()),
            account: "ada".into(),
            session_id: 1,
            session_epoch: 2,
            gateway_node: 3,
            world_width: 1024.0,
            world_height: 1024.0,
            chunk_size: 32.0,
        }),
        B::Batch(Batch {
            tick: 9,
            deltas: vec![delta.clone(), delta],
            events: vec![EventData {
                entity_id: 7,
                r#type: 2,
                payload: payload(4),
            }],
            messages: vec![AccountMessage {
                r#type: 1,
                payload: payload(20),
            }],
        }),
        B::Ping(Ping { nonce: 1 }),
        B::Pong(Pong { nonce: 2 }),
        B::Transfer(Transfer {
            host: "eu-west.example".into(),
            port: 7000,
            cookie: cookies()[0].clone().into(),
            geo: "eu-west".into(),
            server_name: "eu-west.example".into(),
        }),
        B::CookieRequest(edge::CookieRequest {}),
        B::Challenge(edge::Challenge { nonce: payload(16) }),
        B::Probe(edge::ProbeRequest {
            targets: vec![edge::ProbeTarget {
                geo: "montreal".into(),
                host: "edge.montreal.example".into(),
                port: 7300,
                ticket: payload(40),
                server_name: "edge.montreal.example".into(),
            }],
        }),
        B::Kick(Kick::new(KickReason::Idle, "idle for 60 s")),
        B::Kick(Kick::server_full("every gateway is full", 5000)),
    ];
    let mut frames: Vec<ServerFrame> = all.iter().map(|b| ServerFrame::one(b.clone())).collect();
    frames.push(ServerFrame {
        messages: all.into_iter().map(Into::into).collect(),
    });
    bodies(frames)
}

pub const SECRET: &[u8] = b"fuzz-secret";
/// "Now" for tokens (seconds) and cookies (ms).
pub const NOW_UNIX: u64 = 1_700_000_000;
pub const NOW_MS: u64 = NOW_UNIX * 1000;
/// The account and address the cookie target opens every input as.
pub const ACCOUNT: &str = "alice.smith";
pub const ADDR: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));

pub fn tokens() -> Vec<Vec<u8>> {
    let long = "x".repeat(token::MAX_TOKEN_LEN - 90);
    [
        ("alice", NOW_UNIX + 60),
        ("alice.smith", NOW_UNIX + 1),
        ("ünïcode", u64::MAX),
        ("late", NOW_UNIX),
        (long.as_str(), NOW_UNIX + 60),
        ("a", 0),
    ]
    .iter()
    .map(|(account, expiry)| token::sign(SECRET, account, *expiry).into_bytes())
    .chain([
        token::sign(b"other", "alice", NOW_UNIX + 60).into_bytes(),
        b"..".to_vec(),
        b"alice.+100.00".to_vec(),
    ])
    .collect()
}

pub fn cookies() -> Vec<Vec<u8>> {
    let hint = |issued_unix_ms, target_geo: &str, gateway_node, account: &str| HintCookie {
        nonce: [gateway_node as u8; cookie::NONCE_LEN],
        issued_unix_ms,
        target_geo: target_geo.into(),
        gateway_node,
        account: account.into(),
        session_epoch: u64::from(gateway_node) * 1_000,
        // Every other cookie carries a position, so both layouts are in the corpus.
        last_position: (gateway_node % 2 == 1).then_some([1.5, -2.0, 3.25]),
    };
    let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
    [
        (hint(NOW_MS - 10, "eu-west", 3, ACCOUNT), ADDR),
        (hint(NOW_MS, "us-east-1", 0, ACCOUNT), ADDR),
        (
            hint(NOW_MS - cookie::MAX_AGE_MS - 1, "eu", 1, ACCOUNT),
            ADDR,
        ),
        (hint(NOW_MS + 60_000, "eu", 1, ACCOUNT), ADDR),
        (hint(NOW_MS, "eu", 1, "mallory"), ADDR),
        (hint(NOW_MS, "eu", 1, ACCOUNT), v6),
        (
            hint(
                NOW_MS,
                &"g".repeat(cookie::MAX_GEO_LEN),
                u32::MAX,
                &"a".repeat(cookie::MAX_ACCOUNT_LEN),
            ),
            ADDR,
        ),
    ]
    .iter()
    .map(|(h, addr)| cookie::seal(SECRET, h, *addr).expect("valid hint"))
    .collect()
}
