//! The frame codec of every sidecar connection, counting the frames and bytes it decodes and
//! encodes.

use bytes::BytesMut;
use cellmesh_proto::codec::{FrameCodec, FrameError};
use tokio_util::codec::{Decoder, Encoder};

use crate::metrics::{Metrics, Peer, Wire};

/// [`FrameCodec`] that counts what it decodes and encodes.
pub struct MeteredCodec<D> {
    inner: FrameCodec<D>,
    wire: Wire,
}

impl<D> MeteredCodec<D> {
    pub fn new(max_frame: usize, metrics: &Metrics, peer: Peer) -> Self {
        Self {
            inner: FrameCodec::with_max(max_frame),
            wire: metrics.wire(peer),
        }
    }

    /// The largest frame the next decode takes (see [`FrameCodec::set_max_frame`]).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.inner.set_max_frame(max_frame);
    }

    fn counted_in<T>(&self, before: usize, src: &BytesMut, r: &Result<Option<T>, FrameError>) {
        if let Ok(Some(_)) = r {
            self.wire.frames_in.inc();
            self.wire.frames_in_all.inc();
            self.wire.bytes_in.inc_by((before - src.len()) as u64);
        }
    }
}

impl<D: prost::Message + Default> Decoder for MeteredCodec<D> {
    type Item = D;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<D>, FrameError> {
        let before = src.len();
        let r = self.inner.decode(src);
        self.counted_in(before, src, &r);
        r
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<D>, FrameError> {
        let before = src.len();
        let r = self.inner.decode_eof(src);
        self.counted_in(before, src, &r);
        r
    }
}

impl<D, E> Encoder<E> for MeteredCodec<D>
where
    FrameCodec<D>: Encoder<E, Error = FrameError>,
{
    type Error = FrameError;

    fn encode(&mut self, item: E, dst: &mut BytesMut) -> Result<(), FrameError> {
        let before = dst.len();
        self.inner.encode(item, dst)?;
        self.wire.frames_out.inc();
        self.wire.frames_out_all.inc();
        self.wire.bytes_out.inc_by((dst.len() - before) as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::local::{game_message::Body, GameFrame, GameMessage, TickEnd};
    use prometheus_client::registry::Registry;

    #[test]
    fn codec_counts_frames_and_bytes_both_ways() {
        let mut reg = Registry::default();
        let m = Metrics::register(&mut reg);
        let mut codec = MeteredCodec::<GameFrame>::new(1024, &m, Peer::Game);
        let frame = GameFrame {
            messages: vec![GameMessage {
                body: Some(Body::TickEnd(TickEnd { tick: 3 })),
            }],
        };
        let mut buf = BytesMut::new();
        codec.encode(frame.clone(), &mut buf).unwrap();
        let len = buf.len() as u64;
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(frame));
        assert_eq!((m.frames_in_total(), m.frames_out_total()), (1, 1));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains(&format!(
                "cellmesh_sidecar_bytes_total{{direction=\"in\",peer=\"game\"}} {len}"
            )),
            "{text}"
        );
        m.error("malformed_frame");
        assert_eq!(m.errors_total(), 1);
    }
}
