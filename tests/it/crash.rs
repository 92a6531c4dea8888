//! Crash safety: `ckvc commit`, `ckvc gc --compact` and `ckvc gc --keep`
//! run as child processes and are killed with SIGKILL at random moments
//! (at least 17 kills of each while running). After every kill: `fsck` is
//! clean, every commit on the branch checks out byte-exact as the step it
//! claims, and every commit reported done is still there unless the
//! retention policy dropped it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckvc::testing::Rng;

use super::{run_ckvc, same_tree, steps};

const KILLS_PER_OP: usize = 17;

/// How many of the last rounds a failure at the deadline prints.
const TRAIL: usize = 12;

/// A small checkpoint per step (the bf16 model, optimizer, trainer state),
/// so a kill lands anywhere in a commit within a bounded test time.
fn small_steps(root: &Path) -> Vec<(u64, PathBuf)> {
    steps()
        .into_iter()
        .map(|(step, dir)| {
            let d = root.join(format!("step-{step}"));
            std::fs::create_dir_all(&d).unwrap();
            for f in [
                "model.bf16.safetensors",
                "optimizer.pt",
                "trainer_state.json",
            ] {
                std::fs::copy(dir.join(f), d.join(f)).unwrap();
            }
            (step, d)
        })
        .collect()
}

/// Run `ckvc args` in `repo`, SIGKILL it after `delay` if still running.
/// Returns (killed while running, success, stdout).
fn run_and_kill(repo: &Path, args: &[String], delay: Duration) -> (bool, bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckvc"))
        .current_dir(repo)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut killed = false;
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() >= delay {
            child.kill().unwrap(); // SIGKILL
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let out = child.wait_with_output().unwrap();
    (
        killed,
        !killed && out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// fsck is clean and every commit on main checks out as its step; returns
/// the steps on main, newest first.
fn check_whole(repo: &Path, dirs: &[(u64, PathBuf)], context: &str) -> Vec<u64> {
    let (code, out, err) = run_ckvc(repo, &["fsck"]);
    assert_eq!(code, Some(0), "{context}: fsck: {out}{err}");
    let (code, log, err) = run_ckvc(repo, &["log", "--json"]);
    assert_eq!(code, Some(0), "{context}: {err}");
    let log: serde_json::Value = serde_json::from_str(&log).unwrap();
    let mut on_main = Vec::new();
    for e in log.as_array().unwrap() {
        let step = e["step"].as_u64().unwrap();
        let id = e["id"].as_str().unwrap();
        let out = repo.join("out");
        let _ = std::fs::remove_dir_all(&out);
        let (code, _, err) = run_ckvc(repo, &["checkout", id, "-o", "out"]);
        assert_eq!(code, Some(0), "{context}: checkout {step}: {err}");
        let dir = &dirs.iter().find(|(s, _)| *s == step).unwrap().1;
        same_tree(dir, &out);
        on_main.push(step);
    }
    on_main
}

#[test]
fn sigkill_during_commit_and_gc_never_loses_a_committed_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = small_steps(&tmp.path().join("ckpt"));
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    assert_eq!(run_ckvc(&repo, &["init", "--max-chain", "100"]).0, Some(0));
    // CKVC_CRASH_SEED replays the draws of a seed a failure printed.
    let seed = std::env::var("CKVC_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    let mut rng = Rng(seed);
    let ctx = |what: &str| format!("seed {seed}: {what}");

    let commit_args = |step: u64, dir: &Path| -> Vec<String> {
        vec![
            "commit".into(),
            dir.display().to_string(),
            "--step".into(),
            step.to_string(),
        ]
    };
    let gc_compact: Vec<String> = ["gc", "--compact", "--chain", "1", "--grace", "0s"]
        .map(String::from)
        .to_vec();
    let gc_keep: Vec<String> = ["gc", "--keep", "last=3", "--grace", "0s"]
        .map(String::from)
        .to_vec();

    // Calibrate: how long each operation takes here, unkilled.
    let time = |args: &[String]| {
        let t = Instant::now();
        let (_, ok, out) = run_and_kill(&repo, args, Duration::from_secs(600));
        assert!(ok, "{args:?}: {out}");
        t.elapsed()
    };
    let mut done: BTreeSet<u64> = BTreeSet::new();
    let mut attempted: BTreeSet<u64> = BTreeSet::new();
    let mut next = 0usize;
    let t_commit = time(&commit_args(dirs[0].0, &dirs[0].1));
    done.insert(dirs[0].0);
    attempted.insert(dirs[0].0);
    next += 1;
    let t_commit = t_commit.max(time(&commit_args(dirs[1].0, &dirs[1].1)));
    done.insert(dirs[1].0);
    attempted.insert(dirs[1].0);
    next += 1;
    let t_compact = time(&gc_compact);
    let t_keep = time(&gc_keep);

    // Each operation is killed at a random moment in [0, 1.2 t), t being
    // how long it last ran unkilled (widened by a tenth at each kill).
    // t follows the operation as the run goes on: a calibration slowed by
    // the tests running beside this one would otherwise leave the window
    // far wider than the operation, the kills would stop landing, and the
    // rounds run on (the likely way a CI run reached a 600 s deadline
    // that 20-50 s here keep far from). The deadline only bounds a hang.
    let floor = Duration::from_millis(50);
    let mut t = [t_commit, t_compact, t_keep].map(|t| t.max(floor));
    let mut kills = [0usize; 3];
    let mut round = 0usize;
    // The last rounds, for the deadline's message.
    let mut trail: std::collections::VecDeque<String> =
        std::collections::VecDeque::with_capacity(TRAIL + 1);
    let deadline = Instant::now() + Duration::from_secs(1200);
    while kills.iter().any(|&k| k < KILLS_PER_OP) {
        assert!(
            Instant::now() < deadline,
            "{}",
            ctx(&format!(
                "took too long: {round} rounds, kills {kills:?}, windows {t:?}; last rounds:\n{}",
                Vec::from(trail.clone()).join("\n")
            ))
        );
        let op = round % 3;
        round += 1;
        // Steps are reused with new step numbers once the corpus runs out.
        let (base_step, dir) = &dirs[next % dirs.len()];
        let step = *base_step + 1000 * (next / dirs.len()) as u64;
        let args = match op {
            0 => commit_args(step, dir),
            1 => gc_compact.clone(),
            _ => gc_keep.clone(),
        };
        let window = t[op].as_micros() as u64 * 6 / 5 + 1;
        let delay = Duration::from_micros(rng.next_u64() % window);
        let ran = Instant::now();
        let (killed, ok, out) = run_and_kill(&repo, &args, delay);
        let ran = ran.elapsed();
        if killed {
            kills[op] += 1;
            // Widen the window a little: the kills keep landing anywhere
            // in an operation that became slower than its last run.
            t[op] = t[op] * 11 / 10;
        } else {
            assert!(ok, "{}", ctx(&format!("{args:?} failed unkilled: {out}")));
            t[op] = ran.max(floor);
        }
        // Reported done: the commit line reached stdout.
        let reported = op == 0 && out.contains(&format!("] step {step}:"));
        assert!(!ok || op != 0 || reported, "{}", ctx(&out));
        let checked = Instant::now();
        let on_main = check_whole(
            &repo,
            &expected_dirs(&dirs),
            &ctx(&format!("after {args:?}")),
        );
        if trail.len() == TRAIL {
            trail.pop_front();
        }
        trail.push_back(format!(
            "{} delay {delay:?} ran {ran:?} killed {killed}; check of {} commits {:?}",
            args[..2].join(" "),
            on_main.len(),
            checked.elapsed()
        ));
        if op == 0 {
            attempted.insert(step);
            // A commit killed after its ref moved but before it printed
            // landed all the same.
            if reported || on_main.contains(&step) {
                done.insert(step);
                next += 1;
            }
        }
        for s in &on_main {
            assert!(
                attempted.contains(s),
                "{}",
                ctx(&format!("step {s} was never committed"))
            );
        }
        // Every step reported done is there, unless retention (last=3)
        // dropped it; the newest three are always there.
        for s in done.iter().rev().take(3) {
            assert!(
                on_main.contains(s),
                "{}",
                ctx(&format!("step {s} lost: {on_main:?}"))
            );
        }
    }
    eprintln!("crash test: seed {seed}, {round} rounds, kills {kills:?}");
}

/// Step directories by every step number used (the corpus repeats with
/// +1000, +2000, ...).
fn expected_dirs(dirs: &[(u64, PathBuf)]) -> Vec<(u64, PathBuf)> {
    (0..20u64)
        .flat_map(|k| dirs.iter().map(move |(s, d)| (s + 1000 * k, d.clone())))
        .collect()
}
