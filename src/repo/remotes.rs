//! What the repository keeps about remotes: their configuration
//! (`Meta/remotes`, a JSON map from name to settings the remote layer
//! defines) and the remote-tracking refs `refs/remotes/<remote>/<branch>`
//! (where each remote's branches were when last seen; gc roots, never
//! branches).
//!
//! Must not: know what a remote is or how to reach one (the `remote` layer
//! does); settings are opaque JSON values here.

use std::collections::BTreeMap;

use crate::store::{Batch, CommitId, Space, StoreExt};

use super::{RepoError, Repository, REMOTES};

const REMOTES_KEY: &[u8] = b"remotes";

/// `refs/remotes/<remote>/<branch>`.
pub fn tracking_ref(remote: &str, branch: &str) -> String {
    format!("{REMOTES}{remote}/{branch}")
}

/// The configured remotes as read, for a compare-and-swap update
/// ([`Repository::save_remote_configs`]).
#[derive(Debug, Clone)]
pub struct RemoteConfigs<T> {
    /// The stored bytes they were read from (`None`: none stored).
    stored: Option<Vec<u8>>,
    /// Settings by remote name.
    pub remotes: BTreeMap<String, T>,
}

impl Repository {
    /// The configured remotes (`Meta/remotes`).
    pub fn remote_configs<T: serde::de::DeserializeOwned>(
        &self,
    ) -> Result<RemoteConfigs<T>, RepoError> {
        let stored = self.store.get_vec(Space::Meta, REMOTES_KEY)?;
        let remotes = match &stored {
            None => BTreeMap::new(),
            Some(b) => serde_json::from_slice(b).map_err(|e| RepoError::Corrupt {
                site: super::Site::of(super::ObjectRef::Meta {
                    key: "remotes".into(),
                }),
                reason: e.to_string(),
            })?,
        };
        Ok(RemoteConfigs { stored, remotes })
    }

    /// Store `configs` in place of what they were read from (a store
    /// conflict if another process changed them meanwhile), deleting the
    /// remote-tracking refs of remote `removed` in the same batch.
    pub fn save_remote_configs<T: serde::Serialize>(
        &self,
        configs: &RemoteConfigs<T>,
        removed: Option<&str>,
    ) -> Result<(), RepoError> {
        let mut b = Batch::new();
        b.expect(Space::Meta, REMOTES_KEY, configs.stored.as_deref());
        let json =
            serde_json::to_vec_pretty(&configs.remotes).map_err(|e| RepoError::BadInput {
                path: "meta/remotes".into(),
                reason: e.to_string(),
            })?;
        b.put(Space::Meta, REMOTES_KEY, json);
        if let Some(name) = removed {
            for (branch, id) in self.remote_refs(name)? {
                self.move_ref(
                    &mut b,
                    &tracking_ref(name, &branch),
                    Some(&id),
                    None,
                    "remote remove",
                );
            }
        }
        self.store.write(b)?;
        Ok(())
    }

    /// Point `refs/remotes/<remote>/<branch>` at `to` (logged as `op`,
    /// durable); nothing when it does already.
    pub fn set_remote_ref(
        &self,
        remote: &str,
        branch: &str,
        to: &CommitId,
        op: &str,
    ) -> Result<(), RepoError> {
        let old = self.remote_ref(remote, branch)?;
        if old.as_ref() == Some(to) {
            return Ok(());
        }
        let mut b = Batch::new();
        self.move_ref(
            &mut b,
            &tracking_ref(remote, branch),
            old.as_ref(),
            Some(to),
            op,
        );
        self.store.write(b)?;
        self.store.flush()?;
        Ok(())
    }
}
