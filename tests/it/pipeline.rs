//! The commit pipeline reads the files of a checkpoint on several threads:
//! what it stores must not depend on how many, or on which thread read
//! which file.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckvc::repo::{
    CheckoutOptions, CommitOptions, Config, Pause, Progress, Repository, SharedBases,
};
use ckvc::store::{CommitId, MemStore, ObjectId};

use super::{copy_dir, same_tree, steps, Instrumented};

/// A checkpoint of many files: two corpus steps side by side as two
/// "ranks", one file twice (its chunks are new in two files at once) and
/// a 2-rank DCP save.
fn multi_file_checkpoint(out: &Path, a: &Path, b: &Path) {
    copy_dir(a, &out.join("rank0"));
    copy_dir(b, &out.join("rank1"));
    std::fs::create_dir_all(out.join("rank2")).unwrap();
    std::fs::copy(
        b.join("optimizer.pt"),
        out.join("rank2").join("optimizer.pt"),
    )
    .unwrap();
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dcp/ranks2-step-1"),
        &out.join("dcp"),
    );
}

/// A commit's id, tree, files, chunks and new chunks.
type Row = (CommitId, ObjectId, u64, u64, u64);

/// Commits `dirs` in order into a fresh repository with `threads` rayon
/// threads (so as many reading threads); each commit's tree, file and
/// chunk counts.
fn commit_with_threads(
    root: &Path,
    threads: usize,
    dirs: &[(u64, std::path::PathBuf)],
) -> (Repository, Vec<Row>) {
    let config = Config {
        // Many chunks per file, a short queue: the readers interleave.
        chunk_bytes: 64 << 10,
        memory_budget: 4 << 20,
        ..Config::default()
    };
    let repo = Repository::init(root, config).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut out = Vec::new();
    for (step, dir) in dirs {
        let opts = CommitOptions {
            step: Some(*step),
            ..CommitOptions::default()
        };
        let r = pool.install(|| repo.commit(dir, &opts)).unwrap();
        let c = repo.commit_object(&r.id).unwrap();
        out.push((
            r.id,
            c.tree,
            r.stats.files,
            r.stats.chunks,
            r.stats.new_chunks,
        ));
    }
    (repo, out)
}

#[test]
fn a_multi_file_commit_stores_the_same_trees_whatever_the_reader_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let s = steps();
    let mut dirs = Vec::new();
    for (n, pair) in s.windows(2).take(3).enumerate() {
        let d = tmp.path().join(format!("step-{n}"));
        multi_file_checkpoint(&d, &pair[0].1, &pair[1].1);
        dirs.push((n as u64 + 1, d));
    }
    let (one, a) = commit_with_threads(&tmp.path().join("one"), 1, &dirs);
    let (four, b) = commit_with_threads(&tmp.path().join("four"), 4, &dirs);
    // Trees (and so manifests) and counts are equal; commit ids differ
    // only by the commit time.
    let trees = |v: &[Row]| {
        v.iter()
            .map(|&(_, t, f, c, n)| (t, f, c, n))
            .collect::<Vec<_>>()
    };
    assert_eq!(trees(&a), trees(&b));
    assert!(a.iter().all(|&(_, _, files, _, _)| files >= 8), "{a:?}");
    for (repo, ids) in [(&one, &a), (&four, &b)] {
        for ((_, dir), (id, ..)) in dirs.iter().zip(ids.iter()) {
            let out = tempfile::tempdir().unwrap();
            repo.checkout(id, out.path(), &CheckoutOptions::default())
                .unwrap();
            same_tree(dir, out.path());
        }
    }
}

/// A commit's id, tree, stored bytes, new chunks and deepest chain.
type Stored = (CommitId, ObjectId, u64, u64, u16);

/// How `commit_copies` holds the repository between commits.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Handles {
    /// One handle throughout: decoded bases kept between commits.
    Kept,
    /// A fresh handle per commit.
    Fresh,
    /// A fresh handle per commit, all given one `SharedBases` (what the
    /// Python package does for its saves).
    Shared,
}

/// Commits steps of the corpus, each from a copy removed after its commit
/// (so no delta base is read back from the parent's directory), into a
/// repository over `store`, holding handles as `handles` says.
fn commit_copies(
    tmp: &Path,
    store: &Arc<Instrumented<MemStore>>,
    handles: Handles,
) -> (Repository, Vec<Stored>) {
    let config = Config {
        chunk_bytes: 64 << 10,
        // Bases kept: an eighth, more than a corpus step.
        memory_budget: 128 << 20,
        ..Config::default()
    };
    let root = tmp.join(format!("{handles:?}"));
    let mut repo = Repository::init_store(root.clone(), store.clone(), config).unwrap();
    let shared = SharedBases::new();
    let mut rows = Vec::new();
    for (n, (step, dir)) in steps().into_iter().take(4).enumerate() {
        if handles != Handles::Kept {
            repo = Repository::open_store(root.clone(), store.clone()).unwrap();
        }
        if handles == Handles::Shared {
            repo.use_bases(&shared, 256 << 20);
        }
        let copy = tmp.join(format!("copy-{handles:?}-{n}"));
        rows.push(commit_copy(&repo, &copy, step, &dir, false));
    }
    (repo, rows)
}

/// Commits `dir` as `step` from a copy at `copy`, removed after the
/// commit (so no delta base is read back from the parent's directory):
/// the commit's row.
fn commit_copy(repo: &Repository, copy: &Path, step: u64, dir: &Path, shallow: bool) -> Stored {
    copy_dir(dir, copy);
    let opts = CommitOptions {
        step: Some(step),
        shallow_bases: shallow,
        ..CommitOptions::default()
    };
    let r = repo.commit(copy, &opts).unwrap();
    std::fs::remove_dir_all(copy).unwrap();
    let c = repo.commit_object(&r.id).unwrap();
    let stats = &r.stats;
    (
        r.id,
        c.tree,
        stats.stored_bytes,
        stats.new_chunks,
        stats.max_depth,
    )
}

/// The same bases whether kept, shared or decoded: the same records,
/// trees and stored bytes.
fn same(v: &[Stored]) -> Vec<(ObjectId, u64, u64, u16)> {
    v.iter()
        .map(|&(_, t, s, n, d)| (t, s, n, d))
        .collect::<Vec<_>>()
}

fn gets(s: &Arc<Instrumented<MemStore>>) -> u64 {
    s.chunk_gets.load(Ordering::Relaxed)
}

/// Commits the copies with `handles` and with fresh handles, each into a
/// store of its own; checks they stored the same records through chains
/// at least two deep. Returns the first's repository, store and rows,
/// and the chunk records the fresh handles read.
fn beside_fresh_handles(
    tmp: &Path,
    handles: Handles,
) -> (Repository, Arc<Instrumented<MemStore>>, Vec<Stored>, u64) {
    let store = Arc::new(Instrumented::new(MemStore::default()));
    let fresh_store = Arc::new(Instrumented::new(MemStore::default()));
    let (repo, a) = commit_copies(tmp, &store, handles);
    let (_, b) = commit_copies(tmp, &fresh_store, Handles::Fresh);
    assert_eq!(same(&a), same(&b));
    assert!(a.iter().any(|&(.., d)| d >= 2), "{a:?}");
    (repo, store, a, gets(&fresh_store))
}

#[test]
fn decoded_bases_kept_between_commits_and_checkouts_give_the_same_bytes_with_fewer_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let (kept, kept_store, a, fresh_gets) = beside_fresh_handles(tmp.path(), Handles::Kept);
    assert!(
        gets(&kept_store) < fresh_gets,
        "kept {} fresh {fresh_gets}",
        gets(&kept_store)
    );
    // A checkout after one of the step before takes its bases from what
    // that one decoded; a fresh handle decodes their chains; both
    // byte-exact.
    let all = steps();
    let (step, dir) = all[3].clone();
    let (head, ..) = a[3];
    let warm_handle = Repository::open_store(tmp.path().join("Kept"), kept_store.clone()).unwrap();
    let out = tmp.path().join("out-prev");
    warm_handle
        .checkout(&a[2].0, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&all[2].1, &out);
    // The store reads of a byte-exact checkout of `head` by `repo`.
    let checkout_reads = |repo: &Repository, name: &str| {
        let before = gets(&kept_store);
        let out = tmp.path().join(format!("out-{name}-{step}"));
        repo.checkout(&head, &out, &CheckoutOptions::default())
            .unwrap();
        same_tree(&dir, &out);
        gets(&kept_store) - before
    };
    let warm = checkout_reads(&warm_handle, "warm");
    let fresh = Repository::open_store(tmp.path().join("Kept"), kept_store.clone()).unwrap();
    let cold = checkout_reads(&fresh, "fresh");
    assert!(warm < cold, "warm {warm} cold {cold}");
    drop(kept);
}

/// The Python package opens the repository for each save; with one
/// `SharedBases` given to every handle, a delta commit takes its bases
/// from the chunks the commit before stored instead of decoding their
/// chains, and stores the same records as fresh handles.
#[test]
fn fresh_handles_sharing_bases_commit_the_same_records_without_decoding_chains() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, shared_store, _, fresh_gets) = beside_fresh_handles(tmp.path(), Handles::Shared);
    // Fresh handles read every base's chain; shared ones only the small
    // records that carry no stored head.
    assert!(
        2 * gets(&shared_store) < fresh_gets,
        "shared {} fresh {fresh_gets}",
        gets(&shared_store)
    );
}

/// Commits five steps of the corpus, each from a copy removed after its
/// commit and by a fresh handle (no base at hand), with `max_chain` 2:
/// the commits' deepest chains and the large chunk records read.
fn commit_copies_with_fresh_handles(tmp: &Path, shallow: bool) -> (Vec<Stored>, u64) {
    let store = Arc::new(Instrumented::new(MemStore::default()));
    let config = Config {
        chunk_bytes: 64 << 10,
        max_chain: 2,
        ..Config::default()
    };
    let root = tmp.join(format!("shallow-{shallow}"));
    Repository::init_store(root.clone(), store.clone(), config).unwrap();
    let mut rows = Vec::new();
    for (n, (step, dir)) in steps().into_iter().take(5).enumerate() {
        let repo = Repository::open_store(root.clone(), store.clone()).unwrap();
        let copy = tmp.join(format!("copy-shallow-{shallow}-{n}"));
        let row = commit_copy(&repo, &copy, step, &dir, shallow);
        let out = tmp.join(format!("out-shallow-{shallow}-{n}"));
        repo.checkout(&row.0, &out, &CheckoutOptions::default())
            .unwrap();
        same_tree(&dir, &out);
        rows.push(row);
    }
    (rows, store.large_chunk_reads.load(Ordering::Relaxed))
}

/// With shallow bases a commit whose bases are not at hand codes each
/// new chunk against its parent's keyframe instead of decoding the
/// parent's chain: no chain is ever deeper than one, every `max_chain`
/// delta commits the next is a keyframe, fewer records are read, every
/// step checks out byte-exact, and the deltas against the older tensor
/// cost a little more room.
#[test]
fn shallow_bases_code_against_the_keyframe_and_keyframe_every_max_chain_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let (chain, chain_reads) = commit_copies_with_fresh_handles(tmp.path(), false);
    let (shallow, shallow_reads) = commit_copies_with_fresh_handles(tmp.path(), true);
    let depths = |rows: &[Stored]| rows.iter().map(|&(.., d)| d).collect::<Vec<_>>();
    assert_eq!(
        depths(&shallow),
        [0, 1, 1, 0, 1],
        "chain {:?}",
        depths(&chain)
    );
    assert_eq!(depths(&chain)[..3], [0, 1, 2]);
    assert!(shallow.iter().all(|&(_, _, _, n, _)| n > 0), "{shallow:?}");
    // The same trees: the chunks are cut and named alike.
    let trees = |rows: &[Stored]| rows.iter().map(|&(_, t, ..)| t).collect::<Vec<_>>();
    assert_eq!(trees(&chain), trees(&shallow));
    // Only the third commit's bases differ: chain decodes its parent
    // through two records, shallow reads the keyframe's.
    assert!(
        shallow_reads < chain_reads,
        "shallow {shallow_reads} chain {chain_reads}"
    );
    let stored = |rows: &[Stored]| rows.iter().map(|&(_, _, s, ..)| s).collect::<Vec<_>>();
    let (c, s) = (stored(&chain), stored(&shallow));
    assert_eq!(c[..2], s[..2]);
    assert!(s[2] > c[2], "shallow {s:?} chain {c:?}");
}

/// The chunk memtable size in the store's newest options file.
fn chunk_memtable(root: &Path) -> u64 {
    let db = root.join(".ckvc/db");
    let newest = std::fs::read_dir(&db)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("OPTIONS-"))
        .max_by_key(|n| n[8..].parse::<u64>().unwrap_or(0))
        .unwrap();
    let text = std::fs::read_to_string(db.join(newest)).unwrap();
    let chunks = text.split("[CFOptions \"chunks\"]").nth(1).unwrap();
    chunks
        .lines()
        .find_map(|l| l.trim().strip_prefix("write_buffer_size="))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn the_chunk_memtable_is_an_eighth_of_the_memory_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    let config = Config {
        memory_budget: 128 << 20,
        ..Config::default()
    };
    drop(Repository::init(&root, config).unwrap());
    let mut repo = Repository::open(&root, true).unwrap();
    assert_eq!(chunk_memtable(&root), 16 << 20);
    // A handle's own budget (`--memory-budget`), bounded to 64 MiB.
    repo.set_memory_budget(4 << 30).unwrap();
    assert_eq!(chunk_memtable(&root), 64 << 20);
    let (step, dir) = steps()[1].clone();
    let r = repo
        .commit(
            &dir,
            &CommitOptions {
                step: Some(step),
                ..CommitOptions::default()
            },
        )
        .unwrap();
    let out = tmp.path().join("out");
    repo.checkout(&r.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&dir, &out);
}

/// `Repository::open_for_bulk_reads` (what `ckvc checkout` of a gigabyte
/// or more uses) reads the store with O_DIRECT where the file system takes
/// it: every step checks out byte-exact, and the handle is a reader.
#[test]
fn a_checkout_through_direct_reads_gives_every_step_back_byte_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    let repo = Repository::init(&root, Config::default()).unwrap();
    let all = steps();
    let mut ids = Vec::new();
    for (step, dir) in all.iter().take(4) {
        let opts = CommitOptions {
            step: Some(*step),
            ..CommitOptions::default()
        };
        ids.push(repo.commit(dir, &opts).unwrap().id);
    }
    drop(repo);
    let bulk = Repository::open_for_bulk_reads(&root).unwrap();
    for (i, (step, dir)) in all.iter().take(4).enumerate() {
        let out = tmp.path().join(format!("out-{step}"));
        bulk.checkout(&ids[i], &out, &CheckoutOptions::default())
            .unwrap();
        same_tree(dir, &out);
    }
    assert!(
        bulk.create_branch("x", &ids[0]).is_err(),
        "a bulk reader writes nothing"
    );
    assert!(bulk.fsck(false).unwrap().is_clean());
}

/// Bytes a commit reported read.
#[derive(Default)]
struct BytesRead(AtomicU64);

impl Progress for BytesRead {
    fn advance(&self, bytes: u64, _items: u64) {
        self.0.fetch_add(bytes, Ordering::SeqCst);
    }
}

/// A commit given a held pause reads no chunk until the pause is resumed,
/// then stores the checkpoint as any commit does; a hold nobody resumes
/// lapses at its deadline instead of hanging the commit.
#[test]
fn a_held_pause_holds_a_commit_until_resumed_or_its_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let all = steps();
    let (step, dir) = &all[0];
    let repo = Repository::init(&tmp.path().join("r"), Config::default()).unwrap();
    let pause = Arc::new(Pause::new());
    let paused = |step: u64| CommitOptions {
        step: Some(step),
        pause: Some(pause.clone()),
        ..CommitOptions::default()
    };
    pause.hold(Duration::from_secs(600));
    let opts = paused(*step);
    let read = BytesRead::default();
    let report = std::thread::scope(|s| {
        let h = s.spawn(|| repo.commit_with_progress(dir, &opts, &read));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            read.0.load(Ordering::SeqCst),
            0,
            "a chunk was read while held"
        );
        assert!(!h.is_finished());
        pause.resume();
        h.join().unwrap().unwrap()
    });
    assert!(read.0.load(Ordering::SeqCst) > 0);
    let out = tmp.path().join("out");
    repo.checkout(&report.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(dir, &out);

    // Held and never resumed: the next commit waits out the deadline.
    let (step, dir) = &all[1];
    pause.hold(Duration::from_millis(200));
    let t = Instant::now();
    repo.commit(dir, &paused(*step)).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(150));
    assert!(!pause.is_held());
}
