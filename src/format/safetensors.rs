//! safetensors: `u64` LE header length `n`, `n` bytes of JSON, then data.
//!
//! The JSON maps tensor names to `{"dtype", "shape", "data_offsets": [s, e]}`
//! (offsets relative to the first data byte) plus an optional
//! `"__metadata__"` object. The 8-byte length and the JSON are one opaque
//! segment; gaps between tensors and trailing bytes are opaque too.
//!
//! The header is read straight into what the checks need (never into a JSON
//! tree: one held ~25 bytes per byte of a crafted 100 MiB header), within
//! [`ENTRIES_BUDGET`].

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Seek};

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::json::{map_gives, scalars_give, seq_gives, JsonScalar, SkipJson};
use super::{read_at, tensor_bytes, DType, FileKind, FormatError, Layout, TensorInfo};

/// The largest JSON header accepted (the reference implementation uses the
/// same bound).
pub const MAX_HEADER: u64 = 100 << 20;

/// What the header's entries may take in memory as read (names, dtypes,
/// shapes, and [`ENTRY_COST`] each). A header past it keeps every tensor
/// opaque (the file is still stored whole, only not by tensor). An entry
/// takes ~300 bytes as read (~3 bytes a byte of a model's header): a
/// header of up to ~800,000 tensors fits.
pub const ENTRIES_BUDGET: usize = 256 << 20;

/// An entry's cost beside its strings and dimensions: its share of the
/// map's nodes (~200 bytes: key, fields, slack) and the allocator's
/// overhead of its three allocations.
const ENTRY_COST: usize = 256;

/// Parses a safetensors file; every structural lie is an error.
///
/// A tensor whose dtype ckvc does not know (a dtype newer than
/// [`DType`]) keeps its byte range but becomes opaque: the file is sound, only
/// its compression is worse.
pub fn parse_safetensors<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    parse_within(r, len, ENTRIES_BUDGET)
}

/// [`parse_safetensors`] with `budget` bytes for the header's entries.
fn parse_within<R: Read + Seek>(r: &mut R, len: u64, budget: usize) -> Result<Layout, FormatError> {
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
    let mut header = Header {
        budget,
        ..Header::default()
    };
    let mut de = serde_json::Deserializer::from_slice(&json);
    let read = HeaderSeed(&mut header)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    drop(json);
    if header.over_budget.get() {
        return Layout::from_tensors(FileKind::Safetensors, len, Vec::new());
    }
    read.map_err(|e| {
        FormatError::corrupt(8, format!("safetensors header is not a JSON object: {e}"))
    })?;

    let mut tensors = Vec::with_capacity(header.entries.len());
    let mut unknown = Vec::new();
    for (name, entry) in header.entries {
        let bad = |reason: &str| FormatError::corrupt(8, format!("tensor {name:?}: {reason}"));
        if !entry.is_object {
            return Err(bad("entry is not an object"));
        }
        let dtype_name = match entry.dtype {
            Some(Some(d)) => d,
            _ => return Err(bad("missing or non-string dtype")),
        };
        let shape = match entry.shape {
            Some(Some(Ok(shape))) => shape,
            Some(Some(Err(()))) => return Err(bad("shape has a non-integer dimension")),
            _ => return Err(bad("missing or non-array shape")),
        };
        let (s, e) = match entry.offsets {
            Some(Some((2, s, e))) => match (s, e) {
                (Some(s), Some(e)) if s <= e => (s, e),
                _ => return Err(bad("data_offsets are not an increasing pair of integers")),
            },
            _ => return Err(bad("data_offsets is not a pair")),
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
        match DType::from_safetensors_name(&dtype_name) {
            Some(dtype) => {
                if tensor_bytes(&shape, dtype) != Some(byte_len) {
                    return Err(bad(&format!(
                        "{byte_len} data bytes do not match shape {shape:?} of {dtype_name}"
                    )));
                }
                tensors.push(TensorInfo {
                    name,
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

/// The header as read: each tensor name's last entry (a name repeated in
/// the JSON object: the last one counts, as in a parsed JSON tree), in
/// name order.
#[derive(Default)]
struct Header {
    entries: BTreeMap<String, Entry>,
    budget: usize,
    /// Bytes the entries take, counted as they are read.
    built: usize,
    over_budget: Cell<bool>,
}

/// One entry as read. `None`: the key is missing; `Some(None)`: its
/// value is not of the type the key needs. Keys repeated: the last counts.
#[derive(Default)]
struct Entry {
    is_object: bool,
    dtype: Option<Option<String>>,
    /// The dimensions, or `Err` when one is not a whole number of 0 or more.
    shape: Option<Option<Result<Vec<u64>, ()>>>,
    offsets: Option<Option<Offsets>>,
}

/// `data_offsets` as read: the array's length and its first two items as
/// whole numbers.
type Offsets = (usize, Option<u64>, Option<u64>);

impl Entry {
    fn cost(&self) -> usize {
        let dtype = match &self.dtype {
            Some(Some(d)) => d.len(),
            _ => 0,
        };
        let shape = match &self.shape {
            Some(Some(Ok(s))) => 8 * s.capacity(),
            _ => 0,
        };
        ENTRY_COST + dtype + shape
    }
}

struct HeaderSeed<'a>(&'a mut Header);

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        // As serde_json::Map says it (the whole tree's message).
        f.write_str("a map")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        let h = self.0;
        while let Some(name) = a.next_key::<String>()? {
            if name == "__metadata__" {
                a.next_value::<SkipJson>()?;
                continue;
            }
            let e = a.next_value_seed(EntrySeed {
                dims_left: (h.budget - h.built) / 8,
                over_budget: &h.over_budget,
            })?;
            h.built += name.len() + e.cost();
            if h.built > h.budget {
                h.over_budget.set(true);
            }
            if h.over_budget.get() {
                return Err(de::Error::custom("entries over their memory budget"));
            }
            h.entries.insert(name, e);
        }
        Ok(())
    }
}

/// An entry; a shape of more than `dims_left` dimensions puts the header
/// over its budget.
struct EntrySeed<'a> {
    dims_left: usize,
    over_budget: &'a Cell<bool>,
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_> {
    type Value = Entry;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Entry, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed<'_> {
    type Value = Entry;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Entry, A::Error> {
        let mut e = Entry {
            is_object: true,
            ..Entry::default()
        };
        while let Some(k) = a.next_key::<KeyName>()? {
            match k {
                KeyName::Dtype => {
                    e.dtype = Some(match a.next_value()? {
                        JsonScalar::Str(d) => Some(d),
                        _ => None,
                    })
                }
                KeyName::Shape => {
                    e.shape = Some(a.next_value_seed(Dims {
                        left: self.dims_left,
                        over_budget: self.over_budget,
                    })?)
                }
                KeyName::Offsets => e.offsets = Some(a.next_value::<Pair>()?.0),
                KeyName::Other => {
                    a.next_value::<SkipJson>()?;
                }
            }
        }
        Ok(e)
    }
    scalars_give!(Entry::default());
    seq_gives!(Entry::default());
}

/// The keys of an entry that the checks read.
enum KeyName {
    Dtype,
    Shape,
    Offsets,
    Other,
}

impl<'de> de::Deserialize<'de> for KeyName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = KeyName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, k: &str) -> Result<KeyName, E> {
                Ok(match k {
                    "dtype" => KeyName::Dtype,
                    "shape" => KeyName::Shape,
                    "data_offsets" => KeyName::Offsets,
                    _ => KeyName::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// `shape`: an array's dimensions (`Err` when one is not a whole number),
/// or `None` for any other value.
struct Dims<'a> {
    left: usize,
    over_budget: &'a Cell<bool>,
}

impl<'de> DeserializeSeed<'de> for Dims<'_> {
    type Value = Option<Result<Vec<u64>, ()>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Dims<'_> {
    type Value = Option<Result<Vec<u64>, ()>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        let mut dims = Ok(Vec::new());
        while let Some(d) = a.next_element::<JsonScalar>()? {
            match (&mut dims, d.as_u64()) {
                (Ok(v), Some(_)) if v.len() >= self.left => {
                    self.over_budget.set(true);
                    return Err(de::Error::custom("a shape over the header's memory budget"));
                }
                (Ok(v), Some(d)) => v.push(d),
                _ => dims = Err(()),
            }
        }
        Ok(Some(dims))
    }
    scalars_give!(None);
    map_gives!(None);
}

/// `data_offsets`: an array's length and its first two items as whole
/// numbers, or `None` for any other value.
struct Pair(Option<Offsets>);

impl<'de> de::Deserialize<'de> for Pair {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Pair;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Pair, A::Error> {
                let (mut n, mut first, mut second) = (0usize, None, None);
                while let Some(d) = a.next_element::<JsonScalar>()? {
                    match n {
                        0 => first = d.as_u64(),
                        1 => second = d.as_u64(),
                        _ => {}
                    }
                    n += 1;
                }
                Ok(Pair(Some((n, first, second))))
            }
            scalars_give!(Pair(None));
            map_gives!(Pair(None));
        }
        d.deserialize_any(V)
    }
}

/// Tensors of unknown dtype become opaque, but may still not overlap anything.
fn check_disjoint(
    tensors: &[TensorInfo],
    unknown: &[(u64, u64, String)],
) -> Result<(), FormatError> {
    let mut ranges: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|t| (t.offset, t.len, t.name.as_str()))
        .chain(unknown.iter().map(|(o, l, n)| (*o, *l, n.as_str())))
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

    /// What a header gives: the tensors' names in layout order, or the
    /// error's text.
    fn outcome(h: &str, data: usize) -> Result<Vec<String>, String> {
        parse(&build(h, &vec![0u8; data]))
            .map(|l| l.tensors().map(|t| t.name.clone()).collect())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn every_entry_shape_gives_the_check_it_always_gave() {
        let e = |name: &str, body: &str| format!(r#"{{"{name}": {body}}}"#);
        let ok = r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
        let cases: Vec<(String, Result<Vec<&str>, &str>)> = vec![
            // A name repeated: the last entry counts; keys repeated in an
            // entry: the last counts; other keys and __metadata__ skipped.
            (
                r#"{"a":{"dtype":"F32","shape":[9],"data_offsets":[0,36]},"__metadata__":{"x":[1,{"y":null}]},"a":{"dtype":"BF16","dtype":"F32","shape":[1,2],"x":[[]],"data_offsets":[0,8]}}"#.into(),
                Ok(vec!["a"]),
            ),
            (r#"{"__metadata__":1,"__metadata__":"s"}"#.into(), Ok(vec![])),
            (e("a", "[1]"), Err("entry is not an object")),
            (e("a", "null"), Err("entry is not an object")),
            (e("a", r#""x""#), Err("entry is not an object")),
            (e("a", r#"{"dtype":7,"shape":[2],"data_offsets":[0,8]}"#), Err("missing or non-string dtype")),
            (e("a", r#"{"dtype":"F32","dtype":[],"shape":[2],"data_offsets":[0,8]}"#), Err("missing or non-string dtype")),
            (e("a", r#"{"shape":[2],"data_offsets":[0,8]}"#), Err("missing or non-string dtype")),
            (e("a", r#"{"dtype":"F32","shape":{"0":2},"data_offsets":[0,8]}"#), Err("missing or non-array shape")),
            (e("a", r#"{"dtype":"F32","data_offsets":[0,8]}"#), Err("missing or non-array shape")),
            (e("a", r#"{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}"#), Err("non-integer dimension")),
            (e("a", r#"{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}"#), Err("non-integer dimension")),
            (e("a", r#"{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}"#), Err("non-integer dimension")),
            (e("a", r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}"#), Err("data_offsets is not a pair")),
            (e("a", r#"{"dtype":"F32","shape":[2],"data_offsets":"0,8"}"#), Err("data_offsets is not a pair")),
            (e("a", r#"{"dtype":"F32","shape":[2]}"#), Err("data_offsets is not a pair")),
            (e("a", r#"{"dtype":"F32","shape":[2],"data_offsets":[8,0]}"#), Err("increasing pair")),
            (e("a", r#"{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}"#), Err("increasing pair")),
            (e("a", r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}"#), Err("increasing pair")),
            // Errors come in name order, whatever the file's order.
            (format!(r#"{{"b": 1, "a": {ok}, "0": []}}"#), Err("tensor \"0\": entry is not an object")),
            ("[]".into(), Err("not a JSON object")),
            ("{\"a\": ".into(), Err("not a JSON object")),
            (format!("{} x", e("a", ok)), Err("not a JSON object")),
        ];
        for (h, want) in cases {
            match (outcome(&h, 8), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{h}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{h}: {got}"),
                (got, want) => panic!("{h}: {got:?}, want {want:?}"),
            }
        }
    }

    /// Values the reader keeps nothing of (`__metadata__`, other keys of
    /// an entry, the insides of a wrong-typed field) were skipped
    /// unchecked: invalid UTF-8, a lone surrogate escape, a number out of
    /// range or nesting past 128 levels there, which the whole tree
    /// rejected, gave tensors. Now the old reader's error and message.
    #[test]
    fn a_header_not_json_inside_a_skipped_value_is_corrupt_as_before() {
        let ok = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
        let mut cases: Vec<Vec<u8>> = vec![
            format!(r#"{{"__metadata__":{{"format":"\ud800"}},{ok}}}"#).into_bytes(),
            format!(r#"{{"__metadata__":[1e400],{ok}}}"#).into_bytes(),
            format!(
                r#"{{"__metadata__":{}{},{ok}}}"#,
                "[".repeat(200),
                "]".repeat(200)
            )
            .into_bytes(),
            br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[-1e999]}}"#.to_vec(),
            br#"{"a":{"dtype":["\udc00"],"shape":[2],"data_offsets":[0,8]}}"#.to_vec(),
            br#"{"a":{"dtype":"F32","shape":{"\ud800":1},"data_offsets":[0,8]}}"#.to_vec(),
            br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":{"x":1e999}}}"#.to_vec(),
            br#"{"a":[{"x":1e999}]}"#.to_vec(),
        ];
        let mut bad_utf8 = format!("{{\"__metadata__\":{{\"format\":\"x\"}},{ok}}}").into_bytes();
        let at = bad_utf8.iter().position(|&b| b == b'x').unwrap();
        bad_utf8[at] = 0xff;
        cases.push(bad_utf8);
        for h in cases {
            let whole = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&h);
            let Err(want) = whole else {
                panic!("{}: parses", String::from_utf8_lossy(&h))
            };
            let mut f = (h.len() as u64).to_le_bytes().to_vec();
            f.extend_from_slice(&h);
            f.extend_from_slice(&[0u8; 8]);
            let got = parse(&f)
                .map(|l| l.tensors().count())
                .map_err(|e| e.to_string());
            let want = format!("safetensors header is not a JSON object: {want}");
            assert!(
                matches!(&got, Err(g) if g.contains(&want)),
                "{}: {got:?}, want {want}",
                String::from_utf8_lossy(&h)
            );
        }
    }

    /// A header that is JSON but not an object said "expected a JSON
    /// object" where the whole tree said "expected a map".
    #[test]
    fn a_header_not_an_object_gives_the_old_readers_message() {
        for h in ["[]", "7", "null", "\"a\""] {
            let want =
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(h).unwrap_err();
            let want = format!("safetensors header is not a JSON object: {want}");
            let got = parse(&build(h, &[])).map(|_| ()).map_err(|e| e.to_string());
            assert!(
                matches!(&got, Err(g) if g.contains(&want)),
                "{h}: {got:?}, want {want}"
            );
        }
    }

    /// A header whose entries would take more than the budget (a crafted
    /// 100 MiB header of 1.8 million entries took 2.5 GB as a JSON tree):
    /// every tensor opaque, the file still one layout of its bytes.
    #[test]
    fn a_header_over_its_entries_budget_keeps_every_tensor_opaque() {
        let entry = |i: usize| {
            format!(
                r#""t{i:03}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}"#,
                4 * i,
                4 * i + 4
            )
        };
        let h = format!("{{{}}}", (0..100).map(entry).collect::<Vec<_>>().join(","));
        let f = build(&h, &[0u8; 400]);
        // Each entry: 256 + its name (4) + dtype (3) + a shape's capacity (4 x 8).
        let whole = parse_within(&mut Cursor::new(&f), f.len() as u64, 100 * 300).unwrap();
        assert_eq!(whole.tensors().count(), 100);
        let opaque = parse_within(&mut Cursor::new(&f), f.len() as u64, 50 * 300).unwrap();
        assert_eq!(
            (opaque.tensors().count(), opaque.kind),
            (0, FileKind::Safetensors)
        );
        opaque.validate().unwrap();
        assert_eq!(opaque.len, f.len() as u64);
        // One shape of more dimensions than the budget holds.
        let h = format!(
            r#"{{"a":{{"dtype":"F32","shape":[{}1],"data_offsets":[0,4]}}}}"#,
            "1,".repeat(5000)
        );
        let f = build(&h, &[0u8; 4]);
        assert_eq!(
            parse_within(&mut Cursor::new(&f), f.len() as u64, 40_000)
                .unwrap()
                .tensors()
                .count(),
            0
        );
        assert_eq!(
            parse_within(&mut Cursor::new(&f), f.len() as u64, 80_000)
                .unwrap()
                .tensors()
                .count(),
            1
        );
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
