//! Defects a hostile review found (damaged stores, full disks, racing
//! writers, crafted trees, symlinks in the output), each pinned by a test
//! named after it: every case ends with a clear error and nothing lost.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckvc::repo::{CommitOptions, Repository};
use ckvc::store::{Batch, CommitId, ObjectId, Space, StoreExt};

use super::{run_ckvc, same_tree, steps};

/// A small checkpoint directory per corpus step (the bf16 model and the
/// trainer state): fast to commit, real tensors.
fn small_step(root: &Path, i: usize) -> PathBuf {
    let (step, dir) = &steps()[i];
    let d = root.join(format!("step-{step}"));
    std::fs::create_dir_all(&d).unwrap();
    for f in ["model.bf16.safetensors", "trainer_state.json"] {
        std::fs::copy(dir.join(f), d.join(f)).unwrap();
    }
    d
}

fn init(dir: &Path) {
    let (code, _, err) = run_ckvc(dir, &["init"]);
    assert_eq!(code, Some(0), "{err}");
}

/// A fresh repository at `<tmp>/repo` (checkpoints go beside it in `tmp`).
fn new_repo() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    std::fs::create_dir(&root).unwrap();
    init(&root);
    (tmp, root)
}

fn commit(dir: &Path, ckpt: &Path) {
    let (code, out, err) = run_ckvc(dir, &["commit", ckpt.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}{err}");
}

/// Every file name in `dir` with its length.
fn listing(dir: &Path) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().len(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn write_after_lost_current_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    init(root);
    commit(root, &small_step(root, 0));
    let db = root.join(".ckvc/db");
    let current = std::fs::read(db.join("CURRENT")).unwrap();
    std::fs::remove_file(db.join("CURRENT")).unwrap();
    let before = listing(&db);
    assert!(
        before.iter().any(|(n, _)| n.ends_with(".blob")),
        "{before:?}"
    );
    let next = small_step(root, 1);
    let next = next.to_str().unwrap();
    for args in [
        vec!["commit", next],
        vec!["gc"],
        vec!["gc", "--compact"],
        vec!["branch", "x"],
        vec!["tag", "t"],
        vec!["log"],
        vec!["fsck"],
        vec!["checkout", "0", "-o", "out"],
    ] {
        let (code, _, err) = run_ckvc(root, &args);
        assert_eq!(code, Some(3), "{args:?}: {err}");
        assert!(
            err.contains("the store's CURRENT file is missing"),
            "{args:?}: {err}"
        );
        assert_eq!(listing(&db), before, "{args:?} touched the store");
    }
    // Nothing was lost: with CURRENT back the repository is whole.
    std::fs::write(db.join("CURRENT"), current).unwrap();
    let (code, out, err) = run_ckvc(root, &["fsck"]);
    assert_eq!(code, Some(0), "{out}{err}");
    // A repository whose whole store directory is gone is damaged too:
    // nothing but `init` creates a store.
    std::fs::rename(&db, root.join("db-aside")).unwrap();
    let (code, _, err) = run_ckvc(root, &["branch", "y"]);
    assert_eq!(code, Some(3), "{err}");
    assert!(!db.exists());
}

/// A tmpfs mounted for one test, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` when this process may not mount (not root, no tmpfs).
    fn mount(mib: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fill the device with a file until `leave` bytes are free.
    fn fill_to(&self, leave: u64) {
        let fill = self.path().join("fill");
        let _ = std::fs::remove_file(&fill);
        let out = Command::new("df")
            .args(["-B1", "--output=avail"])
            .arg(self.path())
            .output()
            .unwrap();
        let avail: u64 = String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let f = std::fs::File::create(&fill).unwrap();
        // tmpfs allocates what is written: write real zeros.
        let mut w = std::io::BufWriter::new(f);
        let mut left = avail.saturating_sub(leave);
        let block = vec![0u8; 1 << 16];
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            if std::io::Write::write_all(&mut w, &block[..n]).is_err() {
                break;
            }
            left -= n as u64;
        }
        let _ = std::io::Write::flush(&mut w);
    }

    fn unfill(&self) {
        std::fs::remove_file(self.path().join("fill")).unwrap();
    }
}

/// A tmpfs of `mib` MiB, or `None` where none can be mounted (not root:
/// the test `what` is skipped, saying so; CI runs as root and must mount it).
fn tmpfs_or_skip(mib: u64, what: &str) -> Option<Tmpfs> {
    let fs = Tmpfs::mount(mib);
    if fs.is_none() {
        eprintln!("{what}: cannot mount a tmpfs here (not root); skipped");
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs as root and must mount the tmpfs"
        );
    }
    fs
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn nearly_full_disk_is_a_clear_error_for_every_command() {
    // Without a tmpfs (not root), the injected-ENOSPC store covers it:
    // gc_fsck::a_full_disk_during_commit_or_gc_leaves_the_repository_as_it_was.
    let Some(fs) = tmpfs_or_skip(40, "nearly_full_disk") else {
        return;
    };
    let root = fs.path().join("repo");
    std::fs::create_dir(&root).unwrap();
    let ckpts = tempfile::tempdir().unwrap();
    init(&root);
    commit(&root, &small_step(ckpts.path(), 0));
    let next = small_step(ckpts.path(), 1);
    let next = next.to_str().unwrap();
    let (_, log_before, _) = run_ckvc(&root, &["log", "--json"]);
    // Free space below, around and above what each command needs: every
    // command either succeeds or fails with a clear error (exit 1), never
    // RocksDB's abort (exit 134), and the repository stays whole.
    for leave in [200 << 10, 1536 << 10, 6 << 20, 12 << 20] {
        fs.fill_to(leave);
        for args in [
            vec!["branch", "x"],
            vec!["tag", "t"],
            vec!["commit", next],
            vec!["gc", "--keep", "last=1"],
            vec!["gc", "--compact"],
        ] {
            let (code, out, err) = run_ckvc(&root, &args);
            if leave <= 6 << 20 {
                assert_eq!(code, Some(1), "{leave} free, {args:?}: {out}{err}");
                assert!(err.contains("no space left"), "{args:?}: {err}");
            } else {
                assert!(
                    matches!(code, Some(0) | Some(1)),
                    "{leave} free, {args:?}: {code:?} {out}{err}"
                );
            }
        }
        fs.unfill();
        let (code, out, err) = run_ckvc(&root, &["fsck"]);
        assert_eq!(code, Some(0), "after {leave} free: {out}{err}");
        if leave <= 6 << 20 {
            let (_, log_after, _) = run_ckvc(&root, &["log", "--json"]);
            assert_eq!(log_after, log_before, "{leave} free: the log moved");
            let (_, branches, _) = run_ckvc(&root, &["branch"]);
            assert!(!branches.contains('x'), "{branches}");
        }
    }
}

#[test]
fn second_writer_always_gets_locked() {
    let (tmp, root) = new_repo();
    let a = small_step(tmp.path(), 0);
    let b = small_step(tmp.path(), 1);
    let mut locked = 0;
    for race in 0..24 {
        let spawn = |dir: &Path| {
            Command::new(env!("CARGO_BIN_EXE_ckvc"))
                .current_dir(&root)
                // Two commits of one step: when they do not overlap (a
                // loaded machine), the second is still a commit, not a
                // step-order refusal.
                .args(["commit", "--allow-step-order", "--step"])
                .arg(race.to_string())
                .arg(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (p, q) = (spawn(&a), spawn(&b));
        for o in [p.wait_with_output().unwrap(), q.wait_with_output().unwrap()] {
            let err = String::from_utf8_lossy(&o.stderr);
            match o.status.code() {
                Some(0) => {}
                Some(4) => {
                    assert!(err.contains("locked by another writer"), "{err}");
                    locked += 1;
                }
                other => panic!("race {race}: exit {other:?}: {err}"),
            }
        }
    }
    // The races are real: some second writer did find the lock taken.
    assert!(locked > 0, "no race of 24 overlapped");
    let (code, out, err) = run_ckvc(&root, &["fsck"]);
    assert_eq!(code, Some(0), "{out}{err}");
}

#[test]
fn checkout_never_drops_a_file_named_like_a_temporary() {
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    // The old temporary name of model.bf16.safetensors, and names like
    // the new private directory.
    std::fs::write(ck.join(".model.bf16.safetensors.ckvc-tmp"), b"mine").unwrap();
    std::fs::write(ck.join(".ckvc-checkout-1-0"), b"mine too").unwrap();
    std::fs::create_dir(ck.join("sub")).unwrap();
    std::fs::write(ck.join("sub/.x.ckvc-tmp"), b"x").unwrap();
    std::fs::write(ck.join("sub/x"), b"y").unwrap();
    commit(&root, &ck);
    let (code, out, err) = run_ckvc(&root, &["checkout", "0", "-o", "out"]);
    assert_eq!(code, Some(0), "{out}{err}");
    same_tree(&ck, &root.join("out"));
    // No temporary directory is left behind.
    let left: Vec<_> = listing(&root.join("out"))
        .into_iter()
        .filter(|(n, _)| n.starts_with(".ckvc-checkout-") && n != ".ckvc-checkout-1-0")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn fsck_reports_store_damage_with_exit_3_and_goes_on() {
    let (tmp, root) = new_repo();
    for i in 0..3 {
        commit(&root, &small_step(tmp.path(), i));
    }
    let db = root.join(".ckvc/db");
    let backup = tmp.path().join("db-backup");
    super::copy_dir(&db, &backup);

    // A deleted blob file: every file using its chunks is reported.
    let blob = listing(&db)
        .into_iter()
        .filter(|(n, _)| n.ends_with(".blob"))
        .max_by_key(|(_, len)| *len)
        .unwrap()
        .0;
    std::fs::remove_file(db.join(&blob)).unwrap();
    let (code, out, err) = run_ckvc(&root, &["fsck"]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(out.matches("damaged:").count() >= 2, "{out}");
    assert!(out.contains("model.bf16.safetensors"), "{out}");

    // A table file whose footer is overwritten.
    std::fs::remove_dir_all(&db).unwrap();
    super::copy_dir(&backup, &db);
    let sst = listing(&db)
        .into_iter()
        .filter(|(n, _)| n.ends_with(".sst"))
        .max_by_key(|(_, len)| *len)
        .unwrap()
        .0;
    let mut bytes = std::fs::read(db.join(&sst)).unwrap();
    let n = bytes.len();
    bytes[n - 8..].copy_from_slice(b"XXXXXXXX");
    std::fs::write(db.join(&sst), bytes).unwrap();
    let (code, out, err) = run_ckvc(&root, &["fsck"]);
    assert_eq!(code, Some(3), "{out}{err}");
    assert!(
        out.contains("damaged:") || err.contains("damaged"),
        "{out}{err}"
    );
}

#[test]
fn readers_beside_gc_never_report_false_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    std::fs::create_dir(&root).unwrap();
    let (code, _, err) = run_ckvc(&root, &["init", "--max-chain", "1000"]);
    assert_eq!(code, Some(0), "{err}");
    // The whole corpus: compactions rewrite enough files to race the
    // readers' opens (the review saw 4 false corruptions in 66 reads).
    let dirs: Vec<PathBuf> = steps().into_iter().map(|(_, d)| d).collect();
    for d in &dirs {
        commit(&root, d);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (root, stop) = (root.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut runs = 0;
            for chain in [0, 3, 1, 2, 0, 1, 0, 3] {
                let chain = chain.to_string();
                let (code, _, err) = run_ckvc(
                    &root,
                    &["gc", "--compact", "--chain", &chain, "--grace", "0s"],
                );
                assert_eq!(code, Some(0), "gc: {err}");
                runs += 1;
            }
            stop.store(true, Ordering::SeqCst);
            runs
        })
    };
    let (mut ok, mut busy, mut reads) = (0, 0, 0);
    let start = Instant::now();
    while !stop.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(300) {
        let out = tmp.path().join(format!("out-{reads}"));
        let args: Vec<String> = if reads % 2 == 0 {
            vec!["log".into()]
        } else {
            vec![
                "checkout".into(),
                "HEAD".into(),
                "-o".into(),
                out.to_string_lossy().into_owned(),
            ]
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, err) = run_ckvc(&root, &args);
        match code {
            Some(0) => ok += 1,
            Some(4) => {
                assert!(
                    err.contains("being rewritten") || err.contains("locked"),
                    "{err}"
                );
                busy += 1;
            }
            other => panic!("{args:?} beside gc: exit {other:?}: {err}"),
        }
        if code == Some(0) && reads % 2 == 1 {
            same_tree(dirs.last().unwrap(), &out);
        }
        let _ = std::fs::remove_dir_all(&out);
        reads += 1;
    }
    assert_eq!(writer.join().unwrap(), 8);
    assert!(ok > 0, "no read succeeded ({busy} busy)");
}

#[cfg(unix)]
#[test]
fn checkout_force_never_writes_through_a_symlink() {
    use std::os::unix::fs::symlink;
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    std::fs::create_dir(ck.join("sub")).unwrap();
    std::fs::write(ck.join("sub/notes.txt"), b"inside").unwrap();
    commit(&root, &ck);

    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(outside.join("dir")).unwrap();
    std::fs::write(outside.join("victim"), b"keep me").unwrap();
    let out = root.join("out");
    std::fs::create_dir(&out).unwrap();
    symlink(outside.join("victim"), out.join("model.bf16.safetensors")).unwrap();
    symlink(outside.join("dir"), out.join("sub")).unwrap();
    let (code, o, err) = run_ckvc(&root, &["checkout", "0", "-o", "out", "--force"]);
    assert_eq!(code, Some(0), "{o}{err}");
    assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"keep me");
    assert_eq!(listing(&outside.join("dir")), vec![]);
    for p in ["model.bf16.safetensors", "sub"] {
        let m = std::fs::symlink_metadata(out.join(p)).unwrap();
        assert!(!m.file_type().is_symlink(), "{p} is still a link");
    }
    same_tree(&ck, &out);
}

/// Put a commit whose tree holds `path` (with the manifest of a real
/// file) on a new branch `evil`, through the library's store.
fn craft_commit_with_path(root: &Path, path: &str) -> CommitId {
    use ckvc::repo::objects::{object_key, Commit, Tree, KIND_COMMIT, KIND_TREE};
    let repo = Repository::open(root, true).unwrap();
    let head = repo.branch_head("main").unwrap().unwrap();
    let c = repo.commit_object(&head).unwrap();
    let tree = repo.tree(&c.tree).unwrap();
    let evil = Tree {
        entries: vec![(path.to_string(), tree.entries[0].1)],
    };
    let bytes = evil.encode();
    let tree_id = ObjectId::digest(&bytes);
    let mut b = Batch::new();
    b.put(Space::Objects, &object_key(KIND_TREE, &tree_id), bytes);
    let commit = Commit {
        tree: tree_id,
        parents: vec![head],
        ..c
    };
    let bytes = commit.encode();
    let id = CommitId::digest(&bytes);
    b.put(
        Space::Objects,
        &object_key(KIND_COMMIT, &ObjectId::from_bytes(*id.as_bytes())),
        bytes,
    );
    b.put(Space::Refs, b"refs/heads/evil", id.as_bytes().to_vec());
    repo.store().write(b).unwrap();
    id
}

#[test]
fn crafted_tree_cannot_overwrite_the_repository() {
    let (tmp, root) = new_repo();
    commit(&root, &small_step(tmp.path(), 0));
    let id = craft_commit_with_path(&root, ".ckvc/db/CURRENT");
    let current = std::fs::read(root.join(".ckvc/db/CURRENT")).unwrap();
    let hex = id.to_string();
    for args in [
        vec!["checkout", hex.as_str(), "-o", ".", "--force"],
        vec!["checkout", hex.as_str(), "-o", "elsewhere"],
    ] {
        let (code, _, err) = run_ckvc(&root, &args);
        assert_eq!(code, Some(3), "{args:?}: {err}");
        assert!(err.contains(".ckvc"), "{err}");
    }
    assert_eq!(
        std::fs::read(root.join(".ckvc/db/CURRENT")).unwrap(),
        current
    );
    // A plain checkout into a directory holding the repository's own data
    // is refused too.
    let (code, _, err) = run_ckvc(&root, &["checkout", "main", "-o", ".", "--force"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("data directory"), "{err}");
    let (code, _, err) = run_ckvc(
        &root.join(".ckvc"),
        &["checkout", "main", "-o", "..", "--force"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        std::fs::read(root.join(".ckvc/db/CURRENT")).unwrap(),
        current
    );

    // The same tree is refused when a fetch brings it: trees are decoded
    // (and their paths checked) before anything is stored.
    let remote = tmp.path().join("remote");
    let (code, _, err) = run_ckvc(
        &root,
        &["remote", "add", "origin", remote.to_str().unwrap()],
    );
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run_ckvc(&root, &["push", "origin", "evil"]);
    assert_ne!(code, Some(0), "a tree with a .ckvc path was pushed: {err}");
}

#[test]
fn ckvc_dir_inside_a_checkpoint_is_refused() {
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    std::fs::create_dir_all(ck.join(".ckvc/db")).unwrap();
    let (code, _, err) = run_ckvc(&root, &["commit", ck.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(".ckvc"), "{err}");
    // Committing the repository's own root is the same mistake.
    let (code, _, err) = run_ckvc(&root, &["commit", ".", "--step", "1"]);
    assert_eq!(code, Some(1), "{err}");
}

#[cfg(unix)]
#[test]
fn setuid_bits_are_not_restored() {
    use std::os::unix::fs::PermissionsExt;
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    let f = ck.join("trainer_state.json");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o6755)).unwrap();
    commit(&root, &ck);
    let (code, _, err) = run_ckvc(&root, &["checkout", "0", "-o", "out"]);
    assert_eq!(code, Some(0), "{err}");
    let mode = std::fs::metadata(root.join("out/trainer_state.json"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755, "{mode:o}");
}

#[test]
fn control_characters_in_messages_and_paths_are_escaped() {
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    std::fs::write(ck.join("evil\u{1b}[2J.txt"), b"x").unwrap();
    let (code, _, err) = run_ckvc(
        &root,
        &[
            "commit",
            ck.to_str().unwrap(),
            "-m",
            "clear\u{1b}[2J\u{7}screen",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    for args in [vec!["log"], vec!["show"], vec!["diff", "HEAD", "HEAD"]] {
        let (code, out, err) = run_ckvc(&root, &args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}'),
            "{args:?}: {out:?}"
        );
    }
    let (_, out, _) = run_ckvc(&root, &["log"]);
    assert!(out.contains("clear\\u{1b}[2J\\u{7}screen"), "{out}");
    let (_, out, _) = run_ckvc(&root, &["show"]);
    assert!(out.contains("evil\\u{1b}[2J.txt"), "{out}");
    // JSON keeps the exact text (JSON escapes it itself).
    let (_, out, _) = run_ckvc(&root, &["log", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["message"], "clear\u{1b}[2J\u{7}screen");
}

#[test]
fn killed_gc_garbage_is_reclaimed_by_the_next_gc() {
    let (tmp, root) = new_repo();
    for i in 0..3 {
        commit(&root, &small_step(tmp.path(), i));
    }
    let (code, _, err) = run_ckvc(&root, &["gc"]);
    assert_eq!(code, Some(0), "{err}");
    let size = || ckvc::repo::dir_size(&root.join(".ckvc"));
    let clean = size();
    // What a gc --compact killed before its compaction leaves: every chunk
    // record written again (the old values now garbage in blob files) and
    // the marker of a gc in progress.
    {
        let repo = Repository::open(&root, true).unwrap();
        let chunks = repo.store().collect_prefix(Space::Chunks, &[]).unwrap();
        for _ in 0..2 {
            let mut b = Batch::new();
            for (k, v) in &chunks {
                b.put(Space::Chunks, k, v.clone());
            }
            repo.store().write(b).unwrap();
            repo.store().flush().unwrap();
        }
        repo.store()
            .put(Space::Meta, b"gc-pending", vec![1])
            .unwrap();
    }
    let grown = size();
    assert!(grown > clean + clean / 2, "{clean} -> {grown}");
    let (code, out, err) = run_ckvc(&root, &["gc"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let after = size();
    assert!(after < clean + clean / 10, "{clean} -> {grown} -> {after}");
    let repo = Repository::open(&root, false).unwrap();
    assert_eq!(
        repo.store().get_vec(Space::Meta, b"gc-pending").unwrap(),
        None
    );
}

#[test]
fn a_retried_commit_says_already_committed() {
    let (tmp, root) = new_repo();
    let ck = small_step(tmp.path(), 0);
    commit(&root, &ck);
    // The retry of a commit whose report was lost (killed after its last
    // write): the same checkpoint at the same step on the same parent.
    let (code, out, err) = run_ckvc(&root, &["commit", ck.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("already committed as"), "{out}");
    let (_, log, _) = run_ckvc(&root, &["log"]);
    assert_eq!(log.lines().count(), 1, "{log}");
    // A different step of the same bytes is a new commit.
    let repo = Repository::open(&root, true).unwrap();
    let r = repo
        .commit(
            &ck,
            &CommitOptions {
                step: Some(7),
                ..CommitOptions::default()
            },
        )
        .unwrap();
    assert!(!r.already_committed);
}

#[cfg(unix)]
#[test]
fn checkout_of_more_files_than_open_descriptors_allowed_succeeds() {
    use std::os::unix::process::CommandExt;
    let (tmp, root) = new_repo();
    let ck = tmp.path().join("step-1");
    std::fs::create_dir_all(ck.join("shards")).unwrap();
    for i in 0..600 {
        std::fs::write(
            ck.join(format!("shards/part-{i:04}.txt")),
            format!("shard {i}\n"),
        )
        .unwrap();
    }
    commit(&root, &ck);
    // A soft limit of 256 open files, as many systems set 1024.
    // SAFETY: the pre_exec closure only calls setrlimit, which is
    // async-signal-safe, and allocates nothing between fork and exec.
    let out = unsafe {
        Command::new(env!("CARGO_BIN_EXE_ckvc"))
            .current_dir(&root)
            .args(["checkout", "1", "-o", "out"])
            .pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 256,
                    rlim_max: 256,
                };
                // SAFETY: setrlimit with a valid struct, before exec.
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
            .output()
            .unwrap()
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    same_tree(&ck, &root.join("out"));
}

#[test]
fn a_checkout_onto_a_full_disk_is_a_clear_error_and_leaves_no_file() {
    let Some(fs) = tmpfs_or_skip(40, "checkout onto a full disk") else {
        return;
    };
    let (tmp, root) = new_repo();
    let ckpt = small_step(tmp.path(), 0);
    commit(&root, &ckpt);
    let out = fs.path().join("out");
    // Less room than the checkpoint needs: a write fails part way through
    // a file (on the write thread, direct where tmpfs takes it).
    for leave in [64 << 10, 1 << 20] {
        fs.fill_to(leave);
        let (code, o, err) = run_ckvc(&root, &["checkout", "HEAD", "-o", out.to_str().unwrap()]);
        assert_eq!(code, Some(1), "{leave} free: {o}{err}");
        assert!(err.to_lowercase().contains("no space left"), "{err}");
        let left: Vec<_> = std::fs::read_dir(&out)
            .map(|rd| rd.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{leave} free: left behind {left:?}");
        fs.unfill();
    }
    let (code, o, err) = run_ckvc(&root, &["checkout", "HEAD", "-o", out.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{o}{err}");
    same_tree(&ckpt, &out);
}

/// A file where `init` or `commit` wants a directory is the caller's bad
/// input (`RepoError::BadInput`: `InvalidInputError` in Python), not an
/// I/O failure; was `Io` ("File exists (os error 17)", "Not a directory
/// (os error 20)", "No such file or directory (os error 2)").
#[test]
fn init_on_a_file_and_commit_of_a_missing_directory_are_bad_input() {
    use ckvc::repo::{Config, RepoError};
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    for dir in [file.clone(), file.join("sub")] {
        match Repository::init(&dir, Config::default()) {
            Err(RepoError::BadInput { path, .. }) => assert_eq!(path, dir),
            other => panic!("init {}: {other:?}", dir.display()),
        }
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    let repo = Repository::init(&tmp.path().join("repo"), Config::default()).unwrap();
    let missing = tmp.path().join("no-such-checkpoint");
    match repo.commit(&missing, &CommitOptions::default()) {
        Err(RepoError::BadInput { path, reason }) => {
            assert_eq!(path, missing);
            assert_eq!(reason, "no such directory");
        }
        other => panic!("commit of a missing directory: {other:?}"),
    }
}
