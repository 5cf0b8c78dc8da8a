//! Assembles a client's per-tick `Batch` frame from pieces encoded once and shared.
//!
//! A public update seen by thirty clients is encoded once ([`encode_delta`]); each client's batch
//! then only concatenates the shared bytes under the right protobuf headers. The result is byte for
//! byte what prost would produce for the equivalent `ServerFrame` (tested below).

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
use prost::Message;

use crate::edge::{AccountMessage, EntityDelta, EventData};

// Field numbers, from edge.proto.
const FRAME_MESSAGES: u32 = 4; // ServerFrame.messages
const MESSAGE_BATCH: u32 = 2; // ServerMessage.batch
const BATCH_TICK: u32 = 1;
const BATCH_DELTAS: u32 = 2;
const BATCH_EVENTS: u32 = 3;
const BATCH_MESSAGES: u32 = 4;

/// An encoded `EntityDelta`, `EventData` or `AccountMessage`, shareable between batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded(pub Bytes);

pub fn encode_delta(d: &EntityDelta) -> Encoded {
    Encoded(Bytes::from(d.encode_to_vec()))
}
pub fn encode_event(e: &EventData) -> Encoded {
    Encoded(Bytes::from(e.encode_to_vec()))
}
pub fn encode_message(m: &AccountMessage) -> Encoded {
    Encoded(Bytes::from(m.encode_to_vec()))
}

/// One client's batch for one tick.
#[derive(Debug, Default, Clone)]
pub struct BatchWriter {
    tick: u64,
    parts: Vec<(u32, Encoded)>,
}

impl BatchWriter {
    pub fn new(tick: u64) -> Self {
        Self {
            tick,
            parts: Vec::new(),
        }
    }
    pub fn delta(&mut self, d: Encoded) {
        self.parts.push((BATCH_DELTAS, d));
    }
    pub fn event(&mut self, e: Encoded) {
        self.parts.push((BATCH_EVENTS, e));
    }
    pub fn message(&mut self, m: Encoded) {
        self.parts.push((BATCH_MESSAGES, m));
    }
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
    /// Number of deltas, events and messages in the batch.
    pub fn len(&self) -> usize {
        self.parts.len()
    }
    pub fn deltas(&self) -> usize {
        self.parts
            .iter()
            .filter(|(f, _)| *f == BATCH_DELTAS)
            .count()
    }

    /// The encoded `ServerFrame` body holding this batch as its one message. Protobuf puts
    /// repeated fields of one number in order, so deltas, events and messages keep their order.
    pub fn finish(&self) -> Bytes {
        let field_len = |len: usize| 1 + encoded_len_varint(len as u64) + len;
        let mut batch_len = 0;
        if self.tick != 0 {
            batch_len += 1 + encoded_len_varint(self.tick);
        }
        // Canonical order: all deltas, then events, then messages.
        for field in [BATCH_DELTAS, BATCH_EVENTS, BATCH_MESSAGES] {
            for (f, p) in &self.parts {
                if *f == field {
                    batch_len += field_len(p.0.len());
                }
            }
        }
        let msg_len = field_len(batch_len);
        let total = field_len(msg_len);
        let mut buf = BytesMut::with_capacity(total);
        encode_key(FRAME_MESSAGES, WireType::LengthDelimited, &mut buf);
        encode_varint(msg_len as u64, &mut buf);
        encode_key(MESSAGE_BATCH, WireType::LengthDelimited, &mut buf);
        encode_varint(batch_len as u64, &mut buf);
        if self.tick != 0 {
            encode_key(BATCH_TICK, WireType::Varint, &mut buf);
            encode_varint(self.tick, &mut buf);
        }
        for field in [BATCH_DELTAS, BATCH_EVENTS, BATCH_MESSAGES] {
            for (f, p) in &self.parts {
                if *f == field {
                    encode_key(field, WireType::LengthDelimited, &mut buf);
                    encode_varint(p.0.len() as u64, &mut buf);
                    buf.put_slice(&p.0);
                }
            }
        }
        debug_assert_eq!(buf.len(), total);
        buf.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::{server_message::Body, Batch, ComponentData, DeltaKind, ServerFrame, Vec3};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn assembled_batch_equals_prost_encoding(tick in any::<u64>(),
                                                 ids in proptest::collection::vec(any::<u64>(), 0..20),
                                                 payload in proptest::collection::vec(any::<u8>(), 0..300),
                                                 n_events in 0usize..4, n_msgs in 0usize..4) {
            let deltas: Vec<EntityDelta> = ids.iter().map(|&id| EntityDelta {
                entity_id: id,
                kind: (id % 3) as i32,
                position: Some(Vec3 { x: id as f64, y: 1.5, z: 0.0 }),
                components: vec![ComponentData { r#type: 7, payload: payload.clone().into() }],
                removed_types: vec![1, 2],
                owner_account: if id % 2 == 0 { "acc".into() } else { String::new() },
            }).collect();
            let events: Vec<EventData> = (0..n_events as u64).map(|i| EventData { entity_id: i, r#type: 3, payload: payload.clone().into() }).collect();
            let msgs: Vec<AccountMessage> = (0..n_msgs as u32).map(|i| AccountMessage { r#type: i, payload: payload.clone().into() }).collect();
            let mut w = BatchWriter::new(tick);
            // Interleave the kinds: the writer must still emit canonical order.
            for m in &msgs { w.message(encode_message(m)); }
            for e in &events { w.event(encode_event(e)); }
            for d in &deltas { w.delta(encode_delta(d)); }
            let expected = ServerFrame::one(Body::Batch(Batch { tick, deltas, events, messages: msgs })).encode_to_vec();
            prop_assert_eq!(w.finish().to_vec(), expected);
        }
    }

    #[test]
    fn kind_default_is_update() {
        assert_eq!(DeltaKind::default(), DeltaKind::Update);
    }
}
