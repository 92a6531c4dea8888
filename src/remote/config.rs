//! Named remotes: their settings ([`RemoteConfig`]: URL, S3 endpoint),
//! kept by the repository (`Meta/remotes`, through
//! [`Repository::remote_configs`]) with the remote-tracking refs
//! `refs/remotes/<remote>/<branch>` that record where each remote's
//! branches were when last seen.

use std::collections::BTreeMap;

use crate::repo::Repository;

use super::{open_url, parse_url, Remote, RemoteError, S3Options};

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

/// Every configured remote, by name.
pub fn remotes(repo: &Repository) -> Result<BTreeMap<String, RemoteConfig>, RemoteError> {
    Ok(repo.remote_configs()?.remotes)
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
    let mut configs = repo.remote_configs::<RemoteConfig>()?;
    if configs.remotes.contains_key(name) {
        return Err(RemoteError::RemoteExists { name: name.into() });
    }
    let cfg = RemoteConfig { url, s3 };
    configs.remotes.insert(name.into(), cfg.clone());
    repo.save_remote_configs(&configs, None)?;
    Ok(cfg)
}

/// Remove a remote and its remote-tracking refs.
pub fn remove_remote(repo: &Repository, name: &str) -> Result<(), RemoteError> {
    let mut configs = repo.remote_configs::<RemoteConfig>()?;
    if configs.remotes.remove(name).is_none() {
        return Err(RemoteError::NoSuchRemote { name: name.into() });
    }
    repo.save_remote_configs(&configs, Some(name))?;
    Ok(())
}

/// `refs/remotes/<remote>/<branch>`.
pub use crate::repo::tracking_ref;
