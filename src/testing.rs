//! Helpers for tests, examples and fuzz seeds; compiled only for the
//! crate's own tests or with the `testing` feature (which `tests/` and
//! `examples/` get through the crate's dev-dependency on itself). Not part
//! of the library's API.

/// A deterministic generator (xorshift64*) for synthetic benchmark inputs
/// and randomised test schedules: the same seed gives the same bytes
/// everywhere. Not for anything that needs unpredictability.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits. The seed must not be zero.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Fill `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            c.copy_from_slice(&self.next_u64().to_le_bytes()[..c.len()]);
        }
    }
}

/// `g` quantized to `levels` evenly spaced values (step `0.12 / levels`,
/// clamped to the levels around 0): a quantized weight, for the palette
/// frames' tests and `examples/palette_bound.rs`.
pub fn quantize(g: &[f32], levels: u32) -> Vec<f32> {
    let step = 0.12 / levels as f32;
    let half = levels as f32 / 2.0;
    g.iter()
        .map(|&x| (x / step).round().clamp(-half, half - 1.0) * step)
        .collect()
}
