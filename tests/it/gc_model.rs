//! State-machine test: random sequences of commit / branch / delete /
//! gc / compact / keep / checkout against a simple model (each branch a
//! list of steps, each step's file bytes). Invariant after every
//! operation: each branch's history is the model's, and every commit
//! reachable from a ref checks out byte-exact.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;

use ckvc::repo::{CheckoutOptions, CommitOptions, Config, GcOptions, KeepPolicy, Repository};
use ckvc::store::MemStore;

#[derive(Debug, Clone)]
enum Op {
    Commit { branch: usize, seed: u64 },
    Branch { new: usize, from: usize },
    Delete { branch: usize },
    Gc,
    Compact { chain: u16 },
    Keep { last: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, any::<u64>()).prop_map(|(branch, seed)| Op::Commit { branch, seed }),
        1 => (1..3usize, 0..3usize).prop_map(|(new, from)| Op::Branch { new, from }),
        1 => (1..3usize).prop_map(|branch| Op::Delete { branch }),
        1 => Just(Op::Gc),
        1 => (0..3u16).prop_map(|chain| Op::Compact { chain }),
        1 => (1..4usize).prop_map(|last| Op::Keep { last }),
    ]
}

const BRANCHES: [&str; 3] = ["main", "b1", "b2"];

/// A small safetensors file: two f32 tensors and a bf16 one, derived from
/// the previous step's values (so deltas happen) and `seed`.
fn checkpoint(prev: Option<&[f32]>, seed: u64) -> (Vec<f32>, Vec<u8>) {
    let n = 3000;
    let mut s = seed | 1;
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % 2001) as f32 / 1000.0 - 1.0
    };
    let vals: Vec<f32> = match prev {
        Some(p) => p.iter().map(|v| v + rnd() * 1e-3).collect(),
        None => (0..n).map(|_| rnd()).collect(),
    };
    let mut data = Vec::new();
    for v in &vals {
        data.extend_from_slice(&v.to_le_bytes());
    }
    let f32_bytes = n * 4;
    for v in &vals[..1000] {
        data.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    let header = format!(
        r#"{{"a":{{"dtype":"F32","shape":[2000],"data_offsets":[0,8000]}},"b":{{"dtype":"F32","shape":[1000],"data_offsets":[8000,{f32_bytes}]}},"c":{{"dtype":"BF16","shape":[1000],"data_offsets":[{f32_bytes},{}]}}}}"#,
        f32_bytes + 2000
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    (vals, file)
}

struct Model {
    /// Branch -> its steps, oldest first.
    lines: BTreeMap<&'static str, Vec<u64>>,
    /// Step -> (values, file bytes).
    content: BTreeMap<u64, (Vec<f32>, Vec<u8>)>,
    next_step: u64,
}

fn check(repo: &Repository, model: &Model, scratch: &Path) -> Result<(), TestCaseError> {
    for (branch, line) in &model.lines {
        let log = repo.log(Some(branch), None).unwrap();
        let steps: Vec<u64> = log.iter().rev().map(|e| e.commit.step).collect();
        prop_assert_eq!(&steps, line, "history of {}", branch);
        for e in &log {
            let out = scratch.join(format!("co-{}", e.id.short(16)));
            repo.checkout(&e.id, &out, &CheckoutOptions::default())
                .unwrap();
            let got = std::fs::read(out.join("m.safetensors")).unwrap();
            prop_assert!(
                got == model.content[&e.commit.step].1,
                "step {} differs",
                e.commit.step
            );
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
    prop_assert!(repo.fsck(false).unwrap().is_clean());
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().unwrap();
    let config = Config {
        max_chain: 6,
        chunk_bytes: 4096,
        ..Config::default()
    };
    let repo =
        Repository::init_store(tmp.path().into(), Arc::new(MemStore::new()), config).unwrap();
    let mut model = Model {
        lines: BTreeMap::new(),
        content: BTreeMap::new(),
        next_step: 1,
    };
    for op in ops {
        match op {
            Op::Commit { branch, seed } => {
                let name = BRANCHES[branch];
                // A commit on a branch that does not exist creates it,
                // forked from main's head.
                let new = name != "main" && !model.lines.contains_key(name);
                if new {
                    let from_main = model.lines.get("main").cloned().unwrap_or_default();
                    model.lines.insert(name, from_main);
                }
                let prev = model
                    .lines
                    .get(name)
                    .and_then(|l| l.last())
                    .map(|s| model.content[s].0.clone());
                let (vals, file) = checkpoint(prev.as_deref(), seed);
                let step = model.next_step;
                model.next_step += 1;
                let dir = tmp.path().join(format!("ckpt-{step}"));
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join("m.safetensors"), &file).unwrap();
                repo.commit(
                    &dir,
                    &CommitOptions {
                        step: Some(step),
                        branch: Some(name.into()),
                        new_branch: new,
                        ..CommitOptions::default()
                    },
                )
                .unwrap();
                model.content.insert(step, (vals, file));
                model.lines.entry(name).or_default().push(step);
            }
            Op::Branch { new, from } => {
                let (new, from) = (BRANCHES[new], BRANCHES[from]);
                if model.lines.contains_key(new) || !model.lines.contains_key(from) {
                    continue;
                }
                let head = repo.branch_head(from).unwrap().unwrap();
                repo.create_branch(new, &head).unwrap();
                let line = model.lines[from].clone();
                model.lines.insert(new, line);
            }
            Op::Delete { branch } => {
                let name = BRANCHES[branch];
                if model.lines.remove(name).is_some() {
                    repo.delete_branch(name).unwrap();
                }
            }
            Op::Gc => {
                repo.gc(&GcOptions::default()).unwrap();
            }
            Op::Compact { chain } => {
                let r = repo
                    .gc(&GcOptions {
                        compact: true,
                        compact_chain: Some(chain),
                        ..GcOptions::default()
                    })
                    .unwrap();
                prop_assert!(r.after.longest_chain <= chain);
            }
            Op::Keep { last } => {
                repo.gc(&GcOptions {
                    keep: Some(KeepPolicy {
                        last: Some(last),
                        ..KeepPolicy::default()
                    }),
                    ..GcOptions::default()
                })
                .unwrap();
                for line in model.lines.values_mut() {
                    let n = line.len();
                    line.drain(..n.saturating_sub(last));
                }
            }
        }
        check(&repo, &model, tmp.path())?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_commit_reachable_from_a_ref_checks_out_byte_exact(
        ops in proptest::collection::vec(op(), 1..14)
    ) {
        run(ops)?;
    }
}
