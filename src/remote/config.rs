//! Named remotes, stored in the repository (`Meta/remotes`, JSON), and the
//! remote-tracking refs `refs/remotes/<remote>/<branch>` that record where
//! each remote's branches were when last seen.

use std::collections::BTreeMap;

use crate::repo::Repository;
use crate::store::{Batch, Space, StoreExt};

use super::{open_url, parse_url, Remote, RemoteError, S3Options};

const KEY: &[u8] = b"remotes";

/// One configured remote.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteConfig {
    pub url: String,
    /// S3 endpoint and region (credentials come from the environment).
    #[serde(default, flatten)]
    pub s3: S3Options,
}

impl RemoteConfig {
    /// Connect to it.
    pub fn open(&self) -> Result<Box<dyn Remote>, RemoteError> {
        open_url(&self.url, &self.s3)
    }
}

/// Remote names: letters, digits, `-_.`, not starting with `.` or `-`.
pub fn check_remote_name(name: &str) -> Result<(), RemoteError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with(['.', '-'])
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(RemoteError::InvalidRemoteName { name: name.into() })
    }
}

/// The stored bytes (for the compare-and-swap) and the parsed map.
type Stored = (Option<Vec<u8>>, BTreeMap<String, RemoteConfig>);

fn read(repo: &Repository) -> Result<Stored, RemoteError> {
    let raw = repo
        .store()
        .get_vec(Space::Meta, KEY)
        .map_err(crate::repo::RepoError::from)?;
    let map = match &raw {
        None => BTreeMap::new(),
        Some(b) => serde_json::from_slice(b).map_err(|e| {
            RemoteError::Repo(crate::repo::RepoError::Corrupt {
                what: "remote configuration (meta/remotes)".into(),
                reason: e.to_string(),
            })
        })?,
    };
    Ok((raw, map))
}

/// Every configured remote, by name.
pub fn remotes(repo: &Repository) -> Result<BTreeMap<String, RemoteConfig>, RemoteError> {
    Ok(read(repo)?.1)
}

/// The remote called `name`.
pub fn remote(repo: &Repository, name: &str) -> Result<RemoteConfig, RemoteError> {
    remotes(repo)?
        .remove(name)
        .ok_or_else(|| RemoteError::NoSuchRemote { name: name.into() })
}

/// Add a remote (the URL is checked and a directory path made absolute).
pub fn add_remote(
    repo: &Repository,
    name: &str,
    url: &str,
    s3: S3Options,
) -> Result<RemoteConfig, RemoteError> {
    check_remote_name(name)?;
    let url = match parse_url(url)? {
        super::Location::Dir(p) => p.display().to_string(),
        super::Location::S3 { .. } => url.to_string(),
    };
    let (raw, mut map) = read(repo)?;
    if map.contains_key(name) {
        return Err(RemoteError::RemoteExists { name: name.into() });
    }
    let cfg = RemoteConfig { url, s3 };
    map.insert(name.into(), cfg.clone());
    write(repo, raw, &map, |_| {})?;
    Ok(cfg)
}

/// Remove a remote and its remote-tracking refs.
pub fn remove_remote(repo: &Repository, name: &str) -> Result<(), RemoteError> {
    let (raw, mut map) = read(repo)?;
    if map.remove(name).is_none() {
        return Err(RemoteError::NoSuchRemote { name: name.into() });
    }
    let tracking = repo.remote_refs(name)?;
    write(repo, raw, &map, |b| {
        for (branch, id) in &tracking {
            repo.move_ref(
                b,
                &tracking_ref(name, branch),
                Some(id),
                None,
                "remote remove",
            );
        }
    })
}

fn write(
    repo: &Repository,
    old: Option<Vec<u8>>,
    map: &BTreeMap<String, RemoteConfig>,
    more: impl FnOnce(&mut Batch),
) -> Result<(), RemoteError> {
    let mut b = Batch::new();
    b.expect(Space::Meta, KEY, old.as_deref());
    b.put(
        Space::Meta,
        KEY,
        serde_json::to_vec_pretty(map).expect("remote config serialises"),
    );
    more(&mut b);
    repo.store()
        .write(b)
        .map_err(crate::repo::RepoError::from)?;
    Ok(())
}

/// `refs/remotes/<remote>/<branch>`.
pub fn tracking_ref(remote: &str, branch: &str) -> String {
    format!("{}{remote}/{branch}", crate::repo::REMOTES)
}
