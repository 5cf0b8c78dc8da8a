//! Fuzz targets for everything a peer can send: the frame codec of each protocol (local, mesh,
//! edge), the login token and the handover hint cookie. Each target takes arbitrary bytes and must
//! not panic, must end every decode in a message, "needs more", or a named error, must never
//! reserve buffer space for bytes that have not arrived, and must allocate within a fixed factor
//! of what it was given.
//!
//! The targets run as tests for a bounded time, on inputs made by mutating valid encodings (bit
//! flips, inserts, deletes, truncation, splicing, boundary length prefixes) and on random bytes:
//!
//! - `CELLMESH_FUZZ_SECONDS`: seconds per target (default 1, so `cargo test` stays quick);
//! - `CELLMESH_FUZZ_SEED`: the seed (random and printed when unset);
//! - `CELLMESH_FUZZ_INPUT`: one input in hex, run alone (a failure prints the line to use).

#[path = "fuzz/alloc.rs"]
mod alloc;
#[path = "fuzz/corpus.rs"]
mod corpus;
#[path = "fuzz/mutate.rs"]
mod mutate;

use std::any::type_name;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use cellmesh_proto::codec::{FrameCodec, FrameError, DEFAULT_MAX_FRAME};
use cellmesh_proto::cookie::{self, CookieError};
use cellmesh_proto::keys::KeyRing;
use cellmesh_proto::token::{self, TokenError};
use cellmesh_proto::{edge, local, mesh};
use prost::Message;
use tokio_util::codec::Decoder;

use mutate::Rng;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

const HEADER: usize = 4;
/// The limit each stream starts under (the edge's limit before login is of this order). After
/// every decoded frame the codec switches between it and the default, as the edge does after a
/// login, so a limit change between frames is exercised too.
const FUZZ_MAX_FRAME: usize = 4096;
const LIMITS: [usize; 2] = [FUZZ_MAX_FRAME, DEFAULT_MAX_FRAME];

/// Peak bytes one decode may allocate, per byte of frame body, for each frame type.
///
/// prost builds every element of a repeated field in place in a vector it grows by doubling, so
/// the worst body is a run of the smallest elements (a tag and a zero length: 2 bytes) of the
/// largest type: at the last doubling the old and the new vector are both live, 3 slots for every
/// 2 elements, so about 1.5 x the element's size per body byte. A chain of recursive messages
/// (`Adopt.attachments`) is worse per byte: every level is a vector of at least 4 slots for 2
/// bytes. Measured by `amplification_worst_cases`, which prints them (64-bit):
///
/// | frame        | worst body                                  | bytes per body byte |
/// |--------------|---------------------------------------------|---------------------|
/// | GameFrame    | empty `GameMessage`s (104 B each)           | 156                 |
/// | SidecarFrame | a chain of 60 `Adopt`s (136 B each)         | 268                 |
/// | MeshFrame    | empty `MeshMessage`s (192 B each)           | 288                 |
/// | ClientFrame  | empty `ClientMessage`s (48 B; hello boxed)  | 72                  |
/// | ServerFrame  | a `Batch` of empty `EntityDelta`s (120 B)   | 180                 |
///
/// The bounds leave a third more than that, for fields yet to come. A frame of the default 1 MiB
/// can thus hold a few hundred MiB while it is decoded: the limit of each connection is what
/// keeps that in check.
const AMP_GAME: usize = 208;
const AMP_SIDECAR: usize = 360;
const AMP_MESH: usize = 384;
const AMP_CLIENT: usize = 144;
const AMP_SERVER: usize = 240;
/// Allocated by a decode whatever the frame: the shared header `split_to` gives the buffer, the
/// boxed `prost::DecodeError` and its first stack entries.
const ALLOC_SLACK: usize = 512;
/// `token::verify` allocates only the account it returns.
const TOKEN_ALLOC_MAX: usize = token::MAX_TOKEN_LEN;
/// `cookie::open` allocates only the two strings it returns.
const COOKIE_ALLOC_MAX: usize = 2 * cookie::MAX_COOKIE_LEN;

// ------------------------------------------------------------------------------------------------
// Codec targets

/// What a stream decoded to: each frame re-encoded (so NaN fields compare), or the error's kind.
type Outcome = Vec<Result<Vec<u8>, &'static str>>;

/// Decodes `data` once whole and once in pieces chosen from the input itself; both must give the
/// same outcome.
fn codec_target<T: Message + Default>(data: &[u8], amp: usize) {
    let whole = decode_stream::<T>(data, &[data.len()], amp);
    let pieces = split_plan(data);
    let split = decode_stream::<T>(data, &pieces, amp);
    assert_eq!(whole, split, "outcome depends on the split {pieces:?}");
    for frame in &whole {
        note_outcome(frame.as_ref().map_or_else(|kind| *kind, |_| "frame"));
    }
}

/// Lengths of the pieces `data` is fed in: every byte alone for small inputs, or a few random cuts.
fn split_plan(data: &[u8]) -> Vec<usize> {
    let mut rng = Rng::new(mutate::hash(data));
    if data.len() <= 1024 && rng.chance(1, 4) {
        return vec![1; data.len()];
    }
    let mut cuts: Vec<usize> = (0..1 + rng.below(8))
        .map(|_| rng.below(data.len() + 1))
        .collect();
    cuts.sort_unstable();
    cuts.push(data.len());
    let mut last = 0;
    cuts.into_iter()
        .map(|c| {
            let n = c - last;
            last = c;
            n
        })
        .collect()
}

fn decode_stream<T: Message + Default>(data: &[u8], pieces: &[usize], amp: usize) -> Outcome {
    let mut codec = FrameCodec::<T>::with_max(LIMITS[0]);
    let mut decoded = 0;
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut rest = data;
    let mut fed = 0;
    for &n in pieces {
        let (piece, tail) = rest.split_at(n);
        rest = tail;
        // Grown to exactly what it holds, as a reader with a small read buffer would: any
        // capacity beyond that was reserved by the decoder.
        let mut grown = BytesMut::with_capacity(buf.len() + piece.len());
        grown.extend_from_slice(&buf);
        grown.extend_from_slice(piece);
        buf = grown;
        fed += piece.len();
        let limit_at_feed = codec.max_frame();
        loop {
            let capacity = buf.capacity();
            let held = buf.len();
            let announced = (held >= HEADER)
                .then(|| u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize);
            let body = announced.map_or(0, |len| len.min(held - HEADER));
            let limit = codec.max_frame();
            let (res, peak) = alloc::peak_during(|| codec.decode(&mut buf));
            assert!(
                buf.capacity() <= capacity,
                "decode grew the buffer from {capacity} to {} bytes holding {held}",
                buf.capacity()
            );
            assert!(buf.capacity() <= fed, "capacity past the bytes fed");
            assert!(
                buf.capacity() <= limit_at_feed + HEADER + piece.len(),
                "capacity past the limit, a header and one piece"
            );
            let bound = amp * body + ALLOC_SLACK;
            assert!(
                peak <= bound,
                "decoding a {body}-byte body of a {} allocated {peak} bytes (bound {bound})",
                type_name::<T>()
            );
            note_amplification(peak, body);
            match res {
                Ok(Some(msg)) => {
                    out.push(Ok(msg.encode_to_vec()));
                    decoded += 1;
                    codec.set_max_frame(LIMITS[decoded % LIMITS.len()]);
                }
                Ok(None) => {
                    assert!(
                        announced.is_none_or(|len| held < HEADER + len),
                        "needs more with a whole frame held"
                    );
                    break;
                }
                Err(e) => {
                    check_decode_error::<T>(&e, limit);
                    out.push(Err(e.kind()));
                    return out;
                }
            }
        }
    }
    let held = buf.len();
    let (res, peak) = alloc::peak_during(|| codec.decode_eof(&mut buf));
    assert!(peak <= ALLOC_SLACK, "decode_eof allocated {peak} bytes");
    match res {
        Ok(None) => assert_eq!(held, 0, "bytes left over at the end without an error"),
        Err(FrameError::Truncated { have, need }) => {
            assert_eq!(have, held);
            assert!(need > have, "truncated with {have} of {need} bytes");
            assert!(buf.is_empty());
            out.push(Err("truncated_frame"));
        }
        Ok(Some(_)) => panic!("a frame at the end of a drained stream"),
        Err(e) => panic!("at the end of a drained stream: {e}"),
    }
    out
}

fn check_decode_error<T>(e: &FrameError, limit: usize) {
    assert!(
        ["frame_too_large", "undecodable_frame"].contains(&e.kind()),
        "unexpected error from decode: {e}"
    );
    match e {
        FrameError::TooLarge { len, max } => assert!(*max == limit && len > max, "{e}"),
        FrameError::Undecodable { message, .. } => {
            assert!(type_name::<T>().ends_with(message), "{e}")
        }
        _ => unreachable!(),
    }
}

fn game_frame(data: &[u8]) {
    codec_target::<local::GameFrame>(data, AMP_GAME);
}

fn sidecar_frame(data: &[u8]) {
    codec_target::<local::SidecarFrame>(data, AMP_SIDECAR);
}

fn mesh_frame(data: &[u8]) {
    codec_target::<mesh::MeshFrame>(data, AMP_MESH);
}

fn client_frame(data: &[u8]) {
    codec_target::<edge::ClientFrame>(data, AMP_CLIENT);
}

fn server_frame(data: &[u8]) {
    codec_target::<edge::ServerFrame>(data, AMP_SERVER);
}

// ------------------------------------------------------------------------------------------------
// Token and cookie targets

fn token_verify(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let ring = KeyRing::single(corpus::SECRET);
    let (res, peak) = alloc::peak_during(|| token::verify_ring(&ring, &text, corpus::NOW_UNIX));
    if text.len() > token::MAX_TOKEN_LEN {
        assert_eq!(res, Err(TokenError::Malformed("token too long")));
        assert_eq!(peak, 0, "a token too long allocated");
    }
    assert!(peak <= TOKEN_ALLOC_MAX, "verify allocated {peak} bytes");
    match &res {
        // Only the signer's own encoding is accepted: nothing else maps onto a valid signature.
        Ok(account) => {
            let expiry = text.rsplit('.').nth(2).expect("has an expiry");
            let expiry: u64 = expiry.parse().expect("a number");
            assert!(expiry > corpus::NOW_UNIX);
            assert_eq!(
                token::sign(corpus::SECRET, account, expiry),
                text,
                "accepted a token the signer would not have written"
            );
        }
        Err(TokenError::Expired { expiry, now }) => assert!(expiry <= now),
        Err(TokenError::Malformed(_) | TokenError::BadSignature | TokenError::UnknownKey(_)) => {}
        Err(e @ (TokenError::Bearer | TokenError::BadProof)) => {
            panic!("a whole token's check answered as a proof's: {e}")
        }
    }
    note_outcome(match res {
        Ok(_) => "ok",
        Err(TokenError::Malformed(_)) => "malformed",
        Err(TokenError::UnknownKey(_)) => "unknown_kid",
        Err(TokenError::BadSignature) => "bad_signature",
        Err(TokenError::Expired { .. }) => "expired",
        Err(TokenError::Bearer | TokenError::BadProof) => unreachable!("checked above"),
    });
}

fn cookie_open(data: &[u8]) {
    let ring = KeyRing::single(corpus::SECRET);
    let (res, peak) = alloc::peak_during(|| {
        cookie::open_ring(&ring, data, corpus::ACCOUNT, corpus::ADDR, corpus::NOW_MS)
    });
    if data.len() > cookie::MAX_COOKIE_LEN {
        assert_eq!(res, Err(CookieError::TooLong { len: data.len() }));
        assert_eq!(peak, 0, "a cookie too long allocated");
    }
    assert!(peak <= COOKIE_ALLOC_MAX, "open allocated {peak} bytes");
    // Only the sealer's own encoding is accepted, and only when fresh and the account's.
    if let Ok(hint) = &res {
        assert_eq!(hint.account, corpus::ACCOUNT);
        assert!(hint.issued_unix_ms + cookie::MAX_AGE_MS >= corpus::NOW_MS);
        assert!(hint.issued_unix_ms <= corpus::NOW_MS + cookie::MAX_CLOCK_SKEW_MS);
        assert_eq!(
            cookie::seal(corpus::SECRET, hint, corpus::ADDR).as_deref(),
            Ok(data),
            "accepted a cookie the sealer would not have written"
        );
    }
    note_outcome(res.as_ref().map_or_else(CookieError::kind, |_| "ok"));
}

// ------------------------------------------------------------------------------------------------
// Inputs

/// Frame lengths on a boundary: tiny, at and past each limit, the largest.
fn boundary_len(rng: &mut Rng, actual: usize) -> u32 {
    let lens = [
        0,
        1,
        2,
        actual.saturating_sub(1) as u32,
        actual as u32 + 1,
        FUZZ_MAX_FRAME as u32 - 1,
        FUZZ_MAX_FRAME as u32,
        FUZZ_MAX_FRAME as u32 + 1,
        DEFAULT_MAX_FRAME as u32,
        DEFAULT_MAX_FRAME as u32 + 1,
        0x7fff_ffff,
        0xffff_ffff,
    ];
    *rng.pick(&lens)
}

/// A stream of frames: corpus bodies, mostly mutated, framed with their length; sometimes a
/// length prefix rewritten to a boundary value or the stream itself damaged; sometimes noise.
fn stream_input(rng: &mut Rng, corpus: &[Vec<u8>]) -> Vec<u8> {
    match rng.below(16) {
        0 => {
            let n = rng.len(600);
            rng.bytes(n)
        }
        1 => {
            let n = rng.len(600);
            let mut stream = boundary_len(rng, n).to_be_bytes().to_vec();
            stream.extend(rng.bytes(n));
            stream
        }
        _ => {
            let mut stream = Vec::new();
            let mut headers = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let mut body = rng.pick(corpus).clone();
                if rng.chance(3, 4) {
                    let rounds = 1 + rng.below(4);
                    mutate::mutate(rng, &mut body, corpus, rounds);
                }
                headers.push((stream.len(), body.len()));
                stream.extend_from_slice(&(body.len() as u32).to_be_bytes());
                stream.extend(body);
            }
            if rng.chance(1, 4) {
                let (at, actual) = *rng.pick(&headers);
                let len = boundary_len(rng, actual);
                stream[at..at + HEADER].copy_from_slice(&len.to_be_bytes());
            }
            if rng.chance(1, 6) {
                let rounds = 1 + rng.below(3);
                mutate::mutate(rng, &mut stream, corpus, rounds);
            }
            stream
        }
    }
}

/// A token or cookie: a corpus entry mutated, two spliced, noise, or something far too long.
fn flat_input(rng: &mut Rng, corpus: &[Vec<u8>]) -> Vec<u8> {
    match rng.below(16) {
        0 => {
            let n = rng.len(400);
            rng.bytes(n)
        }
        1 => {
            let n = 1000 + rng.below(2000);
            let mut long = rng.pick(corpus).repeat(1 + n / 100);
            long.truncate(n);
            long
        }
        _ => {
            let mut input = rng.pick(corpus).clone();
            let rounds = 1 + rng.below(4);
            mutate::mutate(rng, &mut input, corpus, rounds);
            input
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Driver

std::thread_local! {
    static WORST_AMP: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
    static OUTCOMES: std::cell::RefCell<BTreeMap<&'static str, u64>> =
        const { std::cell::RefCell::new(BTreeMap::new()) };
}

/// Counts how inputs ended, to show the run reached the decoders and not only the length checks.
fn note_outcome(kind: &'static str) {
    OUTCOMES.with(|o| *o.borrow_mut().entry(kind).or_default() += 1);
}

/// Records the largest allocation per body byte seen (bodies of at least 64 bytes, where the
/// fixed costs no longer dominate).
fn note_amplification(peak: usize, body: usize) {
    if body >= 64 {
        WORST_AMP.with(|w| w.set(w.get().max(peak as f64 / body as f64)));
    }
}

fn budget() -> Duration {
    let secs = std::env::var("CELLMESH_FUZZ_SECONDS")
        .ok()
        .map(|s| {
            s.parse::<f64>()
                .expect("CELLMESH_FUZZ_SECONDS is a number of seconds")
        })
        .unwrap_or(1.0);
    Duration::from_secs_f64(secs)
}

fn seed() -> u64 {
    match std::env::var("CELLMESH_FUZZ_SEED") {
        Ok(s) => s.parse().expect("CELLMESH_FUZZ_SEED is a u64"),
        Err(_) => {
            let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            mutate::hash(
                &[
                    t.as_nanos().to_le_bytes(),
                    (std::process::id() as u128).to_le_bytes(),
                ]
                .concat(),
            )
        }
    }
}

fn fuzz(
    name: &str,
    corpus: Vec<Vec<u8>>,
    input: fn(&mut Rng, &[Vec<u8>]) -> Vec<u8>,
    target: fn(&[u8]),
) {
    if let Ok(hex_input) = std::env::var("CELLMESH_FUZZ_INPUT") {
        let data = hex::decode(hex_input.trim()).expect("CELLMESH_FUZZ_INPUT is hex");
        target(&data);
        println!("fuzz {name}: the given input passed");
        return;
    }
    let seed = seed();
    let budget = budget();
    let mut rng = Rng::new(seed ^ mutate::hash(name.as_bytes()));
    let start = Instant::now();
    let mut runs = 0u64;
    for data in &corpus {
        run_one(name, seed, runs, data, target);
        runs += 1;
    }
    while start.elapsed() < budget {
        let data = input(&mut rng, &corpus);
        run_one(name, seed, runs, &data, target);
        runs += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let amp = WORST_AMP.with(|w| w.get());
    let outcomes = OUTCOMES.with(|o| format!("{:?}", o.borrow()));
    let amp = if amp > 0.0 {
        format!("; most allocated per body byte {amp:.1}")
    } else {
        String::new()
    };
    println!(
        "fuzz {name}: {runs} inputs in {secs:.1} s ({:.0}/s), seed {seed}; outcomes {outcomes}{amp}",
        runs as f64 / secs
    );
}

fn run_one(name: &str, seed: u64, n: u64, data: &[u8], target: fn(&[u8])) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| target(data))) {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("panic");
        let hex_input = hex::encode(data);
        panic!(
            "fuzz {name}: input {n} of seed {seed} failed: {why}\n  \
             input ({} bytes): {hex_input}\n  \
             reproduce: CELLMESH_FUZZ_INPUT={hex_input} cargo test -p cellmesh-proto --test fuzz -- --exact {name}\n  \
             or the whole run: CELLMESH_FUZZ_SEED={seed} cargo test -p cellmesh-proto --test fuzz -- --exact {name}",
            data.len()
        );
    }
}

#[test]
fn local_game_frame() {
    fuzz(
        "local_game_frame",
        corpus::game_frames(),
        stream_input,
        game_frame,
    );
}

#[test]
fn local_sidecar_frame() {
    fuzz(
        "local_sidecar_frame",
        corpus::sidecar_frames(),
        stream_input,
        sidecar_frame,
    );
}

#[test]
fn mesh_mesh_frame() {
    fuzz(
        "mesh_mesh_frame",
        corpus::mesh_frames(),
        stream_input,
        mesh_frame,
    );
}

#[test]
fn edge_client_frame() {
    fuzz(
        "edge_client_frame",
        corpus::client_frames(),
        stream_input,
        client_frame,
    );
}

#[test]
fn edge_server_frame() {
    fuzz(
        "edge_server_frame",
        corpus::server_frames(),
        stream_input,
        server_frame,
    );
}

#[test]
fn token_verify_target() {
    fuzz(
        "token_verify_target",
        corpus::tokens(),
        flat_input,
        token_verify,
    );
}

#[test]
fn cookie_open_target() {
    fuzz(
        "cookie_open_target",
        corpus::cookies(),
        flat_input,
        cookie_open,
    );
}

// ------------------------------------------------------------------------------------------------
// The worst cases the amplification bounds are set from

/// A frame body of `n` copies of `element` (a field tag and a zero length), framed.
fn frame_of(prefix: &[u8], element: &[u8], n: usize) -> Vec<u8> {
    let mut body = prefix.to_vec();
    for _ in 0..n {
        body.extend_from_slice(element);
    }
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend(body);
    frame
}

/// A message field holding `inner`: tag, length, bytes.
fn field(tag: u32, inner: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in [(tag << 3 | 2) as u64, inner.len() as u64] {
        let mut v = v;
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    out.extend_from_slice(inner);
    out
}

fn measure<T: Message + Default>(frame: &[u8]) -> f64 {
    let mut codec = FrameCodec::<T>::default();
    let mut buf = BytesMut::from(frame);
    let (res, peak) = alloc::peak_during(|| codec.decode(&mut buf));
    res.expect("decodes").expect("a whole frame");
    peak as f64 / (frame.len() - HEADER) as f64
}

#[test]
fn amplification_worst_cases() {
    // Enough elements that the fixed costs vanish; a count just past a power of two, where a
    // vector has just doubled (the worst moment).
    const N: usize = (1 << 14) + 1;
    let empty = |tag| field(tag, &[]);
    let cases: Vec<(&str, f64, usize)> = vec![
        (
            "GameFrame of empty GameMessages",
            measure::<local::GameFrame>(&frame_of(&[], &empty(1), N)),
            AMP_GAME,
        ),
        (
            "SidecarFrame of empty SidecarMessages",
            measure::<local::SidecarFrame>(&frame_of(&[], &empty(2), N)),
            AMP_SIDECAR,
        ),
        (
            "SidecarFrame of one Adopt of empty attachments",
            measure::<local::SidecarFrame>(&{
                let attachments = empty(7).repeat(N);
                let msg = field(6, &attachments);
                frame_of(&field(2, &msg), &[], 0)
            }),
            AMP_SIDECAR,
        ),
        (
            "SidecarFrame of an Adopt chain 60 deep",
            measure::<local::SidecarFrame>(&{
                let mut chain = Vec::new();
                for _ in 0..60 {
                    chain = field(7, &chain);
                }
                frame_of(&field(2, &field(6, &chain)), &[], 0)
            }),
            AMP_SIDECAR,
        ),
        (
            "MeshFrame of empty MeshMessages",
            measure::<mesh::MeshFrame>(&frame_of(&[], &empty(5), N)),
            AMP_MESH,
        ),
        (
            "MeshFrame of a RestoreReport of empty HandoffOffers",
            measure::<mesh::MeshFrame>(&{
                let offers = empty(4).repeat(N);
                let msg = field(50, &offers);
                frame_of(&field(5, &msg), &[], 0)
            }),
            AMP_MESH,
        ),
        (
            "MeshFrame of a Routed of pieces of empty Recipients",
            measure::<mesh::MeshFrame>(&{
                let recipients = empty(3).repeat(N);
                let msg = field(41, &field(1, &recipients));
                frame_of(&field(5, &msg), &[], 0)
            }),
            AMP_MESH,
        ),
        (
            "ClientFrame of empty ClientMessages",
            measure::<edge::ClientFrame>(&frame_of(&[], &empty(3), N)),
            AMP_CLIENT,
        ),
        (
            "ServerFrame of empty ServerMessages",
            measure::<edge::ServerFrame>(&frame_of(&[], &empty(4), N)),
            AMP_SERVER,
        ),
        (
            "ServerFrame of a Batch of empty EntityDeltas",
            measure::<edge::ServerFrame>(&{
                let deltas = empty(2).repeat(N);
                let msg = field(2, &deltas);
                frame_of(&field(4, &msg), &[], 0)
            }),
            AMP_SERVER,
        ),
    ];
    let mut over = Vec::new();
    for (what, factor, bound) in &cases {
        println!("{what}: {factor:.1} bytes allocated per body byte (bound {bound})");
        if *factor > *bound as f64 {
            over.push(what);
        }
    }
    assert!(over.is_empty(), "over the bound: {over:?}");
}
