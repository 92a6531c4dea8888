//! `gc`: retention (`--keep`), chain compaction (`--compact`) and mark and
//! sweep of everything no ref, tag or recent ref-log entry reaches. The
//! algorithm and why each crash point is safe: `docs/design/gc.md`.
//!
//! Phases, each leaving a consistent repository if interrupted:
//! 1. plan: the retention policy picks the commits to keep on each branch;
//!    kept commits after a dropped one are re-created with new parents (in
//!    memory). Mark: walk from the new refs and recent ref-log entries.
//! 2. rewrite chunks: a live chunk whose delta base is no longer live is
//!    re-encoded against the nearest live chunk of its old chain (or stored
//!    full); with `--compact`, every chunk deeper than `compact_chain` is
//!    stored full. A rewritten record decodes to the same bytes (same id),
//!    so old and new history both stay readable throughout.
//! 3. refs: the new commits and the moved branches in one atomic,
//!    compare-and-swap batch with ref-log entries.
//! 4. sweep: delete what is not live, sparing chunks younger than the grace
//!    period (and their bases); then compact the store to free the disk.

use std::collections::{BTreeMap, HashMap, HashSet};

use rayon::prelude::*;

use crate::codec::{FrameInfo, Scratch};
use crate::store::{Batch, ChunkId, CommitId, ObjectId, Space, StoreExt};

use super::chain::base_chain;
use super::commit::{encode_record, now_secs};
use super::objects::{
    chunk_head_key, corrupt, object_key, stored_head, ChunkHeader, ChunkRecord, Commit, Payload,
    KIND_CHUNK_HEAD, KIND_COMMIT,
};
use super::reach::{Reachable, WalkOptions};
use super::status::dir_size;
use super::{branch_ref, RepoError, Repository, DOT_DIR};

/// `Meta/gc-pending`: present from the start of a gc's writes until its
/// compaction is done (see `docs/format/store.md`).
const GC_PENDING: &[u8] = b"gc-pending";

/// What `gc` should do besides sweeping.
#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Bound every live chunk's delta chain by `compact_chain`.
    pub compact: bool,
    /// Drop commits the policy does not keep (every branch).
    pub keep: Option<KeepPolicy>,
    /// Report, change nothing.
    pub dry_run: bool,
    /// Unreferenced chunks younger than this, and ref-log entries younger
    /// than this, are spared (seconds).
    pub grace_secs: u64,
    /// Longest chain `--compact` leaves; `None`: the repository setting.
    pub compact_chain: Option<u16>,
}

/// Which commits of a branch to keep; a commit is kept if any rule keeps
/// it. The branch head is always kept. Like restic's `forget`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeepPolicy {
    /// The newest `n` commits.
    pub last: Option<usize>,
    /// One commit per `k` steps: the first (lowest step) of each interval
    /// `[i*k, (i+1)*k)`.
    pub every: Option<u64>,
    /// The `n` best by a trainer metric.
    pub best: Option<BestBy>,
    /// Commits made within this many seconds of now.
    pub within_secs: Option<u64>,
}

/// `best=N[:metric[:min|max]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BestBy {
    pub n: usize,
    pub metric: String,
    /// Lower is better (losses); `false` for accuracies.
    pub lower_is_better: bool,
}

impl KeepPolicy {
    /// Parse `last=N`, `every=K`, `best=N[:metric[:min|max]]`, `within=D`
    /// (D: a number with `s`, `m`, `h`, `d` or `w`), one rule per string;
    /// several strings combine.
    pub fn parse(specs: &[String]) -> Result<KeepPolicy, String> {
        let mut p = KeepPolicy::default();
        for spec in specs.iter().flat_map(|s| s.split(',')) {
            let (k, v) = spec
                .split_once('=')
                .ok_or_else(|| format!("--keep {spec:?}: expected RULE=VALUE"))?;
            let num = |v: &str| {
                v.parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("--keep {spec:?}: {v:?} is not a positive number"))
            };
            match k {
                "last" => p.last = Some(num(v)? as usize),
                "every" => p.every = Some(num(v)?),
                "within" => p.within_secs = Some(parse_duration(v)?),
                "best" => {
                    let mut parts = v.split(':');
                    let n = num(parts.next().unwrap_or(""))? as usize;
                    let metric = parts.next().unwrap_or("eval_loss").to_string();
                    let lower_is_better = match parts.next() {
                        None | Some("min") => true,
                        Some("max") => false,
                        Some(o) => return Err(format!("--keep {spec:?}: {o:?} is not min or max")),
                    };
                    p.best = Some(BestBy {
                        n,
                        metric,
                        lower_is_better,
                    });
                }
                _ => {
                    return Err(format!(
                        "--keep {spec:?}: unknown rule {k:?} (last, every, best, within)"
                    ))
                }
            }
        }
        if p == KeepPolicy::default() {
            return Err("--keep needs at least one rule".into());
        }
        Ok(p)
    }

    /// Which of `line` (a branch's first-parent history, newest first) to
    /// keep. `best=` refuses a line where a commit that could be dropped
    /// has no finite value of the metric: ranking it as worst would drop it
    /// for a metric it was never given.
    fn select(&self, line: &[(CommitId, Commit)], now: u64) -> Result<Vec<bool>, RepoError> {
        if let Some(b) = &self.best {
            let missing: Vec<(CommitId, u64)> = line
                .iter()
                .skip(1) // the head is always kept
                .filter(|(_, c)| {
                    !c.metrics
                        .get(&b.metric)
                        .and_then(|v| v.as_f64())
                        .is_some_and(f64::is_finite)
                })
                .map(|(id, c)| (*id, c.step))
                .collect();
            if !missing.is_empty() {
                return Err(RepoError::MissingMetric {
                    metric: b.metric.clone(),
                    commits: missing,
                });
            }
        }
        let mut keep = vec![false; line.len()];
        if let Some(k) = keep.first_mut() {
            *k = true;
        }
        if let Some(n) = self.last {
            keep.iter_mut().take(n).for_each(|k| *k = true);
        }
        if let Some(k) = self.every {
            let mut first_of: HashMap<u64, usize> = HashMap::new();
            for (i, (_, c)) in line.iter().enumerate() {
                let e = first_of.entry(c.step / k).or_insert(i);
                if c.step < line[*e].1.step {
                    *e = i;
                }
            }
            first_of.values().for_each(|&i| keep[i] = true);
        }
        if let Some(b) = &self.best {
            let mut scored: Vec<(f64, usize)> = line
                .iter()
                .enumerate()
                .filter_map(|(i, (_, c))| {
                    let v = c.metrics.get(&b.metric)?.as_f64()?;
                    v.is_finite()
                        .then_some((if b.lower_is_better { v } else { -v }, i))
                })
                .collect();
            scored.sort_by(|a, b| a.0.total_cmp(&b.0));
            scored.iter().take(b.n).for_each(|&(_, i)| keep[i] = true);
        }
        if let Some(w) = self.within_secs {
            for (i, (_, c)) in line.iter().enumerate() {
                if c.time >= now.saturating_sub(w) {
                    keep[i] = true;
                }
            }
        }
        Ok(keep)
    }
}

/// `30d`, `12h`, `90m`, `3600s`, `2w`, or a bare number of seconds.
pub fn parse_duration(v: &str) -> Result<u64, String> {
    let (n, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{v:?} is not a duration like 30d, 12h, 90m, 0s"))?;
    let mul = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        "w" => 7 * 86400,
        _ => return Err(format!("{v:?}: unknown unit {unit:?} (s, m, h, d, w)")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| format!("{v:?} is too long"))
}

/// Size and shape of a repository, before and after gc.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RepoCounts {
    /// Bytes of the store directory (0 for an in-memory store).
    pub disk_bytes: u64,
    /// Commits reachable from refs.
    pub commits: usize,
    /// Chunk records stored (reachable or not).
    pub chunks: usize,
    /// Longest delta chain of a reachable chunk (0: all full).
    pub longest_chain: u16,
}

/// A commit removed from a branch's history.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Dropped {
    pub branch: String,
    pub commit: CommitId,
    pub step: u64,
}

/// What gc did (or, with `dry_run`, would do).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    pub before: RepoCounts,
    /// Equal to `before` on a dry run.
    pub after: RepoCounts,
    pub dropped: Vec<Dropped>,
    /// Kept commits re-created with new parents.
    pub rewritten_commits: usize,
    /// Branches moved to their rewritten heads: (branch, old, new).
    pub moved: Vec<(String, CommitId, CommitId)>,
    /// Chunk records re-encoded: made full (compaction) or rebased.
    pub keyframes: usize,
    pub rebased: usize,
    /// Records whose only change is their recorded depth.
    pub relabelled: usize,
    pub deleted_chunks: usize,
    pub deleted_objects: usize,
    /// Bytes of the deleted records and objects.
    pub freed_bytes: u64,
    /// Unreferenced chunks spared because they are younger than the grace.
    pub spared_chunks: usize,
}

/// A branch's history rewrite.
struct LinePlan {
    branch: String,
    old_head: CommitId,
    new_head: CommitId,
    /// Every commit of the old first-parent line.
    old: Vec<CommitId>,
}

/// What the sweep removes.
struct SweepPlan {
    /// Dead chunks (id, stored bytes).
    dead_chunks: Vec<(ChunkId, u64)>,
    /// Unreferenced chunks the grace period spares.
    spared: usize,
    /// Dead objects (key, stored bytes).
    dead_objects: Vec<(Vec<u8>, u64)>,
    /// Chunk records stored.
    stored: usize,
    /// Chunk heads whose record is not stored (damage: a commit would take
    /// such a chunk as stored); removed with the dead chunks.
    orphan_heads: Vec<ChunkId>,
}

/// A rewritten chunk: id, encoded record, its depth.
type Rewritten = (ChunkId, Vec<u8>, u16);

/// How a live chunk's record changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewrite {
    /// Re-encode against this base, or full (`None`).
    Encode(Option<ChunkId>),
    /// Same payload, new depth.
    Depth,
}

impl Repository {
    /// Counts for the report.
    pub fn counts(&self) -> Result<RepoCounts, RepoError> {
        let roots = self.roots(u64::MAX)?;
        let reach = self.reachable(
            &roots,
            WalkOptions {
                chunk_headers: true,
                frame_headers: false,
                depth: None,
            },
        )?;
        let mut chunks = 0usize;
        self.store.scan_prefix(Space::Chunks, &[], &mut |_, _| {
            chunks += 1;
            Ok(true)
        })?;
        let depths = true_depths(&reach.headers);
        Ok(self.counts_of(&reach, chunks, &depths))
    }

    /// Counts of a walk: its commits and longest live chain (by `depths`),
    /// with `chunks` records stored and the store directory's size now.
    fn counts_of(
        &self,
        reach: &Reachable,
        chunks: usize,
        depths: &HashMap<ChunkId, u16>,
    ) -> RepoCounts {
        RepoCounts {
            disk_bytes: dir_size(&self.root.join(DOT_DIR)),
            commits: reach.commits.len(),
            chunks,
            longest_chain: reach
                .chunks
                .keys()
                .filter_map(|c| depths.get(c))
                .copied()
                .max()
                .unwrap_or(0),
        }
    }

    /// Run gc.
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport, RepoError> {
        let now = now_secs();
        let since = now.saturating_sub(opts.grace_secs);
        let mut report = GcReport {
            dry_run: opts.dry_run,
            ..GcReport::default()
        };

        // 1. Plan the retention and mark.
        let mut overlay: HashMap<CommitId, Commit> = HashMap::new();
        let mut plans = Vec::new();
        if let Some(policy) = &opts.keep {
            for (branch, head) in self.branches()? {
                if let Some(plan) =
                    self.plan_line(&branch, head, policy, now, &mut overlay, &mut report)?
                {
                    plans.push(plan);
                }
            }
        }
        let superseded: HashSet<CommitId> =
            plans.iter().flat_map(|p| p.old.iter().copied()).collect();
        // Every ref is a root (tags, other branches and remote-tracking refs
        // keep what they reach, superseded or not), except the old heads of
        // the rewritten branches, which move to their new heads. Ref-log
        // entries naming superseded commits are not roots: retention is an
        // explicit request to forget them.
        let moved: HashSet<&str> = plans.iter().map(|p| p.branch.as_str()).collect();
        let mut roots: Vec<CommitId> = self
            .reflog_roots(since)?
            .into_iter()
            .filter(|c| !superseded.contains(c))
            .collect();
        roots.extend(plans.iter().map(|p| p.new_head));
        for (b, h) in self.branches()? {
            if !moved.contains(b.as_str()) {
                roots.push(h);
            }
        }
        roots.extend(self.tags()?.into_iter().map(|(_, c)| c));
        roots.extend(self.all_remote_refs()?.into_iter().map(|(_, c)| c));
        roots.sort();
        roots.dedup();
        let reach = self.reachable_with(
            &roots,
            WalkOptions {
                chunk_headers: true,
                frame_headers: false,
                depth: None,
            },
            &overlay,
        )?;
        let first = reach
            .damage
            .first()
            .map(|d| &d.2)
            .or_else(|| reach.chunk_damage.first().map(|(_, e)| e));
        if let Some(first) = first {
            return Err(RepoError::Damaged {
                count: reach.damage.len() + reach.chunk_damage.len(),
                first: first.to_string(),
            });
        }

        // 2. Chunk rewrites.
        let limit = if opts.compact {
            Some(opts.compact_chain.unwrap_or(self.config.compact_chain))
        } else {
            None
        };
        let live: HashSet<ChunkId> = reach.chunks.keys().copied().collect();

        // 4 (planned). What the sweep removes.
        let SweepPlan {
            dead_chunks,
            spared,
            dead_objects,
            stored: stored_chunks,
            orphan_heads,
        } = self.sweep_plan(&reach, &live, since)?;
        // Before: the mark is of the current refs unless --keep moves some.
        report.before = if plans.is_empty() {
            self.counts_of(&reach, stored_chunks, &true_depths(&reach.headers))
        } else {
            self.counts()?
        };
        report.after = report.before;
        report.spared_chunks = spared;
        report.deleted_chunks = dead_chunks.len();
        report.deleted_objects = dead_objects.len();
        report.freed_bytes = dead_chunks.iter().map(|d| d.1).sum::<u64>()
            + dead_objects.iter().map(|d| d.1).sum::<u64>();
        if opts.dry_run {
            self.rewrite_chunks(&reach, limit, true, &mut report)?;
            return Ok(report);
        }

        // A gc that rewrites or deletes leaves garbage in the store's files
        // until the final compaction; a kill before it would leave that
        // garbage for good (the next gc finds nothing to delete and would
        // not compact). So the intent is recorded first and cleared only
        // after the compaction: a marker found here means a gc was killed.
        let interrupted = self.store.get_vec(Space::Meta, GC_PENDING)?.is_some();
        self.store.ensure_room_to_compact()?;
        self.store.put(Space::Meta, GC_PENDING, vec![1])?;

        let depths = self.rewrite_chunks(&reach, limit, false, &mut report)?;

        // 3. New commits and branch moves, atomically.
        if !plans.is_empty() {
            let mut b = Batch::new();
            for (id, c) in &overlay {
                b.put(
                    Space::Objects,
                    &object_key(KIND_COMMIT, &ObjectId::from_bytes(*id.as_bytes())),
                    c.encode(),
                );
            }
            for p in &plans {
                self.move_ref(
                    &mut b,
                    &branch_ref(&p.branch),
                    Some(&p.old_head),
                    Some(&p.new_head),
                    "gc --keep",
                );
            }
            self.store.write(b)?;
            self.store.flush()?;
        }

        // 4. Sweep.
        let mut b = Batch::new();
        for (id, _) in &dead_chunks {
            // The head first in the same batch: never a head without its chunk.
            b.delete(Space::Index, &chunk_head_key(id));
            b.delete(Space::Chunks, id.as_bytes());
            if b.len() >= 10_000 {
                self.store.write(std::mem::take(&mut b))?;
            }
        }
        for id in &orphan_heads {
            b.delete(Space::Index, &chunk_head_key(id));
        }
        for (key, _) in &dead_objects {
            b.delete(Space::Objects, key);
            if b.len() >= 10_000 {
                self.store.write(std::mem::take(&mut b))?;
            }
        }
        if !b.is_empty() {
            self.store.write(b)?;
        }
        self.store.flush()?;
        if interrupted
            || !dead_chunks.is_empty()
            || !orphan_heads.is_empty()
            || !dead_objects.is_empty()
            || report.keyframes + report.rebased + report.relabelled > 0
        {
            self.store.compact()?;
        }
        let mut b = Batch::new();
        b.delete(Space::Meta, GC_PENDING);
        self.store.write(b)?;
        // After: what the mark kept, with the chains as rewritten.
        report.after = self.counts_of(&reach, stored_chunks - dead_chunks.len(), &depths);
        Ok(report)
    }

    /// Plan the rewrite of one branch's first-parent line under `policy`;
    /// `None` when it keeps every commit.
    fn plan_line(
        &self,
        branch: &str,
        head: CommitId,
        policy: &KeepPolicy,
        now: u64,
        overlay: &mut HashMap<CommitId, Commit>,
        report: &mut GcReport,
    ) -> Result<Option<LinePlan>, RepoError> {
        let mut line = Vec::new();
        let shallow = self.shallow()?;
        let mut cur = Some(head);
        while let Some(id) = cur {
            // No cycle is possible: a commit's id hashes its parents' ids
            // and every commit read is checked against its id.
            let c = self.commit_object(&id)?;
            // A shallow clone's history ends where its parents were left behind.
            cur = c
                .parents
                .first()
                .copied()
                .filter(|_| !shallow.contains(&id));
            line.push((id, c));
        }
        let keep = policy.select(&line, now)?;
        if keep.iter().all(|&k| k) {
            return Ok(None);
        }
        // Re-create kept commits oldest first; an unchanged prefix keeps
        // its ids.
        let mut parent: Option<CommitId> = None;
        let mut changed = false;
        for (i, (id, c)) in line.iter().enumerate().rev() {
            if !keep[i] {
                changed = true;
                report.dropped.push(Dropped {
                    branch: branch.into(),
                    commit: *id,
                    step: c.step,
                });
                continue;
            }
            if !changed {
                parent = Some(*id);
                continue;
            }
            let mut n = c.clone();
            let rest = n.parents.iter().skip(1).copied();
            n.parents = parent.into_iter().chain(rest).collect();
            let new_id = CommitId::digest(&n.encode());
            overlay.insert(new_id, n);
            report.rewritten_commits += 1;
            parent = Some(new_id);
        }
        let new_head = parent.expect("the head is always kept");
        report.moved.push((branch.into(), head, new_head));
        Ok(Some(LinePlan {
            branch: branch.into(),
            old_head: head,
            new_head,
            old: line.into_iter().map(|(id, _)| id).collect(),
        }))
    }

    /// Dead chunks (id, stored bytes), how many unreferenced chunks the
    /// grace spares, dead objects (key, bytes), and how many chunk records
    /// are stored.
    fn sweep_plan(
        &self,
        reach: &Reachable,
        live: &HashSet<ChunkId>,
        since: u64,
    ) -> Result<SweepPlan, RepoError> {
        let mut dead_objects = Vec::new();
        let reached_commits: HashSet<&CommitId> = reach.commits.iter().collect();
        self.store.scan_prefix(Space::Objects, &[], &mut |k, v| {
            let live = match (k.first(), k.get(1..).and_then(ObjectId::from_slice)) {
                (Some(&super::objects::KIND_COMMIT), Some(id)) => {
                    reached_commits.contains(&CommitId::from_bytes(*id.as_bytes()))
                }
                (Some(&super::objects::KIND_TREE), Some(id)) => reach.trees.contains(&id),
                (Some(&super::objects::KIND_MANIFEST), Some(id)) => {
                    reach.manifests.contains_key(&id)
                }
                _ => true, // not ours to judge: leave it
            };
            if !live {
                dead_objects.push((k.to_vec(), v.len() as u64));
            }
            Ok(true)
        })?;
        let mut candidates: Vec<(ChunkId, u64, Option<ChunkHeader>)> = Vec::new();
        let mut stored = 0usize;
        let mut stored_ids: HashSet<ChunkId> = HashSet::new();
        self.store.scan_prefix(Space::Chunks, &[], &mut |k, v| {
            stored += 1;
            if let Some(id) = ChunkId::from_slice(k) {
                stored_ids.insert(id);
                if !live.contains(&id) {
                    candidates.push((id, v.len() as u64, ChunkRecord::decode_header(v).ok()));
                }
            }
            Ok(true)
        })?;
        // Chunks of the commits this gc deletes were committed once: they
        // are garbage whatever their age.
        let dead_commits: Vec<CommitId> = dead_objects
            .iter()
            .filter(|(k, _)| k.first() == Some(&super::objects::KIND_COMMIT))
            .filter_map(|(k, _)| CommitId::from_slice(&k[1..]))
            .collect();
        let committed = self
            .reachable(
                &dead_commits,
                WalkOptions {
                    chunk_headers: false,
                    frame_headers: false,
                    depth: Some(1),
                },
            )?
            .chunks;
        // Young chunks no commit ever named (a commit in flight) and their
        // bases stay.
        let by_id: HashMap<ChunkId, Option<ChunkHeader>> =
            candidates.iter().map(|(id, _, h)| (*id, *h)).collect();
        let mut spare: HashSet<ChunkId> = HashSet::new();
        let mut spared = 0;
        for (id, _, h) in &candidates {
            if h.is_some_and(|h| h.written > since) && !committed.contains_key(id) {
                spared += 1;
                // A damaged chain (a cycle, too long) spares what it reached.
                let chain = base_chain(*id, |c| {
                    Ok(by_id.get(c).copied().flatten().and_then(|h| h.base))
                });
                for c in chain.map_while(Result::ok) {
                    if !spare.insert(c) {
                        break;
                    }
                }
            }
        }
        let dead_chunks = candidates
            .into_iter()
            .filter(|(id, _, _)| !spare.contains(id))
            .map(|(id, n, _)| (id, n))
            .collect();
        let mut orphan_heads = Vec::new();
        self.store
            .scan_prefix(Space::Index, &[KIND_CHUNK_HEAD], &mut |k, _| {
                if let Some(id) = ChunkId::from_slice(&k[1..]) {
                    if !stored_ids.contains(&id) {
                        orphan_heads.push(id);
                    }
                }
                Ok(true)
            })?;
        Ok(SweepPlan {
            dead_chunks,
            spared,
            dead_objects,
            stored,
            orphan_heads,
        })
    }

    /// Give every live chunk a live base (the nearest live chunk of its old
    /// chain, else none) and, with `limit`, a chain no longer than it:
    /// re-encode or relabel records, level by level of the old chains (a
    /// new base is always an old ancestor, so it is final before its
    /// dependents), each level in bounded parallel batches. A dry run only
    /// counts (assuming every delta still pays). Returns every live chunk's
    /// depth afterwards.
    fn rewrite_chunks(
        &self,
        reach: &Reachable,
        limit: Option<u16>,
        dry_run: bool,
        report: &mut GcReport,
    ) -> Result<HashMap<ChunkId, u16>, RepoError> {
        let live = &reach.chunks;
        let old_depth = true_depths(&reach.headers);
        let mut levels: BTreeMap<u16, Vec<ChunkId>> = BTreeMap::new();
        for id in live.keys() {
            if reach.headers.contains_key(id) {
                levels
                    .entry(old_depth.get(id).copied().unwrap_or(0))
                    .or_default()
                    .push(*id);
            }
        }
        let mut depth: HashMap<ChunkId, u16> = HashMap::with_capacity(live.len());
        let level = self.config.zstd_level;
        for (_, mut ids) in levels {
            ids.sort();
            let mut work: Vec<(ChunkId, Rewrite, u16)> = Vec::new();
            for id in ids {
                let h = &reach.headers[&id];
                // The nearest live chunk down the old chain (none past a
                // damaged one).
                let mut chosen = base_chain(id, |c| Ok(reach.headers.get(c).and_then(|h| h.base)))
                    .skip(1)
                    .map_while(Result::ok)
                    .find(|b| live.contains_key(b));
                let mut d = match chosen {
                    Some(b) => depth
                        .get(&b)
                        .or_else(|| reach.headers.get(&b).map(|h| &h.depth))
                        .copied()
                        .unwrap_or(0)
                        .saturating_add(1),
                    None => 0,
                };
                if limit.is_some_and(|l| d > l) {
                    chosen = None;
                    d = 0;
                }
                if chosen != h.base {
                    match chosen {
                        None => report.keyframes += 1,
                        Some(_) => report.rebased += 1,
                    }
                    work.push((id, Rewrite::Encode(chosen), d));
                } else if d != h.depth {
                    report.relabelled += 1;
                    work.push((id, Rewrite::Depth, d));
                }
                depth.insert(id, d);
            }
            if dry_run {
                continue;
            }
            for group in work.chunks(16) {
                let records: Vec<Result<Rewritten, RepoError>> = group
                    .par_iter()
                    .map_init(Scratch::default, |scratch, (id, rw, d)| {
                        let site = || super::Site::chunk(*id);
                        let old = self
                            .store
                            .get_vec(Space::Chunks, id.as_bytes())?
                            .ok_or_else(|| RepoError::Missing { site: site() })?;
                        let mut rec =
                            ChunkRecord::decode(&old).map_err(super::objects::corrupt(site()))?;
                        match rw {
                            Rewrite::Depth => rec.depth = *d,
                            Rewrite::Encode(base) => {
                                let dtype = match rec.payload {
                                    Payload::Codec => Some(
                                        FrameInfo::parse(&rec.data)
                                            .map_err(|source| RepoError::Decode {
                                                site: site(),
                                                source,
                                            })?
                                            .dtype,
                                    ),
                                    Payload::Zstd => None,
                                };
                                let raw = self.read_chunk(id)?;
                                let base_raw = match base {
                                    Some(b) => Some((*b, self.read_chunk(b)?, d - 1)),
                                    None => None,
                                };
                                // Its rows in the tensor naming it, as a
                                // commit gives them: a new keyframe of
                                // optimizer state may be a row frame.
                                let place = live.get(id).and_then(|u| u.place.as_ref());
                                let rows = self.keyframe_rows(dtype, place, raw.len());
                                let written = rec.written;
                                rec = encode_record(
                                    &raw,
                                    dtype,
                                    rows,
                                    base_raw.as_ref().map(|(b, r, bd)| (*b, r.as_slice(), *bd)),
                                    level,
                                    scratch,
                                )?;
                                // The record keeps its age: rewriting is not writing.
                                rec.written = written;
                            }
                        }
                        Ok((*id, rec.encode(), rec.depth))
                    })
                    .collect();
                let mut b = Batch::new();
                for r in records {
                    let (id, bytes, actual) = r?;
                    // A delta that no longer pays is stored full: depth 0.
                    depth.insert(id, actual);
                    // A logged batch: the new head is durable with its record.
                    // A record now too small for a head loses its old one.
                    match stored_head(&bytes).map_err(corrupt(super::Site::chunk(id)))? {
                        Some(head) => b.put(Space::Index, &chunk_head_key(&id), head.to_vec()),
                        None => b.delete(Space::Index, &chunk_head_key(&id)),
                    };
                    b.put(Space::Chunks, id.as_bytes(), bytes);
                }
                self.store.write(b)?;
            }
        }
        if !dry_run {
            self.store.flush()?;
        }
        Ok(depth)
    }
}

/// Delta steps from each chunk to a full one, following stored bases.
fn true_depths(headers: &HashMap<ChunkId, ChunkHeader>) -> HashMap<ChunkId, u16> {
    let mut depth: HashMap<ChunkId, u16> = HashMap::with_capacity(headers.len());
    for &start in headers.keys() {
        let mut path = Vec::new();
        let mut d = 0u16;
        // A damaged chain (a cycle, too long) counts from where it ends.
        for c in
            base_chain(start, |c| Ok(headers.get(c).and_then(|h| h.base))).map_while(Result::ok)
        {
            if let Some(&known) = depth.get(&c) {
                d = known;
                break;
            }
            path.push(c);
        }
        for c in path.into_iter().rev() {
            let has_base = headers.get(&c).is_some_and(|h| h.base.is_some());
            d = if has_base { d.saturating_add(1) } else { 0 };
            depth.insert(c, d);
        }
    }
    depth
}
