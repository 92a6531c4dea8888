//! An in-memory remote for tests: one mutex over a sorted map, so every
//! write, conditional or not, is atomic.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{check_key, Remote, RemoteError, Version};

/// A remote held in memory (tests).
#[derive(Debug, Default)]
pub struct MemRemote {
    files: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemRemote {
    pub fn new() -> Self {
        Self::default()
    }

    fn files(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // A panic elsewhere cannot leave the map half-written: writes are
        // single map operations.
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn version_of(data: &[u8]) -> Version {
    Version(blake3::hash(data).to_hex().to_string())
}

impl Remote for MemRemote {
    fn url(&self) -> String {
        "mem://".into()
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        check_key(key)?;
        Ok(self.files().get(key).cloned())
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        check_key(key)?;
        let end = super::range_end(key, start, len)?;
        match self.files().get(key) {
            Some(b) => super::cut_range(key, b, start, end).map(Some),
            None => Ok(None),
        }
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        check_key(key)?;
        Ok(self.files().get(key).map(|d| (d.clone(), version_of(d))))
    }

    fn put(&self, key: &str, data: Vec<u8>) -> Result<(), RemoteError> {
        check_key(key)?;
        self.files().insert(key.into(), data);
        Ok(())
    }

    fn put_if(
        &self,
        key: &str,
        data: Vec<u8>,
        expected: Option<&Version>,
    ) -> Result<(), RemoteError> {
        check_key(key)?;
        let mut files = self.files();
        let current = files.get(key).map(|d| version_of(d));
        if current.as_ref() != expected {
            return Err(RemoteError::Conflict { key: key.into() });
        }
        files.insert(key.into(), data);
        Ok(())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>, RemoteError> {
        Ok(self
            .files()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect())
    }

    fn delete(&self, key: &str) -> Result<(), RemoteError> {
        check_key(key)?;
        self.files().remove(key);
        Ok(())
    }
}
