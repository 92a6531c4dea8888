//! Element types the codec knows, with their stable on-disk codes.
//!
//! Owns: the dtype code byte of a frame and each type's element width and
//! float-ness; the names checkpoint formats use for them belong to
//! `format`.

use std::fmt;

/// The element type of a tensor chunk.
///
/// The codec only needs the element width and whether the bytes are an IEEE
/// float (and so have a sign bit to rotate); the other variants exist so the
/// format layer can carry the exact type through a round trip. The `code` of
/// each variant is part of the frame format and never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::I64,
        DType::U64,
        DType::F64,
    ];

    /// Bytes per element: 1, 2, 4 or 8.
    pub const fn width(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// True for IEEE-style floats with a sign bit in the top bit.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F8E4M3 | DType::F8E5M2 | DType::F16 | DType::BF16 | DType::F32 | DType::F64
        )
    }

    /// Stable one-byte code used in frames and manifests.
    pub const fn code(self) -> u8 {
        match self {
            DType::Bool => 0,
            DType::U8 => 1,
            DType::I8 => 2,
            DType::F8E4M3 => 3,
            DType::F8E5M2 => 4,
            DType::I16 => 5,
            DType::U16 => 6,
            DType::F16 => 7,
            DType::BF16 => 8,
            DType::I32 => 9,
            DType::U32 => 10,
            DType::F32 => 11,
            DType::I64 => 12,
            DType::U64 => 13,
            DType::F64 => 14,
        }
    }

    /// Inverse of [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// The name safetensors uses in its header (`"BF16"`, `"F32"`, ...).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::I64 => "I64",
            DType::U64 => "U64",
            DType::F64 => "F64",
        }
    }

    /// Inverse of [`DType::safetensors_name`].
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.safetensors_name() == name)
    }

    /// Short lower-case name for tables and JSON (`"bf16"`, `"fp32"`, ...).
    pub const fn short_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::F16 => "fp16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::F32 => "fp32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::F64 => "fp64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(d.code() as usize, i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(*d));
        }
        assert_eq!(DType::from_code(15), None);
        assert_eq!(DType::from_safetensors_name("F31"), None);
    }
}
