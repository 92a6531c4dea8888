//! `show` and `diff` on the real corpus: steps 0, 60 and 600 of the run,
//! cross-checked against the safetensors files read directly.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ckvc::repo::{CommitOptions, Config, FileStatus, Repository, SegmentShow, TensorChange};
use ckvc::store::{CommitId, Mode, RocksStore};

use super::Instrumented;

struct Fixture {
    _tmp: tempfile::TempDir,
    store: Arc<Instrumented<RocksStore>>,
    repo: Repository,
    /// Commits of steps 0, 60, 600.
    ids: [CommitId; 3],
}

impl Fixture {
    fn chunk_gets(&self) -> u64 {
        self.store.chunk_gets.load(Ordering::Relaxed)
    }
}

/// Steps 0, 60 and 600 in a RocksDB repository. Chunks of 64 KiB (not the
/// default 4 MiB) so the larger tensors span several chunks and `diff`
/// streams across chunk boundaries.
fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(Instrumented::new(
        RocksStore::open(tmp.path().join("db"), Mode::ReadWrite).unwrap(),
    ));
    let config = Config {
        chunk_bytes: 64 << 10,
        ..Config::default()
    };
    let repo = Repository::init_store(tmp.path().to_path_buf(), store.clone(), config).unwrap();
    let ids = ["step-0", "step-60", "step-600"].map(|s| {
        repo.commit(&super::corpus().join(s), &CommitOptions::default())
            .unwrap()
            .id
    });
    Fixture {
        _tmp: tmp,
        store,
        repo,
        ids,
    }
}

/// A safetensors file read directly: name -> (dtype, shape, data bytes).
fn read_safetensors(path: &Path) -> HashMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let off: Vec<usize> = v["data_offsets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let dtype = v["dtype"].as_str().unwrap().to_string();
            (k, (dtype, shape, data[off[0]..off[1]].to_vec()))
        })
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn show_lists_every_file_and_the_52_fp32_tensors_with_their_shapes() {
    let f = fixture();
    let r = f.repo.show(&f.ids[2]).unwrap();
    assert_eq!(r.id, f.ids[2]);
    assert_eq!(r.commit.step, 600);
    assert_eq!(r.commit.branch, "main");
    assert_eq!(r.commit.parents, vec![f.ids[1]]);
    assert!(r.commit.metrics.contains_key("eval_loss"));
    let dir = super::corpus().join("step-600");
    let paths: Vec<&str> = r.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "model.bf16.safetensors",
            "model.safetensors",
            "optimizer.pt",
            "trainer_state.json"
        ]
    );
    for file in &r.files {
        let bytes = std::fs::read(dir.join(&file.path)).unwrap();
        assert_eq!(file.len, bytes.len() as u64, "{}", file.path);
        assert_eq!(file.hash_hex(), blake3::hash(&bytes).to_hex().as_str());
        let seg_bytes: u64 = file
            .segments
            .iter()
            .map(|s| match s {
                SegmentShow::Tensor(t) => t.bytes,
                SegmentShow::Opaque { bytes, .. } => *bytes,
            })
            .sum();
        assert_eq!(seg_bytes, file.len, "{}", file.path);
        let st = file.storage();
        assert!(st.chunks > 0 && st.stored_bytes > 0, "{}", file.path);
    }

    let model = &r.files[1];
    let direct = read_safetensors(&dir.join("model.safetensors"));
    let tensors: Vec<_> = model.tensors().collect();
    assert_eq!(tensors.len(), 52);
    assert_eq!(direct.len(), 52);
    for t in &tensors {
        let (dtype, shape, data) = &direct[&t.name];
        assert_eq!(t.dtype.safetensors_name(), "F32", "{}", t.name);
        assert_eq!(dtype, "F32");
        assert_eq!(&t.shape, shape, "{}", t.name);
        assert_eq!(t.bytes, data.len() as u64, "{}", t.name);
        // 64 KiB chunks
        assert_eq!(t.storage.chunks, t.bytes.div_ceil(64 << 10), "{}", t.name);
        assert!(t.storage.stored_bytes > 0);
    }
    let wte = tensors.iter().find(|t| t.name == "wte.weight").unwrap();
    assert_eq!(wte.shape, [256, 128]);
    // Step 600 follows step 60 in the same repository: some of its chunks
    // are deltas, and a delta's chain is at least one step deep.
    let all = r.files.iter().map(|f| f.storage()).collect::<Vec<_>>();
    assert!(all.iter().any(|s| s.is_delta() && s.max_depth >= 1));
}

#[test]
fn diff_of_a_commit_with_itself_is_all_unchanged_and_reads_no_chunk() {
    let f = fixture();
    let before = f.chunk_gets();
    let r = f.repo.diff(&f.ids[1], &f.ids[1]).unwrap();
    assert_eq!(f.chunk_gets(), before, "no chunk was read");
    assert_eq!(r.files.len(), 4);
    assert_eq!(r.count(FileStatus::Unchanged), 4);
    let mut tensors = 0;
    for file in &r.files {
        assert!(!file.opaque_changed);
        for t in &file.tensors {
            assert!(
                matches!(t.change, TensorChange::Unchanged { .. }),
                "{} {}",
                file.path,
                t.name
            );
            tensors += 1;
        }
    }
    assert_eq!(
        tensors,
        52 + 52 + 156,
        "both models and the optimizer state"
    );
}

#[test]
fn diff_step_60_to_600_measures_every_tensor_and_matches_a_direct_computation() {
    let f = fixture();
    let r = f.repo.diff(&f.ids[1], &f.ids[2]).unwrap();
    assert_eq!((r.step_a, r.step_b), (60, 600));
    assert_eq!(r.count(FileStatus::Changed), 4);
    let ts = r.file("trainer_state.json").unwrap();
    assert_eq!(ts.status, FileStatus::Changed);
    assert!(ts.opaque_changed && ts.tensors.is_empty());

    let model = r.file("model.safetensors").unwrap();
    assert_eq!(model.status, FileStatus::Changed);
    assert_eq!(model.tensors.len(), 52);
    // The 60 -> 600 steps of training move nearly every weight.
    let mut stats = HashMap::new();
    for t in &model.tensors {
        let TensorChange::Changed { dtype, diff, .. } = &t.change else {
            panic!("{} is {}", t.name, t.change.as_str());
        };
        assert_eq!(dtype.safetensors_name(), "F32");
        assert!(diff.fraction_changed() > 0.5, "{} {diff:?}", t.name);
        assert!(diff.rel_l2().unwrap() > 0.0, "{} {diff:?}", t.name);
        assert_eq!(diff.nonfinite, 0);
        stats.insert(t.name.clone(), *diff);
    }

    // Cross-check against the files, in f32 math. c_fc.weight is 256 KiB:
    // four 64 KiB chunks on each side.
    let a = read_safetensors(&super::corpus().join("step-60/model.safetensors"));
    let b = read_safetensors(&super::corpus().join("step-600/model.safetensors"));
    for name in ["h.0.c_fc.weight", "wte.weight", "ln_f.bias"] {
        let (xa, xb) = (f32s(&a[name].2), f32s(&b[name].2));
        let max = xa
            .iter()
            .zip(&xb)
            .map(|(x, y)| (y - x).abs())
            .fold(0f32, f32::max);
        let changed = xa.iter().zip(&xb).filter(|(x, y)| x != y).count();
        let norm_a = xa.iter().map(|x| x * x).sum::<f32>().sqrt();
        let norm_d = xa
            .iter()
            .zip(&xb)
            .map(|(x, y)| (y - x) * (y - x))
            .sum::<f32>()
            .sqrt();
        let d = &stats[name];
        assert_eq!(d.elements, xa.len() as u64, "{name}");
        assert_eq!(d.changed, changed as u64, "{name}");
        assert!(
            (d.max_abs - f64::from(max)).abs() <= 1e-6 * f64::from(max),
            "{name}: {} vs {max}",
            d.max_abs
        );
        let rel = f64::from(norm_d / norm_a);
        assert!(
            (d.rel_l2().unwrap() - rel).abs() <= 1e-3 * rel,
            "{name}: {:?} vs {rel}",
            d.rel_l2()
        );
    }

    // The bf16 copy changes too, and the optimizer's moments.
    let opt = r.file("optimizer.pt").unwrap();
    assert_eq!(opt.tensors.len(), 156);
    assert!(opt
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("exp_avg_sq"))
        .all(|t| matches!(t.change, TensorChange::Changed { .. })));

    // Step 0's optimizer.pt holds no state yet: every tensor is new at 60.
    let r = f.repo.diff(&f.ids[0], &f.ids[1]).unwrap();
    let opt = r.file("optimizer.pt").unwrap();
    assert_eq!(opt.status, FileStatus::Changed);
    assert!(opt
        .tensors
        .iter()
        .all(|t| matches!(t.change, TensorChange::Added { .. })));
    assert_eq!(opt.tensors.len(), 156);
}

#[test]
fn cli_show_and_diff_json_have_the_expected_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let ckvc = |args: &[&str]| {
        let (code, out, err) = super::run_ckvc(tmp.path(), args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        out
    };
    ckvc(&["init"]);
    for s in ["step-0", "step-60"] {
        ckvc(&["commit", super::corpus().join(s).to_str().unwrap()]);
    }

    let show: serde_json::Value = serde_json::from_str(&ckvc(&["show", "HEAD", "--json"])).unwrap();
    for k in [
        "id", "step", "branch", "parents", "time", "message", "metrics", "stats", "files",
    ] {
        assert!(show.get(k).is_some(), "show: {k}");
    }
    assert_eq!(show["step"], 60);
    let files = show["files"].as_array().unwrap();
    assert_eq!(files.len(), 4);
    for k in [
        "path", "kind", "bytes", "blake3", "mode", "tensors", "opaque",
    ] {
        assert!(files[0].get(k).is_some(), "show file: {k}");
    }
    let model = files
        .iter()
        .find(|f| f["path"] == "model.safetensors")
        .unwrap();
    let t = &model["tensors"][0];
    for k in ["name", "dtype", "shape", "bytes", "storage"] {
        assert!(t.get(k).is_some(), "show tensor: {k}");
    }
    for k in ["chunks", "stored_as", "max_depth", "stored_bytes"] {
        assert!(t["storage"].get(k).is_some(), "show storage: {k}");
    }
    assert_eq!(t["dtype"], "F32");

    let diff: serde_json::Value =
        serde_json::from_str(&ckvc(&["diff", "0", "60", "--json"])).unwrap();
    for k in ["a", "b", "summary", "files"] {
        assert!(diff.get(k).is_some(), "diff: {k}");
    }
    assert_eq!(diff["a"]["step"], 0);
    assert_eq!(diff["b"]["step"], 60);
    assert_eq!(diff["summary"]["changed"], 4);
    let model = diff["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "model.safetensors")
        .unwrap();
    assert_eq!(model["status"], "changed");
    let t = model["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "h.0.c_attn.weight")
        .unwrap();
    for k in [
        "status",
        "dtype",
        "shape",
        "elements",
        "changed",
        "fraction_changed",
        "max_abs_diff",
        "mean_abs_diff",
        "rel_l2",
    ] {
        assert!(t.get(k).is_some(), "diff tensor: {k}");
    }
    assert_eq!(t["status"], "changed");
    assert!(t["fraction_changed"].as_f64().unwrap() > 0.5);

    // The human forms print too.
    assert!(ckvc(&["show", "0"]).contains("wte.weight"));
    let text = ckvc(&["diff", "0", "60"]);
    assert!(text.contains("M model.safetensors"), "{text}");
    assert!(text.contains("M trainer_state.json"), "{text}");
}
