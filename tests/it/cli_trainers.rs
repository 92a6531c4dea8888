//! The CLI as trainers use it: metrics from HF Trainer's `log_history`,
//! step sources and order, branches, run import, revision errors, `show`,
//! `log`, `checkout --clean`. One test per reported problem.

use std::path::{Path, PathBuf};

use super::{run_ckvc, same_tree, steps};

/// A repository in a fresh temporary directory.
fn repo() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    std::fs::create_dir(&root).unwrap();
    let (code, _, err) = run_ckvc(&root, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    (tmp, root)
}

/// An HF Trainer checkpoint directory `checkpoint-<step>` with a
/// `trainer_state.json` as transformers 5 writes it: the metrics only in
/// `log_history`, which also holds entries after this step.
fn hf_checkpoint(root: &Path, i: usize, step: u64) -> PathBuf {
    let d = root.join(format!("checkpoint-{step}"));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(
        steps()[i].1.join("model.bf16.safetensors"),
        d.join("model.safetensors"),
    )
    .unwrap();
    let state = serde_json::json!({
        "best_global_step": null, "best_metric": null, "epoch": step as f64 / 100.0,
        "eval_steps": 500, "global_step": step, "is_local_process_zero": true,
        "logging_steps": 10, "max_steps": 1000,
        "log_history": [
            {"epoch": 0.1, "grad_norm": 0.9, "learning_rate": 5e-5, "loss": 2.5, "step": 10},
            {"epoch": 0.2, "eval_loss": 2.2, "eval_runtime": 1.5, "step": step},
            {"epoch": 0.2, "grad_norm": 0.5, "learning_rate": 4e-5, "loss": 2.0 + 1.0 / step as f64, "step": step},
            {"epoch": 0.3, "loss": 0.1, "eval_loss": 0.1, "step": step + 10},
        ],
        "stateful_callbacks": {}, "total_flos": 1.0, "train_batch_size": 8,
    });
    std::fs::write(
        d.join("trainer_state.json"),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();
    d
}

fn log_json(root: &Path) -> Vec<serde_json::Value> {
    let (code, out, err) = run_ckvc(root, &["log", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    serde_json::from_str(&out).unwrap()
}

fn commit(root: &Path, args: &[&str]) -> String {
    let mut a = vec!["commit"];
    a.extend_from_slice(args);
    let (code, out, err) = run_ckvc(root, &a);
    assert_eq!(code, Some(0), "{args:?}: {out}{err}");
    out
}

#[test]
fn metrics_come_from_the_log_history_of_the_checkpoints_own_step() {
    let (tmp, root) = repo();
    let ck = hf_checkpoint(tmp.path(), 0, 20);
    commit(&root, &[ck.to_str().unwrap()]);
    let log = log_json(&root);
    let m = &log[0]["metrics"];
    assert_eq!(m["eval_loss"], 2.2, "{m}");
    assert_eq!(m["loss"], 2.05, "{m}");
    assert_eq!(m["learning_rate"], 4e-5, "{m}");
    assert_eq!(m["grad_norm"], 0.5, "{m}");
    assert_eq!(m["epoch"], 0.2, "{m}");
    // The human log shows them too.
    let (_, out, _) = run_ckvc(&root, &["log"]);
    assert!(out.contains("loss 2.0500 eval 2.2000"), "{out}");
}

#[test]
fn commit_metric_flag_records_metrics_for_trainers_without_state() {
    let (tmp, root) = repo();
    let d = tmp.path().join("step-5");
    std::fs::create_dir(&d).unwrap();
    std::fs::copy(
        steps()[0].1.join("model.bf16.safetensors"),
        d.join("m.safetensors"),
    )
    .unwrap();
    commit(
        &root,
        &[
            d.to_str().unwrap(),
            "--metric",
            "eval_loss=0.31",
            "--metric",
            "acc=0.9",
        ],
    );
    let log = log_json(&root);
    assert_eq!(log[0]["metrics"]["eval_loss"], 0.31);
    assert_eq!(log[0]["metrics"]["acc"], 0.9);
    let (code, _, err) = run_ckvc(&root, &["commit", d.to_str().unwrap(), "--metric", "x"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("KEY=VALUE"), "{err}");
}

#[test]
fn gc_keep_best_refuses_when_commits_lack_the_metric() {
    let (tmp, root) = repo();
    for (i, step) in [(0, 10), (1, 20), (2, 30)] {
        let d = tmp.path().join(format!("step-{step}"));
        std::fs::create_dir(&d).unwrap();
        std::fs::copy(
            steps()[i].1.join("model.bf16.safetensors"),
            d.join("m.safetensors"),
        )
        .unwrap();
        commit(&root, &[d.to_str().unwrap()]);
    }
    let (_, before, _) = run_ckvc(&root, &["log"]);
    for keep in ["best=1", "best=1:loss"] {
        let (code, out, err) = run_ckvc(&root, &["gc", "--keep", keep, "--dry-run"]);
        assert_eq!(code, Some(1), "{keep}: {out}{err}");
        assert!(
            err.contains("have no value of") && err.contains("step 20, 10"),
            "{err}"
        );
        let (code, _, err) = run_ckvc(&root, &["gc", "--keep", keep]);
        assert_eq!(code, Some(1), "{err}");
    }
    let (_, after, _) = run_ckvc(&root, &["log"]);
    assert_eq!(before, after, "nothing was dropped");
}

#[test]
fn commit_line_says_where_the_step_came_from() {
    let (tmp, root) = repo();
    // accelerate's save_state layout: checkpoint_<i>, no trainer state.
    let acc = tmp.path().join("checkpoint_3");
    std::fs::create_dir(&acc).unwrap();
    std::fs::copy(
        steps()[0].1.join("model.bf16.safetensors"),
        acc.join("model.safetensors"),
    )
    .unwrap();
    let out = commit(&root, &[acc.to_str().unwrap()]);
    assert!(
        out.contains("step 3:") && out.contains("step from the directory name"),
        "{out}"
    );
    // With accelerate's RNG files it is accelerate's save counter, and the
    // commit line says that it is not a training step.
    let acc = tmp.path().join("checkpoint_4");
    std::fs::create_dir(&acc).unwrap();
    std::fs::copy(
        steps()[1].1.join("model.bf16.safetensors"),
        acc.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(acc.join("random_states_0.pkl"), b"not read").unwrap();
    let out = commit(&root, &[acc.to_str().unwrap()]);
    assert!(
        out.contains("step 4:")
            && out.contains("counts saves, not training steps")
            && out.contains("--step"),
        "{out}"
    );
    let hf = hf_checkpoint(tmp.path(), 1, 40);
    let out = commit(&root, &[hf.to_str().unwrap()]);
    assert!(
        out.contains("step 40:") && out.contains("step from trainer_state.json"),
        "{out}"
    );
    let out = commit(&root, &[hf.to_str().unwrap(), "--step", "41"]);
    assert!(
        out.contains("step 41:") && out.contains("step given"),
        "{out}"
    );
}

#[test]
fn committing_a_step_not_after_the_head_is_refused_without_allow_step_order() {
    let (tmp, root) = repo();
    let a = hf_checkpoint(tmp.path(), 0, 20);
    let b = hf_checkpoint(tmp.path(), 1, 30);
    commit(&root, &[b.to_str().unwrap()]);
    for step in ["20", "30"] {
        let (code, _, err) = run_ckvc(&root, &["commit", a.to_str().unwrap(), "--step", step]);
        assert_eq!(code, Some(1), "{err}");
        assert!(
            err.contains("is not after the head") && err.contains("--allow-step-order"),
            "{err}"
        );
    }
    assert_eq!(log_json(&root).len(), 1);
    commit(
        &root,
        &[a.to_str().unwrap(), "--step", "30", "--allow-step-order"],
    );
    assert_eq!(log_json(&root).len(), 2);
}

#[test]
fn checkout_step_says_which_commit_it_picked_when_several_have_it() {
    let (tmp, root) = repo();
    let a = hf_checkpoint(tmp.path(), 0, 20);
    let b = hf_checkpoint(tmp.path(), 1, 30);
    commit(&root, &[a.to_str().unwrap()]);
    commit(
        &root,
        &[b.to_str().unwrap(), "--step", "20", "--allow-step-order"],
    );
    let newest = log_json(&root)[0]["id"].as_str().unwrap().to_string();
    let (code, _, err) = run_ckvc(&root, &["checkout", "20", "-o", "out"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("2 commits of branch main have step 20"),
        "{err}"
    );
    assert!(err.contains(&newest[..12]), "{err}");
    same_tree(&b, &root.join("out"));
}

#[test]
fn commit_branch_typo_does_not_create_an_orphan_branch() {
    let (tmp, root) = repo();
    let a = hf_checkpoint(tmp.path(), 0, 20);
    let b = hf_checkpoint(tmp.path(), 1, 30);
    commit(&root, &[a.to_str().unwrap()]);
    let (code, _, err) = run_ckvc(&root, &["commit", b.to_str().unwrap(), "--branch", "mian"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no branch \"mian\"") && err.contains("--new-branch"),
        "{err}"
    );
    let (_, branches, _) = run_ckvc(&root, &["branch"]);
    assert!(!branches.contains("mian"), "{branches}");
    // --new-branch forks from the current branch's head: not an orphan.
    commit(
        &root,
        &[b.to_str().unwrap(), "--branch", "exp", "--new-branch"],
    );
    let (code, out, err) = run_ckvc(&root, &["log", "exp", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 2, "{out}");
    let (code, _, err) = run_ckvc(
        &root,
        &[
            "commit",
            b.to_str().unwrap(),
            "--branch",
            "exp",
            "--new-branch",
        ],
    );
    assert_eq!(code, Some(1), "{err}");
}

#[test]
fn commit_run_imports_each_checkpoint_in_step_order_skipping_committed_ones() {
    let (tmp, root) = repo();
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    // checkpoint-100 sorts before checkpoint-20 by name; steps order them.
    let dirs: Vec<PathBuf> = [(0, 20), (1, 100), (2, 50)]
        .into_iter()
        .map(|(i, s)| hf_checkpoint(&run, i, s))
        .collect();
    std::fs::write(run.join("notes.txt"), b"not a checkpoint").unwrap();
    // A step committed before the import is skipped.
    commit(&root, &[dirs[0].to_str().unwrap()]);
    let out = commit(&root, &["--run", run.to_str().unwrap()]);
    assert!(
        out.contains("skipped") && out.contains("(step 20)"),
        "{out}"
    );
    let steps: Vec<u64> = log_json(&root)
        .iter()
        .rev()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [20, 50, 100]);
    // Run again: everything is there.
    let out = commit(&root, &["--run", run.to_str().unwrap()]);
    assert_eq!(out.matches("skipped").count(), 3, "{out}");
    let (code, _, err) = run_ckvc(&root, &["checkout", "50", "-o", "out"]);
    assert_eq!(code, Some(0), "{err}");
    same_tree(&dirs[2], &root.join("out"));
}

#[test]
fn unknown_revisions_say_what_was_looked_for_and_suggest() {
    let (tmp, root) = repo();
    for (i, step) in [(0, 20), (1, 30), (2, 40)] {
        let ck = hf_checkpoint(tmp.path(), i, step);
        commit(&root, &[ck.to_str().unwrap()]);
    }
    let (code, _, err) = run_ckvc(&root, &["checkout", "25", "-o", "o1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no commit at step 25 on branch \"main\""),
        "{err}"
    );
    assert!(err.contains("nearest steps: 20, 30"), "{err}");
    let (code, _, err) = run_ckvc(&root, &["show", "mian"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no branch, tag or commit id \"mian\"") && err.contains("did you mean: main"),
        "{err}"
    );
    let (code, _, err) = run_ckvc(&root, &["show", "HEAD~5"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("past the first commit (2 back)"), "{err}");
}

#[test]
fn show_displays_code_provenance() {
    let (tmp, root) = repo();
    let code_dir = tmp.path().join("code");
    std::fs::create_dir(&code_dir).unwrap();
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .current_dir(&code_dir)
            .args(args)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .unwrap()
    };
    git(&["init", "-q", "-b", "train"]);
    std::fs::write(code_dir.join("train.py"), b"print(1)\n").unwrap();
    git(&["add", "."]);
    git(&["commit", "-q", "-m", "x"]);
    std::fs::write(code_dir.join("train.py"), b"print(2)\n").unwrap();
    let ck = hf_checkpoint(tmp.path(), 0, 20);
    commit(
        &root,
        &[ck.to_str().unwrap(), "--code", code_dir.to_str().unwrap()],
    );
    let (_, out, _) = run_ckvc(&root, &["show"]);
    let line = out
        .lines()
        .find(|l| l.starts_with("code "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains(" on train") && line.contains("dirty"),
        "{line}"
    );
    let (_, out, _) = run_ckvc(&root, &["show", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["code"]["dirty"], true);
    assert_eq!(v["code"]["branch"], "train");
}

#[test]
fn log_says_no_new_data_for_a_fully_deduplicated_commit() {
    let (tmp, root) = repo();
    let a = hf_checkpoint(tmp.path(), 0, 20);
    commit(&root, &[a.to_str().unwrap()]);
    commit(&root, &[a.to_str().unwrap(), "--step", "21"]);
    let (_, out, _) = run_ckvc(&root, &["log"]);
    let first = out.lines().next().unwrap();
    assert!(
        first.contains("no new data") && !first.contains("snapshot"),
        "{out}"
    );
    assert_eq!(log_json(&root)[0]["new_data"], false);
}

#[test]
fn checkout_force_clean_leaves_exactly_the_commits_files() {
    let (tmp, root) = repo();
    let a = hf_checkpoint(tmp.path(), 0, 20);
    std::fs::create_dir(a.join("sub")).unwrap();
    std::fs::write(a.join("sub/kept.txt"), b"k").unwrap();
    commit(&root, &[a.to_str().unwrap()]);
    let out = root.join("out");
    std::fs::create_dir_all(out.join("sub")).unwrap();
    std::fs::create_dir_all(out.join("stale/deeper")).unwrap();
    std::fs::write(out.join("optimizer.pt"), b"from another step").unwrap();
    std::fs::write(out.join("sub/old.txt"), b"old").unwrap();
    std::fs::write(out.join("stale/deeper/x"), b"x").unwrap();
    // Without --clean, --force leaves other files there (and says nothing).
    let (code, _, err) = run_ckvc(&root, &["checkout", "20", "-o", "out", "--force"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.join("optimizer.pt").exists());
    let (code, o, err) = run_ckvc(
        &root,
        &["checkout", "20", "-o", "out", "--force", "--clean"],
    );
    assert_eq!(code, Some(0), "{err}");
    for removed in [
        "removed optimizer.pt",
        "removed stale",
        "removed sub/old.txt",
    ] {
        assert!(o.contains(removed), "{o}");
    }
    same_tree(&a, &out);
    let (code, _, _) = run_ckvc(&root, &["checkout", "20", "-o", "out", "--clean"]);
    assert_eq!(code, Some(2), "--clean needs --force");
}

#[test]
fn commit_line_says_how_much_went_in_as_tensors_and_names_large_opaque_files() {
    let (tmp, root) = repo();
    let ck = hf_checkpoint(tmp.path(), 0, 20);
    // 2 MiB that no parser reads as tensors (a pickle-only checkpoint, say).
    let blob: Vec<u8> = (0..2u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(ck.join("states.ckpt"), &blob).unwrap();
    let out = commit(&root, &[ck.to_str().unwrap()]);
    assert!(
        out.contains(" as tensors, ") && out.contains(" opaque"),
        "{out}"
    );
    assert!(
        out.contains("note: states.ckpt (2.0 MiB) was stored as opaque bytes"),
        "{out}"
    );
    assert!(!out.contains("note: model.safetensors"), "{out}");
}

#[test]
fn every_repository_command_prints_json_with_json() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    let json = |args: &[&str]| -> serde_json::Value {
        let (code, out, err) = run_ckvc(&root, args);
        assert_eq!(code, Some(0), "{args:?}: {out}{err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    };
    std::fs::create_dir(&root).unwrap();
    let v = json(&["init", "--json"]);
    assert!(v["config"]["max_chain"].is_number(), "{v}");
    let a = hf_checkpoint(tmp.path(), 0, 20);
    let b = hf_checkpoint(tmp.path(), 1, 30);
    let v = json(&["commit", a.to_str().unwrap(), "--json"]);
    assert_eq!(v["step"], 20);
    assert_eq!(v["step_source"], "trainer-state");
    assert_eq!(v["id"].as_str().unwrap().len(), 64);
    assert!(v["stats"]["logical_bytes"].as_u64().unwrap() > 0);
    let v = json(&["commit", b.to_str().unwrap(), "--json"]);
    assert_eq!(v["step"], 30);
    let v = json(&["checkout", "20", "-o", "out", "--json"]);
    assert_eq!(
        (v["step"].clone(), v["files"].clone()),
        (20.into(), 2.into())
    );
    assert!(json(&["branch", "exp", "--json"])["created"] == "exp");
    let v = json(&["branch", "--json"]);
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["current"] == true && b["name"] == "main"));
    assert_eq!(json(&["tag", "best", "20", "--json"])["tagged"], "best");
    assert_eq!(json(&["tag", "--json"])[0]["step"], 20);
    let v = json(&["status", "--json"]);
    assert_eq!(
        (v["branch"].clone(), v["commits"].clone()),
        ("main".into(), 2.into())
    );
    let v = json(&["gc", "--dry-run", "--json"]);
    assert_eq!(v["dry_run"], true);
    assert!(v["before"]["commits"].as_u64().unwrap() >= 2);
    let v = json(&["fsck", "--json"]);
    assert_eq!(v["damage"].as_array().unwrap().len(), 0);
    assert!(v["commits"].as_u64().unwrap() >= 2);
    let v = json(&["reflog", "--json"]);
    assert!(v.as_array().unwrap().len() >= 3, "{v}");
    assert!(json(&["branch", "-d", "exp", "--json"])["was"].is_string());
    let shared = tmp.path().join("shared");
    let v = json(&[
        "remote",
        "add",
        "origin",
        shared.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(v["name"], "origin");
    assert!(v["url"].as_str().unwrap().ends_with("shared"), "{v}");
    let v = json(&["remote", "-v", "--json"]);
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["name"], "origin");
    assert_eq!(
        json(&["remote", "remove", "origin", "--json"])["removed"],
        "origin"
    );
    assert_eq!(json(&["remote", "--json"]).as_array().unwrap().len(), 0);
    for args in [
        &["log", "--json"][..],
        &["show", "--json"],
        &["diff", "20", "30", "--json"],
    ] {
        json(args);
    }
    // Streams: one object per line.
    let (code, out, err) = run_ckvc(
        &root,
        &["commit", "--run", tmp.path().to_str().unwrap(), "--json"],
    );
    assert_eq!(code, Some(0), "{err}");
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["event"] == "skipped" || v["event"] == "committed", "{v}");
    }
}

/// `tests/fixtures/optim/<which>/checkpoint-<step>` (see its generate.py).
fn optim_fixture(which: &str, step: u64) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/optim")
        .join(which)
        .join(format!("checkpoint-{step}"))
}

/// The tensor `name` of `file` in `show --json` output.
fn json_tensor<'a>(v: &'a serde_json::Value, file: &str, name: &str) -> &'a serde_json::Value {
    let f = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == file)
        .unwrap();
    f["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap()
}

#[test]
fn optimizer_tensors_are_shown_with_their_parameter_names_when_the_optimizer_records_them() {
    // A Trainer-style checkpoint (model.safetensors + optimizer.pt with the
    // weight-decay group first) whose optimizer was given named
    // parameters: torch records `param_names`, and index 2 is norm.weight
    // (the second group's first), not the model file's third key.
    let (_tmp, root) = repo();
    for step in [1, 2] {
        let d = optim_fixture("named", step);
        let (code, _, err) = run_ckvc(&root, &["commit", d.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{err}");
    }
    let (code, out, err) = run_ckvc(&root, &["show", "2"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("state.0.exp_avg (embed.weight)"), "{out}");
    assert!(out.contains("state.2.exp_avg_sq (norm.weight)"), "{out}");
    assert!(out.contains("state.4.step (proj.bias)"), "{out}");
    let (_, out, _) = run_ckvc(&root, &["show", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        json_tensor(&v, "optimizer.pt", "state.1.exp_avg")["param"],
        "proj.weight"
    );
    assert_eq!(
        json_tensor(&v, "optimizer.pt", "state.3.exp_avg")["param"],
        "norm.bias"
    );
    // Model tensors are named already: no `param` field.
    assert!(json_tensor(&v, "model.safetensors", "proj.bias")
        .get("param")
        .is_none());
    let (code, out, err) = run_ckvc(&root, &["diff", "1", "2"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("state.1.exp_avg (proj.weight)"), "{out}");
    let (_, out, _) = run_ckvc(&root, &["diff", "1", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "optimizer.pt")
        .unwrap();
    let t = f["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "state.2.exp_avg")
        .unwrap();
    assert_eq!(t["param"], "norm.weight", "{t}");
}

#[test]
fn optimizer_tensors_keep_bare_indices_when_the_optimizer_records_no_names() {
    // As transformers' Trainer saves it: indices only, and the model file
    // (keys sorted) cannot say which index is which, so nothing is guessed.
    let (_tmp, root) = repo();
    let d = optim_fixture("unnamed", 1);
    let (code, _, err) = run_ckvc(&root, &["commit", d.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = run_ckvc(&root, &["show", "1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("state.0.exp_avg "), "{out}");
    assert!(!out.contains("state.0.exp_avg ("), "{out}");
    let (_, out, _) = run_ckvc(&root, &["show", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(json_tensor(&v, "optimizer.pt", "state.0.exp_avg")
        .get("param")
        .is_none());
}

/// Issue 20: a legacy `torch.save(..., _use_new_zipfile_serialization=False)`
/// file went in as opaque bytes; it is read as tensors (never executing its
/// pickle) and checks out byte for byte.
#[test]
fn legacy_torch_save_files_are_committed_as_tensors_and_check_out_exactly() {
    let (tmp, root) = repo();
    let dir = tmp.path().join("step-1");
    std::fs::create_dir(&dir).unwrap();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch-legacy/legacy.pt");
    std::fs::copy(&fixture, dir.join("optimizer.pt")).unwrap();
    let line = commit(&root, &[dir.to_str().unwrap()]);
    assert!(line.contains("as tensors"), "{line}");
    let (code, out, err) = run_ckvc(&root, &["show", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = &v["files"][0];
    assert_eq!(f["kind"], "torch-legacy", "{f}");
    assert!(f["warning"].is_null(), "{f}");
    // model 2 weights + 2 biases, AdamW 4 x 3, a bf16 and an int64 tensor.
    assert_eq!(f["tensors"].as_array().unwrap().len(), 18, "{f}");
    let out = root.join("out");
    let (code, _, err) = run_ckvc(&root, &["checkout", "1", "-o", out.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    same_tree(&dir, &out);
}
