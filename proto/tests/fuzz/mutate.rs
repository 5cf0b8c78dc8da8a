//! A seeded generator and the mutations applied to corpus entries.
//!
//! The generator is a SplitMix64 of our own rather than `rand`'s: a printed seed must reproduce the
//! same inputs whatever version of a dependency a later build resolves.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True `num` times in `den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A length biased towards small values, at most `max`.
    pub fn len(&mut self, max: usize) -> usize {
        match self.below(4) {
            0 => self.below(max.min(4) + 1),
            1 => self.below(max.min(32) + 1),
            _ => self.below(max + 1),
        }
    }
}

/// A deterministic hash of an input, so a target derives how to split it from the input alone
/// (FNV-1a).
pub fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
    out
}

/// Values that sit on a boundary, as protobuf varints (inner lengths, counts, tags).
const INTERESTING: [u64; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    4096,
    4097,
    1 << 20,
    (1 << 20) + 1,
    0x7fff_ffff,
    0xffff_ffff,
    u64::MAX,
];

/// Applies `rounds` random mutations to `data`; `others` are spliced from.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>], rounds: usize) {
    for _ in 0..rounds {
        let n = data.len();
        let at = rng.below(n + 1);
        match rng.below(12) {
            // Bit flip.
            0 | 1 if n > 0 => {
                let i = rng.below(n);
                data[i] ^= 1 << rng.below(8);
            }
            // A random or boundary byte.
            2 if n > 0 => {
                let i = rng.below(n);
                let choices = [rng.byte(), 0, 0x7f, 0x80, 0xff];
                data[i] = *rng.pick(&choices);
            }
            // Insert random bytes.
            3 => {
                let n = 1 + rng.len(16);
                let bytes = rng.bytes(n);
                data.splice(at..at, bytes);
            }
            // Delete a range.
            4 if n > 0 => {
                let start = rng.below(n);
                let end = (start + 1 + rng.len(16)).min(n);
                data.drain(start..end);
            }
            // Truncate.
            5 => data.truncate(at),
            // Duplicate a range in place (repeated fields, runs of messages).
            6 if n > 0 => {
                let start = rng.below(n);
                let end = (start + 1 + rng.len(64)).min(n);
                let piece = data[start..end].to_vec();
                for _ in 0..1 + rng.len(8) {
                    data.splice(end..end, piece.iter().copied());
                }
            }
            // Splice in a piece of another entry.
            7 if !others.is_empty() => {
                let other = rng.pick(others);
                let start = rng.below(other.len());
                let end = (start + rng.len(other.len())).min(other.len());
                data.splice(at..at, other[start..end].iter().copied());
            }
            // Keep a prefix, then another entry's suffix.
            8 if !others.is_empty() => {
                let other = rng.pick(others);
                data.truncate(at);
                data.extend_from_slice(&other[rng.below(other.len() + 1)..]);
            }
            // Overwrite with a boundary varint (an inner length prefix, most usefully).
            9 if n > 0 => {
                let v = varint(*rng.pick(&INTERESTING));
                let i = rng.below(n);
                let end = (i + v.len()).min(n);
                data.splice(i..end, v);
            }
            // Insert a boundary varint.
            10 => {
                let v = varint(*rng.pick(&INTERESTING));
                data.splice(at..at, v);
            }
            // Swap two bytes.
            11 if n > 1 => {
                let (i, j) = (rng.below(n), rng.below(n));
                data.swap(i, j);
            }
            _ => {}
        }
    }
}
