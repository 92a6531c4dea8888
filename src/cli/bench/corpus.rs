//! A training run's tensors in memory, a checkpoint at a time for the codec
//! benchmark (`ckvc debug codec-bench`), the whole run for the codec
//! examples and the corpus tests.
//!
//! Not part of the library: this file uses only `ckvc`'s public API, and is
//! compiled into the binary (`cli::bench`) and, by `#[path]`, into
//! `examples/` and `tests/it`, which measure the codec on the same bytes.

use std::path::{Path, PathBuf};

use ckvc::codec::DType;
use ckvc::format;

/// Why a run could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Format {
        path: PathBuf,
        source: format::FormatError,
    },
    #[error("{path}: no checkpoint directories with tensors found")]
    Empty { path: PathBuf },
}

/// One tensor of one checkpoint.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// `file/name`, the key that matches it across checkpoints.
    pub key: String,
    pub dtype: DType,
    pub group: &'static str,
    /// The tensor's dimensions: the last one is its row length.
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// A checkpoint directory of the run with its tensors.
#[derive(Debug, Clone)]
// `dir` and `step` are read by the examples and tests that include this file.
#[allow(dead_code)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: u64,
    pub tensors: Vec<Tensor>,
}

/// Tensors with fewer elements are left out by default (0-d optimizer
/// step counters say nothing about the codec).
pub const MIN_ELEMENTS: u64 = 16;

/// How deep below the run directory checkpoint directories are looked
/// for (`run/iter_0000500`, `run/checkpoints/checkpoint-500`, ...).
const MAX_RUN_DEPTH: usize = 3;

/// The checkpoint directories of a run, in step order, with their steps:
/// a checkpoint directory is one whose name ends in its step (`step-500`,
/// `checkpoint-500`, `iter_0000500`), found up to [`MAX_RUN_DEPTH`] levels
/// down.
pub fn run_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>, LoadError> {
    let mut dirs = Vec::new();
    find_checkpoint_dirs(dir, 0, &mut dirs)?;
    dirs.sort();
    Ok(dirs)
}

/// The tensors of one checkpoint directory (of at least `min_elements`
/// elements), `None` when it has none. Its files are read at any depth
/// below it (Megatron's `iter_0000500/mp_rank_00/model_optim_rng.pt`) and
/// keyed by their path in it. Files that are not tensor formats are
/// skipped; a corrupt tensor file is an error.
pub fn load_checkpoint(
    step: u64,
    d: &Path,
    min_elements: u64,
) -> Result<Option<Checkpoint>, LoadError> {
    let mut files = Vec::new();
    files_below(d, &mut files)?;
    files.sort();
    let mut tensors = Vec::new();
    for f in files {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let rel = f
            .strip_prefix(d)
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or_else(|_| name.clone());
        let bytes = std::fs::read(&f).map_err(io_error(&f))?;
        let layout = format::parse(&name, &mut std::io::Cursor::new(&bytes), bytes.len() as u64)
            .map_err(|source| LoadError::Format {
                path: f.clone(),
                source,
            })?;
        for t in layout.tensors() {
            if t.len / t.dtype.width() as u64 >= min_elements.max(1) {
                let (a, b) = (t.offset as usize, (t.offset + t.len) as usize);
                tensors.push(Tensor {
                    key: format!("{rel}/{}", t.name),
                    dtype: t.dtype,
                    group: group_of(&name, &t.name),
                    shape: t.shape.clone(),
                    data: bytes[a..b].to_vec(),
                });
            }
        }
    }
    Ok((!tensors.is_empty()).then(|| Checkpoint {
        dir: d.to_path_buf(),
        step,
        tensors,
    }))
}

/// Load the checkpoints of a run directory in step order ([`run_dirs`],
/// each by [`load_checkpoint`]); those without tensors are left out, and a
/// run without any is an error.
// The examples' and tests' (they include this file); the benchmark loads
// a checkpoint at a time.
#[allow(dead_code)]
pub fn load_run(dir: &Path, min_elements: u64) -> Result<Vec<Checkpoint>, LoadError> {
    let mut out = Vec::new();
    for (step, d) in run_dirs(dir)? {
        out.extend(load_checkpoint(step, &d, min_elements)?);
    }
    if out.is_empty() {
        return Err(LoadError::Empty {
            path: dir.to_path_buf(),
        });
    }
    Ok(out)
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> LoadError {
    let path = path.to_path_buf();
    move |source| LoadError::Io { path, source }
}

/// "optimizer" for the tensors of an optimizer file (`optimizer.pt`,
/// `optim_states.pt`); in a file holding model and optimizer together
/// (Megatron's `model_optim_rng.pt`), for the tensors under its optimizer
/// key; else "weights".
fn group_of(file: &str, tensor: &str) -> &'static str {
    let file = file.to_ascii_lowercase();
    let optimizer = file.contains("optim")
        && (!file.contains("model") || tensor.to_ascii_lowercase().contains("optim"));
    if optimizer {
        "optimizer"
    } else {
        "weights"
    }
}

/// Directories below `dir` (to [`MAX_RUN_DEPTH`]) whose name gives a step;
/// the search does not descend into them.
fn find_checkpoint_dirs(
    dir: &Path,
    depth: usize,
    out: &mut Vec<(u64, PathBuf)>,
) -> Result<(), LoadError> {
    for e in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let e = e.map_err(io_error(dir))?;
        if !e.file_type().map_err(io_error(&e.path()))?.is_dir() {
            continue;
        }
        match format::step_of_dir_name(&e.file_name().to_string_lossy()) {
            Some(step) => out.push((step, e.path())),
            None if depth + 1 < MAX_RUN_DEPTH => find_checkpoint_dirs(&e.path(), depth + 1, out)?,
            None => {}
        }
    }
    Ok(())
}

/// Every file below `dir`, at any depth (symbolic links are not followed).
fn files_below(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), LoadError> {
    for e in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let e = e.map_err(io_error(dir))?;
        let t = e.file_type().map_err(io_error(&e.path()))?;
        if t.is_dir() {
            files_below(&e.path(), out)?;
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    Ok(())
}

/// Every tensor of the run with its base: with `delta`, the same tensor
/// (key, dtype and length) of the previous checkpoint, tensors without one
/// left out; else no base.
#[allow(dead_code)] // the examples' and tests'
pub fn with_bases(
    run: &[Checkpoint],
    delta: bool,
) -> impl Iterator<Item = (&Tensor, Option<&[u8]>)> + '_ {
    run.iter().enumerate().flat_map(move |(i, ck)| {
        let prev = i.checked_sub(1).map(|p| &run[p]);
        bases_of(prev, ck, delta)
    })
}

/// [`with_bases`] for one checkpoint `ck` after `prev`: its tensors, or
/// with `delta` those `prev` has (none without `prev`), each with its
/// base.
pub fn bases_of<'a>(
    prev: Option<&'a Checkpoint>,
    ck: &'a Checkpoint,
    delta: bool,
) -> impl Iterator<Item = (&'a Tensor, Option<&'a [u8]>)> + 'a {
    ck.tensors.iter().filter_map(move |t| {
        if !delta {
            return Some((t, None));
        }
        let p = prev?
            .tensors
            .iter()
            .find(|p| p.key == t.key && p.dtype == t.dtype && p.data.len() == t.data.len())?;
        Some((t, Some(p.data.as_slice())))
    })
}
