//! `ckvc watch` beside a job that writes checkpoints slowly, file by file,
//! in the layouts of HF Trainer, DCP, DeepSpeed, Megatron and a plain
//! `step-N/`; the watcher is killed and restarted in the middle.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{run_ckvc, same_tree, steps};

/// One checkpoint as the job writes it: files (relative path, bytes) in
/// order, the completion marker last (inside or beside the directory).
struct Ckpt {
    step: u64,
    dir: String,
    files: Vec<(String, Vec<u8>)>,
    /// Written last, relative to the run directory.
    marker: Option<(String, Vec<u8>)>,
}

fn corpus_file(i: usize, name: &str) -> Vec<u8> {
    std::fs::read(steps()[i].1.join(name)).unwrap()
}

fn hf(i: usize, step: u64) -> Ckpt {
    let dir = format!("checkpoint-{step}");
    Ckpt {
        step,
        files: vec![
            (
                "model.bf16.safetensors".into(),
                corpus_file(i, "model.bf16.safetensors"),
            ),
            ("optimizer.pt".into(), corpus_file(i, "optimizer.pt")),
        ],
        marker: Some((
            format!("{dir}/trainer_state.json"),
            format!("{{\"global_step\": {step}, \"log_history\": []}}").into_bytes(),
        )),
        dir,
    }
}

fn deepspeed(i: usize, step: u64) -> Ckpt {
    Ckpt {
        step,
        dir: format!("global_step{step}"),
        files: vec![
            (
                "mp_rank_00_model_states.pt".into(),
                corpus_file(i, "optimizer.pt"),
            ),
            (
                "zero_pp_rank_0_mp_rank_00_optim_states.pt".into(),
                corpus_file(i, "optimizer.pt"),
            ),
        ],
        marker: Some(("latest".into(), format!("global_step{step}").into_bytes())),
    }
}

fn megatron(i: usize, step: u64) -> Ckpt {
    Ckpt {
        step,
        dir: format!("iter_{step:07}"),
        files: vec![(
            "mp_rank_00/model_optim_rng.pt".into(),
            corpus_file(i, "optimizer.pt"),
        )],
        marker: Some((
            "latest_checkpointed_iteration.txt".into(),
            step.to_string().into_bytes(),
        )),
    }
}

fn dcp(step: u64, fixture: &str) -> Ckpt {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dcp")
        .join(fixture);
    let dir = format!("step-{step}");
    Ckpt {
        step,
        files: vec![(
            "__0_0.distcp".into(),
            std::fs::read(d.join("__0_0.distcp")).unwrap(),
        )],
        marker: Some((
            format!("{dir}/.metadata"),
            std::fs::read(d.join(".metadata")).unwrap(),
        )),
        dir,
    }
}

fn plain(i: usize, step: u64) -> Ckpt {
    Ckpt {
        step,
        dir: format!("step-{step}"),
        files: vec![
            (
                "model.safetensors".into(),
                corpus_file(i, "model.bf16.safetensors"),
            ),
            (
                "trainer_state.json".into(),
                corpus_file(i, "trainer_state.json"),
            ),
        ],
        marker: None,
    }
}

/// Write `c` under `run` slowly: each file in a few pieces with pauses.
fn write_slowly(run: &Path, c: &Ckpt, pause: Duration) {
    let dir = run.join(&c.dir);
    for (rel, bytes) in &c.files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let mut f = std::fs::File::create(&p).unwrap();
        for piece in bytes.chunks(bytes.len() / 3 + 1) {
            std::io::Write::write_all(&mut f, piece).unwrap();
            std::io::Write::flush(&mut f).unwrap();
            std::thread::sleep(pause);
        }
    }
    if let Some((rel, bytes)) = &c.marker {
        std::fs::write(run.join(rel), bytes).unwrap();
    }
}

/// The checkpoint `c` as a finished directory under `root`, to compare.
fn expected(root: &Path, c: &Ckpt) -> PathBuf {
    let d = root.join(&c.dir);
    for (rel, bytes) in &c.files {
        let p = d.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    if let Some((rel, bytes)) = &c.marker {
        if let Some(inner) = rel.strip_prefix(&format!("{}/", c.dir)) {
            std::fs::write(d.join(inner), bytes).unwrap();
        }
    }
    d
}

fn start_watch(repo: &Path, run: &Path, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ckvc"))
        .current_dir(repo)
        .args(["watch", "--interval", "0.1", "--settle", "1", "--json"])
        .args(extra)
        .arg(run)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// `ckvc watch` lowers its priority (nice +10 by default, `--nice N`)
/// before it commits, so the training job beside it comes first.
#[cfg(target_os = "linux")]
#[test]
fn watch_runs_at_a_lower_priority_than_the_job() {
    fn nice_of(child: &Child) -> i64 {
        // /proc/PID/stat: the command sits in parentheses; the nice value
        // is field 19, the 17th after them.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        rest.split(' ').nth(16).unwrap().parse().unwrap()
    }
    let tmp = tempfile::tempdir().unwrap();
    let (repo, run) = (tmp.path().join("repo"), tmp.path().join("run"));
    for d in [&repo, &run] {
        std::fs::create_dir(d).unwrap();
    }
    let (code, _, err) = run_ckvc(&repo, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    // SAFETY: reads this process's priority; no memory is passed.
    let ours = i64::from(unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) });
    for (extra, by) in [
        (vec![], 10),
        (vec!["--nice", "3"], 3),
        (vec!["--nice", "0"], 0),
    ] {
        let mut w = start_watch(&repo, &run, &extra);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = ours;
        while Instant::now() < deadline {
            seen = nice_of(&w);
            if seen == (ours + by).min(19) && (by == 0 || seen != ours) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        w.kill().unwrap();
        w.wait().unwrap();
        assert_eq!(seen, (ours + by).min(19), "--nice {by}");
    }
    let run = run.to_str().unwrap();
    let (code, _, err) = run_ckvc(&repo, &["watch", "--nice", "20", "--once", run]);
    assert_eq!(
        code,
        Some(2),
        "an out-of-range --nice is a usage error: {err}"
    );
}

fn logged_steps(repo: &Path) -> Vec<(u64, String)> {
    let (code, out, err) = run_ckvc(repo, &["log", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut s: Vec<(u64, String)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    s.reverse(); // oldest first
    s
}

/// The job writes `ckpts` in order while a watcher runs; the watcher is
/// killed after the first commit and started again. Returns the repository
/// and the finished checkpoints to compare with.
fn run_job(ckpts: Vec<Ckpt>, prune: Option<usize>) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (repo, run, want) = (
        tmp.path().join("repo"),
        tmp.path().join("run"),
        tmp.path().join("want"),
    );
    for d in [&repo, &run, &want] {
        std::fs::create_dir(d).unwrap();
    }
    let (code, _, err) = run_ckvc(&repo, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    let keep = prune.map(|k| k.to_string());
    let extra: Vec<&str> = match &keep {
        Some(k) => vec!["--prune-local", k.as_str()],
        None => vec![],
    };
    for c in &ckpts {
        expected(&want, c);
    }
    let last = ckpts.last().unwrap().step;
    let n = ckpts.len();
    let writer = {
        let run = run.clone();
        std::thread::spawn(move || {
            for c in &ckpts {
                write_slowly(&run, c, Duration::from_millis(60));
                std::thread::sleep(Duration::from_millis(150));
            }
        })
    };
    let mut watcher = start_watch(&repo, &run, &extra);
    // Kill the watcher once it has committed something, then restart it.
    let start = Instant::now();
    while logged_steps(&repo).is_empty() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    watcher.kill().unwrap();
    watcher.wait().unwrap();
    let mut watcher = start_watch(&repo, &run, &extra);
    writer.join().unwrap();
    let start = Instant::now();
    while logged_steps(&repo).last().map(|s| s.0) != Some(last) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "not every checkpoint was committed: {:?}",
            logged_steps(&repo)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // With --prune-local K, let the pruning pass after the last commit
    // finish: wait until at most K checkpoint directories are left (a fixed
    // sleep was too short on a loaded machine), with a generous deadline.
    if let Some(k) = prune {
        let dirs = || {
            std::fs::read_dir(&run)
                .unwrap()
                .filter(|e| e.as_ref().unwrap().path().is_dir())
                .count()
        };
        let start = Instant::now();
        while dirs() > k && start.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    watcher.kill().unwrap();
    watcher.wait().unwrap();
    let logged = logged_steps(&repo);
    assert_eq!(logged.len(), n, "each checkpoint exactly once: {logged:?}");
    assert!(logged.windows(2).all(|w| w[0].0 < w[1].0), "{logged:?}");
    (tmp, repo, want)
}

/// Every commit checks out byte-exact as the finished checkpoint.
fn check_commits(repo: &Path, want: &Path, ckpts: &[(u64, String)]) {
    let logged = logged_steps(repo);
    for ((step, dir), (lstep, id)) in ckpts.iter().zip(&logged) {
        assert_eq!(step, lstep);
        let out = repo.join(format!("out-{step}"));
        let (code, _, err) = run_ckvc(repo, &["checkout", id, "-o", out.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{err}");
        same_tree(&want.join(dir), &out);
    }
}

fn names(ckpts: &[Ckpt]) -> Vec<(u64, String)> {
    ckpts.iter().map(|c| (c.step, c.dir.clone())).collect()
}

#[test]
fn watch_commits_each_hf_trainer_checkpoint_once_in_order_across_a_restart() {
    let ckpts: Vec<Ckpt> = (0..4).map(|i| hf(i, 10 * (i as u64 + 1))).collect();
    let want_names = names(&ckpts);
    let (_tmp, repo, want) = run_job(ckpts, None);
    check_commits(&repo, &want, &want_names);
}

#[test]
fn watch_understands_deepspeed_megatron_dcp_and_plain_layouts() {
    type Make = Box<dyn Fn(usize, u64) -> Ckpt>;
    let layouts: Vec<(&str, Make)> = vec![
        ("deepspeed", Box::new(deepspeed)),
        ("megatron", Box::new(megatron)),
        (
            "dcp",
            Box::new(|i, step| dcp(step, if i % 2 == 0 { "step-1" } else { "step-2" })),
        ),
        ("plain", Box::new(plain)),
    ];
    for (name, make) in layouts {
        let ckpts: Vec<Ckpt> = (0..3).map(|i| make(i, 100 + i as u64)).collect();
        let want_names = names(&ckpts);
        let (_tmp, repo, want) = run_job(ckpts, None);
        check_commits(&repo, &want, &want_names);
        eprintln!("{name}: ok");
    }
}

#[test]
fn watch_prune_local_never_deletes_an_uncommitted_checkpoint() {
    let ckpts: Vec<Ckpt> = (0..4).map(|i| hf(i, 10 * (i as u64 + 1))).collect();
    let want_names = names(&ckpts);
    let (_tmp, repo, want) = run_job(ckpts, Some(1));
    let run = repo.parent().unwrap().join("run");
    let left: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["checkpoint-40".to_string()]);
    check_commits(&repo, &want, &want_names);

    // A checkpoint that is not committed (here: older than the branch
    // head, so it never will be) is never deleted.
    let stray = run.join("checkpoint-5");
    write_slowly(&run, &hf(0, 5), Duration::ZERO);
    let (code, _, err) = run_ckvc(
        &repo,
        &[
            "watch",
            "--once",
            "--interval",
            "0.1",
            "--prune-local",
            "0",
            run.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(stray.is_dir(), "an uncommitted checkpoint was deleted");
    assert!(
        !run.join("checkpoint-40").exists(),
        "checkpoint-40 was committed and verified"
    );
}
