//! `push`: send a branch to a remote.
//!
//! Walk what the branch needs ([`Repository::reachable`]), subtract what
//! the remote's pack indexes list, write the rest as packs (each pack, then
//! its index), and only then move the remote ref with compare-and-swap. A
//! push killed midway leaves complete packs (with an index) that the next
//! run skips, perhaps one pack without an index that it rewrites, and the
//! remote ref untouched. Reads the repository only through its export API
//! ([`Repository::object_bytes`]).

use std::collections::{HashMap, HashSet};

use crate::repo::{check_branch_name, ObjectKind, RepoError, Repository, WalkOptions};
use crate::store::{ChunkId, CommitId, Hash32, ObjectId};

use super::gc::read_pending;
use super::layout::{
    check_layout, idx_key, load_index, pack_key, parse_ref, ref_file, HEADS, REF_BYTES,
};
use super::pack::{Kind, PackWriter};
use super::{Progress, Remote, RemoteError};

/// How to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// The branch (default: the current one).
    pub branch: Option<String>,
    /// Move the remote ref even if that drops commits from it.
    pub force: bool,
    /// A pack is closed once it holds this many bytes.
    pub pack_bytes: usize,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            branch: None,
            force: false,
            // Measured: 64 MiB packs keep a push of the corpus to a few
            // PUTs while bounding memory (one pack is built at a time).
            pack_bytes: 64 << 20,
        }
    }
}

/// What a push did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PushReport {
    pub branch: String,
    /// The remote ref before (`None`: created).
    pub old: Option<CommitId>,
    pub new: CommitId,
    pub up_to_date: bool,
    pub forced: bool,
    /// Commits the remote did not have.
    pub commits: u64,
    /// Their checkpoints' size (what `cp -r` would copy).
    pub logical_bytes: u64,
    /// Objects (chunks, manifests, trees, commits) sent, and already there.
    pub objects_sent: u64,
    pub objects_present: u64,
    pub packs_sent: u64,
    /// Bytes of packs and indexes uploaded.
    pub bytes_sent: u64,
}

/// Push a branch to `remote` (named `remote_name` locally, for its
/// tracking ref).
pub fn push(
    repo: &Repository,
    remote_name: &str,
    remote: &dyn Remote,
    opts: &PushOptions,
    progress: &dyn Progress,
) -> Result<PushReport, RemoteError> {
    let branch = match &opts.branch {
        Some(b) => b.clone(),
        None => repo.current_branch()?,
    };
    check_branch_name(&branch)?;
    let head = repo
        .branch_head(&branch)?
        .ok_or_else(|| RepoError::NoSuchBranch {
            name: branch.clone(),
        })?;
    check_layout(remote, true)?;
    // Temporary files of pushes killed more than an hour ago (a push in
    // progress writes fresh ones); failing to remove them fails nothing.
    let _ = remote.clean_stale(std::time::Duration::from_secs(3600));
    let key = format!("{HEADS}{branch}");
    let old = match remote.get_versioned_limited(&key, REF_BYTES)? {
        Some((b, v)) => Some((parse_ref(&b, &key)?, v)),
        None => None,
    };
    let mut report = PushReport {
        branch: branch.clone(),
        old: old.as_ref().map(|o| o.0),
        new: head,
        ..Default::default()
    };
    if old.as_ref().is_some_and(|o| o.0 == head) {
        report.up_to_date = true;
        repo.set_remote_ref(remote_name, &branch, &head, "push")?;
        return Ok(report);
    }
    if let Some((o, _)) = &old {
        let ff = repo.has_commit(o)? && repo.is_ancestor(o, &head)?;
        if !ff {
            if !opts.force {
                return Err(RemoteError::NonFastForward {
                    branch,
                    remote: Some(*o),
                    local: head,
                    raced: false,
                });
            }
            report.forced = true;
        }
    }

    let ix = load_index(remote)?;
    // Packs a remote gc found unreachable may be deleted by the next gc at
    // any moment, before this push moves its ref: their objects do not
    // count as on the remote (they are sent again, in packs of other
    // names), whatever else the indexes say.
    // Only the objects no other pack holds are set apart (not a copy of
    // the whole index: it is in memory twice already).
    let pending = read_pending(remote)?;
    let mut stale: HashSet<(Kind, [u8; 32])> = ix
        .contents
        .iter()
        .filter(|(p, _)| pending.contains_key(*p))
        .flat_map(|(_, es)| es.iter().map(|e| (e.kind, e.id)))
        .collect();
    if !stale.is_empty() {
        for (_, es) in ix
            .contents
            .iter()
            .filter(|(p, _)| !pending.contains_key(*p))
        {
            for e in es {
                stale.remove(&(e.kind, e.id));
            }
        }
    }
    let held = |k_id: &(Kind, [u8; 32])| ix.entries.contains_key(k_id) && !stale.contains(k_id);
    let reach = repo.reachable(
        &[head],
        WalkOptions {
            chunk_headers: true,
            frame_headers: false,
            depth: None,
        },
    )?;
    if let Some((_, _, e)) = reach.damage.first() {
        return Err(RemoteError::Refused {
            reason: format!("refusing to push a damaged history ({e}); run `ckvc fsck`"),
        });
    }
    // A shallow clone can push only on top of history the remote has.
    for s in repo.shallow()? {
        if reach.commits.contains(&s) {
            for p in repo.commit_object(&s)?.parents {
                if !held(&(Kind::Commit, *p.as_bytes())) {
                    return Err(RemoteError::Refused {
                        reason: format!(
                            "this shallow clone lacks the history before commit {}, and the remote does not have it either; push from a full clone",
                            s.short(12)
                        ),
                    });
                }
            }
        }
    }

    // What to send: chunks first, then manifests, trees, commits (parents
    // first), so a pack never holds an object whose content it precedes.
    let mut todo: Vec<(Kind, [u8; 32])> = Vec::new();
    // Chunks grouped by the commit the walk found them in (then by file
    // and tensor), so that a commit's chunks lie together and a shallow
    // fetch reads them in few ranges; bases no manifest names come last.
    let position: std::collections::HashMap<&CommitId, usize> = reach
        .commits
        .iter()
        .enumerate()
        .map(|(i, c)| (c, i))
        .collect();
    let mut chunk_ids: Vec<(usize, &str, &str, ChunkId)> = reach
        .all_chunks()
        .map(|c| match reach.chunks.get(c) {
            Some(u) => (
                position.get(&u.commit).copied().unwrap_or(usize::MAX),
                u.path.as_str(),
                u.tensor.as_deref().unwrap_or(""),
                *c,
            ),
            None => (usize::MAX, "", "", *c),
        })
        .collect();
    chunk_ids.sort();
    for (.., c) in chunk_ids {
        todo.push((Kind::Chunk, *c.as_bytes()));
    }
    let mut manifests: Vec<ObjectId> = reach.manifests.keys().copied().collect();
    manifests.sort();
    todo.extend(manifests.iter().map(|m| (Kind::Manifest, *m.as_bytes())));
    let mut trees: Vec<ObjectId> = reach.trees.iter().copied().collect();
    trees.sort();
    todo.extend(trees.iter().map(|t| (Kind::Tree, *t.as_bytes())));
    todo.extend(reach.commits.iter().map(|c| (Kind::Commit, *c.as_bytes())));
    let total = todo.len() as u64;
    todo.retain(|k_id| !held(k_id));
    report.objects_present = total - todo.len() as u64;
    for (k, id) in &todo {
        if *k == Kind::Commit {
            report.commits += 1;
            let c = repo.commit_object(&CommitId::from_bytes(*id))?;
            report.logical_bytes = report.logical_bytes.saturating_add(c.stats.logical_bytes);
        }
    }

    progress.start("upload", 0, todo.len() as u64);
    let mut w = PackWriter::new();
    let mut buf = Vec::new();
    for (kind, id) in &todo {
        if !repo.object_bytes(ObjectKind::from(*kind), id, &mut buf)? {
            return Err(RepoError::Missing {
                site: crate::repo::Site::of(ObjectKind::from(*kind).object_ref(id)),
            }
            .into());
        }
        w.add(*kind, *id, &buf);
        if w.len() >= opts.pack_bytes {
            send_pack(
                remote,
                std::mem::take(&mut w),
                &pending,
                &mut report,
                progress,
            )?;
            w = PackWriter::new();
        }
    }
    if !w.is_empty() {
        send_pack(remote, w, &pending, &mut report, progress)?;
    }
    progress.finish();

    // Every object is on the remote: now, and only now, move the ref.
    let expected = old.as_ref().map(|o| &o.1);
    match remote.put_if(&key, ref_file(&head), expected) {
        Ok(()) => {}
        Err(RemoteError::Conflict { .. }) => {
            let now = remote
                .get_limited(&key, REF_BYTES)?
                .and_then(|b| parse_ref(&b, &key).ok());
            return Err(RemoteError::NonFastForward {
                branch,
                remote: now,
                local: head,
                raced: true,
            });
        }
        Err(e) => return Err(e),
    }
    repo.set_remote_ref(remote_name, &branch, &head, "push")?;
    Ok(report)
}

fn send_pack(
    remote: &dyn Remote,
    w: PackWriter,
    pending: &HashMap<Hash32, u64>,
    report: &mut PushReport,
    progress: &dyn Progress,
) -> Result<(), RemoteError> {
    let count = w.count() as u64;
    // Never the name of a pack a gc is about to delete.
    let (bytes, name, idx) = w.finish_unlike(|n| pending.contains_key(n));
    let n = (bytes.len() + idx.len()) as u64;
    // The pack before its index: an index always names a complete pack.
    remote.put(&pack_key(&name), bytes)?;
    remote.put(&idx_key(&name), idx)?;
    report.packs_sent += 1;
    report.objects_sent += count;
    report.bytes_sent += n;
    progress.advance(n, count);
    Ok(())
}
