//! Frame codec throughput: encoding one client batch versus relaying pre-encoded bytes.
use bytes::BytesMut;
use cellmesh_proto::codec::{encode_body, FrameCodec, RawFrame};
use cellmesh_proto::edge::{
    server_message::Body, Batch, ComponentData, DeltaKind, EntityDelta, ServerFrame, Vec3,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio_util::codec::{Decoder, Encoder};

fn batch(n: usize) -> ServerFrame {
    let deltas = (0..n as u64)
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
                payload: vec![7u8; 16].into(),
            }],
            removed_types: vec![],
            owner_account: String::new(),
        })
        .collect();
    ServerFrame::one(Body::Batch(Batch {
        tick: 1,
        deltas,
        events: vec![],
        messages: vec![],
    }))
}

fn codec(c: &mut Criterion) {
    let frame = batch(64);
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(1));
    g.bench_function("encode_batch_64", |b| {
        let mut codec = FrameCodec::<ServerFrame>::default();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        b.iter(|| {
            buf.clear();
            codec.encode(frame.clone(), &mut buf).unwrap();
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
        b.iter(|| {
            let mut buf = encoded.clone();
            codec.decode(&mut buf).unwrap().unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
