//! 32-byte content ids: newtypes over `[u8; 32]`, printed as lowercase hex.
//!
//! The store treats ids as opaque key bytes; what an id is the hash *of* is
//! decided by the repository layer (`ChunkId = blake3(raw chunk bytes)`, see
//! `../shared/DESIGN.md`). Distinct types keep a commit id from being used
//! where a chunk id is expected; they share one implementation.

use std::fmt;
use std::str::FromStr;

/// Why a hex string is not a 32-byte id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseIdError {
    /// An id is exactly 64 hex digits.
    #[error("an id has 64 hex digits, found {found} characters")]
    Length { found: usize },
    /// The character at `index` is not a hex digit.
    #[error("character {index} is not a hex digit")]
    Digit { index: usize },
}

/// Writes `bytes` as lowercase hex into `out`.
pub(crate) fn hex_into(bytes: &[u8], out: &mut String) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
}

/// Lowercase hex of arbitrary bytes (used for keys in error values).
pub fn to_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    hex_into(bytes, &mut s);
    s
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn parse_hex32(s: &str) -> Result<[u8; 32], ParseIdError> {
    let s = s.as_bytes();
    if s.len() != 64 {
        return Err(ParseIdError::Length { found: s.len() });
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = nibble(s[2 * i]).ok_or(ParseIdError::Digit { index: 2 * i })?;
        let lo = nibble(s[2 * i + 1]).ok_or(ParseIdError::Digit { index: 2 * i + 1 })?;
        *o = hi << 4 | lo;
    }
    Ok(out)
}

macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            /// Length of the id in bytes (and as a store key).
            pub const LEN: usize = 32;

            pub const fn from_bytes(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }

            pub const fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// The id from exactly 32 bytes of a key or record, `None` for any
            /// other length.
            pub fn from_slice(bytes: &[u8]) -> Option<Self> {
                <[u8; 32]>::try_from(bytes).ok().map(Self)
            }

            /// blake3 of `data`.
            pub fn digest(data: &[u8]) -> Self {
                Self(*blake3::hash(data).as_bytes())
            }

            /// The first `n` hex digits (at most 64), for display.
            pub fn short(&self, n: usize) -> String {
                let mut s = self.to_string();
                s.truncate(n.min(64));
                s
            }
        }

        impl AsRef<[u8]> for $name {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }

        impl From<[u8; 32]> for $name {
            fn from(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut s = String::with_capacity(64);
                hex_into(&self.0, &mut s);
                f.write_str(&s)
            }
        }

        /// As its 64 lowercase hex digits (in `--json` output).
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self)
            }
        }

        impl FromStr for $name {
            type Err = ParseIdError;
            fn from_str(s: &str) -> Result<Self, ParseIdError> {
                parse_hex32(s).map(Self)
            }
        }
    };
}

hash_newtype!(
    /// Any 32-byte hash, when no more specific id type applies.
    Hash32
);
hash_newtype!(
    /// The id of a chunk: blake3 of its raw (decoded) bytes.
    ChunkId
);
hash_newtype!(
    /// The id of a stored object (file manifest, tree, commit).
    ObjectId
);
hash_newtype!(
    /// The id of a commit.
    CommitId
);

impl From<CommitId> for ObjectId {
    fn from(id: CommitId) -> Self {
        Self(id.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        let id = ChunkId::digest(b"abc");
        let s = id.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s.parse::<ChunkId>(), Ok(id));
        assert_eq!(s.to_uppercase().parse::<ChunkId>(), Ok(id));
        assert_eq!(
            "abc".parse::<ChunkId>(),
            Err(ParseIdError::Length { found: 3 })
        );
        let mut bad = s.clone();
        bad.replace_range(10..11, "g");
        assert_eq!(
            bad.parse::<ChunkId>(),
            Err(ParseIdError::Digit { index: 10 })
        );
        // multi-byte UTF-8 must not panic
        let odd = "é".repeat(32);
        assert!(odd.parse::<CommitId>().is_err());
        assert_eq!(id.short(8), s[..8]);
        assert_eq!(format!("{id:?}"), format!("ChunkId({s})"));
        assert_eq!(ChunkId::from_slice(&[1; 31]), None);
        assert_eq!(ChunkId::from_slice(id.as_bytes()), Some(id));
    }

    #[test]
    fn known_answer_blake3_empty() {
        assert_eq!(
            Hash32::digest(b"").to_string(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }
}
