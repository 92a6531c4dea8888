//! The remote layout (`docs/format/remote.md`): the layout marker, ref
//! files under `refs/heads/`, packs and their indexes under `packs/`, and
//! reading them back (the branches, the union of the pack indexes).
//!
//! Owns the remote's key names and the checks on what is read there (ref
//! files hold one id, indexes name the pack they describe, sizes within
//! limits). Must not: touch the local repository.

use std::collections::{BTreeMap, HashMap};

use crate::repo::check_branch_name;
use crate::store::{CommitId, Hash32};

use super::pack::{self, Kind};
use super::{Remote, RemoteError};

/// The layout marker file at a remote's root, and its version.
pub const LAYOUT_KEY: &str = "ckvc-remote";
pub const LAYOUT_VERSION: u32 = 1;
pub(crate) const PACKS: &str = "packs/";
pub(crate) const HEADS: &str = "refs/heads/";
/// A ref file is 65 bytes; nothing longer is read.
pub(crate) const REF_BYTES: u64 = 256;

pub(crate) fn corrupt(what: impl Into<String>, reason: impl Into<String>) -> RemoteError {
    RemoteError::Corrupt {
        what: what.into(),
        reason: reason.into(),
    }
}

/// Check the remote's layout marker; with `create`, write it when absent.
pub(crate) fn check_layout(remote: &dyn Remote, create: bool) -> Result<(), RemoteError> {
    let marker = format!("ckvc-remote {LAYOUT_VERSION}\n");
    match remote.get_limited(LAYOUT_KEY, 64)? {
        None if create => match remote.put_if(LAYOUT_KEY, marker.into_bytes(), None) {
            Ok(()) | Err(RemoteError::Conflict { .. }) => check_layout(remote, false),
            Err(e) => Err(e),
        },
        None => Err(RemoteError::NotARemote {
            url: remote.url(),
            reason: format!("no {LAYOUT_KEY} file: nothing was ever pushed there"),
        }),
        Some(b) => {
            let s = String::from_utf8_lossy(&b);
            let v = s.trim_end().strip_prefix("ckvc-remote ").ok_or_else(|| {
                RemoteError::NotARemote {
                    url: remote.url(),
                    reason: format!(
                        "{LAYOUT_KEY} holds {:?}",
                        s.chars().take(40).collect::<String>()
                    ),
                }
            })?;
            match v.parse::<u32>() {
                Ok(LAYOUT_VERSION) => Ok(()),
                _ => Err(RemoteError::VersionTooNew {
                    url: remote.url(),
                    found: v.chars().take(20).collect(),
                    supported: LAYOUT_VERSION,
                }),
            }
        }
    }
}

/// A ref file: 64 lowercase hex digits and a newline.
pub(crate) fn parse_ref(bytes: &[u8], key: &str) -> Result<CommitId, RemoteError> {
    let s = std::str::from_utf8(bytes).map_err(|_| corrupt(key, "not UTF-8"))?;
    s.strip_suffix('\n')
        .unwrap_or(s)
        .parse::<CommitId>()
        .map_err(|_| corrupt(key, "does not hold a 64-digit commit id"))
}

pub(crate) fn ref_file(id: &CommitId) -> Vec<u8> {
    format!("{id}\n").into_bytes()
}

/// The remote's branches: name -> commit.
pub(crate) fn remote_heads(remote: &dyn Remote) -> Result<BTreeMap<String, CommitId>, RemoteError> {
    let mut out = BTreeMap::new();
    for key in remote.list(HEADS)? {
        let branch = &key[HEADS.len()..];
        check_branch_name(branch).map_err(|_| RemoteError::BadPath {
            key: key.clone(),
            reason: "not a valid branch name".into(),
        })?;
        if let Some(b) = remote.get_limited(&key, REF_BYTES)? {
            out.insert(branch.to_string(), parse_ref(&b, &key)?);
        }
    }
    Ok(out)
}

/// Where an object is on the remote: its pack, and where its bytes are in
/// it (as the pack's index says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) pack: Hash32,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// Where each object on the remote is: the union of the pack indexes.
#[derive(Default)]
pub(crate) struct RemoteIndex {
    pub(crate) entries: HashMap<(Kind, [u8; 32]), Loc>,
    /// Each pack's length.
    pub(crate) packs: HashMap<Hash32, u64>,
    /// Each pack's entries, as its index lists them.
    pub(crate) contents: HashMap<Hash32, Vec<pack::Entry>>,
}

pub(crate) fn load_index(remote: &dyn Remote) -> Result<RemoteIndex, RemoteError> {
    let mut ix = RemoteIndex::default();
    for key in remote.list(PACKS)? {
        let Some(stem) = key[PACKS.len()..].strip_suffix(".idx") else {
            continue;
        };
        let name: Hash32 = stem.parse().map_err(|_| RemoteError::BadPath {
            key: key.clone(),
            reason: "a pack index must be named by 64 hex digits".into(),
        })?;
        let Some(bytes) = remote.get_limited(&key, pack::MAX_INDEX_BYTES)? else {
            continue; // removed meanwhile
        };
        let idx = pack::decode_index(&bytes, &format!("pack index {key}"))?;
        if idx.pack != name {
            return Err(corrupt(
                format!("pack index {key}"),
                "describes a different pack than its name says",
            ));
        }
        if idx.pack_len > pack::MAX_PACK_BYTES {
            return Err(corrupt(
                format!("pack index {key}"),
                format!("pack of {} bytes is larger than the limit", idx.pack_len),
            ));
        }
        for e in &idx.entries {
            let loc = Loc {
                pack: name,
                offset: e.offset,
                len: e.len,
            };
            ix.entries.insert((e.kind, e.id), loc);
        }
        ix.packs.insert(name, idx.pack_len);
        ix.contents.insert(name, idx.entries);
    }
    Ok(ix)
}

pub(crate) fn pack_key(name: &Hash32) -> String {
    format!("{PACKS}{name}.pack")
}

pub(crate) fn idx_key(name: &Hash32) -> String {
    format!("{PACKS}{name}.idx")
}
