//! `ckvc._ckvc`: the native half of the Python package, a thin layer over
//! the `ckvc` library (no second implementation).
//!
//! Writers open the repository for one operation and close it again, so
//! the single-writer lock is never held between calls (the CLI can commit
//! while a Python `Repository` object exists); readers open it read-only.
//! The library's work runs with the GIL released. Errors become the
//! exceptions below, with the library's typed fields as attributes
//! ([`to_py_err`] is the one place that maps them).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ckvc::repo::SharedBases;
use ckvc::repo::{lower_thread_priority, CorruptReason, ObjectRef, RevKind, SegmentShow};
use ckvc::repo::{CheckoutOptions, CommitOptions, CommitReport, Config, RepoError, Repository};
use ckvc::store::{CommitId, StoreError};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::BoundObject;

create_exception!(
    _ckvc,
    CkvcError,
    PyException,
    "Base class of every ckvc error."
);
create_exception!(
    _ckvc,
    CorruptError,
    CkvcError,
    "Stored data is damaged or missing (attributes: what, reason, commit, file, tensor)."
);
create_exception!(
    _ckvc,
    LockedError,
    CkvcError,
    "Another process holds the repository's write lock, or rewrites it (gc); retry."
);
create_exception!(
    _ckvc,
    NotFoundError,
    CkvcError,
    "No such revision, branch, file or tensor, or not a repository."
);
create_exception!(
    _ckvc,
    StepOrderError,
    CkvcError,
    "A commit's step is not after the branch head's (attributes: branch, step, head_step)."
);
create_exception!(
    _ckvc,
    AlreadyExistsError,
    CkvcError,
    "A repository, branch or tag of that name exists, or the output directory is not empty."
);
create_exception!(
    _ckvc,
    InvalidInputError,
    CkvcError,
    "Input the library refuses (a bad path, name, metric or checkpoint file)."
);
create_exception!(
    _ckvc,
    StorageFullError,
    CkvcError,
    "Too little free space to write safely; nothing was changed."
);

/// What a call was about, added to a corruption error's attributes (the
/// library names the place only in its `what` text).
#[derive(Default)]
struct Ctx<'a> {
    commit: Option<&'a str>,
    file: Option<&'a str>,
    tensor: Option<&'a str>,
}

/// The Python exception for a library error: its class by kind, its
/// fields as attributes. Every current `RepoError` variant is named here;
/// `RepoError` is `#[non_exhaustive]`, so variants added later fall to the
/// base class until they are added.
fn to_py_err(py: Python<'_>, e: RepoError, ctx: &Ctx<'_>) -> PyErr {
    let msg = e.to_string();
    let mut attrs: Vec<(&str, Py<PyAny>)> = Vec::new();
    let path = |p: &Path| p.to_string_lossy().into_owned();
    macro_rules! attr {
        ($k:expr, $v:expr) => {
            if let Some(o) = obj(py, $v) {
                attrs.push(($k, o));
            }
        };
    }
    let err = match &e {
        RepoError::NotARepository { path: p } => {
            attr!("path", path(p));
            NotFoundError::new_err(msg)
        }
        RepoError::AlreadyExists { path: p } | RepoError::OutputNotEmpty { path: p } => {
            attr!("path", path(p));
            AlreadyExistsError::new_err(msg)
        }
        RepoError::BranchExists { name } | RepoError::TagExists { name } => {
            attr!("name", name.as_str());
            AlreadyExistsError::new_err(msg)
        }
        RepoError::Store(se) => match se {
            StoreError::Locked { path: p } => {
                attr!("path", path(p));
                LockedError::new_err(msg)
            }
            StoreError::Rewritten => LockedError::new_err(msg),
            StoreError::Full {
                path: p,
                free,
                need,
            } => {
                attr!("path", path(p));
                attr!("free", *free);
                attr!("need", *need);
                StorageFullError::new_err(msg)
            }
            StoreError::NotFound { path: p } => {
                attr!("path", path(p));
                NotFoundError::new_err(msg)
            }
            StoreError::Corrupt {
                space,
                key_hex,
                reason,
            } => {
                attr!("what", format!("{space}/{key_hex}"));
                attr!("reason", reason.as_str());
                CorruptError::new_err(msg)
            }
            StoreError::MissingCurrent { path: p } | StoreError::Damaged { path: p, .. } => {
                attr!("what", path(p));
                attr!("reason", msg.as_str());
                CorruptError::new_err(msg)
            }
            _ if se.is_busy() => LockedError::new_err(msg),
            _ => CkvcError::new_err(msg),
        },
        RepoError::Format { path: p, .. }
        | RepoError::BadInput { path: p, .. }
        | RepoError::NoStep { dir: p } => {
            attr!("path", path(p));
            InvalidInputError::new_err(msg)
        }
        RepoError::InvalidBranchName { name } | RepoError::CurrentBranch { name } => {
            attr!("name", name.as_str());
            InvalidInputError::new_err(msg)
        }
        RepoError::Io { path: p, source } => {
            attr!("path", path(p));
            // A full disk met outside the store's own free-space check
            // (e.g. writing a checkout) is the same condition to a caller.
            if source.kind() == std::io::ErrorKind::StorageFull {
                StorageFullError::new_err(msg)
            } else {
                CkvcError::new_err(msg)
            }
        }
        RepoError::UnknownRevision {
            rev,
            kind,
            suggestions,
        } => {
            attr!("rev", rev.as_str());
            attr!("suggestions", suggestions.clone());
            if let RevKind::Step { branch, step } = kind {
                attr!("branch", branch.as_str());
                attr!("step", *step);
            }
            NotFoundError::new_err(msg)
        }
        RepoError::AmbiguousRevision { rev } => {
            attr!("rev", rev.as_str());
            NotFoundError::new_err(msg)
        }
        RepoError::NoSuchBranch { name } => {
            attr!("name", name.as_str());
            NotFoundError::new_err(msg)
        }
        RepoError::Empty => NotFoundError::new_err(msg),
        // Damage: what and where, from the error's typed site.
        RepoError::Corrupt { site, .. }
        | RepoError::BadObject { site, .. }
        | RepoError::Decode { site, .. }
        | RepoError::Missing { site } => {
            let reason = match &e {
                RepoError::Corrupt { reason, .. } => reason.clone(),
                RepoError::BadObject { source, .. } => source.to_string(),
                RepoError::Decode { source, .. } => source.to_string(),
                _ => "missing from the store".to_string(),
            };
            attr!("what", site.to_string());
            attr!("reason", reason);
            if let Some(ObjectRef::Chunk { id }) = &site.object {
                attr!("chunk", id.to_string());
            }
            if let Some(step) = site.place.step {
                attr!("step", step);
            }
            CorruptError::new_err(msg)
        }
        RepoError::Damaged { count, first } => {
            attr!("what", first.as_str());
            attr!("reason", msg.as_str());
            attr!("count", *count);
            CorruptError::new_err(msg)
        }
        RepoError::MissingMetric { metric, commits } => {
            attr!("metric", metric.as_str());
            attr!(
                "commits",
                commits
                    .iter()
                    .map(|(id, step)| (id.to_string(), *step))
                    .collect::<Vec<_>>()
            );
            InvalidInputError::new_err(msg)
        }
        RepoError::StepOrder {
            branch,
            step,
            head_step,
        } => {
            attr!("branch", branch.as_str());
            attr!("step", *step);
            attr!("head_step", *head_step);
            StepOrderError::new_err(msg)
        }
        // Damaged data a fetch or clone received: nothing was written, the
        // remote's copy is what is corrupt.
        RepoError::Received(inner) => {
            attr!("what", inner.to_string());
            attr!("reason", msg.as_str());
            attr!("received", true);
            CorruptError::new_err(msg)
        }
        // Coding failed while writing (not damage).
        RepoError::Encode { what, reason } => {
            attr!("what", what.as_str());
            attr!("reason", reason.as_str());
            CkvcError::new_err(msg)
        }
        _ => CkvcError::new_err(msg),
    };
    if err.is_instance_of::<CorruptError>(py) {
        attr!("reason_kind", CorruptReason::of(&e).kind());
        // Where: from the error's own fields when it has them, else from
        // what the call was about.
        let place = e.site().map(|s| s.place.clone()).unwrap_or_default();
        let (commit, file, tensor) = (
            place.commit.map(|c| c.to_string()),
            place.file,
            place.tensor,
        );
        for (k, typed, v) in [
            ("commit", commit, ctx.commit),
            ("file", file, ctx.file),
            ("tensor", tensor, ctx.tensor),
        ] {
            let v = typed.or_else(|| v.map(str::to_string));
            attrs.push((k, v.and_then(|v| obj(py, v)).unwrap_or_else(|| py.None())));
        }
    }
    let value = err.value(py);
    for (k, v) in attrs {
        let _ = value.setattr(k, v);
    }
    err
}

/// `v` as a Python object (`None` if it cannot be converted).
fn obj<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> Option<Py<PyAny>> {
    v.into_pyobject(py).ok().map(|o| o.into_any().unbind())
}

/// Runs `f` with the GIL released and maps its error.
fn run<T: Send>(
    py: Python<'_>,
    ctx: &Ctx<'_>,
    f: impl FnOnce() -> Result<T, RepoError> + Send,
) -> PyResult<T> {
    py.detach(f).map_err(|e| to_py_err(py, e, ctx))
}

fn parse_commit(hex: &str) -> PyResult<CommitId> {
    CommitId::from_str(hex)
        .map_err(|_| NotFoundError::new_err(format!("{hex:?} is not a 64-digit hex commit id")))
}

fn report_dict<'py>(py: Python<'py>, r: &CommitReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", r.id.to_string())?;
    d.set_item("step", r.step)?;
    d.set_item("branch", &r.branch)?;
    d.set_item("already_committed", r.already_committed)?;
    d.set_item("logical_bytes", r.stats.logical_bytes)?;
    d.set_item("stored_bytes", r.stats.stored_bytes)?;
    d.set_item("files", r.stats.files)?;
    d.set_item("new_chunks", r.stats.new_chunks)?;
    d.set_item("max_depth", r.stats.max_depth)?;
    Ok(d)
}

fn commit_dict<'py>(
    py: Python<'py>,
    id: &CommitId,
    c: &ckvc::repo::objects::Commit,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", id.to_string())?;
    d.set_item("step", c.step)?;
    d.set_item("branch", &c.branch)?;
    d.set_item("message", &c.message)?;
    d.set_item(
        "metrics_json",
        serde_json::Value::Object(c.metrics.clone()).to_string(),
    )?;
    d.set_item("time", c.time)?;
    d.set_item(
        "parents",
        c.parents.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
    )?;
    d.set_item("logical_bytes", c.stats.logical_bytes)?;
    d.set_item("stored_bytes", c.stats.stored_bytes)?;
    d.set_item("files", c.stats.files)?;
    d.set_item("max_depth", c.stats.max_depth)?;
    Ok(d)
}

/// Open the repository whose root is `path` (not a repository:
/// [`RepoError::NotARepository`], not a damaged store).
/// Raises the process's soft open-file limit to its hard one first (the
/// store keeps the blob files it reads open; see
/// [`ckvc::store::raise_open_file_limit`]).
fn open_repo(path: &Path, write: bool) -> Result<Repository, RepoError> {
    if !path.join(ckvc::repo::DOT_DIR).is_dir() {
        return Err(RepoError::NotARepository {
            path: path.to_path_buf(),
        });
    }
    ckvc::store::raise_open_file_limit();
    Repository::open(path, write)
}

/// Create a repository in `path` (like `ckvc init`); `row_frames` false
/// is `ckvc init --no-row-frames`.
#[pyfunction]
#[pyo3(signature = (path, row_frames = true))]
fn init(py: Python<'_>, path: PathBuf, row_frames: bool) -> PyResult<()> {
    let config = Config {
        row_frames,
        ..Config::default()
    };
    run(py, &Ctx::default(), || {
        Repository::init(&path, config).map(drop)
    })
}

/// A slice of a Python buffer the library reads with the GIL released.
struct Bytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced while the `PyBuffer` export it
// came from is alive (held by the caller for the whole call), and the
// Python side promises not to modify the buffer during the call (it is its
// own staging buffer); reading it from another thread is then sound.
unsafe impl Send for Bytes {}

impl Bytes {
    /// The bytes.
    ///
    /// # Safety
    /// The buffer export this came from is alive and nobody writes the
    /// bytes for as long as the slice is used.
    unsafe fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            // A zero-length buffer may have a dangling pointer, which
            // `from_raw_parts` does not allow.
            &[]
        } else {
            // SAFETY: the caller's promise above.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// The writable buffer export this came from is alive and nothing else
    /// reads or writes the bytes for as long as the slice is used.
    #[allow(clippy::mut_from_ref)]
    unsafe fn as_mut_slice(&self) -> &mut [u8] {
        if self.len == 0 {
            &mut []
        } else {
            // SAFETY: the caller's promise above.
            unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
        }
    }
}

/// `obj`'s buffer export and its bytes, for writing: an
/// `InvalidInputError` naming it as `what` unless it is writable and
/// C-contiguous. The bytes stay valid while the export is alive.
fn writable(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(PyBuffer<u8>, Bytes)> {
    let buf = PyBuffer::<u8>::get(obj)?;
    if buf.readonly() || !buf.is_c_contiguous() {
        return Err(InvalidInputError::new_err(format!(
            "{what} must be writable and C-contiguous"
        )));
    }
    let bytes = Bytes {
        ptr: buf.buf_ptr() as *const u8,
        len: buf.len_bytes(),
    };
    Ok((buf, bytes))
}

/// Commit in-memory files (`[(path, buffer)]`, any C-contiguous byte
/// buffers; a file may also be a list of buffers, the file being their
/// concatenation: nothing is copied into one buffer first) at `step`. The
/// buffers must stay alive and unmodified during the call (the GIL is
/// released while the library reads them). With `nice` above 0 (a
/// background save) the calling thread's nice value is set that much
/// above the process's, for good, and the commit runs on a pool of
/// threads of that priority, so a training loop on the same cores comes
/// first. With `pause`, the commit's reading and coding wait while it is
/// held (`Pause.hold`).
///
/// `check()` is called (with the GIL) once every buffer has been read and
/// stored, before the commit is published; an exception it raises
/// abandons the commit and is the one this call raises. With `mirror`
/// (`(path, staging)`: one of the files and a writable buffer at least as
/// long), a thread copies that file from its end into `staging` while the
/// commit reads it from its start, and the commit reads the rest from
/// `staging` once they meet (`Repository::commit_parts_mirrored`): `check`
/// is called then, once no byte of that file's buffers will be read
/// again, and the caller may change them from its return.
#[pyfunction]
#[pyo3(signature = (path, files, step, message = String::new(), metrics = Vec::new(), branch = None, nice = 0, check = None, bases = None, bases_cap = 0, pause = None, mirror = None))]
#[allow(clippy::too_many_arguments)]
fn commit_buffers<'py>(
    py: Python<'py>,
    path: PathBuf,
    files: Vec<(String, Bound<'py, PyAny>)>,
    step: u64,
    message: String,
    metrics: Vec<(String, f64)>,
    branch: Option<String>,
    nice: i32,
    check: Option<Py<PyAny>>,
    bases: Option<PyRef<'py, Bases>>,
    bases_cap: u64,
    pause: Option<PyRef<'py, Pause>>,
    mirror: Option<(String, Bound<'py, PyAny>)>,
) -> PyResult<Bound<'py, PyDict>> {
    let bases = bases.map(|b| b.shared.clone());
    let pause = pause.map(|p| p.inner.clone());
    let mut held = Vec::new();
    let mut files_parts: Vec<(String, Vec<Bytes>)> = Vec::with_capacity(files.len());
    for (rel, obj) in &files {
        let objs: Vec<Bound<'py, PyAny>> = if obj.is_instance_of::<PyList>() {
            obj.cast::<PyList>()?.iter().collect()
        } else {
            vec![obj.clone()]
        };
        let mut parts = Vec::with_capacity(objs.len());
        for o in &objs {
            let buf = PyBuffer::<u8>::get(o)?;
            if !buf.is_c_contiguous() {
                return Err(InvalidInputError::new_err(format!(
                    "a buffer of {rel} is not contiguous"
                )));
            }
            parts.push(Bytes {
                ptr: buf.buf_ptr() as *const u8,
                len: buf.len_bytes(),
            });
            held.push(buf);
        }
        files_parts.push((rel.clone(), parts));
    }
    let mirror = match &mirror {
        Some((rel, obj)) => {
            let (buf, staging) = writable(obj, "the staging buffer")?;
            held.push(buf);
            Some((rel.clone(), staging))
        }
        None => None,
    };
    let opts = CommitOptions {
        step: Some(step),
        message,
        branch,
        metrics,
        // A save's bases are kept from the save before when the cap lets
        // them be; the rest are coded against their chain's keyframe
        // rather than decoding the chain (a background delta save of
        // GPT-2 small + AdamW was durable in 3.0-3.3 s at every depth
        // against 3.3-6.5 s, and stored 2.4% more over five saves).
        shallow_bases: true,
        pause,
        ..CommitOptions::default()
    };
    // `check()`: see the doc above.
    let raised: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
    let checked = || -> Result<(), String> {
        let Some(check) = &check else { return Ok(()) };
        Python::attach(|py| match check.call0(py) {
            Ok(_) => Ok(()),
            Err(e) => {
                let reason = e.to_string();
                *raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Err(reason)
            }
        })
    };
    let checked = &checked;
    let report = run(py, &Ctx::default(), move || {
        let slices: Vec<(&str, Vec<&[u8]>)> = files_parts
            .iter()
            .map(|(rel, parts)| {
                // SAFETY: `held` keeps every export alive until after this
                // closure returns, and the Python side does not write the
                // buffers until the commit has read them all (a save that
                // reads the training state in place lets training go on
                // from `check()`, after the last read: the commit then
                // only publishes, or reads the mirror's staging buffer).
                let parts = parts.iter().map(|b| unsafe { b.as_slice() }).collect();
                (rel.as_str(), parts)
            })
            .collect();
        let mut repo = open_repo(&path, true)?;
        if let Some(b) = &bases {
            repo.use_bases(b, bases_cap);
        }
        at_priority(nice, || match mirror {
            Some((rel, staging)) => {
                // SAFETY: `held` keeps the export alive until after this
                // closure returns, and the Python side neither reads nor
                // writes the staging buffer until the call has returned.
                let staging = unsafe { staging.as_mut_slice() };
                repo.commit_parts_mirrored(&slices, &opts, (&rel, staging), checked)
            }
            None => repo.commit_parts_checked(&slices, &opts, checked),
        })
    });
    drop(held);
    if let Some(e) = raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    report_dict(py, &report?)
}

/// Run `f` here, or for `nice` above 0 with this thread's nice value set
/// that much above the process's (threads it starts inherit it) on a pool
/// of that nice value, built by the first thread to ask for it so that its
/// threads have the same priority (one pool per value: the staged saves'
/// and the in-place first save's). `scripts/bench_python.py --compute
/// cpu` (forward and backward on the same two cores), the same build back
/// to back: a second background save lengthened the training step beside
/// it by 0.73x `torch.save` + fsync at the trainer's priority, 0.18x at
/// nice 10.
fn at_priority<T: Send>(nice: i32, f: impl FnOnce() -> T + Send) -> T {
    type Pools = std::collections::BTreeMap<i32, Option<std::sync::Arc<rayon::ThreadPool>>>;
    static POOLS: std::sync::Mutex<Pools> = std::sync::Mutex::new(Pools::new());
    if nice <= 0 {
        return f();
    }
    lower_thread_priority(nice);
    let pool = {
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .entry(nice)
            .or_insert_with(|| {
                rayon::ThreadPoolBuilder::new()
                    .build()
                    .ok()
                    .map(std::sync::Arc::new)
            })
            .clone()
    };
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// [`lower_thread_priority`] for a thread of the Python package's own (the
/// staging buffer's fault-in after a first background save).
#[pyfunction]
#[pyo3(name = "lower_priority")]
fn lower_priority_py(by: i32) {
    lower_thread_priority(by)
}

/// Commit a checkpoint directory (what `ckvc commit DIR` does); `nice`
/// as for [`commit_buffers`] (the Trainer callback's background commits).
#[pyfunction]
#[pyo3(signature = (path, dir, step = None, message = String::new(), branch = None, nice = 0))]
fn commit_dir<'py>(
    py: Python<'py>,
    path: PathBuf,
    dir: PathBuf,
    step: Option<u64>,
    message: String,
    branch: Option<String>,
    nice: i32,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = CommitOptions {
        step,
        message,
        branch,
        ..CommitOptions::default()
    };
    let report = run(py, &Ctx::default(), move || {
        let repo = open_repo(&path, true)?;
        at_priority(nice, || repo.commit(&dir, &opts))
    })?;
    report_dict(py, &report)
}

/// Delta bases kept between the saves of one `ckvc.Repository` object
/// (each save opens the repository anew): the chunks a save stored are
/// the next save's bases, so it need not decode their chains. Holds at
/// most the cap the last save gave (`commit_buffers(bases_cap=)`).
#[pyclass(frozen, module = "ckvc._ckvc")]
struct Bases {
    shared: SharedBases,
}

#[pymethods]
impl Bases {
    #[new]
    fn new() -> Self {
        Bases {
            shared: SharedBases::new(),
        }
    }

    /// Bytes of chunks held now.
    fn held_bytes(&self) -> u64 {
        self.shared.held_bytes()
    }

    /// Let go of every chunk held.
    fn clear(&self) {
        self.shared.clear()
    }
}

/// Holds the reading and coding of the commits given it (`commit_buffers(
/// pause=)`) while the training step beside them runs; see
/// `ckvc::repo::Pause`.
#[pyclass(frozen, module = "ckvc._ckvc")]
struct Pause {
    inner: Arc<ckvc::repo::Pause>,
}

#[pymethods]
impl Pause {
    #[new]
    fn new() -> Self {
        Pause {
            inner: Arc::new(ckvc::repo::Pause::new()),
        }
    }

    /// Hold the commits' work until `resume` (once per hold) or `clear`,
    /// and at most `limit` seconds (`inf`: no deadline).
    fn hold(&self, limit: f64) -> PyResult<()> {
        if limit.is_nan() || limit < 0.0 {
            return Err(PyValueError::new_err(format!(
                "limit is a number of seconds, not {limit}"
            )));
        }
        self.inner
            .hold(Duration::try_from_secs_f64(limit).unwrap_or(Duration::MAX));
        Ok(())
    }

    /// End one hold.
    fn resume(&self) {
        self.inner.resume()
    }

    /// End every hold.
    fn clear(&self) {
        self.inner.clear()
    }

    /// True while a hold is in force.
    fn is_held(&self) -> bool {
        self.inner.is_held()
    }
}

/// A read-only view of a repository: resolves revisions and reads
/// commits, files and tensors. It does not hold the write lock, and sees
/// the repository as it was when it was opened.
#[pyclass(frozen, module = "ckvc._ckvc")]
struct Reader {
    repo: Repository,
}

#[pymethods]
impl Reader {
    /// Open the repository at `path` read-only.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let repo = run(py, &Ctx::default(), move || open_repo(&path, false))?;
        Ok(Reader { repo })
    }

    /// The commit id (hex) a revision names: a step on the current branch,
    /// a branch, a tag, `branch@step`, `HEAD~N` or an id prefix.
    fn resolve(&self, py: Python<'_>, rev: &str) -> PyResult<String> {
        run(py, &Ctx::default(), || self.repo.resolve(rev)).map(|id| id.to_string())
    }

    /// The current branch.
    fn current_branch(&self, py: Python<'_>) -> PyResult<String> {
        run(py, &Ctx::default(), || self.repo.current_branch())
    }

    /// One commit's metadata, as a dict.
    fn commit<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyDict>> {
        let cid = parse_commit(id)?;
        let ctx = Ctx {
            commit: Some(id),
            ..Ctx::default()
        };
        let c = run(py, &ctx, || self.repo.commit_object(&cid))?;
        commit_dict(py, &cid, &c)
    }

    /// Commits newest first from `rev` (default the current branch's head;
    /// empty for a branch with no commits), at most `limit`.
    #[pyo3(signature = (rev = None, limit = None))]
    fn log<'py>(
        &self,
        py: Python<'py>,
        rev: Option<&str>,
        limit: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let entries = run(py, &Ctx::default(), || self.repo.log(rev, limit))?;
        let out = PyList::empty(py);
        for e in &entries {
            out.append(commit_dict(py, &e.id, &e.commit)?)?;
        }
        Ok(out)
    }

    /// The files of a commit: `[(path, kind, length, [(tensor, dtype,
    /// shape, bytes)])]`, dtypes by their safetensors names.
    fn list_files<'py>(&self, py: Python<'py>, id: &str) -> PyResult<Bound<'py, PyList>> {
        let cid = parse_commit(id)?;
        let ctx = Ctx {
            commit: Some(id),
            ..Ctx::default()
        };
        let files = run(py, &ctx, || self.repo.list_files(&cid))?;
        let out = PyList::empty(py);
        for f in &files {
            let tensors = PyList::empty(py);
            for s in &f.segments {
                if let SegmentShow::Tensor(t) = s {
                    tensors.append((
                        t.name.as_str(),
                        t.dtype.safetensors_name(),
                        t.shape.clone(),
                        t.bytes,
                    ))?;
                }
            }
            out.append((
                f.path.as_str(),
                format!("{:?}", f.kind).to_ascii_lowercase(),
                f.len,
                tensors,
            ))?;
        }
        Ok(out)
    }

    /// The whole file `file` of commit `id`, verified (bytes).
    fn read_file<'py>(
        &self,
        py: Python<'py>,
        id: &str,
        file: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let cid = parse_commit(id)?;
        let ctx = Ctx {
            commit: Some(id),
            file: Some(file),
            ..Ctx::default()
        };
        let bytes = run(py, &ctx, || self.repo.read_file(&cid, file))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Decode tensor `tensor` of file `file` of commit `id` into `out`, a
    /// writable C-contiguous byte buffer of exactly its length (a numpy
    /// array, a bytearray, ...). Only that tensor's chunks are read, each
    /// verified.
    fn read_tensor_into(
        &self,
        py: Python<'_>,
        id: &str,
        file: &str,
        tensor: &str,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let cid = parse_commit(id)?;
        let (buf, dst) = writable(out, "the output buffer")?;
        let ctx = Ctx {
            commit: Some(id),
            file: Some(file),
            tensor: Some(tensor),
        };
        let result = run(py, &ctx, move || {
            // SAFETY: `buf` keeps the writable export alive until after
            // this closure; the caller passes a buffer nothing else
            // reads or writes during the call (a freshly allocated array).
            let out = unsafe { dst.as_mut_slice() };
            self.repo.read_tensor_into(&cid, file, tensor, out)
        });
        drop(buf);
        result
    }

    /// Write the files of commit `id` into `out` (what `ckvc checkout`
    /// does); returns `(files, bytes)`.
    #[pyo3(signature = (id, out, force = false))]
    fn checkout(
        &self,
        py: Python<'_>,
        id: &str,
        out: PathBuf,
        force: bool,
    ) -> PyResult<(u64, u64)> {
        let cid = parse_commit(id)?;
        let ctx = Ctx {
            commit: Some(id),
            ..Ctx::default()
        };
        let opts = CheckoutOptions {
            force,
            ..CheckoutOptions::default()
        };
        let r = run(py, &ctx, || {
            // Gigabytes are read around the page cache (as the CLI does).
            let bulk = self.repo.checkout_reader(&cid)?;
            bulk.as_ref()
                .unwrap_or(&self.repo)
                .checkout(&cid, &out, &opts)
        })?;
        Ok((r.files, r.bytes))
    }

    /// The steps on `branch` (default the current branch), ascending.
    #[pyo3(signature = (branch = None))]
    fn steps(&self, py: Python<'_>, branch: Option<&str>) -> PyResult<Vec<u64>> {
        run(py, &Ctx::default(), || {
            let branch = match branch {
                Some(b) => b.to_string(),
                None => self.repo.current_branch()?,
            };
            if self.repo.branch_head(&branch)?.is_none() {
                return Ok(Vec::new());
            }
            let mut steps: Vec<u64> = self
                .repo
                .log(Some(&branch), None)?
                .iter()
                .map(|e| e.commit.step)
                .collect();
            steps.sort_unstable();
            Ok(steps)
        })
    }

    /// True when deleting checkpoint directory `dir` loses nothing: commit
    /// `id` holds exactly its files and every file reads back whole (what
    /// `ckvc watch --prune-local` checks).
    fn holds_dir(&self, py: Python<'_>, id: &str, dir: PathBuf) -> PyResult<bool> {
        let cid = parse_commit(id)?;
        let ctx = Ctx {
            commit: Some(id),
            ..Ctx::default()
        };
        run(py, &ctx, || self.repo.holds_dir(&cid, &dir))
    }
}

/// How many CRC32Cs RocksDB has asked ckvc's hardware CRC for in this
/// process ([`ckvc::store::rocksdb_crc_calls`]): it grows with every save
/// when this module's definition takes the place of librocksdb's.
#[pyfunction]
fn rocksdb_crc_calls() -> u64 {
    ckvc::store::rocksdb_crc_calls()
}

#[pymodule]
fn _ckvc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(commit_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(commit_dir, m)?)?;
    m.add_function(wrap_pyfunction!(rocksdb_crc_calls, m)?)?;
    m.add_function(wrap_pyfunction!(lower_priority_py, m)?)?;
    m.add_class::<Reader>()?;
    m.add_class::<Bases>()?;
    m.add_class::<Pause>()?;
    m.add("CkvcError", py.get_type::<CkvcError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("LockedError", py.get_type::<LockedError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("StepOrderError", py.get_type::<StepOrderError>())?;
    m.add("AlreadyExistsError", py.get_type::<AlreadyExistsError>())?;
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    m.add("StorageFullError", py.get_type::<StorageFullError>())?;
    Ok(())
}
