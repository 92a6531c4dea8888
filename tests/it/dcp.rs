//! PyTorch distributed checkpoints (DCP) committed as tensors: the fixtures
//! of `tests/fixtures/dcp/` (`scripts/gen_dcp_fixtures.py`).

use std::path::PathBuf;

use super::{run_ckvc, same_tree};

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dcp")
        .join(rel)
}

/// Both serializations DCP offers (torch.save archives, safetensors
/// blobs) and a 2-rank save, as consecutive steps.
const STEPS: [(u64, &str); 5] = [
    (1, "step-1"),
    (2, "step-2"),
    (3, "ranks2-step-1"),
    (4, "st-step-1"),
    (5, "st-step-2"),
];

#[test]
fn dcp_checkpoints_are_committed_as_tensors_with_deltas_and_check_out_byte_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (code, _, err) = run_ckvc(root, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    for (step, dir) in STEPS {
        let d = fixture(dir);
        let (code, out, err) = run_ckvc(
            root,
            &["commit", d.to_str().unwrap(), "--step", &step.to_string()],
        );
        assert_eq!(code, Some(0), "{out}{err}");
    }
    // show --json lists the tensors of the .distcp file.
    for step in ["2", "5"] {
        let (code, out, err) = run_ckvc(root, &["show", step, "--json"]);
        assert_eq!(code, Some(0), "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let file = v["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == "__0_0.distcp")
            .expect("the data file");
        assert_eq!(file["kind"], "distcp");
        assert!(file["warning"].is_null(), "{file}");
        let tensors = file["tensors"].as_array().unwrap();
        assert_eq!(tensors.len(), 16, "{file}");
        // Step 2's tensors are deltas against step 1's.
        assert!(
            tensors.iter().any(|t| t["storage"]["stored_as"] == "delta"),
            "{file}"
        );
        assert!(
            tensors.iter().any(|t| t["name"] == "model.0.weight"),
            "{file}"
        );
    }
    for (step, dir) in STEPS {
        let out = root.join(format!("out-{step}"));
        let (code, _, err) = run_ckvc(
            root,
            &["checkout", &step.to_string(), "-o", out.to_str().unwrap()],
        );
        assert_eq!(code, Some(0), "{err}");
        same_tree(&fixture(dir), &out);
    }
}

#[test]
fn a_distcp_file_not_understood_is_stored_opaque_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("repo");
    std::fs::create_dir(&root).unwrap();
    let (code, _, err) = run_ckvc(&root, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    let ck = tmp.path().join("step-5");
    std::fs::create_dir(&ck).unwrap();
    let mut bytes = std::fs::read(fixture("step-1/__0_0.distcp")).unwrap();
    bytes.truncate(bytes.len() - 3);
    std::fs::write(ck.join("__0_0.distcp"), &bytes).unwrap();
    let (code, out, err) = run_ckvc(&root, &["commit", ck.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, err) = run_ckvc(&root, &["show"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("warning: a distributed-checkpoint file"),
        "{out}"
    );
    let (code, _, err) = run_ckvc(&root, &["checkout", "5", "-o", "out"]);
    assert_eq!(code, Some(0), "{err}");
    same_tree(&ck, &root.join("out"));
}

#[test]
fn dcp_resharded_save_finds_its_bases_across_files() {
    // Step 1 saved by two ranks (two .distcp files), step 2 by one: each
    // tensor's base is found by its state-dict key in whichever file of
    // the parent holds it.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (code, _, err) = run_ckvc(root, &["init"]);
    assert_eq!(code, Some(0), "{err}");
    for (step, dir) in [(1, "ranks2-step-1"), (2, "step-2")] {
        let d = fixture(dir);
        let (code, out, err) = run_ckvc(
            root,
            &["commit", d.to_str().unwrap(), "--step", &step.to_string()],
        );
        assert_eq!(code, Some(0), "{out}{err}");
    }
    let (_, out, _) = run_ckvc(root, &["show", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let tensors: Vec<&serde_json::Value> = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| f["tensors"].as_array().unwrap())
        .collect();
    assert_eq!(tensors.len(), 16);
    for t in &tensors {
        let numel: u64 = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        if numel >= 16 {
            assert_eq!(t["storage"]["stored_as"], "delta", "{t}");
        }
        assert!(!t["name"].as_str().unwrap().contains("/data/"), "{t}");
    }
}
