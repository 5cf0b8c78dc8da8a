//! The mesh listener before a peer has said who it is: a stranger can make it hold little, and
//! for little time, and the peers that do say who they are still get in.

mod support;

use std::time::Duration;

use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::mesh::{mesh_message, MeshFrame};
use futures::{SinkExt, StreamExt};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};

/// What the sidecar says to a connection that announced a 5000-byte first frame: before, it
/// waited for the 5000 bytes (a megabyte would have been taken) until the hello timeout.
#[tokio::test]
async fn a_first_frame_larger_than_a_hello_is_refused_at_once() {
    let s = TestSidecar::start().await;
    let mut stream = TcpStream::connect(s.mesh()).await.unwrap();
    stream.write_all(&5000u32.to_be_bytes()).await.unwrap();
    stream.write_all(&[0; 100]).await.unwrap();
    let mut reader = FramedRead::new(stream, FrameCodec::<MeshFrame>::default());
    let answer = tokio::time::timeout(Duration::from_secs(3), reader.next())
        .await
        .expect("refused before the hello timeout")
        .expect("a frame")
        .expect("a well-formed frame");
    match answer.messages.into_iter().next().and_then(|m| m.body) {
        Some(mesh_message::Body::Refused(r)) => {
            assert!(
                r.reason.contains("5000") && r.reason.contains("4096"),
                "{r:?}"
            )
        }
        other => panic!("expected LinkRefused, got {other:?}"),
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"frame_too_large\"} 1"),
        "{metrics}"
    );
    // A peer that says who it is gets in, and may then send frames as large as the config lets.
    let _link = s.link("proxy-a").await;
}

/// Idle connections that never say hello hold at most 256 handshakes: the next is closed at once,
/// counted, and a peer gets in again as soon as they are gone.
#[tokio::test]
async fn connections_in_their_handshake_are_capped() {
    let s = TestSidecar::start().await;
    let mut idle = Vec::new();
    for _ in 0..256 {
        idle.push(TcpStream::connect(s.mesh()).await.unwrap());
    }
    // The 257th is accepted by the kernel, then closed by the sidecar without a word.
    let mut one_more = TcpStream::connect(s.mesh()).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(3), one_more.read(&mut buf))
        .await
        .expect("closed before the hello timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_errors_total{kind=\"handshakes_full\"} 1"),
        "{metrics}"
    );
    drop(idle);
    // Their handshakes end as the sidecar reads their close: a peer that dials until it is
    // answered gets in.
    cellmesh_test_support::within("a peer answered again", async {
        loop {
            let stream = TcpStream::connect(s.mesh()).await.unwrap();
            let (r, w) = stream.into_split();
            let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
            writer.send(link_hello("proxy-a", 1)).await.unwrap();
            let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
            if let Some(Ok(f)) = reader.next().await {
                if let Some(mesh_message::Body::Hello(_)) =
                    f.messages.into_iter().next().and_then(|m| m.body)
                {
                    break;
                }
            }
        }
    })
    .await;
}
