//! The repository on the real corpus: every step committed in order and
//! checked out byte for byte, a branch resumed mid-run, and bad input that
//! must leave the repository unchanged.

use std::path::PathBuf;
use std::process::Command;

use super::{copy_dir, same_tree, steps};
use ckvc::repo::{CheckoutOptions, CommitOptions, Config, RepoError, Repository};

#[test]
fn every_step_commits_and_checks_out_byte_exact_and_a_branch_resumes_mid_run() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(tmp.path(), Config::default()).unwrap();
    let mut ids = Vec::new();
    let mut logical = 0;
    let mut stored = 0;
    for (step, dir) in steps() {
        let r = repo.commit(&dir, &CommitOptions::default()).unwrap();
        assert_eq!(r.step, step, "step from trainer_state.json");
        logical += r.stats.logical_bytes;
        stored += r.stats.stored_bytes;
        ids.push((step, r.id, dir));
    }
    assert_eq!(ids.len(), 11);
    assert!(
        stored < logical * 85 / 100,
        "the run compresses: {stored} of {logical}"
    );
    // Same content again: (almost) nothing new.
    let again = repo
        .commit(
            &ids[10].2,
            &CommitOptions {
                step: Some(601),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(again.stats.new_chunks, 0);
    assert!(
        again.stats.stored_bytes < 4096,
        "{}",
        again.stats.stored_bytes
    );

    drop(repo);
    // A reader (no lock) checks every step out.
    let reader = Repository::open(tmp.path(), false).unwrap();
    for (step, id, dir) in &ids {
        assert_eq!(reader.resolve(&step.to_string()).unwrap(), *id);
        let out = tmp.path().join(format!("out-{step}"));
        let r = reader
            .checkout(id, &out, &CheckoutOptions::default())
            .unwrap();
        assert_eq!(r.step, *step);
        same_tree(dir, &out);
    }
    let log = reader.log(None, None).unwrap();
    assert_eq!(log.len(), 12);
    assert_eq!(log[0].commit.step, 601);
    assert!(
        log.iter().any(|e| e.commit.stats.max_depth > 0),
        "deltas are used"
    );
    // Chains stop at `max_chain`: the step after the one where a tensor's
    // chain reached it stores that tensor whole, and its chain starts
    // again (a matrix here; biases start from shared zeros at step 0, so
    // their chains run a step behind).
    let max_chain = Config::default().max_chain;
    let depths: Vec<u16> = ids
        .iter()
        .map(|(_, id, _)| {
            let r = reader.show(id).unwrap();
            let f = r.files.iter().find(|f| f.path == "model.safetensors");
            let f = f.expect("weights");
            assert!(f.storage().max_depth <= max_chain);
            let t = f.tensors().find(|t| t.name == "h.0.c_attn.weight");
            t.expect("a matrix").storage.max_depth
        })
        .collect();
    let expect: Vec<u16> = (0..ids.len() as u16).map(|i| i % (max_chain + 1)).collect();
    assert_eq!(depths, expect);
    assert_eq!(reader.resolve("HEAD~1").unwrap(), ids[10].1);
    drop(reader);

    // Resume from step 240 on a branch: its log is 240's history plus the
    // new commit; main is untouched.
    let repo = Repository::open(tmp.path(), true).unwrap();
    let at = repo.resolve("240").unwrap();
    repo.create_branch("exp", &at).unwrap();
    let r = repo
        .commit(
            &ids[7].2,
            &CommitOptions {
                step: Some(241),
                branch: Some("exp".into()),
                ..Default::default()
            },
        )
        .unwrap();
    let exp = repo.log(Some("exp"), None).unwrap();
    assert_eq!(
        exp.iter().map(|e| e.commit.step).collect::<Vec<_>>(),
        vec![241, 240, 180, 120, 60, 0]
    );
    assert_eq!(repo.log(Some("main"), None).unwrap().len(), 12);
    assert_eq!(repo.resolve("exp@241").unwrap(), r.id);
    let out = tmp.path().join("out-exp");
    repo.checkout(&r.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&ids[7].2, &out);
    // --only, and refusing a non-empty output.
    let out = tmp.path().join("only");
    repo.checkout(
        &r.id,
        &out,
        &CheckoutOptions {
            only: vec!["*.json".into()],
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    assert!(matches!(
        repo.checkout(&r.id, &out, &CheckoutOptions::default()),
        Err(RepoError::OutputNotEmpty { .. })
    ));
    // A second writer is refused while this one holds the lock; a reader
    // beside it sees every commit and checks out.
    assert!(matches!(
        Repository::open(tmp.path(), true),
        Err(RepoError::Store(ckvc::store::StoreError::Locked { .. }))
    ));
    let reader = Repository::open(tmp.path(), false).unwrap();
    assert_eq!(reader.resolve("exp@241").unwrap(), r.id);
    let out = tmp.path().join("beside-writer");
    reader
        .checkout(&r.id, &out, &CheckoutOptions::default())
        .unwrap();
    same_tree(&ids[7].2, &out);
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_the_branch_where_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(tmp.path(), Config::default()).unwrap();
    let good = super::corpus().join("step-60");
    let first = repo.commit(&good, &CommitOptions::default()).unwrap();
    let unchanged =
        |repo: &Repository| assert_eq!(repo.branch_head("main").unwrap(), Some(first.id));

    // safetensors whose header lies about its offsets
    let bad = tmp.path().join("bad-st");
    copy_dir(&good, &bad);
    let mut st = std::fs::read(bad.join("model.safetensors")).unwrap();
    st.truncate(st.len() - 100);
    std::fs::write(bad.join("model.safetensors"), &st).unwrap();
    let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
    assert!(matches!(e, RepoError::Format { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    unchanged(&repo);

    // a zip whose central directory is damaged
    let bad = tmp.path().join("bad-zip");
    copy_dir(&good, &bad);
    let mut pt = std::fs::read(bad.join("optimizer.pt")).unwrap();
    let n = pt.len();
    pt[n - 22..n - 18].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    let eocd = (0..n - 3)
        .rev()
        .find(|&i| pt[i..i + 4] == [0x50, 0x4b, 0x01, 0x02])
        .unwrap();
    pt[eocd + 10] ^= 0xff;
    std::fs::write(bad.join("optimizer.pt"), &pt).unwrap();
    let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
    assert!(e.to_string().contains("optimizer.pt"), "{e}");
    unchanged(&repo);

    // a pickle with an opcode torch never writes (nothing is executed)
    let bad = tmp.path().join("bad-pickle");
    copy_dir(&good, &bad);
    let mut pt = std::fs::read(bad.join("optimizer.pt")).unwrap();
    let at = pt
        .windows(3)
        .position(|w| w == [0x80, 0x02, b'}'])
        .expect("the pickle's PROTO 2 and EMPTY_DICT");
    pt[at + 2] = 0xfe;
    std::fs::write(bad.join("optimizer.pt"), &pt).unwrap();
    let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("optimizer.pt") && e.to_string().contains("opcode"),
        "{e}"
    );
    unchanged(&repo);

    // a special file (a named pipe)
    #[cfg(unix)]
    {
        let bad = tmp.path().join("bad-fifo");
        copy_dir(&good, &bad);
        let ok = Command::new("mkfifo")
            .arg(bad.join("pipe"))
            .status()
            .map(|s| s.success());
        if ok.unwrap_or(false) {
            let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
            assert!(
                e.to_string().contains("pipe") && e.to_string().contains("special file"),
                "{e}"
            );
            unchanged(&repo);
        }
    }

    // a symlink and a path with no step
    let bad = tmp.path().join("bad-link");
    copy_dir(&good, &bad);
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("/etc/passwd", bad.join("evil")).unwrap();
        let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
        assert!(
            e.to_string().contains("evil") && e.to_string().contains("symbolic link"),
            "{e}"
        );
        unchanged(&repo);
        std::fs::remove_file(bad.join("evil")).unwrap();
    }
    std::fs::remove_file(bad.join("trainer_state.json")).unwrap();
    let e = repo.commit(&bad, &CommitOptions::default()).unwrap_err();
    assert!(matches!(e, RepoError::NoStep { .. }), "{e}");
    unchanged(&repo);

    // an unreadable file
    #[cfg(unix)]
    if !is_root() {
        use std::os::unix::fs::PermissionsExt;
        let p = bad.join("model.bf16.safetensors");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o000)).unwrap();
        let e = repo
            .commit(
                &bad,
                &CommitOptions {
                    step: Some(1),
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("model.bf16.safetensors"), "{e}");
        unchanged(&repo);
    }
}

#[cfg(unix)]
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(true)
}

#[test]
fn cli_quick_start_init_commit_log_checkout_branch() {
    let tmp = tempfile::tempdir().unwrap();
    let ckvc = |args: &[&str]| super::run_ckvc(tmp.path(), args);
    let c = super::corpus();
    assert_eq!(ckvc(&["init"]).0, Some(0));
    for s in ["step-0", "step-60", "step-120"] {
        let (code, out, err) = ckvc(&["commit", c.join(s).to_str().unwrap(), "-m", s]);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("ratio"), "{out}");
    }
    let (code, out, _) = ckvc(&["log", "--json"]);
    assert_eq!(code, Some(0));
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["step"], 120);
    assert_eq!(rows[0]["metrics"]["eval_loss"], 2.3734);
    let (code, out, err) = ckvc(&["checkout", "60"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("step-60"), "{out}");
    same_tree(&c.join("step-60"), &tmp.path().join("step-60"));
    assert_eq!(
        ckvc(&["checkout", "60"]).0,
        Some(1),
        "refuses a non-empty output"
    );
    let (code, _, err) = ckvc(&["checkout", "-b", "exp", "60", "-o", "resume"]);
    assert_eq!(code, Some(0), "{err}");
    let (_, out, _) = ckvc(&["branch"]);
    assert!(out.contains("* exp") && out.contains("main"), "{out}");
    assert_eq!(ckvc(&["tag", "best", "main@60"]).0, Some(0));
    assert_eq!(ckvc(&["tag", "best"]).0, Some(1), "tags do not move");
    let (code, out, err) = ckvc(&["checkout", "best", "-o", "tagged"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("step 60"), "{out}");
    let (code, out, _) = ckvc(&["status"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("on branch exp") && out.contains("2 branches, 3 commits reachable"),
        "{out}"
    );
    let (code, _, err) = ckvc(&["checkout", "nope"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("no branch, tag or commit id \"nope\""),
        "{err}"
    );
    // outside any repository
    let (code, _, err) = ckvc(&["-C", "/", "log"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("not a ckvc repository"), "{err}");
}

#[test]
fn commit_records_the_training_code_git_state() {
    let tmp = tempfile::tempdir().unwrap();
    let code = tmp.path().join("code");
    std::fs::create_dir_all(&code).unwrap();
    let git = |args: &[&str]| {
        let o = Command::new("git")
            .current_dir(&code)
            .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    git(&["init", "-q", "-b", "trainer"]);
    std::fs::write(code.join("train.py"), "print(1)\n").unwrap();
    git(&["add", "train.py"]);
    git(&["commit", "-q", "-m", "v1"]);
    let head = git(&["rev-parse", "HEAD"]);
    let repo_dir = tmp.path().join("repo");
    let repo = Repository::init(&repo_dir, Config::default()).unwrap();
    let step0 = super::corpus().join("step-0");
    let opts = CommitOptions {
        code: Some(code.clone()),
        ..Default::default()
    };
    let r = repo.commit(&step0, &opts).unwrap();
    let p = repo
        .commit_object(&r.id)
        .unwrap()
        .provenance
        .expect("inside a git repository");
    assert_eq!(
        (p.commit.as_str(), p.branch.as_str(), p.dirty),
        (head.as_str(), "trainer", false)
    );
    std::fs::write(code.join("train.py"), "print(2)\n").unwrap();
    let r = repo
        .commit(
            &step0,
            &CommitOptions {
                step: Some(1),
                ..opts
            },
        )
        .unwrap();
    assert!(repo.commit_object(&r.id).unwrap().provenance.unwrap().dirty);
    // Outside any git repository: no provenance, and the commit still works.
    let r = repo
        .commit(
            &step0,
            &CommitOptions {
                step: Some(2),
                code: Some(PathBuf::from("/")),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(repo.commit_object(&r.id).unwrap().provenance, None);
}

/// Writes the tensors of the safetensors file `src` into `parts` shard
/// files named like transformers' (`model-0000i-of-0000n.safetensors`).
fn write_shards(src: &std::path::Path, dir: &std::path::Path, parts: usize) {
    let bytes = std::fs::read(src).unwrap();
    let layout = ckvc::format::parse(
        "model.safetensors",
        &mut std::io::Cursor::new(&bytes),
        bytes.len() as u64,
    )
    .unwrap();
    let tensors: Vec<_> = layout.tensors().collect();
    let per = tensors.len().div_ceil(parts);
    for (i, group) in tensors.chunks(per).enumerate() {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for t in group {
            let start = data.len();
            data.extend_from_slice(&bytes[t.offset as usize..(t.offset + t.len) as usize]);
            header.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": t.dtype.safetensors_name(),
                    "shape": t.shape,
                    "data_offsets": [start, data.len()],
                }),
            );
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&h);
        file.extend_from_slice(&data);
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, parts);
        std::fs::write(dir.join(name), file).unwrap();
    }
}

#[test]
fn a_resharded_step_finds_its_delta_bases_by_tensor_name_in_other_files() {
    let s = steps();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    // Step A as one file, step B as two shards of the same tensors; and
    // the same two steps both as single files, to compare.
    let mut ratios = Vec::new();
    for (tag, sharded_b) in [("single", false), ("sharded", true)] {
        let root = tmp.path().join(tag);
        std::fs::create_dir_all(&root).unwrap();
        let repo = Repository::init(&root, Config::default()).unwrap();
        let a = ck.join(format!("{tag}-a"));
        let b = ck.join(format!("{tag}-b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::copy(
            s[4].1.join("model.safetensors"),
            a.join("model.safetensors"),
        )
        .unwrap();
        if sharded_b {
            write_shards(&s[5].1.join("model.safetensors"), &b, 2);
        } else {
            std::fs::copy(
                s[5].1.join("model.safetensors"),
                b.join("model.safetensors"),
            )
            .unwrap();
        }
        repo.commit(
            &a,
            &CommitOptions {
                step: Some(1),
                ..CommitOptions::default()
            },
        )
        .unwrap();
        let r = repo
            .commit(
                &b,
                &CommitOptions {
                    step: Some(2),
                    ..CommitOptions::default()
                },
            )
            .unwrap();
        assert!(r.stats.max_depth >= 1, "{tag}: no delta was coded");
        let ratio = r.stats.stored_bytes as f64 / r.stats.logical_bytes as f64;
        eprintln!("{tag}: step B stored at {ratio:.4} of logical");
        ratios.push(ratio);
        if sharded_b {
            // Every tensor of the shards found its base in the single file.
            let tree = repo.tree(&repo.commit_object(&r.id).unwrap().tree).unwrap();
            for (path, mid) in &tree.entries {
                let show = repo.manifest(mid, path).unwrap();
                for seg in &show.segments {
                    if let ckvc::repo::objects::SegmentRef::Tensor { name, chunks, .. } = seg {
                        for c in chunks {
                            let h = repo.chunk_header(c).unwrap();
                            assert!(
                                h.base.is_some() || h.raw_len < 4096,
                                "{path}: {name} has no delta base"
                            );
                        }
                    }
                }
            }
        }
    }
    // Re-sharding costs (almost) nothing: same deltas, a second header.
    assert!(ratios[1] < ratios[0] * 1.01, "{ratios:?}");
}

/// A [`Progress`](ckvc::repo::Progress) that sums what it is told.
#[derive(Default)]
struct Counted {
    phases: std::sync::Mutex<Vec<(String, u64, u64)>>,
    bytes: std::sync::atomic::AtomicU64,
    items: std::sync::atomic::AtomicU64,
    finished: std::sync::atomic::AtomicU64,
}

impl ckvc::repo::Progress for Counted {
    fn start(&self, phase: &str, total_bytes: u64, total_items: u64) {
        self.phases
            .lock()
            .unwrap()
            .push((phase.into(), total_bytes, total_items));
    }
    fn advance(&self, bytes: u64, items: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bytes.fetch_add(bytes, Relaxed);
        self.items.fetch_add(items, Relaxed);
    }
    fn finish(&self) {
        self.finished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Issue 20: commit and checkout report progress (the CLI draws bars from
/// it): every byte and file once, against totals announced up front.
#[test]
fn commit_and_checkout_report_every_byte_and_file_as_progress() {
    use std::sync::atomic::Ordering::Relaxed;
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::init(tmp.path(), Config::default()).unwrap();
    let (_, dir) = steps().remove(1);
    let p = Counted::default();
    let r = repo
        .commit_with_progress(&dir, &CommitOptions::default(), &p)
        .unwrap();
    let (bytes, files) = (r.stats.logical_bytes, r.stats.files);
    assert_eq!(
        *p.phases.lock().unwrap(),
        [("commit".to_string(), bytes, files)]
    );
    assert_eq!(
        (p.bytes.load(Relaxed), p.items.load(Relaxed)),
        (bytes, files)
    );
    assert_eq!(p.finished.load(Relaxed), 1);

    let p = Counted::default();
    let out = tmp.path().join("out");
    let c = repo
        .checkout_with_progress(&r.id, &out, &CheckoutOptions::default(), &p)
        .unwrap();
    assert_eq!((c.bytes, c.files), (bytes, files));
    assert_eq!(
        *p.phases.lock().unwrap(),
        [("checkout".to_string(), bytes, files)]
    );
    assert_eq!(
        (p.bytes.load(Relaxed), p.items.load(Relaxed)),
        (bytes, files)
    );
    assert_eq!(p.finished.load(Relaxed), 1);
    same_tree(&dir, &out);
}

/// Row frames in a repository: committing the corpus's last step stores
/// some optimizer chunks as row frames (format version 8) and fewer
/// bytes than a repository made with `row_frames: false` (`ckvc init
/// --no-row-frames`), which stores none; both pass fsck and check out
/// byte for byte.
#[test]
fn commit_stores_row_frames_unless_the_repository_says_not_to() {
    use ckvc::codec::FrameInfo;
    use ckvc::repo::objects::{ChunkRecord, Payload};
    use ckvc::store::{Space, StoreExt};
    let (_, last) = steps().pop().unwrap();
    let mut found = Vec::new();
    for row_frames in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let config = Config {
            row_frames,
            ..Config::default()
        };
        let repo = Repository::init(tmp.path(), config).unwrap();
        let r = repo.commit(&last, &CommitOptions::default()).unwrap();
        let records = repo.store().collect_prefix(Space::Chunks, &[]).unwrap();
        let rows = records
            .iter()
            .map(|(_, v)| ChunkRecord::decode(v).unwrap())
            .filter(|rec| {
                rec.payload == Payload::Codec && FrameInfo::parse(&rec.data).unwrap().rows
            })
            .count();
        assert!(repo.fsck(false).unwrap().is_clean());
        let out = tmp.path().join("out");
        repo.checkout(&r.id, &out, &CheckoutOptions::default())
            .unwrap();
        same_tree(&last, &out);
        found.push((rows, r.stats.stored_bytes));
    }
    let [(rows, with), (none, without)] = found[..] else {
        unreachable!()
    };
    assert!(rows > 0 && none == 0, "{rows} row frames, {none} without");
    assert!(
        with < without,
        "{with} bytes with row frames, {without} without"
    );
}
