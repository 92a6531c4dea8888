//! The ref log: every move of a branch or tag (old -> new, what moved it,
//! when), written in the same atomic batch as the move itself, so the log
//! and the refs never disagree. `ckvc reflog` shows it; gc counts recent
//! entries as roots, so a branch deleted by mistake can be recovered within
//! the grace period.
//!
//! Keys live in the `refs` space: `logs/<refname> NUL <nanoseconds BE u64>`,
//! so one ref's entries scan in time order.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::store::{Batch, CommitId, Space};

use super::objects::{corrupt, RefLogEntry};
use super::{RepoError, Repository};

const LOGS: &str = "logs/";

fn log_key(refname: &str, nanos: u64) -> Vec<u8> {
    let mut k = format!("{LOGS}{refname}\0").into_bytes();
    k.extend_from_slice(&nanos.to_be_bytes());
    k
}

impl Repository {
    /// Add to `batch` the move of `refname` from `old` to `new` (`None`:
    /// absent): a compare-and-swap on the old value, the write, and its ref
    /// log entry. The batch fails with a store conflict if the ref moved.
    pub(crate) fn move_ref(
        &self,
        batch: &mut Batch,
        refname: &str,
        old: Option<&CommitId>,
        new: Option<&CommitId>,
        op: &str,
    ) {
        let key = refname.as_bytes();
        batch.expect(Space::Refs, key, old.map(|o| o.as_bytes().as_slice()));
        match new {
            Some(n) => batch.put(Space::Refs, key, n.as_bytes().to_vec()),
            None => batch.delete(Space::Refs, key),
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let entry = RefLogEntry {
            refname: refname.into(),
            old: old.copied(),
            new: new.copied(),
            time: now.as_secs(),
            op: op.into(),
        };
        let nanos = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        batch.put(Space::Refs, &log_key(refname, nanos), entry.encode());
    }

    /// The ref log, newest first: of one ref (`refs/heads/main`, or a bare
    /// branch or tag name), or of every ref when `refname` is `None`.
    pub fn reflog(&self, refname: Option<&str>) -> Result<Vec<RefLogEntry>, RepoError> {
        let prefix = match refname {
            None => LOGS.to_string(),
            Some(r) if r.starts_with("refs/") => format!("{LOGS}{r}\0"),
            Some(r) => {
                let full = if self.tag(r)?.is_some() && self.branch_head(r)?.is_none() {
                    format!("{}{r}", super::TAGS)
                } else {
                    format!("{}{r}", super::HEADS)
                };
                format!("{LOGS}{full}\0")
            }
        };
        let mut raw = Vec::new();
        self.store
            .scan_prefix(Space::Refs, prefix.as_bytes(), &mut |k, v| {
                raw.push((k.to_vec(), v.to_vec()));
                Ok(true)
            })?;
        let mut out = Vec::with_capacity(raw.len());
        for (k, v) in raw {
            let (name, nanos) = parse_log_key(&k).ok_or_else(|| RepoError::Corrupt {
                site: super::Site::of(super::ObjectRef::RefLog { name: None }),
                reason: format!("bad key {}", String::from_utf8_lossy(&k)),
            })?;
            out.push((
                nanos,
                RefLogEntry::decode(&name, &v).map_err(corrupt(super::Site::of(
                    super::ObjectRef::RefLog {
                        name: Some(name.clone()),
                    },
                )))?,
            ));
        }
        out.sort_by_key(|e| std::cmp::Reverse(e.0));
        Ok(out.into_iter().map(|(_, e)| e).collect())
    }
}

fn parse_log_key(k: &[u8]) -> Option<(String, u64)> {
    let rest = k.strip_prefix(LOGS.as_bytes())?;
    if rest.len() < 9 || rest[rest.len() - 9] != 0 {
        return None;
    }
    let (name, nanos) = rest.split_at(rest.len() - 9);
    let nanos = u64::from_be_bytes(nanos[1..].try_into().ok()?);
    Some((String::from_utf8(name.to_vec()).ok()?, nanos))
}
