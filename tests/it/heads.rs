//! Chunk heads (repository format 2): a commit learns whether a chunk is
//! stored, and a delta base's depth and length, without reading chunk
//! records; every writer keeps the heads beside the records; fsck checks
//! them, gc removes a head left without its record, and a version-1
//! repository is read as it is and upgraded by its first writer.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ckvc::repo::objects::{chunk_head_key, ChunkRecord, HEAD_MIN_RECORD, KIND_CHUNK_HEAD};
use ckvc::repo::{
    CheckoutOptions, CommitOptions, CommitReport, Config, CorruptReason, GcOptions, ObjectRef,
    Repository,
};
use ckvc::store::{Batch, ChunkId, MemStore, Space, Store, StoreExt};

use super::{same_tree, steps, Instrumented};

fn commit_step(repo: &Repository, step: u64, dir: &std::path::Path) -> CommitReport {
    let opts = CommitOptions {
        step: Some(step),
        ..CommitOptions::default()
    };
    repo.commit(dir, &opts).unwrap()
}

fn heads(store: &dyn Store) -> Vec<(ChunkId, Vec<u8>)> {
    store
        .collect_prefix(Space::Index, &[KIND_CHUNK_HEAD])
        .unwrap()
        .into_iter()
        .map(|(k, v)| (ChunkId::from_slice(&k[1..]).unwrap(), v))
        .collect()
}

/// Every stored chunk record of at least `HEAD_MIN_RECORD` bytes has a
/// head equal to its bytes before the payload; no other head exists.
fn assert_heads_match_records(store: &dyn Store) {
    let records = store.collect_prefix(Space::Chunks, b"").unwrap();
    let heads = heads(store);
    let large = records
        .iter()
        .filter(|(_, v)| v.len() >= HEAD_MIN_RECORD)
        .count();
    assert!(
        large > 0 && large < records.len(),
        "{large} of {}",
        records.len()
    );
    assert_eq!(heads.len(), large);
    for (id, head) in heads {
        let rec = store
            .get_vec(Space::Chunks, id.as_bytes())
            .unwrap()
            .unwrap();
        let h = ChunkRecord::decode_header(&rec).unwrap();
        assert_eq!(head, rec[..h.payload_offset], "head of {id}");
    }
}

#[test]
fn a_delta_commit_and_a_repeated_one_read_no_record_from_a_blob_file() {
    let all = steps();
    let store = Arc::new(Instrumented::new(MemStore::default()));
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init_store(tmp.path().into(), store.clone(), Config::default()).unwrap();
    commit_step(&repo, all[0].0, &all[0].1);
    commit_step(&repo, all[1].0, &all[1].1);
    // A fresh handle keeps no decoded bases: the bases come from the
    // parent's files, their depth and length from their heads.
    let repo = Repository::open_store(tmp.path().into(), store.clone()).unwrap();
    let large = &store.large_chunk_reads;
    let before = large.load(Ordering::Relaxed);
    let r = commit_step(&repo, all[2].0, &all[2].1);
    assert!(r.stats.max_depth >= 2, "{:?}", r.stats);
    // The same checkpoint again at a later step: every chunk is stored.
    let again = commit_step(&repo, all[2].0 + 1, &all[2].1);
    assert_eq!(again.stats.new_chunks, 0);
    assert_eq!(
        large.load(Ordering::Relaxed),
        before,
        "records in blob files read"
    );
    assert_heads_match_records(&*store);
    let out = tmp.path().join("out");
    repo.checkout(&again.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&all[2].1, &out);
}

#[test]
fn a_version_1_repository_is_read_as_it_is_and_upgraded_by_its_first_writer() {
    let all = steps();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    let repo = Repository::init(&root, Config::default()).unwrap();
    commit_step(&repo, all[0].0, &all[0].1);
    commit_step(&repo, all[1].0, &all[1].1);
    // What a version-1 build left: no heads, format 1.
    let mut b = Batch::new();
    for (id, _) in heads(repo.store()) {
        b.delete(Space::Index, &chunk_head_key(&id));
    }
    b.put(Space::Meta, b"format", vec![1u8]);
    repo.store().write(b).unwrap();
    drop(repo);

    let reader = Repository::open(&root, false).unwrap();
    assert_eq!(
        reader.store().get_vec(Space::Meta, b"format").unwrap(),
        Some(vec![1u8]),
        "a reader writes nothing"
    );
    let out = tmp.path().join("out1");
    let head = reader.resolve(&all[1].0.to_string()).unwrap();
    reader
        .checkout(&head, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&all[1].1, &out);
    drop(reader);

    let repo = Repository::open(&root, true).unwrap();
    assert_eq!(
        repo.store().get_vec(Space::Meta, b"format").unwrap(),
        Some(vec![ckvc::repo::REPO_FORMAT])
    );
    // Bases without heads are read from their records.
    let r = commit_step(&repo, all[2].0, &all[2].1);
    assert!(r.stats.max_depth >= 2, "{:?}", r.stats);
    let n = heads(repo.store()).len() as u64;
    assert!(n > 0 && n < r.stats.new_chunks, "{n} heads, {:?}", r.stats);
    let out = tmp.path().join("out2");
    repo.checkout(&r.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&all[2].1, &out);
    assert!(repo.fsck(false).unwrap().is_clean());
}

#[test]
fn a_repository_format_newer_than_the_build_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(MemStore::default());
    Repository::init_store(tmp.path().into(), store.clone(), Config::default()).unwrap();
    let mut b = Batch::new();
    b.put(Space::Meta, b"format", vec![ckvc::repo::REPO_FORMAT + 1]);
    store.write(b).unwrap();
    let e = Repository::open_store(tmp.path().into(), store.clone())
        .err()
        .unwrap();
    assert!(e.to_string().contains("this build reads 1 to"), "{e}");
}

#[test]
fn fsck_names_a_head_without_its_record_or_disagreeing_with_it_and_gc_removes_the_orphan() {
    let all = steps();
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(MemStore::default());
    let repo = Repository::init_store(tmp.path().into(), store.clone(), Config::default()).unwrap();
    commit_step(&repo, all[0].0, &all[0].1);
    commit_step(&repo, all[1].0, &all[1].1);
    assert!(repo.fsck(true).unwrap().is_clean());
    let (id, head) = heads(&*store)
        .into_iter()
        .find(|(_, h)| ChunkRecord::decode_header(h).unwrap().depth == 1)
        .unwrap();

    // A head whose record is gone (a commit would take the chunk as stored).
    let orphan = ChunkId::from_bytes([7; 32]);
    let mut b = Batch::new();
    b.put(Space::Index, &chunk_head_key(&orphan), head.clone());
    // A head that misstates a stored chunk's depth.
    let mut wrong_head = head.clone();
    // The depth (u16) comes right before the write time (u64).
    let depth_at = ChunkRecord::decode_header(&head).unwrap().payload_offset - 10;
    wrong_head[depth_at..depth_at + 2].copy_from_slice(&0u16.to_le_bytes());
    b.put(Space::Index, &chunk_head_key(&id), wrong_head);
    store.write(b).unwrap();

    for quick in [true, false] {
        let f = repo.fsck(quick).unwrap();
        let mut named: Vec<(ChunkId, String)> = f
            .damage
            .iter()
            .map(|d| match (&d.object, &d.reason) {
                (ObjectRef::Chunk { id }, CorruptReason::Inconsistent { message }) => {
                    (*id, message.clone())
                }
                other => panic!("{other:?}"),
            })
            .collect();
        named.sort();
        let mut expected = vec![
            (
                orphan,
                "it has a head (index space) but no record".to_string(),
            ),
            (
                id,
                "its head (index space) disagrees with its record".to_string(),
            ),
        ];
        expected.sort();
        assert_eq!(named, expected, "quick {quick}");
    }

    // gc removes the orphan head (the wrong one stays fsck's to report).
    repo.gc(&GcOptions::default()).unwrap();
    let left: Vec<ChunkId> = heads(&*store).into_iter().map(|(i, _)| i).collect();
    assert!(!left.contains(&orphan));
    let f = repo.fsck(true).unwrap();
    assert_eq!(f.damage.len(), 1, "{:?}", f.damage);
}
