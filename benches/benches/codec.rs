//! Frame codec throughput, per frame of 64 pieces with 32-byte payloads (throughput counts the
//! pieces): a client batch encoded by prost, assembled from shared pre-encoded deltas (what the
//! gateway's fold does), relayed as pre-encoded bytes (what the proxy does) and decoded; and a
//! tick's delta `EntityState`s from an owner to one subscriber, encoded and decoded.
use bytes::BytesMut;
use cellmesh_benches::payload;
use cellmesh_proto::batch::{encode_delta, BatchWriter};
use cellmesh_proto::codec::{encode_body, FrameCodec, RawFrame};
use cellmesh_proto::edge::{
    server_message::Body, Batch, ComponentData, DeltaKind, EntityDelta, ServerFrame, Vec3,
};
use cellmesh_proto::mesh::{mesh_message, EntityState, MeshFrame, MeshVec3, PublicComponent};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tokio_util::codec::{Decoder, Encoder};

const PIECES: usize = 64;

fn deltas(n: usize) -> Vec<EntityDelta> {
    (0..n as u64)
        .map(|i| EntityDelta {
            entity_id: i,
            kind: DeltaKind::Update as i32,
            position: Some(Vec3 {
                x: i as f64,
                y: 2.0 * i as f64,
                z: 0.0,
            }),
            components: vec![ComponentData {
                r#type: 2,
                payload: payload(i),
            }],
            removed_types: vec![],
            owner_account: String::new(),
        })
        .collect()
}

fn batch(n: usize) -> ServerFrame {
    ServerFrame::one(Body::Batch(Batch {
        tick: 1,
        deltas: deltas(n),
        events: vec![],
        messages: vec![],
    }))
}

fn entity_states(n: usize) -> MeshFrame {
    let messages = (0..n as u64)
        .map(|i| {
            mesh_message::Body::EntityState(EntityState {
                entity_id: i,
                entity_epoch: 3,
                full: false,
                position: Some(MeshVec3 {
                    x: i as f64,
                    y: 2.0 * i as f64,
                    z: 0.0,
                }),
                components: vec![PublicComponent {
                    r#type: 2,
                    payload: payload(i),
                }],
                ..Default::default()
            })
            .into()
        })
        .collect();
    MeshFrame { messages }
}

fn codec(c: &mut Criterion) {
    let frame = batch(PIECES);
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(PIECES as u64));
    g.bench_function("encode_batch_64", |b| {
        let mut codec = FrameCodec::<ServerFrame>::default();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        b.iter_batched(
            || frame.clone(),
            |f| {
                buf.clear();
                codec.encode(f, &mut buf).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    let shared: Vec<_> = deltas(PIECES).iter().map(encode_delta).collect();
    g.bench_function("assemble_batch_64_shared_deltas", |b| {
        let mut codec = FrameCodec::<ServerFrame>::default();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        b.iter(|| {
            let mut w = BatchWriter::new(1);
            for d in &shared {
                w.delta(d.clone());
            }
            buf.clear();
            codec.encode(RawFrame(w.finish()), &mut buf).unwrap();
        })
    });
    let raw = encode_body(&frame);
    g.bench_function("relay_preencoded_batch_64", |b| {
        let mut codec = FrameCodec::<ServerFrame>::default();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        b.iter(|| {
            buf.clear();
            codec.encode(RawFrame(raw.clone()), &mut buf).unwrap();
        })
    });
    let mut encoded = BytesMut::new();
    FrameCodec::<ServerFrame>::default()
        .encode(frame.clone(), &mut encoded)
        .unwrap();
    g.bench_function("decode_batch_64", |b| {
        let mut codec = FrameCodec::<ServerFrame>::default();
        b.iter_batched_ref(
            || encoded.clone(),
            |buf| codec.decode(buf).unwrap().unwrap(),
            BatchSize::SmallInput,
        )
    });

    let mesh = entity_states(PIECES);
    g.bench_function("encode_mesh_entity_states_64", |b| {
        let mut codec = FrameCodec::<MeshFrame>::default();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        b.iter_batched(
            || mesh.clone(),
            |f| {
                buf.clear();
                codec.encode(f, &mut buf).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    let mut encoded = BytesMut::new();
    FrameCodec::<MeshFrame>::default()
        .encode(mesh.clone(), &mut encoded)
        .unwrap();
    g.bench_function("decode_mesh_entity_states_64", |b| {
        let mut codec = FrameCodec::<MeshFrame>::default();
        b.iter_batched_ref(
            || encoded.clone(),
            |buf| codec.decode(buf).unwrap().unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
