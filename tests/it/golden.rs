//! Known-answer tests: the exact bytes of every object encoding (chunk
//! records and their heads, file manifests, trees, commits, ref-log
//! entries) and of packs
//! and pack indexes. Object ids are blake3 of these bytes, so a change here
//! changes every id: it must be a versioned change (docs/format/objects.md,
//! docs/format/remote.md, CHANGELOG "On-disk format").

use ckvc::codec::DType;
use ckvc::format::FileKind;
use ckvc::remote::pack::{decode_index, verify_pack, Kind, PackWriter};
use ckvc::repo::objects::{
    chunk_head_key, chunk_head_of, ChunkRecord, Commit, CommitStats, FileManifest, Payload,
    RefLogEntry, SegmentRef, Tree,
};
use ckvc::repo::provenance::Provenance;
use ckvc::store::{ChunkId, CommitId, ObjectId};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn id(b: u8) -> [u8; 32] {
    [b; 32]
}

/// Compares `bytes` with the pinned hex, printing the actual hex on failure.
fn pinned(what: &str, bytes: &[u8], want: &str) {
    assert_eq!(
        hex(bytes),
        want,
        "{what} changed; its bytes are now:\n{}",
        hex(bytes)
    );
}

/// The bytes of [`sample_record`] before its payload (`dead`).
const SAMPLE_HEAD: &str = concat!(
    "02",
    "00",
    "0201000000000000",
    "01",
    "abababababababababababababababababababababababababababababababab",
    "0300",
    "0021436500000000",
);

/// A delta record with every field set.
fn sample_record() -> ChunkRecord {
    ChunkRecord {
        payload: Payload::Codec,
        raw_len: 0x0102,
        base: Some(ChunkId::from_bytes(id(0xab))),
        depth: 3,
        written: 0x6543_2100,
        data: vec![0xde, 0xad],
    }
}

#[test]
fn chunk_record_bytes_are_pinned_and_version_1_still_decodes() {
    let rec = sample_record();
    let want = format!("{SAMPLE_HEAD}dead");
    pinned("chunk record v2", &rec.encode(), &want);
    assert_eq!(ChunkRecord::decode(&unhex(&want)).unwrap(), rec);
    let full = ChunkRecord {
        payload: Payload::Zstd,
        base: None,
        depth: 0,
        ..rec.clone()
    };
    pinned(
        "chunk record v2, no base",
        &full.encode(),
        concat!(
            "02",
            "01",
            "0201000000000000",
            "00",
            "0000",
            "0021436500000000",
            "dead"
        ),
    );
    // Version 1 (written before gc's grace period existed): no `written`.
    let v1 = unhex(concat!(
        "01",
        "00",
        "0201000000000000",
        "01",
        "abababababababababababababababababababababababababababababababab",
        "0300",
        "dead"
    ));
    let old = ChunkRecord::decode(&v1).unwrap();
    assert_eq!(old, ChunkRecord { written: 0, ..rec });
}

#[test]
fn chunk_head_key_and_value_are_pinned() {
    let rec = sample_record();
    let key = chunk_head_key(&ChunkId::from_bytes(id(0x5a)));
    pinned(
        "chunk head key",
        &key,
        concat!(
            "48",
            "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
        ),
    );
    // The record's bytes before the payload.
    let bytes = rec.encode();
    pinned("chunk head", chunk_head_of(&bytes).unwrap(), SAMPLE_HEAD);
}

#[test]
fn manifest_tree_commit_and_reflog_bytes_are_pinned() {
    let m = FileManifest {
        kind: FileKind::Safetensors,
        len: 0x20,
        hash: id(0x11),
        mode: 0o644,
        segments: vec![
            SegmentRef::Opaque {
                len: 0x10,
                chunks: vec![ChunkId::from_bytes(id(0x22))],
            },
            SegmentRef::Tensor {
                name: "w".into(),
                dtype: DType::BF16,
                shape: vec![2, 4],
                len: 0x10,
                chunks: vec![ChunkId::from_bytes(id(0x33))],
            },
        ],
    };
    let mb = m.encode();
    pinned("file manifest", &mb, MANIFEST);
    assert_eq!(FileManifest::decode(&mb).unwrap(), m);

    let t = Tree {
        entries: vec![
            ("a.safetensors".into(), ObjectId::from_bytes(id(0x44))),
            ("sub/b.pt".into(), ObjectId::from_bytes(id(0x55))),
        ],
    };
    let tb = t.encode();
    pinned("tree", &tb, TREE);
    assert_eq!(Tree::decode(&tb).unwrap(), t);

    let mut metrics = serde_json::Map::new();
    metrics.insert("eval_loss".into(), serde_json::json!(2.5));
    let c = Commit {
        tree: ObjectId::from_bytes(id(0x66)),
        parents: vec![CommitId::from_bytes(id(0x77))],
        step: 500,
        branch: "main".into(),
        message: "m".into(),
        time: 1_700_000_000,
        metrics,
        stats: CommitStats {
            files: 1,
            logical_bytes: 2,
            stored_bytes: 3,
            chunks: 4,
            new_chunks: 5,
            max_depth: 6,
        },
        provenance: Some(Provenance {
            repo: "/r".into(),
            commit: "c0".into(),
            branch: "b".into(),
            dirty: true,
        }),
    };
    let cb = c.encode();
    pinned("commit", &cb, COMMIT);
    assert_eq!(Commit::decode(&cb).unwrap(), c);
    // A commit's id is the blake3 of exactly these bytes.
    pinned("commit id", CommitId::digest(&cb).as_bytes(), COMMIT_ID);

    let e = RefLogEntry {
        refname: "refs/heads/main".into(),
        old: None,
        new: Some(CommitId::from_bytes(id(0x88))),
        time: 1_700_000_001,
        op: "commit".into(),
    };
    let eb = e.encode();
    pinned("ref-log entry", &eb, REFLOG);
    assert_eq!(RefLogEntry::decode("refs/heads/main", &eb).unwrap(), e);
}

#[test]
fn pack_and_pack_index_bytes_are_pinned() {
    let mut w = PackWriter::new();
    w.add(Kind::Chunk, id(0x01), b"chunk");
    // Non-chunk entries must hash to their id.
    w.add(Kind::Commit, *blake3::hash(b"c").as_bytes(), b"c");
    let (pack, name, idx) = w.finish();
    pinned("pack", &pack, PACK);
    pinned("pack index", &idx, PACK_INDEX);
    let entries = verify_pack(&pack, &name, "golden").unwrap();
    assert_eq!(entries.len(), 2);
    let index = decode_index(&idx, "golden").unwrap();
    assert_eq!(index.entries, entries);
}

const MANIFEST: &str = "010120000000000000001111111111111111111111111111111111111111111111111111111111111111a4010000020110000000000000000122222222222222222222222222222222222222222222222222222222222222220001770802020000000000000004000000000000001000000000000000013333333333333333333333333333333333333333333333333333333333333333";
const TREE: &str = "01020d612e7361666574656e736f72734444444444444444444444444444444444444444444444444444444444444444087375622f622e70745555555555555555555555555555555555555555555555555555555555555555";
const COMMIT: &str = "016666666666666666666666666666666666666666666666666666666666666666017777777777777777777777777777777777777777777777777777777777777777f40100000000000000f1536500000000046d61696e016d117b226576616c5f6c6f7373223a322e357d01000000000000000200000000000000030000000000000004000000000000000500000000000000060001022f72026330016201";
const COMMIT_ID: &str = "dfb849a1b0ef177b634d1bad5d461f03c31f0909d17f1b4c9ff8e31b3a03e6cd";
const REFLOG: &str = "010001888888888888888888888888888888888888888888888888888888888888888801f153650000000006636f6d6d6974";
const PACK: &str = "434b56435041434b01000000020000004b010101010101010101010101010101010101010101010101010101010101010105000000000000006368756e6b43ea7aa1fc9efdbe106dbb70369a75e9671fa29d52bd55536711bf197477b8f021010000000000000063";
const PACK_INDEX: &str = "434b5643494458000100000023191d57672855413611c554f1d13240ec710d1af3f683445d4336e551f6cdb26800000000000000020000004b01010101010101010101010101010101010101010101010101010101010101013900000000000000050000000000000043ea7aa1fc9efdbe106dbb70369a75e9671fa29d52bd55536711bf197477b8f021670000000000000001000000000000006a4731a9d2d3c6fbba56e196410efd3b6a4b055925f31d67b3df338f54ce3df9";
