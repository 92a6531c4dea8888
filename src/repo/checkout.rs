//! `checkout`: write a commit's files back, byte for byte.
//!
//! Every chunk is decoded through its (bounded) delta chain and checked
//! against its blake3 id before it is written; every file is checked
//! against its whole-file hash; files are written under a temporary name
//! and renamed into place only when whole, so a damaged chunk never leaves
//! a wrong file behind. Chunks are decoded on all cores in windows bounded
//! by the memory budget while one thread writes each file sequentially
//! (around the page cache where it can, see [`super::outfile`]).

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender};

use rayon::prelude::*;

use crate::store::{ChunkId, CommitId};

use super::objects::{check_path, FileManifest, SegmentRef};
use super::outfile::{OutFile, PageBuf, OUT_BUF_BYTES};
use super::{ObjectRef, Place, RepoError, Repository, Site};

/// Checkout knobs.
#[derive(Debug, Clone, Default)]
pub struct CheckoutOptions {
    /// Write into a non-empty directory.
    pub force: bool,
    /// Only paths matching one of these globs (`*` any run within a
    /// component, `?` one character, `**` any number of components).
    pub only: Vec<String>,
    /// After every file is written, delete whatever else is in the output
    /// directory (with `force`), so it holds exactly the commit's files.
    /// Not with `only`.
    pub clean: bool,
}

/// What a checkout wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckoutReport {
    pub commit: CommitId,
    pub step: u64,
    pub out: PathBuf,
    pub files: u64,
    pub bytes: u64,
    /// What `clean` deleted (relative paths; a directory counts once).
    pub removed: Vec<String>,
}

/// A checkout of a commit of at least this many bytes reads the store with
/// `O_DIRECT` ([`Repository::checkout_reader`]). Measured (CLI): a 10 GiB
/// file took 14.9-15.0 s direct against 17.7-23.4 s buffered (12-17 s of
/// them in the kernel, faulting in page-cache pages); but the large run's
/// newest 1.42 GiB step (depth 3) took 5.0-5.8 s direct against 5.1-6.2 s
/// buffered with its blobs out of the page cache, and 5.1-5.4 s against
/// 3.0-3.5 s with them in it; six gpt-small checkouts of 11 MiB took
/// 0.58-0.66 s direct against 0.37-0.45 s. Direct reads pay only where
/// the data cannot be in the page cache anyway. A lower threshold (256
/// MiB) when the page cache held under half the store's blob files was
/// tried (0919b2e, reverted in 43f85c1): with the machine's free memory
/// idle the large run's newest step took 5.39-5.68 s direct against 8.29
/// s buffered, but right after the commits (blob files written with
/// `O_DIRECT`, so "uncached", memory warm) repo-bench's checkout of every
/// step took 15.01 s against 12.59 s and peaked at 514 MiB: what decides
/// is how recently the free memory was touched, which the page cache does
/// not show.
pub const BULK_READ_BYTES: u64 = 4 << 30;

impl Repository {
    /// The handle to check `commit` out with: `None` for this one, or, for
    /// a commit of at least [`BULK_READ_BYTES`] in a repository on disk, a
    /// reader of the same repository that reads its files with `O_DIRECT`
    /// ([`Repository::open_for_bulk_reads`], the same memory budget).
    /// Gigabytes read through the page cache cost more than the cache
    /// saves. Where that reader cannot be opened, `None`.
    pub fn checkout_reader(&self, commit: &CommitId) -> Result<Option<Repository>, RepoError> {
        let c = self.commit_object(commit)?;
        if c.stats.logical_bytes < BULK_READ_BYTES {
            return Ok(None);
        }
        Ok(Repository::open_for_bulk_reads(self.root())
            .and_then(|mut r| r.set_memory_budget(self.config.memory_budget).map(|()| r))
            .ok())
    }

    /// Write the files of `commit` into `out`.
    ///
    /// Each file is written into a private temporary directory inside `out`
    /// (so no temporary name can be a committed name) and renamed into place
    /// only when whole and verified; the files are fsynced together before
    /// their renames and the directories after them (on an error, the files
    /// finished before it are installed the same way). Nothing is ever written
    /// through a symbolic link: a link met where the commit has a directory
    /// or a file is replaced (with `force`), and `out` itself may not
    /// contain this repository's data directory.
    pub fn checkout(
        &self,
        commit: &CommitId,
        out: &Path,
        opts: &CheckoutOptions,
    ) -> Result<CheckoutReport, RepoError> {
        self.checkout_with_progress(commit, out, opts, &super::NoProgress)
    }

    /// [`Repository::checkout`], reporting phase `"checkout"` to
    /// `progress`: the bytes of each file as they are written, and each
    /// file when it is whole.
    pub fn checkout_with_progress(
        &self,
        commit: &CommitId,
        out: &Path,
        opts: &CheckoutOptions,
        progress: &dyn super::Progress,
    ) -> Result<CheckoutReport, RepoError> {
        let c = self.commit_object(commit)?;
        let tree = self.tree(&c.tree)?;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| RepoError::Io { path, source }
        };
        if opts.clean && !opts.only.is_empty() {
            return Err(RepoError::BadInput {
                path: out.to_path_buf(),
                reason: "--clean deletes every file the commit does not hold; it cannot go \
                         with --only"
                    .into(),
            });
        }
        if out.exists() {
            let mut rd = std::fs::read_dir(out).map_err(io(out))?;
            if rd.next().is_some() && !opts.force {
                return Err(RepoError::OutputNotEmpty {
                    path: out.to_path_buf(),
                });
            }
        }
        std::fs::create_dir_all(out).map_err(io(out))?;
        self.refuse_own_data_dir(out)?;
        let mut report = CheckoutReport {
            commit: *commit,
            step: c.step,
            out: out.to_path_buf(),
            files: 0,
            bytes: 0,
            removed: Vec::new(),
        };
        let mut selected = Vec::new();
        for (rel, mid) in &tree.entries {
            if !opts.only.is_empty() && !opts.only.iter().any(|g| glob_match(g, rel)) {
                continue;
            }
            check_path(rel).map_err(|e| RepoError::BadObject {
                site: Site::of(ObjectRef::Tree { id: c.tree }).with_place(Place {
                    commit: Some(*commit),
                    step: Some(c.step),
                    ..Place::default()
                }),
                source: e.into(),
            })?;
            selected.push((rel, mid));
        }
        let staging = Staging::new(out, tree.entries.iter().map(|(p, _)| p.as_str()))?;
        let mut files = Vec::with_capacity(selected.len());
        for (n, (rel, mid)) in selected.into_iter().enumerate() {
            let m = self.manifest(mid, rel)?;
            make_dirs_no_symlinks(out, rel)?;
            files.push(FileJob {
                rel,
                dest: out.join(rel),
                tmp: staging.dir.join(n.to_string()),
                m,
            });
        }
        // Decoding (all cores, in windows of chunks in file order) runs
        // beside writing (one thread, each file sequentially); the files
        // written and verified before any error are made durable together
        // and renamed into place, then their directories are synced: one
        // barrier per checkout instead of one per file.
        let budget = self.config.memory_budget;
        let window = window_bytes(budget.saturating_sub(super::base_cache_bytes(budget)));
        let total = files.iter().map(|f| f.m.len).sum();
        progress.start("checkout", total, files.len() as u64);
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Decoded>>(1);
        let (done, result) = std::thread::scope(|s| {
            let writer = s.spawn(|| self.write_files(&files, commit, c.step, rx, progress));
            // Stops early only when the writer did (its error says which
            // file and chunk).
            self.decode_windows(&files, window, tx);
            writer
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        });
        progress.finish();
        install(&files[..done])?;
        result?;
        for f in &files {
            report.files += 1;
            report.bytes += f.m.len;
        }
        drop(staging);
        if opts.clean {
            let keep: std::collections::HashSet<&str> =
                tree.entries.iter().map(|(p, _)| p.as_str()).collect();
            remove_others(out, "", &keep, &mut report.removed)?;
        }
        Ok(report)
    }

    /// Decode every chunk of `files` in file order, in windows of about
    /// `window` bytes decoded in parallel, and send each window to the
    /// writer. Stops when the writer has gone (its error is the one to
    /// report).
    fn decode_windows(&self, files: &[FileJob<'_>], window: u64, tx: SyncSender<Vec<Decoded>>) {
        let mut ids: Vec<ChunkId> = Vec::new();
        let mut bytes = 0u64;
        let send = |ids: &mut Vec<ChunkId>| -> bool {
            let w: Vec<Decoded> = ids
                .par_iter()
                .map(|id| (*id, self.read_chunk(id)))
                .collect();
            ids.clear();
            tx.send(w).is_ok()
        };
        for f in files {
            for seg in &f.m.segments {
                let n = seg.chunks().len().max(1) as u64;
                // About each chunk's size, to bound the window's memory.
                let each = seg.len() / n;
                for id in seg.chunks() {
                    ids.push(*id);
                    bytes += each;
                    if bytes >= window {
                        if !send(&mut ids) {
                            return;
                        }
                        bytes = 0;
                    }
                }
            }
        }
        if !ids.is_empty() {
            send(&mut ids);
        }
    }

    /// Write `files` in order into their temporary files from the decoded
    /// windows, checking every segment length and whole-file blake3 (the
    /// chunks were checked when decoded). Returns how many files were
    /// finished (the first ones, in order) and how it ended.
    fn write_files(
        &self,
        files: &[FileJob<'_>],
        commit: &CommitId,
        step: u64,
        rx: Receiver<Vec<Decoded>>,
        progress: &dyn super::Progress,
    ) -> (usize, Result<(), RepoError>) {
        let mut incoming = rx.into_iter().flatten();
        let mut done = 0;
        let mut buf = PageBuf::new(OUT_BUF_BYTES);
        for f in files {
            let io = |path: &Path| {
                let path = path.to_path_buf();
                move |source| RepoError::Io { path, source }
            };
            let result = (|| {
                let mut w = OutFile::create(&f.tmp, &mut buf).map_err(io(&f.tmp))?;
                self.stream_file(
                    &f.m,
                    f.rel,
                    commit,
                    step,
                    |id| match incoming.next() {
                        Some((got, raw)) if got == *id => raw,
                        _ => Err(RepoError::Stopped {
                            stage: "checkout decoder",
                        }),
                    },
                    |_, raw| {
                        w.write_all(&raw).map_err(io(&f.tmp))?;
                        progress.advance(raw.len() as u64, 0);
                        self.pool.put(raw);
                        Ok(())
                    },
                )?;
                let file = w.finish().map_err(io(&f.tmp))?;
                set_mode(&file, f.m.mode & 0o777).map_err(io(&f.tmp))?;
                Ok(file)
            })();
            match result {
                // Closed now (reopened for the sync): a checkout of
                // thousands of files must not hold a descriptor each.
                Ok(_file) => {
                    done += 1;
                    progress.advance(0, 1);
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&f.tmp);
                    return (done, Err(e));
                }
            }
        }
        (done, Ok(()))
    }

    /// Refuses an output directory that holds this repository's own data
    /// directory (`out` is the repository root or one of its parents).
    fn refuse_own_data_dir(&self, out: &Path) -> Result<(), RepoError> {
        let canon = |p: &Path| std::fs::canonicalize(p).ok();
        let (Some(out_c), Some(dot)) = (canon(out), canon(&self.root().join(super::DOT_DIR)))
        else {
            return Ok(());
        };
        if dot.starts_with(&out_c) {
            return Err(RepoError::BadInput {
                path: out.to_path_buf(),
                reason: format!(
                    "holds this repository's data directory {}; check out into a \
                     directory of its own",
                    dot.display()
                ),
            });
        }
        Ok(())
    }
}

/// A private directory inside the checkout's output for files being
/// written, removed (with anything left in it) on drop.
struct Staging {
    dir: PathBuf,
}

impl Staging {
    /// Creates `out/.ckvc-checkout-<pid>-<n>`, a name no path of `committed`
    /// starts with, exclusively (never an existing directory).
    fn new<'a>(out: &Path, committed: impl Iterator<Item = &'a str>) -> Result<Staging, RepoError> {
        let tops: std::collections::HashSet<&str> = committed
            .map(|p| p.split('/').next().unwrap_or(p))
            .collect();
        let pid = std::process::id();
        let mut last = None;
        for n in 0u32..1000 {
            let name = format!(".ckvc-checkout-{pid}-{n}");
            if tops.contains(name.as_str()) {
                continue;
            }
            let dir = out.join(&name);
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(Staging { dir }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(source) => return Err(RepoError::Io { path: dir, source }),
            }
        }
        Err(RepoError::Io {
            path: out.to_path_buf(),
            source: last.unwrap_or_else(|| std::io::Error::other("no free temporary name")),
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One file of a checkout: where it goes and where it is written first.
struct FileJob<'a> {
    rel: &'a str,
    m: FileManifest,
    dest: PathBuf,
    tmp: PathBuf,
}

/// A chunk as the decoder hands it to the writer.
type Decoded = (ChunkId, Result<Vec<u8>, RepoError>);

/// Bytes of decoded chunks per window for a memory budget: one window is
/// decoded (each thread also holding the bases of its chain) while one
/// waits and one is written.
fn window_bytes(budget: u64) -> u64 {
    (budget / 8).clamp(8 << 20, 128 << 20)
}

/// Make the finished files durable (fsynced in parallel), rename each into
/// place, then sync every directory that received one.
fn install(files: &[FileJob<'_>]) -> Result<(), RepoError> {
    files.par_iter().try_for_each(|f| {
        std::fs::File::open(&f.tmp)
            .and_then(|file| file.sync_all())
            .map_err(|source| RepoError::Io {
                path: f.tmp.clone(),
                source,
            })
    })?;
    let mut dirs: Vec<&Path> = Vec::new();
    for f in files {
        replace_with(&f.tmp, &f.dest)?;
        let dir = f
            .dest
            .parent()
            .expect("a joined relative path has a parent");
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    for d in dirs {
        std::fs::File::open(d)
            .and_then(|h| h.sync_all())
            .map_err(|source| RepoError::Io {
                path: d.to_path_buf(),
                source,
            })?;
    }
    Ok(())
}

/// Creates the directories of `rel` under `out`, one component at a time,
/// never through a symbolic link: a link (or a file) where a directory
/// belongs is removed and a real directory made in its place. (`out`
/// itself, named by the user, may be a link.)
fn make_dirs_no_symlinks(out: &Path, rel: &str) -> Result<(), RepoError> {
    let mut dir = out.to_path_buf();
    let comps: Vec<&str> = rel.split('/').collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        dir.push(c);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(&dir).map_err(|source| RepoError::Io {
                path: dir.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(RepoError::Io { path: dir, source }),
        }
        std::fs::create_dir(&dir).map_err(|source| RepoError::Io {
            path: dir.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Deletes everything under `dir` (at `prefix` within the output) that is
/// neither a committed file nor a directory on the way to one; links are
/// removed, never followed.
fn remove_others(
    dir: &Path,
    prefix: &str,
    keep: &std::collections::HashSet<&str>,
    removed: &mut Vec<String>,
) -> Result<(), RepoError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RepoError::Io { path, source }
    };
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    names.sort_by_key(|e| e.file_name());
    for e in names {
        let rel = format!("{prefix}{}", e.file_name().to_string_lossy());
        let path = e.path();
        let ft = e.file_type().map_err(io(&path))?;
        if ft.is_dir() {
            let under = format!("{rel}/");
            if keep.iter().any(|k| k.starts_with(&under)) {
                remove_others(&path, &under, keep, removed)?;
                continue;
            }
            std::fs::remove_dir_all(&path).map_err(io(&path))?;
        } else if keep.contains(rel.as_str()) && ft.is_file() {
            continue;
        } else {
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
        removed.push(rel);
    }
    Ok(())
}

/// Renames the finished file `tmp` to `dest`. A rename replaces a symbolic
/// link at `dest` itself (never its target); a directory there is an error.
fn replace_with(tmp: &Path, dest: &Path) -> Result<(), RepoError> {
    if let Ok(m) = std::fs::symlink_metadata(dest) {
        if m.is_dir() {
            return Err(RepoError::BadInput {
                path: dest.to_path_buf(),
                reason: "is a directory where the commit has a file".into(),
            });
        }
    }
    std::fs::rename(tmp, dest).map_err(|source| RepoError::Io {
        path: dest.to_path_buf(),
        source,
    })
}

impl Repository {
    /// Feed the chunks of file `rel` (manifest `m`, in `commit` at `step`)
    /// to `sink` in order, each read by `read` (which verifies it against
    /// its id); then check the segment lengths and the whole-file blake3. On
    /// error `sink` may have seen bytes of a damaged file: callers write to
    /// a temporary file.
    pub(crate) fn stream_file(
        &self,
        m: &FileManifest,
        rel: &str,
        commit: &CommitId,
        step: u64,
        mut read: impl FnMut(&ChunkId) -> Result<Vec<u8>, RepoError>,
        mut sink: impl FnMut(&ChunkId, Vec<u8>) -> Result<(), RepoError>,
    ) -> Result<(), RepoError> {
        let mut hasher = blake3::Hasher::new();
        for seg in &m.segments {
            let mut written = 0u64;
            for id in seg.chunks() {
                let raw = read(id).map_err(|e| {
                    let place = Place {
                        commit: Some(*commit),
                        step: Some(step),
                        file: Some(rel.to_string()),
                        tensor: seg_tensor(seg),
                    };
                    e.placed(&place)
                })?;
                hasher.update(&raw);
                written += raw.len() as u64;
                sink(id, raw)?;
            }
            if written != seg.len() {
                return Err(RepoError::Corrupt {
                    site: Site::at(Place {
                        commit: Some(*commit),
                        step: Some(step),
                        file: Some(rel.to_string()),
                        tensor: seg_tensor(seg),
                    }),
                    reason: format!(
                        "its chunks hold {written} bytes, its manifest says {}",
                        seg.len()
                    ),
                });
            }
        }
        if *hasher.finalize().as_bytes() != m.hash {
            return Err(RepoError::Corrupt {
                site: Site::at(Place {
                    commit: Some(*commit),
                    step: Some(step),
                    file: Some(rel.to_string()),
                    tensor: None,
                }),
                reason: "the reassembled file does not match its recorded blake3".into(),
            });
        }
        Ok(())
    }
}

/// The tensor a segment holds (`None`: opaque bytes).
fn seg_tensor(s: &SegmentRef) -> Option<String> {
    match s {
        SegmentRef::Tensor { name, .. } => Some(name.clone()),
        SegmentRef::Opaque { .. } => None,
    }
}

#[cfg(unix)]
fn set_mode(f: &std::fs::File, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
}

#[cfg(not(unix))]
fn set_mode(f: &std::fs::File, mode: u32) -> std::io::Result<()> {
    let mut p = f.metadata()?.permissions();
    p.set_readonly(mode & 0o200 == 0);
    f.set_permissions(p)
}

/// Glob match on `/`-separated paths: `*` and `?` within a component, `**`
/// across components.
pub fn glob_match(glob: &str, path: &str) -> bool {
    let comp = |g: &str, s: &str| {
        star_match(
            g.as_bytes(),
            s.as_bytes(),
            |&g| g == b'*',
            |g, s| *g == b'?' || g == s,
        )
    };
    // A glob without '/' matches the file name anywhere.
    if !glob.contains('/') {
        return path.rsplit('/').next().is_some_and(|name| comp(glob, name));
    }
    let g: Vec<&str> = glob.split('/').collect();
    let p: Vec<&str> = path.split('/').collect();
    star_match(&g, &p, |&g| g == "**", |g, s| comp(g, s))
}

/// Whether `pat` matches all of `s`, each of its items matching one item
/// of `s` (`one`) but stars, which match any run of items (none too).
/// Greedy, going back only to the last star: time at most the product of
/// the lengths, where trying every split from each star was exponential in
/// the number of stars (`*a*a*a*a*a*a*a*a*a*a*b` against a long name).
fn star_match<G, S>(
    pat: &[G],
    s: &[S],
    star: impl Fn(&G) -> bool,
    one: impl Fn(&G, &S) -> bool,
) -> bool {
    let (mut pi, mut si) = (0, 0);
    // After the last star seen: where the pattern goes on, and the first
    // item of `s` not yet given to that star.
    let mut back: Option<(usize, usize)> = None;
    while si < s.len() {
        match pat.get(pi) {
            Some(p) if star(p) => {
                back = Some((pi + 1, si));
                pi += 1;
            }
            Some(p) if one(p, &s[si]) => {
                pi += 1;
                si += 1;
            }
            _ => match back {
                Some((bp, bs)) => {
                    // The star takes one more item.
                    back = Some((bp, bs + 1));
                    (pi, si) = (bp, bs + 1);
                }
                None => return false,
            },
        }
    }
    pat[pi..].iter().all(star)
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("*.safetensors", "model.safetensors"));
        assert!(glob_match("*.safetensors", "sub/model.safetensors"));
        assert!(!glob_match("*.safetensors", "optimizer.pt"));
        assert!(glob_match("sub/*.pt", "sub/optimizer.pt"));
        assert!(!glob_match("sub/*.pt", "other/optimizer.pt"));
        assert!(glob_match("**/x?.bin", "a/b/x1.bin"));
        assert!(glob_match("**", "a/b"));
        assert!(glob_match("a/**/c", "a/c"));
        assert!(!glob_match("a/**/c", "a/b/d"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("?", ""));
    }

    /// The recursive matcher it replaced (exponential in the stars).
    fn reference(glob: &str, path: &str) -> bool {
        let g: Vec<&str> = glob.split('/').collect();
        let p: Vec<&str> = path.split('/').collect();
        fn comps(g: &[&str], p: &[&str]) -> bool {
            match (g.first(), p.first()) {
                (None, None) => true,
                (Some(&"**"), _) => comps(&g[1..], p) || (!p.is_empty() && comps(g, &p[1..])),
                (Some(gc), Some(pc)) => {
                    comp(gc.as_bytes(), pc.as_bytes()) && comps(&g[1..], &p[1..])
                }
                _ => false,
            }
        }
        fn comp(g: &[u8], s: &[u8]) -> bool {
            match (g.first(), s.first()) {
                (None, None) => true,
                (Some(b'*'), _) => comp(&g[1..], s) || (!s.is_empty() && comp(g, &s[1..])),
                (Some(b'?'), Some(_)) => comp(&g[1..], &s[1..]),
                (Some(a), Some(b)) => a == b && comp(&g[1..], &s[1..]),
                _ => false,
            }
        }
        if !glob.contains('/') {
            return p
                .last()
                .is_some_and(|name| comp(glob.as_bytes(), name.as_bytes()));
        }
        comps(&g, &p)
    }

    proptest::proptest! {
        /// Small globs and paths over a few letters: the same answers as
        /// the recursive matcher.
        #[test]
        fn glob_match_answers_as_the_recursive_matcher_did(
            glob in "/?(\\*\\*|\\*\\*\\*|[ab*?/]{0,4})(/(\\*\\*|[ab*?]{0,4})){0,4}/?",
            path in "/?[ab*?/]{0,5}(/[ab*?]{0,5}){0,5}/?",
        ) {
            proptest::prop_assert_eq!(glob_match(&glob, &path), reference(&glob, &path));
        }
    }

    /// `checkout --only '*a*a*a*a*a*a*a*a*a*a*a*a*b'` against a long file
    /// name tried every split from every star: exponential in the stars.
    #[test]
    fn a_glob_of_many_stars_against_a_long_name_does_not_backtrack_exponentially() {
        let glob = "*a".repeat(14) + "*b";
        let name = "a".repeat(200);
        assert!(!glob_match(&glob, &name));
        assert!(glob_match(&glob, &(name.clone() + "b")));
        assert!(!glob_match(
            &format!("x/**/{glob}"),
            &format!("x/{}/{name}", "d/".repeat(50))
        ));
    }
}
