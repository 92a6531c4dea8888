//! In-memory [`Store`] for tests.

use std::collections::BTreeMap;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{to_hex, Batch, ScanFn, Space, Store, StoreError};

type Map = BTreeMap<Vec<u8>, Vec<u8>>;

/// A [`Store`] in memory: one ordered map per [`Space`].
///
/// All spaces sit behind one `RwLock` rather than a lock per space: a batch
/// may touch several spaces, and readers must never see part of it.
#[derive(Debug, Default)]
pub struct MemStore {
    spaces: RwLock<[Map; 5]>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    // A panic while holding the lock cannot leave a half-applied batch (the
    // batch is validated before the first mutation and inserts do not panic),
    // so a poisoned lock still guards consistent data.
    fn read(&self) -> RwLockReadGuard<'_, [Map; 5]> {
        self.spaces.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_lock(&self) -> RwLockWriteGuard<'_, [Map; 5]> {
        self.spaces.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for MemStore {
    fn get(&self, space: Space, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, StoreError> {
        buf.clear();
        match self.read()[space.index()].get(key) {
            Some(v) => {
                buf.extend_from_slice(v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn contains(&self, space: Space, key: &[u8]) -> Result<bool, StoreError> {
        Ok(self.read()[space.index()].contains_key(key))
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let mut spaces = self.write_lock();
        for e in &batch.expects {
            if spaces[e.space.index()].get(&e.key) != e.value.as_ref() {
                return Err(StoreError::Conflict {
                    space: e.space,
                    key_hex: to_hex(&e.key),
                });
            }
        }
        for op in batch.ops {
            let map = &mut spaces[op.space.index()];
            match op.value {
                Some(v) => {
                    map.insert(op.key, v);
                }
                None => {
                    map.remove(&op.key);
                }
            }
        }
        Ok(())
    }

    fn scan_prefix(
        &self,
        space: Space,
        prefix: &[u8],
        f: &mut ScanFn<'_>,
    ) -> Result<(), StoreError> {
        let spaces = self.read();
        for (k, v) in spaces[space.index()].range(prefix.to_vec()..) {
            if !k.starts_with(prefix) || !f(k, v)? {
                break;
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
