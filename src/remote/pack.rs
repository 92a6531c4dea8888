//! Packs: many chunk records and objects in one immutable file named by
//! the blake3 of its bytes, and an index file listing what it holds
//! (`docs/format/remote.md`). Decoders check every length before using it
//! and never trust a count to size an allocation.

use crate::repo::ObjectKind;
use crate::store::Hash32;

use super::RemoteError;

/// Pack and index format version written and read by this build.
pub const PACK_VERSION: u8 = 1;
const PACK_MAGIC: &[u8; 8] = b"CKVCPACK";
const IDX_MAGIC: &[u8; 8] = b"CKVCIDX\0";
/// The bytes before a pack's first entry.
pub const PACK_HEADER: usize = 16;
/// The bytes before each entry's bytes: kind, id, length.
pub const ENTRY_HEADER: usize = 1 + 32 + 8;
const IDX_ENTRY: usize = 1 + 32 + 8 + 8;
/// No pack a reader accepts is larger (it is read into memory to verify).
pub const MAX_PACK_BYTES: u64 = 2 << 30;
/// The largest index a reader reads (49 bytes an entry: over a million).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// The most raw bytes a chunk record may declare: a commit cuts chunks of
/// the repository's `chunk_bytes` (4 MiB by default), never more than this.
pub const MAX_CHUNK_RAW: u64 = 64 << 20;

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Kind {
    /// A chunk record (`docs/format/objects.md`); id = blake3 of the raw chunk.
    Chunk = b'K',
    /// A file manifest; id = blake3 of the encoding, as are the next two.
    Manifest = b'F',
    Tree = b'T',
    Commit = b'C',
}

impl Kind {
    pub fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            b'K' => Kind::Chunk,
            b'F' => Kind::Manifest,
            b'T' => Kind::Tree,
            b'C' => Kind::Commit,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::Chunk => "chunk",
            Kind::Manifest => "manifest",
            Kind::Tree => "tree",
            Kind::Commit => "commit",
        }
    }
}

impl From<Kind> for ObjectKind {
    fn from(k: Kind) -> ObjectKind {
        match k {
            Kind::Chunk => ObjectKind::Chunk,
            Kind::Manifest => ObjectKind::Manifest,
            Kind::Tree => ObjectKind::Tree,
            Kind::Commit => ObjectKind::Commit,
        }
    }
}

/// One entry of a pack: where its bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    pub id: [u8; 32],
    /// Offset of the entry's bytes in the pack (after its entry header).
    pub offset: u64,
    pub len: u64,
}

/// A pack under construction.
#[derive(Debug, Default)]
pub struct PackWriter {
    bytes: Vec<u8>,
    entries: Vec<Entry>,
}

impl PackWriter {
    pub fn new() -> Self {
        let mut bytes = Vec::with_capacity(PACK_HEADER);
        bytes.extend_from_slice(PACK_MAGIC);
        bytes.push(PACK_VERSION);
        bytes.extend_from_slice(&[0, 0, 0]);
        bytes.extend_from_slice(&0u32.to_le_bytes());
        PackWriter {
            bytes,
            entries: Vec::new(),
        }
    }

    pub fn add(&mut self, kind: Kind, id: [u8; 32], data: &[u8]) {
        self.bytes.push(kind as u8);
        self.bytes.extend_from_slice(&id);
        self.bytes
            .extend_from_slice(&(data.len() as u64).to_le_bytes());
        self.entries.push(Entry {
            kind,
            id,
            offset: self.bytes.len() as u64,
            len: data.len() as u64,
        });
        self.bytes.extend_from_slice(data);
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn count(&self) -> usize {
        self.entries.len()
    }

    /// The pack's bytes, its name (blake3 of the bytes) and its index file.
    pub fn finish(self) -> (Vec<u8>, Hash32, Vec<u8>) {
        self.finish_unlike(|_| false)
    }

    /// Like [`PackWriter::finish`], but the pack is never named as one
    /// `taken` refuses (a pack a remote gc is about to delete: re-sending
    /// its very bytes under its name would be deleted with it): while it
    /// would be, its smallest entry is repeated at its end (readers accept
    /// an entry twice).
    pub fn finish_unlike(mut self, taken: impl Fn(&Hash32) -> bool) -> (Vec<u8>, Hash32, Vec<u8>) {
        loop {
            let n = self.entries.len() as u32;
            self.bytes[12..16].copy_from_slice(&n.to_le_bytes());
            let name = Hash32::digest(&self.bytes);
            let smallest = self.entries.iter().min_by_key(|e| e.len).copied();
            match smallest {
                Some(e) if taken(&name) => {
                    let data = self.bytes[e.offset as usize..(e.offset + e.len) as usize].to_vec();
                    self.add(e.kind, e.id, &data);
                }
                _ => {
                    let idx = encode_index(&name, self.bytes.len() as u64, &self.entries);
                    return (self.bytes, name, idx);
                }
            }
        }
    }
}

/// `magic | version | 0 0 0 | pack name 32 | pack length u64 | count u32 |
/// entries (kind u8 | id 32 | offset u64 | len u64) | blake3 of all before`
pub fn encode_index(name: &Hash32, pack_len: u64, entries: &[Entry]) -> Vec<u8> {
    let mut w = Vec::with_capacity(56 + entries.len() * IDX_ENTRY + 32);
    w.extend_from_slice(IDX_MAGIC);
    w.push(PACK_VERSION);
    w.extend_from_slice(&[0, 0, 0]);
    w.extend_from_slice(name.as_bytes());
    w.extend_from_slice(&pack_len.to_le_bytes());
    w.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        w.push(e.kind as u8);
        w.extend_from_slice(&e.id);
        w.extend_from_slice(&e.offset.to_le_bytes());
        w.extend_from_slice(&e.len.to_le_bytes());
    }
    let sum = blake3::hash(&w);
    w.extend_from_slice(sum.as_bytes());
    w
}

fn corrupt(what: &str, reason: impl Into<String>) -> RemoteError {
    RemoteError::Corrupt {
        what: what.into(),
        reason: reason.into(),
    }
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

fn check_version(what: &str, v: u8, reserved: &[u8]) -> Result<(), RemoteError> {
    if v != PACK_VERSION {
        return Err(corrupt(
            what,
            format!("format version {v}, this build reads {PACK_VERSION} (upgrade ckvc?)"),
        ));
    }
    if reserved.iter().any(|&b| b != 0) {
        return Err(corrupt(what, "reserved bytes are not zero"));
    }
    Ok(())
}

/// A parsed index file: the pack it describes and its entries.
#[derive(Debug, Clone)]
pub struct Index {
    pub pack: Hash32,
    pub pack_len: u64,
    pub entries: Vec<Entry>,
}

/// Parse and check an index file (`what` names it in errors).
pub fn decode_index(bytes: &[u8], what: &str) -> Result<Index, RemoteError> {
    if bytes.len() < 56 + 32 {
        return Err(corrupt(what, format!("truncated ({} bytes)", bytes.len())));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != sum {
        return Err(corrupt(
            what,
            "checksum mismatch (truncated or bit-flipped)",
        ));
    }
    if &body[..8] != IDX_MAGIC {
        return Err(corrupt(what, "not a ckvc pack index (bad magic)"));
    }
    check_version(what, body[8], &body[9..12])?;
    let pack = Hash32::from_bytes(body[12..44].try_into().expect("32 bytes"));
    let pack_len = le_u64(&body[44..52]);
    let n = u32::from_le_bytes(body[52..56].try_into().expect("4 bytes")) as usize;
    let rest = &body[56..];
    if rest.len() != n.saturating_mul(IDX_ENTRY) {
        return Err(corrupt(
            what,
            format!("{n} entries promised, {} bytes of entries", rest.len()),
        ));
    }
    let mut entries = Vec::with_capacity(n);
    for e in rest.chunks_exact(IDX_ENTRY) {
        let kind = Kind::from_code(e[0])
            .ok_or_else(|| corrupt(what, format!("unknown entry kind {}", e[0])))?;
        let offset = le_u64(&e[33..41]);
        let len = le_u64(&e[41..49]);
        if offset.checked_add(len).is_none_or(|end| end > pack_len) {
            return Err(corrupt(what, "an entry lies outside the pack"));
        }
        entries.push(Entry {
            kind,
            id: e[1..33].try_into().expect("32 bytes"),
            offset,
            len,
        });
    }
    Ok(Index {
        pack,
        pack_len,
        entries,
    })
}

/// Check a downloaded pack: its bytes hash to `name`, its structure is
/// sound, and every manifest, tree and commit hashes to its id (chunk
/// records are verified by decoding them, which needs their delta bases:
/// the caller does that). Returns the entries.
pub fn verify_pack(bytes: &[u8], name: &Hash32, what: &str) -> Result<Vec<Entry>, RemoteError> {
    if Hash32::digest(bytes) != *name {
        return Err(corrupt(
            what,
            "its bytes do not hash to its name (truncated or bit-flipped)",
        ));
    }
    if bytes.len() < PACK_HEADER || &bytes[..8] != PACK_MAGIC {
        return Err(corrupt(what, "not a ckvc pack (bad magic)"));
    }
    check_version(what, bytes[8], &bytes[9..12])?;
    let n = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    let mut entries = Vec::with_capacity(n.min(bytes.len() / ENTRY_HEADER));
    let mut p = PACK_HEADER;
    for i in 0..n {
        if bytes.len() - p < ENTRY_HEADER {
            return Err(corrupt(what, format!("entry {i} is truncated")));
        }
        let kind = Kind::from_code(bytes[p])
            .ok_or_else(|| corrupt(what, format!("entry {i}: unknown kind {}", bytes[p])))?;
        let id: [u8; 32] = bytes[p + 1..p + 33].try_into().expect("32 bytes");
        let len = le_u64(&bytes[p + 33..p + 41]);
        let start = p + ENTRY_HEADER;
        if len > (bytes.len() - start) as u64 {
            return Err(corrupt(what, format!("entry {i} runs past the end")));
        }
        let end = start + len as usize;
        if kind != Kind::Chunk && *blake3::hash(&bytes[start..end]).as_bytes() != id {
            return Err(corrupt(
                what,
                format!(
                    "{} {} does not hash to its id",
                    kind.name(),
                    crate::store::to_hex(&id[..6])
                ),
            ));
        }
        entries.push(Entry {
            kind,
            id,
            offset: start as u64,
            len,
        });
        p = end;
    }
    if p != bytes.len() {
        return Err(corrupt(what, format!("{} trailing bytes", bytes.len() - p)));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Vec<u8>, Hash32, Vec<u8>) {
        let mut w = PackWriter::new();
        let obj = b"a tree".to_vec();
        w.add(Kind::Tree, *blake3::hash(&obj).as_bytes(), &obj);
        w.add(Kind::Chunk, [7; 32], &[1, 2, 3, 4]);
        w.finish()
    }

    #[test]
    fn packs_and_indexes_round_trip() {
        let (pack, name, idx) = sample();
        let entries = verify_pack(&pack, &name, "pack").unwrap();
        let index = decode_index(&idx, "index").unwrap();
        assert_eq!(index.pack, name);
        assert_eq!(index.pack_len, pack.len() as u64);
        assert_eq!(index.entries, entries);
        let e = entries[1];
        assert_eq!(
            &pack[e.offset as usize..(e.offset + e.len) as usize],
            &[1, 2, 3, 4]
        );
    }

    #[test]
    fn every_truncation_and_bit_flip_is_an_error() {
        let (pack, name, idx) = sample();
        for cut in 0..pack.len() {
            assert!(verify_pack(&pack[..cut], &name, "p").is_err());
        }
        for cut in 0..idx.len() {
            assert!(decode_index(&idx[..cut], "i").is_err());
        }
        for i in 0..pack.len() * 8 {
            let mut p = pack.clone();
            p[i / 8] ^= 1 << (i % 8);
            assert!(verify_pack(&p, &name, "p").is_err());
        }
        for i in 0..idx.len() * 8 {
            let mut x = idx.clone();
            x[i / 8] ^= 1 << (i % 8);
            assert!(decode_index(&x, "i").is_err());
        }
    }

    #[test]
    fn a_pack_named_like_a_taken_one_repeats_an_entry_and_still_reads() {
        let (_, taken, _) = sample();
        let mut w = PackWriter::new();
        let obj = b"a tree".to_vec();
        w.add(Kind::Tree, *blake3::hash(&obj).as_bytes(), &obj);
        w.add(Kind::Chunk, [7; 32], &[1, 2, 3, 4]);
        let (pack, name, idx) = w.finish_unlike(|n| *n == taken);
        assert_ne!(name, taken);
        let entries = verify_pack(&pack, &name, "pack").unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[2].id, [7; 32]);
        assert_eq!(decode_index(&idx, "index").unwrap().entries, entries);
    }

    #[test]
    fn a_well_hashed_pack_with_a_bad_object_is_refused() {
        let mut w = PackWriter::new();
        w.add(Kind::Commit, [1; 32], b"not the commit with id 0101..");
        let (pack, name, _) = w.finish();
        let e = verify_pack(&pack, &name, "pack x").unwrap_err();
        assert!(e.to_string().contains("does not hash to its id"), "{e}");
    }
}
