//! numpy `.npy`: magic `\x93NUMPY`, version byte pair, header length (`u16`
//! LE in version 1, `u32` LE in versions 2 and 3), a Python dict literal
//! (`{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`), then the
//! raw array.
//!
//! The header is one opaque segment and the array one tensor segment named
//! [`NPY_TENSOR_NAME`]. Arrays ckvc cannot describe as a little-endian
//! [`DType`] (big-endian, object, structured, datetime...) leave the whole
//! file opaque; that is not an error.

use std::io::{Read, Seek};

use super::{read_at, tensor_bytes, DType, FileKind, FormatError, Layout, TensorInfo};

/// The name of the single tensor of an `.npy` file.
pub const NPY_TENSOR_NAME: &str = "array";

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// numpy itself refuses headers above 10 000 bytes by default; allow more
/// for long structured descriptions but stay bounded.
const MAX_HEADER: u64 = 1 << 20;

/// Nesting depth of the header literal (structured dtypes nest lists of
/// tuples); deeper is corrupt rather than a stack overflow.
const MAX_DEPTH: usize = 32;

/// Parses an `.npy` file.
///
/// A Fortran-order array is described by its reversed shape, which is what
/// its bytes are in C order.
pub fn parse_npy<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    let pre = read_at(r, len, 0, 8, 8, "npy preamble")?;
    if &pre[..6] != MAGIC {
        return Err(FormatError::corrupt(0, "not an npy file (bad magic)"));
    }
    let (major, minor) = (pre[6], pre[7]);
    let (len_bytes, header_start) = match major {
        1 => (2, 10),
        2 | 3 => (4, 12),
        _ => {
            return Err(FormatError::corrupt(
                6,
                format!("unsupported npy version {major}.{minor}"),
            ))
        }
    };
    let hl = read_at(r, len, 8, len_bytes, 4, "npy header length")?;
    let header_len = hl
        .iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    let header = read_at(r, len, header_start, header_len, MAX_HEADER, "npy header")?;
    let data_start = header_start + header_len;
    // Versions 1 and 2 are latin-1; every byte of a well-formed header is
    // ASCII, so anything else is as good as a parse error.
    let text = std::str::from_utf8(&header)
        .map_err(|_| FormatError::corrupt(header_start, "npy header is not text"))?;
    let bad = |reason: &str| FormatError::corrupt(header_start, format!("npy header: {reason}"));
    let dict = match Parser::new(text).literal(0) {
        Some(Lit::Dict(d)) => d,
        _ => return Err(bad("not a dict literal")),
    };
    let field = |key: &str| dict.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let fortran = match field("fortran_order") {
        Some(Lit::Bool(b)) => *b,
        _ => return Err(bad("missing fortran_order")),
    };
    let mut shape = match field("shape") {
        Some(Lit::Seq(items)) => items
            .iter()
            .map(|d| match d {
                Lit::Int(n) => Some(*n),
                _ => None,
            })
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| bad("shape is not a tuple of integers"))?,
        _ => return Err(bad("missing shape")),
    };
    let dtype = match field("descr") {
        Some(Lit::Str(d)) => descr_dtype(d),
        // Structured arrays describe their fields in a list.
        Some(Lit::Seq(_)) => None,
        _ => return Err(bad("missing descr")),
    };
    let Some(dtype) = dtype else {
        return Ok(Layout::opaque(len));
    };
    if fortran {
        shape.reverse();
    }
    let need = tensor_bytes(&shape, dtype).ok_or_else(|| bad("shape overflows"))?;
    let have = len.saturating_sub(data_start);
    if have < need {
        return Err(FormatError::Truncated {
            what: "npy array data",
            need: data_start.saturating_add(need),
            have: len,
        });
    }
    if have > need {
        return Err(FormatError::corrupt(
            data_start + need,
            format!("{} bytes after the array", have - need),
        ));
    }
    let tensor = TensorInfo {
        name: NPY_TENSOR_NAME.to_string(),
        dtype,
        shape,
        offset: data_start,
        len: need,
    };
    Layout::from_tensors(FileKind::Npy, len, vec![tensor])
}

/// Maps a numpy type string to a little-endian dtype; `None` for anything
/// that is not a plain little-endian number (so the file stays opaque).
fn descr_dtype(descr: &str) -> Option<DType> {
    let (order, code) = descr.split_at_checked(1)?;
    let dtype = match code {
        "b1" => DType::Bool,
        "u1" => DType::U8,
        "i1" => DType::I8,
        "i2" => DType::I16,
        "u2" => DType::U16,
        "f2" => DType::F16,
        "i4" => DType::I32,
        "u4" => DType::U32,
        "f4" => DType::F32,
        "i8" => DType::I64,
        "u8" => DType::U64,
        "f8" => DType::F64,
        _ => return None,
    };
    // Byte order is meaningless for one-byte types; numpy writes `|`.
    match order {
        "<" => Some(dtype),
        "|" | ">" | "=" if dtype.width() == 1 => Some(dtype),
        _ => None,
    }
}

/// The subset of Python literals an npy header uses.
#[derive(Debug, PartialEq)]
enum Lit {
    Str(String),
    Int(u64),
    Bool(bool),
    None,
    /// A tuple or a list.
    Seq(Vec<Lit>),
    Dict(Vec<(String, Lit)>),
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(s: &'a str) -> Self {
        Parser {
            s: s.as_bytes(),
            pos: 0,
        }
    }

    fn skip_ws(&mut self) {
        while self
            .s
            .get(self.pos)
            .is_some_and(|b| b.is_ascii_whitespace())
        {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Items up to `close`, separated by commas, trailing comma allowed.
    fn seq(&mut self, close: u8, depth: usize) -> Option<Vec<Lit>> {
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(items);
            }
            items.push(self.literal(depth + 1)?);
            if !self.eat(b',') {
                return self.eat(close).then_some(items);
            }
        }
    }

    fn literal(&mut self, depth: usize) -> Option<Lit> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'{' => {
                self.pos += 1;
                let mut entries = Vec::new();
                loop {
                    if self.eat(b'}') {
                        return Some(Lit::Dict(entries));
                    }
                    let Lit::Str(k) = self.literal(depth + 1)? else {
                        return None;
                    };
                    if !self.eat(b':') {
                        return None;
                    }
                    entries.push((k, self.literal(depth + 1)?));
                    if !self.eat(b',') {
                        return self.eat(b'}').then_some(Lit::Dict(entries));
                    }
                }
            }
            b'(' => {
                self.pos += 1;
                self.seq(b')', depth).map(Lit::Seq)
            }
            b'[' => {
                self.pos += 1;
                self.seq(b']', depth).map(Lit::Seq)
            }
            q @ (b'\'' | b'"') => {
                self.pos += 1;
                let mut out = Vec::new();
                loop {
                    let b = *self.s.get(self.pos)?;
                    self.pos += 1;
                    match b {
                        b'\\' => {
                            out.push(*self.s.get(self.pos)?);
                            self.pos += 1;
                        }
                        _ if b == q => return String::from_utf8(out).ok().map(Lit::Str),
                        _ => out.push(b),
                    }
                }
            }
            b'0'..=b'9' => {
                let start = self.pos;
                while self.s.get(self.pos).is_some_and(u8::is_ascii_digit) {
                    self.pos += 1;
                }
                // Python 2 era numpy wrote `3L`.
                if self.s.get(self.pos) == Some(&b'L') {
                    self.pos += 1;
                }
                std::str::from_utf8(&self.s[start..self.pos])
                    .ok()?
                    .trim_end_matches('L')
                    .parse()
                    .ok()
                    .map(Lit::Int)
            }
            _ => {
                for (word, lit) in [
                    ("True", Lit::Bool(true)),
                    ("False", Lit::Bool(false)),
                    ("None", Lit::None),
                ] {
                    if self.s[self.pos..].starts_with(word.as_bytes()) {
                        self.pos += word.len();
                        return Some(lit);
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::format::Segment;

    /// A version-1 npy file with the given header dict and data.
    pub(crate) fn build(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut h = dict.to_string();
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&[1, 0]);
        f.extend_from_slice(&(h.len() as u16).to_le_bytes());
        f.extend_from_slice(h.as_bytes());
        f.extend_from_slice(data);
        f
    }

    fn parse(f: &[u8]) -> Result<Layout, FormatError> {
        parse_npy(&mut Cursor::new(f), f.len() as u64)
    }

    #[test]
    fn little_endian_array_is_a_tensor() {
        let f = build(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &[0u8; 24],
        );
        let d = f.len() as u64 - 24;
        assert_eq!(d % 64, 0);
        let l = parse(&f).unwrap();
        l.validate().unwrap();
        assert_eq!(l.kind, FileKind::Npy);
        assert_eq!(l.segments[0], Segment::Opaque { offset: 0, len: d });
        let t = l.tensors().next().unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice(), t.offset, t.len),
            (DType::F32, &[2, 3][..], d, 24)
        );
    }

    #[test]
    fn scalars_bytes_and_fortran_order() {
        let l = parse(&build(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (), }",
            &[7],
        ))
        .unwrap();
        assert_eq!(l.tensors().next().unwrap().shape, Vec::<u64>::new());
        let l = parse(&build(
            "{'descr': '<i2', 'fortran_order': True, 'shape': (2, 5,), }",
            &[0; 20],
        ))
        .unwrap();
        assert_eq!(l.tensors().next().unwrap().shape, vec![5, 2]);
        let l = parse(&build(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (0,), }",
            &[],
        ))
        .unwrap();
        assert_eq!(l.segments.len(), 2);
        l.validate().unwrap();
    }

    #[test]
    fn version_2_header() {
        let h = "{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }\n";
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&[2, 0]);
        f.extend_from_slice(&(h.len() as u32).to_le_bytes());
        f.extend_from_slice(h.as_bytes());
        f.extend_from_slice(&[1, 0, 2, 0, 3, 0]);
        let l = parse(&f).unwrap();
        assert_eq!(l.tensors().next().unwrap().offset, 12 + h.len() as u64);
    }

    #[test]
    fn big_endian_object_and_structured_are_opaque() {
        for d in [
            "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }",
            "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
            "{'descr': [('a', '<f4'), ('b', '<i4', (2,))], 'fortran_order': False, 'shape': (1,), }",
            "{'descr': '<V2', 'fortran_order': False, 'shape': (4,), }",
        ] {
            let l = parse(&build(d, &[0u8; 8])).unwrap();
            assert_eq!(l, Layout::opaque(l.len), "{d}");
        }
    }

    #[test]
    fn truncated_npy_is_an_error() {
        let f = build(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &[0u8; 24],
        );
        let end = f.len() as u64;
        assert!(
            matches!(parse(&f[..f.len() - 8]), Err(FormatError::Truncated { need, .. }) if need == end)
        );
        assert!(matches!(
            parse(&f[..40]),
            Err(FormatError::Truncated {
                what: "npy header",
                ..
            })
        ));
        assert!(matches!(parse(&f[..7]), Err(FormatError::Truncated { .. })));
        let mut long = f.clone();
        long.push(0);
        assert!(matches!(parse(&long), Err(FormatError::Corrupt { offset, .. }) if offset == end));
    }

    #[test]
    fn malformed_headers_are_corrupt() {
        for d in [
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }",
            "{'descr': '<f4', 'shape': (2,), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, }",
            "not a dict",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }",
        ] {
            assert!(
                matches!(
                    parse(&build(d, &[0u8; 8])),
                    Err(FormatError::Corrupt { .. })
                ),
                "{d}"
            );
        }
        let deep = format!("{{'descr': {}1{}}}", "(".repeat(100), ")".repeat(100));
        assert!(matches!(
            parse(&build(&deep, &[])),
            Err(FormatError::Corrupt { .. })
        ));
        let mut f = build(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
            &[0u8; 8],
        );
        f[6] = 9;
        assert!(matches!(
            parse(&f),
            Err(FormatError::Corrupt { offset: 6, .. })
        ));
        f[0] = b'x';
        assert!(matches!(
            parse(&f),
            Err(FormatError::Corrupt { offset: 0, .. })
        ));
    }
}
