//! safetensors: `u64` LE header length `n`, `n` bytes of JSON, then data.
//!
//! The JSON maps tensor names to `{"dtype", "shape", "data_offsets": [s, e]}`
//! (offsets relative to the first data byte) plus an optional
//! `"__metadata__"` object. The 8-byte length and the JSON are one opaque
//! segment; gaps between tensors and trailing bytes are opaque too.

use std::io::{Read, Seek};

use serde_json::{Map, Value};

use super::{read_at, tensor_bytes, DType, FileKind, FormatError, Layout, TensorInfo};

/// The largest JSON header accepted (the reference implementation uses the
/// same bound).
pub const MAX_HEADER: u64 = 100 << 20;

/// Parses a safetensors file; every structural lie is an error.
///
/// A tensor whose dtype ckvc does not know (a dtype newer than
/// [`DType`]) keeps its byte range but becomes opaque: the file is sound, only
/// its compression is worse.
pub fn parse_safetensors<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    let prefix = read_at(r, len, 0, 8, 8, "safetensors header length")?;
    let n = u64::from_le_bytes(prefix.try_into().expect("read_at returned 8 bytes"));
    if n > MAX_HEADER {
        return Err(FormatError::TooLarge {
            what: "safetensors header",
            size: n,
            limit: MAX_HEADER,
        });
    }
    let json = read_at(r, len, 8, n, MAX_HEADER, "safetensors header")?;
    let data_start = 8 + n;
    let header: Map<String, Value> = serde_json::from_slice(&json).map_err(|e| {
        FormatError::corrupt(8, format!("safetensors header is not a JSON object: {e}"))
    })?;

    let mut tensors = Vec::with_capacity(header.len());
    let mut unknown = Vec::new();
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |reason: &str| FormatError::corrupt(8, format!("tensor {name:?}: {reason}"));
        let entry = entry
            .as_object()
            .ok_or_else(|| bad("entry is not an object"))?;
        let dtype_name = entry
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing or non-string dtype"))?;
        let shape = entry
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing or non-array shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad("shape has a non-integer dimension"))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        let offsets = entry
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("data_offsets is not a pair"))?;
        let (s, e) = match (offsets[0].as_u64(), offsets[1].as_u64()) {
            (Some(s), Some(e)) if s <= e => (s, e),
            _ => return Err(bad("data_offsets are not an increasing pair of integers")),
        };
        let offset = data_start
            .checked_add(s)
            .ok_or_else(|| bad("data offset overflows"))?;
        let byte_len = e - s;
        if offset.saturating_add(byte_len) > len {
            return Err(FormatError::Truncated {
                what: "safetensors tensor data",
                need: offset.saturating_add(byte_len),
                have: len,
            });
        }
        match DType::from_safetensors_name(dtype_name) {
            Some(dtype) => {
                if tensor_bytes(&shape, dtype) != Some(byte_len) {
                    return Err(bad(&format!(
                        "{byte_len} data bytes do not match shape {shape:?} of {dtype_name}"
                    )));
                }
                tensors.push(TensorInfo {
                    name: name.clone(),
                    dtype,
                    shape,
                    offset,
                    len: byte_len,
                });
            }
            None => unknown.push((offset, byte_len, name)),
        }
    }
    check_disjoint(&tensors, &unknown)?;
    Layout::from_tensors(FileKind::Safetensors, len, tensors)
}

/// Tensors of unknown dtype become opaque, but may still not overlap anything.
fn check_disjoint(
    tensors: &[TensorInfo],
    unknown: &[(u64, u64, &String)],
) -> Result<(), FormatError> {
    let mut ranges: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|t| (t.offset, t.len, t.name.as_str()))
        .chain(unknown.iter().map(|&(o, l, n)| (o, l, n.as_str())))
        .filter(|&(_, l, _)| l > 0)
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((o1, l1, n1), (o2, _, n2)) = (w[0], w[1]);
        if o1 + l1 > o2 {
            return Err(FormatError::corrupt(
                o2,
                format!("tensors {n1:?} and {n2:?} overlap"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::format::Segment;

    /// Builds a safetensors file from a raw JSON header and a data section.
    pub(crate) fn build(header: &str, data: &[u8]) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(data);
        f
    }

    fn parse(f: &[u8]) -> Result<Layout, FormatError> {
        parse_safetensors(&mut Cursor::new(f), f.len() as u64)
    }

    #[test]
    fn gaps_and_trailing_bytes_are_opaque() {
        let h = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}"#;
        let f = build(h, &[0u8; 16]);
        let l = parse(&f).unwrap();
        l.validate().unwrap();
        let d = 8 + h.len() as u64;
        let names: Vec<_> = l.tensors().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "z", "b"]);
        assert_eq!(l.segments[0], Segment::Opaque { offset: 0, len: d });
        assert_eq!(
            l.segments[3],
            Segment::Opaque {
                offset: d + 4,
                len: 4
            }
        );
        assert_eq!(
            *l.segments.last().unwrap(),
            Segment::Opaque {
                offset: d + 12,
                len: 4
            }
        );
    }

    #[test]
    fn unknown_dtype_is_opaque_but_checked_for_overlap() {
        let h = r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        let l = parse(&build(h, &[0u8; 4])).unwrap();
        assert_eq!(l.tensors().count(), 1);
        let h = r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 4])),
            Err(FormatError::Corrupt { .. })
        ));
    }

    #[test]
    fn header_length_beyond_file_is_truncated() {
        let mut f = build(r#"{}"#, &[]);
        f[..8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(matches!(
            parse(&f),
            Err(FormatError::Truncated { need: 1008, .. })
        ));
        f[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&f), Err(FormatError::TooLarge { .. })));
        assert!(matches!(parse(&f[..5]), Err(FormatError::Truncated { .. })));
    }

    #[test]
    fn offsets_beyond_file_are_truncated() {
        let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 8])),
            Err(FormatError::Truncated { .. })
        ));
        let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,18446744073709551615]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 8])),
            Err(FormatError::Corrupt { .. } | FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn overlapping_tensors_are_corrupt() {
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 12])),
            Err(FormatError::Corrupt { .. })
        ));
    }

    #[test]
    fn byte_count_not_matching_shape_is_corrupt() {
        let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 8])),
            Err(FormatError::Corrupt { .. })
        ));
        let h = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#;
        assert!(matches!(
            parse(&build(h, &[0u8; 8])),
            Err(FormatError::Corrupt { .. })
        ));
    }

    #[test]
    fn malformed_headers_are_corrupt() {
        for h in [
            "not json",
            "[1,2]",
            r#"{"a":1}"#,
            r#"{"a":{"dtype":"F32","shape":[1]}}"#,
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            r#"{"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}}"#,
        ] {
            assert!(
                matches!(
                    parse(&build(h, &[0u8; 8])),
                    Err(FormatError::Corrupt { .. })
                ),
                "{h}"
            );
        }
    }
}
