//! The frame codec shared by every cellmesh protocol: a 4-byte big-endian length, then one
//! protobuf message of exactly that many bytes.
//!
//! The decoder checks the length against a maximum and never reserves room for a frame it has not
//! received: the buffer grows only as bytes arrive, so a hostile length prefix costs nothing; a
//! stream that ends inside a frame is a typed error. The maximum can change between frames (the
//! edge admits a few KiB until a client has logged in).

use std::marker::PhantomData;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

/// Default largest frame body accepted or sent: 1 MiB.
pub const DEFAULT_MAX_FRAME: usize = 1024 * 1024;
const HEADER: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("stream ended inside a frame: {have} of {need} bytes received")]
    Truncated { have: usize, need: usize },
    #[error("undecodable {message}: {source}")]
    Undecodable {
        message: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl FrameError {
    /// A short, stable name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "frame_too_large",
            FrameError::Truncated { .. } => "truncated_frame",
            FrameError::Undecodable { .. } => "undecodable_frame",
            FrameError::Io(_) => "io",
        }
    }
}

/// A frame body that is already encoded (e.g. a client batch built once by the gateway and
/// relayed by the proxy): written with its length prefix, never re-encoded.
#[derive(Debug, Clone)]
pub struct RawFrame(pub Bytes);

/// Decodes frames into `D`; encodes any prost message (or a [`RawFrame`]).
#[derive(Debug)]
pub struct FrameCodec<D> {
    max_frame: usize,
    /// Body length of the frame decoded last, so a reader can count bytes without walking it.
    last_frame_len: usize,
    _decodes: PhantomData<fn() -> D>,
}

impl<D> Clone for FrameCodec<D> {
    fn clone(&self) -> Self {
        Self::with_max(self.max_frame)
    }
}

impl<D> Default for FrameCodec<D> {
    fn default() -> Self {
        Self::with_max(DEFAULT_MAX_FRAME)
    }
}

impl<D> FrameCodec<D> {
    pub fn with_max(max_frame: usize) -> Self {
        Self {
            max_frame,
            last_frame_len: 0,
            _decodes: PhantomData,
        }
    }

    /// The body length of the frame [`Decoder::decode`] returned last.
    pub fn last_frame_len(&self) -> usize {
        self.last_frame_len
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Changes the largest frame accepted from the next frame on.
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    fn check_len(&self, len: usize) -> Result<(), FrameError> {
        if len > self.max_frame {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame,
            });
        }
        Ok(())
    }
}

impl<D: Message + Default> Decoder for FrameCodec<D> {
    type Item = D;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<D>, FrameError> {
        if src.len() < HEADER {
            return Ok(None);
        }
        let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        self.check_len(len)?;
        if src.len() < HEADER + len {
            // No reservation for the rest: a peer that announces a large frame and sends little
            // of it holds only what it sent (the reader grows the buffer as bytes arrive).
            return Ok(None);
        }
        src.advance(HEADER);
        self.last_frame_len = len;
        let body = src.split_to(len).freeze();
        D::decode(body)
            .map(Some)
            .map_err(|source| FrameError::Undecodable {
                message: short_type_name::<D>(),
                source,
            })
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<D>, FrameError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() => Ok(None),
            None => {
                let need = if src.len() >= HEADER {
                    HEADER + u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize
                } else {
                    HEADER
                };
                let have = src.len();
                src.clear();
                Err(FrameError::Truncated { have, need })
            }
        }
    }
}

impl<D, E: Message> Encoder<E> for FrameCodec<D> {
    type Error = FrameError;

    fn encode(&mut self, item: E, dst: &mut BytesMut) -> Result<(), FrameError> {
        let len = item.encoded_len();
        self.check_len(len)?;
        dst.reserve(HEADER + len);
        dst.put_u32(len as u32);
        item.encode(dst).expect("reserved enough capacity");
        Ok(())
    }
}

impl<D> Encoder<RawFrame> for FrameCodec<D> {
    type Error = FrameError;

    fn encode(&mut self, item: RawFrame, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.check_len(item.0.len())?;
        dst.reserve(HEADER + item.0.len());
        dst.put_u32(item.0.len() as u32);
        dst.put_slice(&item.0);
        Ok(())
    }
}

/// Encodes one message as a frame body (no length prefix), for sharing one encoding between many
/// recipients as a [`RawFrame`].
pub fn encode_body<M: Message>(msg: &M) -> Bytes {
    Bytes::from(msg.encode_to_vec())
}

fn short_type_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::{self, game_message::Body, GameFrame, GameMessage};
    use proptest::prelude::*;

    fn frame_bytes(msg: &GameFrame) -> BytesMut {
        let mut buf = BytesMut::new();
        FrameCodec::<GameFrame>::default()
            .encode(msg.clone(), &mut buf)
            .unwrap();
        buf
    }

    fn sample() -> GameFrame {
        GameFrame {
            messages: vec![GameMessage {
                body: Some(Body::TickEnd(local::TickEnd { tick: 42 })),
            }],
        }
    }

    #[test]
    fn round_trip() {
        let mut buf = frame_bytes(&sample());
        let mut codec = FrameCodec::<GameFrame>::default();
        let got = codec.decode(&mut buf).unwrap();
        assert_eq!(got, Some(sample()));
        assert!(buf.is_empty());
        assert_eq!(codec.last_frame_len(), sample().encoded_len());
    }

    #[test]
    fn four_gib_length_is_refused_without_allocating() {
        let mut buf = BytesMut::from(&[0xff, 0xff, 0xff, 0xff, 1, 2][..]);
        let err = FrameCodec::<GameFrame>::default()
            .decode(&mut buf)
            .unwrap_err();
        assert!(matches!(
            err,
            FrameError::TooLarge {
                len: 0xffff_ffff,
                max: DEFAULT_MAX_FRAME
            }
        ));
        assert!(buf.capacity() < 1024, "capacity grew to {}", buf.capacity());
    }

    #[test]
    fn truncated_frame_at_eof_is_a_typed_error() {
        let full = frame_bytes(&sample());
        let mut buf = BytesMut::from(&full[..full.len() - 1]);
        let err = FrameCodec::<GameFrame>::default()
            .decode_eof(&mut buf)
            .unwrap_err();
        assert!(
            matches!(err, FrameError::Truncated { have, need } if have == full.len() - 1 && need == full.len())
        );
        let mut header_only = BytesMut::from(&[0u8, 0][..]);
        let err = FrameCodec::<GameFrame>::default()
            .decode_eof(&mut header_only)
            .unwrap_err();
        assert!(matches!(err, FrameError::Truncated { have: 2, need: 4 }));
    }

    #[test]
    fn garbage_body_is_undecodable_not_a_panic() {
        let mut buf = BytesMut::from(&[0, 0, 0, 3, 0xff, 0xff, 0xff][..]);
        let err = FrameCodec::<GameFrame>::default()
            .decode(&mut buf)
            .unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::Undecodable {
                    message: "GameFrame",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn encoder_refuses_oversize() {
        let big = GameFrame {
            messages: vec![GameMessage {
                body: Some(Body::Send(local::Send {
                    accounts: vec![],
                    r#type: 1,
                    payload: vec![0u8; 200].into(),
                })),
            }],
        };
        let mut buf = BytesMut::new();
        let err = FrameCodec::<GameFrame>::with_max(100)
            .encode(big, &mut buf)
            .unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 100, .. }));
        assert!(buf.is_empty());
    }

    #[test]
    fn raw_frame_matches_encoded_message() {
        let msg = sample();
        let mut a = BytesMut::new();
        let mut b = BytesMut::new();
        let mut codec = FrameCodec::<GameFrame>::default();
        codec.encode(msg.clone(), &mut a).unwrap();
        codec.encode(RawFrame(encode_body(&msg)), &mut b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn a_frame_announced_at_the_maximum_reserves_nothing() {
        for max in [DEFAULT_MAX_FRAME, 4096] {
            let mut codec = FrameCodec::<GameFrame>::with_max(max);
            let mut buf = BytesMut::with_capacity(64);
            buf.put_u32(max as u32);
            buf.put_slice(&[0x0a, 0x00, 0x0a]);
            assert!(codec.decode(&mut buf).unwrap().is_none());
            assert!(
                buf.capacity() <= 64,
                "capacity grew to {} for 7 bytes held",
                buf.capacity()
            );
            assert_eq!(buf.len(), 7, "nothing consumed before the frame is whole");
        }
    }

    #[test]
    fn the_maximum_applies_from_the_next_frame() {
        let mut data = frame_bytes(&sample());
        data.extend_from_slice(&frame_bytes(&sample()));
        let len = data.len() / 2 - HEADER;
        let mut codec = FrameCodec::<GameFrame>::with_max(len);
        assert_eq!(codec.decode(&mut data).unwrap(), Some(sample()));
        codec.set_max_frame(len - 1);
        let err = codec.decode(&mut data).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max, .. } if max == len - 1));
    }

    /// Feeds `pieces` in turn and records each frame (re-encoded, so NaN fields compare equal)
    /// or the error that ended the stream. Checks on the way that the decoder never reserves: the
    /// buffer is grown to exactly what it holds, so any more capacity came from `decode`.
    fn outcome<D: Message + Default>(
        pieces: &[&[u8]],
        max: usize,
    ) -> Vec<Result<Vec<u8>, &'static str>> {
        let mut codec = FrameCodec::<D>::with_max(max);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for p in pieces {
            let mut grown = BytesMut::with_capacity(buf.len() + p.len());
            grown.extend_from_slice(&buf);
            grown.extend_from_slice(p);
            buf = grown;
            loop {
                let capacity = buf.capacity();
                let res = codec.decode(&mut buf);
                assert!(buf.capacity() <= capacity, "decode reserved ahead");
                assert!(buf.capacity() <= max + HEADER + p.len());
                match res {
                    Ok(Some(f)) => out.push(Ok(f.encode_to_vec())),
                    Ok(None) => break,
                    Err(e) => {
                        out.push(Err(e.kind()));
                        return out;
                    }
                }
            }
        }
        match codec.decode_eof(&mut buf) {
            Ok(Some(f)) => out.push(Ok(f.encode_to_vec())),
            Ok(None) => {}
            Err(e) => out.push(Err(e.kind())),
        }
        out
    }

    fn split_at_cuts<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
        points.sort_unstable();
        let mut pieces = Vec::new();
        let mut last = 0;
        for p in points {
            pieces.push(&data[last..p]);
            last = p;
        }
        pieces.push(&data[last..]);
        pieces
    }

    /// A valid frame of `msg` with `noise` spliced in at `at`.
    fn noisy_stream<M: Message>(msg: &M, noise: &[u8], at: usize) -> Vec<u8> {
        let mut data = Vec::new();
        data.extend_from_slice(&(msg.encoded_len() as u32).to_be_bytes());
        data.extend_from_slice(&msg.encode_to_vec());
        let at = at % (data.len() + 1);
        data.splice(at..at, noise.iter().copied());
        data
    }

    fn mesh_sample(n: u64) -> crate::mesh::MeshFrame {
        use crate::mesh::{mesh_message::Body, EntityGone, Heartbeat, MeshFrame};
        MeshFrame {
            messages: vec![
                Body::Heartbeat(Heartbeat { sent_unix_ms: n }).into(),
                Body::EntityGone(EntityGone {
                    entity_id: n,
                    entity_epoch: 1,
                    position: None,
                })
                .into(),
            ],
        }
    }

    fn client_sample(n: u64) -> crate::edge::ClientFrame {
        use crate::edge::{client_message::Body, ClientFrame, ClientInput, Ping};
        ClientFrame {
            messages: vec![
                Body::Ping(Ping { nonce: n }).into(),
                Body::Input(ClientInput {
                    seq: n,
                    payload: vec![1, 2, 3].into(),
                })
                .into(),
            ],
        }
    }

    proptest! {
        /// Arbitrary bytes fed in arbitrary pieces: never a panic, never a reservation past the
        /// maximum, and the outcome does not depend on how the input was split.
        #[test]
        fn arbitrary_bytes_and_splits(data in proptest::collection::vec(any::<u8>(), 0..2048),
                                      cuts in proptest::collection::vec(any::<usize>(), 0..8),
                                      max in 0usize..600) {
            let whole = outcome::<GameFrame>(&[&data], max);
            prop_assert_eq!(whole, outcome::<GameFrame>(&split_at_cuts(&data, &cuts), max));
        }

        /// The same for the mesh protocol, from a valid frame with noise spliced in.
        #[test]
        fn mesh_frames_with_noise_and_splits(n in any::<u64>(),
                                             noise in proptest::collection::vec(any::<u8>(), 0..64),
                                             at in any::<usize>(),
                                             cuts in proptest::collection::vec(any::<usize>(), 0..8),
                                             max in 0usize..600) {
            let data = noisy_stream(&mesh_sample(n), &noise, at);
            let whole = outcome::<crate::mesh::MeshFrame>(&[&data], max);
            prop_assert_eq!(whole, outcome::<crate::mesh::MeshFrame>(&split_at_cuts(&data, &cuts), max));
        }

        /// The same for the edge protocol (client to proxy).
        #[test]
        fn client_frames_with_noise_and_splits(n in any::<u64>(),
                                               noise in proptest::collection::vec(any::<u8>(), 0..64),
                                               at in any::<usize>(),
                                               cuts in proptest::collection::vec(any::<usize>(), 0..8),
                                               max in 0usize..600) {
            let data = noisy_stream(&client_sample(n), &noise, at);
            let whole = outcome::<crate::edge::ClientFrame>(&[&data], max);
            prop_assert_eq!(whole, outcome::<crate::edge::ClientFrame>(&split_at_cuts(&data, &cuts), max));
        }

        /// Any sequence of valid frames survives any split.
        #[test]
        fn valid_frames_survive_any_split(ticks in proptest::collection::vec(any::<u64>(), 1..20),
                                          cut in any::<usize>()) {
            let frames: Vec<GameFrame> = ticks.iter().map(|t| GameFrame { messages: vec![GameMessage { body: Some(Body::TickEnd(local::TickEnd { tick: *t })) }] }).collect();
            prop_assert_eq!(decode_split(&frames, cut), frames);
        }

        #[test]
        fn valid_mesh_frames_survive_any_split(ns in proptest::collection::vec(any::<u64>(), 1..20),
                                               cut in any::<usize>()) {
            let frames: Vec<_> = ns.into_iter().map(mesh_sample).collect();
            prop_assert_eq!(decode_split(&frames, cut), frames);
        }

        #[test]
        fn valid_client_frames_survive_any_split(ns in proptest::collection::vec(any::<u64>(), 1..20),
                                                 cut in any::<usize>()) {
            let frames: Vec<_> = ns.into_iter().map(client_sample).collect();
            prop_assert_eq!(decode_split(&frames, cut), frames);
        }
    }

    /// Encodes `frames` into one stream and decodes it in two pieces cut at `cut`.
    fn decode_split<D: Message + Default + Clone>(frames: &[D], cut: usize) -> Vec<D> {
        let mut data = BytesMut::new();
        let mut codec = FrameCodec::<D>::default();
        for f in frames {
            codec.encode(f.clone(), &mut data).unwrap();
        }
        let cut = cut % (data.len() + 1);
        let mut buf = BytesMut::from(&data[..cut]);
        let mut got = Vec::new();
        while let Some(f) = codec.decode(&mut buf).unwrap() {
            got.push(f);
        }
        buf.extend_from_slice(&data[cut..]);
        while let Some(f) = codec.decode(&mut buf).unwrap() {
            got.push(f);
        }
        assert!(codec.decode_eof(&mut buf).unwrap().is_none());
        got
    }
}
