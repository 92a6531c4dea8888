//! Special files where checkpoint files were, and pickles that repeat one
//! big object by memo: each test is named after the bug it pinned (found
//! by a hostile review).
//!
//! The hang tests run the operation on a thread and give it a time limit;
//! on a hang they unblock the FIFO (open it for writing) so the test
//! process does not stay stuck, then fail.

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use ckvc::repo::{CommitOptions, Config, Repository, WatchOptions};

const LIMIT: Duration = Duration::from_secs(30);

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

/// Runs `f` on a thread; `Some(result)` if it ends within [`LIMIT`], else
/// unblocks every reader of `fifo` (opening it for writing) and `None`.
fn bounded<T: Send + 'static>(fifo: &Path, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(LIMIT) {
        Ok(r) => Some(r),
        Err(_) => {
            unblock(fifo);
            None
        }
    }
}

/// Releases a thread blocked opening `fifo` for reading: a non-blocking
/// open for writing succeeds while a reader waits, and closing it gives
/// the reader end of file.
fn unblock(fifo: &Path) {
    use std::os::unix::fs::OpenOptionsExt;
    for _ in 0..50 {
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn new_repo(tmp: &Path) -> PathBuf {
    let root = tmp.join("repo");
    std::fs::create_dir(&root).unwrap();
    Repository::init(&root, Config::default()).unwrap();
    root
}

/// The bf16 model of corpus step `i` in `<root>/step-<n>`.
fn small_step(root: &Path, i: usize) -> PathBuf {
    let steps = super::steps();
    let (step, dir) = &steps[i];
    let d = root.join(format!("step-{step}"));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(
        dir.join("model.bf16.safetensors"),
        d.join("model.bf16.safetensors"),
    )
    .unwrap();
    d
}

/// `commit --run` reads each subdirectory's `trainer_state.json` (to find
/// its step) before listing its files, with `read_to_string`: a FIFO there
/// blocks the command forever instead of being refused as a special file.
#[test]
fn commit_run_hangs_on_a_fifo_trainer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let root = new_repo(tmp.path());
    let run = tmp.path().join("run");
    let ck = run.join("checkpoint-5");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("a.bin"), b"hello").unwrap();
    let fifo = ck.join("trainer_state.json");
    mkfifo(&fifo);
    let r = bounded(&fifo, move || {
        let repo = Repository::open(&root, true).unwrap();
        repo.commit_run(&run, &CommitOptions::default(), |_| {})
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let r = r.expect("commit_run hung on a FIFO named trainer_state.json");
    let e = r.expect_err("a FIFO in a checkpoint is an error");
    assert!(e.contains("special file"), "{e}");
}

/// `watch` reads `trainer_state.json` of each `checkpoint-N/` (and the
/// run's `latest` tracker) with `std::fs::read`: a FIFO there blocks the
/// watcher forever.
/// `watch --once` on `run` (a repository beside it) ends within the limit
/// though `fifo` is a FIFO.
fn watch_ends_despite(tmp: &Path, run: PathBuf, fifo: &Path) -> bool {
    let root = new_repo(tmp);
    mkfifo(fifo);
    let opts = WatchOptions {
        once: true,
        interval: Duration::from_millis(10),
        ..WatchOptions::default()
    };
    let r = bounded(fifo, move || {
        ckvc::repo::watch(&root, &run, &opts, |_| std::ops::ControlFlow::Continue(()))
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    r.is_some()
}

#[test]
fn watch_hangs_on_a_fifo_marker() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let ck = run.join("checkpoint-5");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("a.bin"), b"hello").unwrap();
    assert!(
        watch_ends_despite(tmp.path(), run, &ck.join("trainer_state.json")),
        "watch hung on a FIFO named trainer_state.json"
    );

    // The DeepSpeed tracker `latest` in the run directory itself.
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    std::fs::create_dir_all(run.join("global_step5")).unwrap();
    let fifo = run.join("latest");
    assert!(
        watch_ends_despite(tmp.path(), run, &fifo),
        "watch hung on a FIFO named latest"
    );
}

/// A delta commit reads its bases from the parent's checkpoint directory
/// (`Meta/commit-source`), opening the parent's file with `File::open`
/// before checking it is a regular file: when that file has since been
/// replaced by a FIFO, the next commit blocks forever in `open`.
#[test]
fn delta_commit_hangs_on_a_fifo_in_the_parents_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let root = new_repo(tmp.path());
    let repo = Repository::open(&root, true).unwrap();
    let a = small_step(tmp.path(), 0);
    let b = small_step(tmp.path(), 1);
    repo.commit(&a, &CommitOptions::default()).unwrap();
    drop(repo);
    // The parent's file is now a FIFO (the user reused the directory).
    let fifo = a.join("model.bf16.safetensors");
    mkfifo(&fifo);
    let r = bounded(&fifo, move || {
        let repo = Repository::open(&root, true).unwrap();
        let c = repo
            .commit(&b, &CommitOptions::default())
            .map_err(|e| e.to_string())?;
        let out = b.parent().unwrap().join("out");
        repo.checkout(&c.id, &out, &Default::default())
            .map_err(|e| e.to_string())?;
        let same = std::fs::read(out.join("model.bf16.safetensors")).unwrap()
            == std::fs::read(b.join("model.bf16.safetensors")).unwrap();
        Ok::<bool, String>(same)
    });
    let r = r.expect("commit hung opening a FIFO in its parent's directory");
    assert_eq!(r, Ok(true));
}

/// A file of the checkpoint replaced by a FIFO after the directory was
/// listed (a training job rewriting its output): the reader opens it with
/// `File::open`, which blocks until a writer appears. It must be an error.
#[test]
fn commit_hangs_when_a_file_becomes_a_fifo_while_committing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = new_repo(tmp.path());
    let ck = tmp.path().join("step-7");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("a.bin"), vec![1u8; 1 << 16]).unwrap();
    std::fs::write(ck.join("b.bin"), vec![2u8; 1 << 16]).unwrap();
    let pause = std::sync::Arc::new(ckvc::repo::Pause::new());
    // The reader stops before the first chunk of a.bin (after the listing).
    pause.hold(LIMIT * 2);
    let opts = CommitOptions {
        pause: Some(pause.clone()),
        ..CommitOptions::default()
    };
    struct Started(std::sync::Mutex<mpsc::Sender<()>>);
    impl ckvc::repo::Progress for Started {
        fn start(&self, _: &str, _: u64, _: u64) {
            let _ = self.0.lock().unwrap().send(());
        }
    }
    let (started_tx, started_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let ck2 = ck.clone();
    std::thread::spawn(move || {
        let repo = Repository::open(&root, true).unwrap();
        // One reader thread, so b.bin is opened after a.bin's chunks.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let progress = Started(std::sync::Mutex::new(started_tx));
        let r = pool.install(|| {
            repo.commit_with_progress(&ck2, &opts, &progress)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        let _ = done_tx.send(r);
    });
    started_rx.recv_timeout(LIMIT).expect("the commit starts");
    std::thread::sleep(Duration::from_millis(300));
    let fifo = ck.join("b.bin");
    mkfifo(&fifo);
    pause.clear();
    match done_rx.recv_timeout(LIMIT) {
        Ok(r) => {
            let e = r.expect_err("a FIFO is not a checkpoint file");
            assert!(e.contains("b.bin"), "{e}");
        }
        Err(_) => {
            unblock(&fifo);
            panic!("commit hung opening a file replaced by a FIFO");
        }
    }
}

/// A `.metadata` pickle whose `storage_data` holds `items` entries that
/// all name (by memo) one index object and one storage-info object, whose
/// shared state dict holds `junk` entries before the real fields.
fn shared_state_metadata(junk: usize, items: usize) -> Vec<u8> {
    let mut p = b"\x80\x02".to_vec();
    let s = |p: &mut Vec<u8>, x: &str| {
        p.push(0x8c);
        p.push(x.len() as u8);
        p.extend_from_slice(x.as_bytes());
    };
    // Object A (index and storage info at once), state {junk..., fields}.
    p.extend_from_slice(b"cm\nC\n)\x81}(");
    for _ in 0..junk {
        p.extend_from_slice(b"K\x00K\x00");
    }
    s(&mut p, "fqn");
    s(&mut p, "w");
    s(&mut p, "relative_path");
    s(&mut p, "__0_0.distcp");
    s(&mut p, "offset");
    p.extend_from_slice(b"K\x00");
    s(&mut p, "length");
    p.extend_from_slice(b"K\x01");
    p.extend_from_slice(b"ubq\x000");
    // The root Metadata object, state {"storage_data": {A: A, ...}}.
    p.extend_from_slice(b"cm\nM\n)\x81}(");
    s(&mut p, "storage_data");
    p.extend_from_slice(b"}(");
    for _ in 0..items {
        p.extend_from_slice(b"h\x00h\x00");
    }
    p.extend_from_slice(b"uub.");
    p
}

/// `DcpIndex::parse` (every commit of a directory with a `.metadata`)
/// looks each field up by a linear scan of the object's state dict, once
/// per item: a `.metadata` whose items share one state dict (by memo)
/// with many entries takes time quadratic in its size. 800 KB take
/// minutes; the 64 MiB allowed, days.
#[test]
fn dcp_metadata_with_a_shared_state_dict_takes_quadratic_time() {
    let bytes = shared_state_metadata(100_000, 100_000);
    assert!(bytes.len() < 1 << 20);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(ckvc::format::DcpIndex::parse(&bytes).is_ok());
    });
    let r = rx.recv_timeout(Duration::from_secs(10));
    assert!(r.is_ok(), "parsing an 800 KB .metadata took over 10 s");
}

/// A minimal `torch.save` zip: `archive/data.pkl` holding `pkl`, stored.
fn torch_zip_with_pickle(pkl: &[u8]) -> Vec<u8> {
    let name = b"archive/data.pkl";
    let crc = 0u32;
    let mut f = Vec::new();
    // local header
    f.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
    f.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    f.extend_from_slice(&crc.to_le_bytes());
    f.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
    f.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
    f.extend_from_slice(&(name.len() as u16).to_le_bytes());
    f.extend_from_slice(&0u16.to_le_bytes());
    f.extend_from_slice(name);
    f.extend_from_slice(pkl);
    let cd_offset = f.len() as u32;
    // central directory
    f.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
    f.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    f.extend_from_slice(&crc.to_le_bytes());
    f.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
    f.extend_from_slice(&(pkl.len() as u32).to_le_bytes());
    f.extend_from_slice(&(name.len() as u16).to_le_bytes());
    f.extend_from_slice(&[0; 12]);
    f.extend_from_slice(&0u32.to_le_bytes()); // local header offset
    f.extend_from_slice(name);
    let cd_size = f.len() as u32 - cd_offset;
    // end record
    f.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
    f.extend_from_slice(&cd_size.to_le_bytes());
    f.extend_from_slice(&cd_offset.to_le_bytes());
    f.extend_from_slice(&0u16.to_le_bytes());
    f
}

/// `optimizer_param_names` (`ckvc show` of an optimizer file) scans each
/// param group's dict for `params` and `param_names`: `param_groups`
/// listing one big dict many times (by memo) takes quadratic time.
#[test]
fn optimizer_param_groups_sharing_one_dict_take_quadratic_time() {
    let mut p = b"\x80\x02}".to_vec();
    let s = |p: &mut Vec<u8>, x: &str| {
        p.push(0x8c);
        p.push(x.len() as u8);
        p.extend_from_slice(x.as_bytes());
    };
    s(&mut p, "param_groups");
    // One group dict: junk, then empty params and param_names.
    p.extend_from_slice(b"](}(");
    for _ in 0..300_000 {
        p.extend_from_slice(b"K\x00K\x00");
    }
    s(&mut p, "params");
    p.extend_from_slice(b"]");
    s(&mut p, "param_names");
    p.extend_from_slice(b"]uq\x00");
    for _ in 0..300_000 {
        p.extend_from_slice(b"h\x00");
    }
    p.extend_from_slice(b"es.");
    let f = torch_zip_with_pickle(&p);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = ckvc::format::optimizer_param_names(&mut std::io::Cursor::new(&f), f.len() as u64);
        let _ = tx.send(r.map(|n| n.is_none()).map_err(|e| e.to_string()));
    });
    let r = rx.recv_timeout(Duration::from_secs(10));
    assert!(r.is_ok(), "reading a 1.8 MB data.pkl took over 10 s");
    assert_eq!(r.unwrap(), Ok(true));
}
