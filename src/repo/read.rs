//! Reading a commit's files into memory: a whole file
//! ([`Repository::read_file`]) or one tensor of it
//! ([`Repository::read_tensor_into`]), for callers that load a checkpoint
//! without checking it out to disk (the Python package's `load` and
//! `open`).
//!
//! Every chunk is decoded through its bounded delta chain and verified
//! against its blake3 id before a byte of it is handed out; a whole file is
//! also checked against its manifest's blake3 (the checkout's
//! `stream_file`). A tensor read decodes only that tensor's
//! chunks.

use std::path::PathBuf;

use rayon::prelude::*;

use crate::store::CommitId;

use super::objects::{FileManifest, SegmentRef};
use super::{RepoError, Repository};

impl Repository {
    /// The manifest of file `path` of `commit`, and the commit's step.
    pub(super) fn manifest_at(
        &self,
        commit: &CommitId,
        path: &str,
    ) -> Result<(FileManifest, u64), RepoError> {
        let c = self.commit_object(commit)?;
        let tree = self.tree(&c.tree)?;
        let mid = tree
            .entries
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, m)| *m)
            .ok_or_else(|| RepoError::BadInput {
                path: PathBuf::from(path),
                reason: format!("commit {} has no such file", commit.short(12)),
            })?;
        Ok((self.manifest(&mid, path)?, c.step))
    }

    /// The whole file `path` of `commit`: every chunk verified against its
    /// blake3, the file against its recorded blake3. A path the commit
    /// does not hold is [`RepoError::BadInput`].
    pub fn read_file(&self, commit: &CommitId, path: &str) -> Result<Vec<u8>, RepoError> {
        let (m, step) = self.manifest_at(commit, path)?;
        // The recorded length is a hint only (the segments are checked as
        // they are read); never trust it for a huge allocation up front.
        let mut out = Vec::with_capacity(m.len.min(1 << 30) as usize);
        self.stream_file(
            &m,
            path,
            commit,
            step,
            |id| self.read_chunk(id),
            |_, raw| {
                out.extend_from_slice(&raw);
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// Decode the tensor `tensor` of file `path` of `commit` into `out`,
    /// which must be exactly its byte length (see
    /// [`Repository::list_files`]). Only that tensor's chunks are read,
    /// decoded in parallel in windows bounded by the memory budget, each
    /// verified against its blake3 (the whole file's hash is not checked:
    /// the rest of the file is not read). An unknown file or tensor, or a
    /// buffer of another length, is [`RepoError::BadInput`].
    pub fn read_tensor_into(
        &self,
        commit: &CommitId,
        path: &str,
        tensor: &str,
        out: &mut [u8],
    ) -> Result<(), RepoError> {
        let (m, step) = self.manifest_at(commit, path)?;
        let (len, chunks) = m
            .segments
            .iter()
            .find_map(|s| match s {
                SegmentRef::Tensor {
                    name, len, chunks, ..
                } if name == tensor => Some((*len, chunks)),
                _ => None,
            })
            .ok_or_else(|| RepoError::BadInput {
                path: PathBuf::from(path),
                reason: format!(
                    "commit {} has no tensor {tensor:?} in this file",
                    commit.short(12)
                ),
            })?;
        if out.len() as u64 != len {
            return Err(RepoError::BadInput {
                path: PathBuf::from(path),
                reason: format!(
                    "tensor {tensor:?} holds {len} bytes, the buffer {}",
                    out.len()
                ),
            });
        }
        let place = super::Place {
            commit: Some(*commit),
            step: Some(step),
            file: Some(path.to_string()),
            tensor: Some(tensor.to_string()),
        };
        let chunk_bytes = self.config.chunk_bytes.max(1);
        let per_window = (self.config.memory_budget / 4 / chunk_bytes).max(1) as usize;
        let mut at = 0usize;
        for window in chunks.chunks(per_window) {
            let decoded: Vec<Result<Vec<u8>, RepoError>> =
                window.par_iter().map(|id| self.read_chunk(id)).collect();
            for raw in decoded {
                let raw = raw.map_err(|e| e.placed(&place))?;
                let end = at
                    .checked_add(raw.len())
                    .filter(|&e| e <= out.len())
                    .ok_or_else(|| RepoError::Corrupt {
                        site: super::Site::at(place.clone()),
                        reason: format!("its chunks hold more than its {len} bytes"),
                    })?;
                out[at..end].copy_from_slice(&raw);
                at = end;
            }
        }
        if at != out.len() {
            return Err(RepoError::Corrupt {
                site: super::Site::at(place),
                reason: format!("its chunks hold {at} bytes, the tensor {len}"),
            });
        }
        Ok(())
    }
}
