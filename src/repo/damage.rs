//! Typed names for damaged data: which object ([`ObjectRef`]), where it is
//! used ([`Place`]) and why it is unusable ([`CorruptReason`]), so a repair
//! tool, the Python package or a script reading `fsck --json` can tell which
//! chunk of which file of which commit is damaged without parsing text.

use crate::store::{ChunkId, CommitId, ObjectId, StoreError};

use super::objects::ObjectDecodeError;
use super::RepoError;

/// A stored object. Ids serialise as hex.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ObjectRef {
    Chunk {
        id: ChunkId,
    },
    /// The manifest of file `path`.
    Manifest {
        id: ObjectId,
        path: String,
    },
    Tree {
        id: ObjectId,
    },
    Commit {
        id: CommitId,
    },
}

/// Where damaged data is used: the commit (and its step), the file and
/// the tensor, as far as known.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Place {
    pub commit: Option<CommitId>,
    pub step: Option<u64>,
    pub file: Option<String>,
    /// `None` for opaque bytes (headers, pickles, blobs) or when unknown.
    pub tensor: Option<String>,
}

/// Why stored data is unusable, by kind; `message` fields hold the text of
/// causes that have no fields of their own.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum CorruptReason {
    /// Not in the store.
    Missing,
    /// The encoded object does not decode.
    BadEncoding { error: ObjectDecodeError },
    /// The codec refused a chunk's payload.
    Codec { message: String },
    /// The storage engine found damage in its own files.
    Store { message: String },
    /// Any other inconsistency (a hash that does not match, a delta chain
    /// that loops, a file that does not reassemble).
    Inconsistent { message: String },
}

impl CorruptReason {
    /// The kind, as `--json` names it (`"missing"`, `"bad_encoding"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            CorruptReason::Missing => "missing",
            CorruptReason::BadEncoding { .. } => "bad_encoding",
            CorruptReason::Codec { .. } => "codec",
            CorruptReason::Store { .. } => "store",
            CorruptReason::Inconsistent { .. } => "inconsistent",
        }
    }

    /// The reason behind a corruption error (see [`RepoError::is_corruption`]).
    pub fn of(e: &RepoError) -> CorruptReason {
        match e {
            RepoError::Missing { .. } => CorruptReason::Missing,
            RepoError::BadObject { source, .. } => CorruptReason::BadEncoding {
                error: source.clone(),
            },
            RepoError::Decode { source, .. } => CorruptReason::Codec {
                message: source.to_string(),
            },
            RepoError::Corrupt { reason, .. } => CorruptReason::Inconsistent {
                message: reason.clone(),
            },
            RepoError::Store(s @ StoreError::Corrupt { .. }) => CorruptReason::Store {
                message: s.to_string(),
            },
            RepoError::Received(inner) => CorruptReason::of(inner),
            RepoError::At { source, .. } => CorruptReason::of(source),
            e => CorruptReason::Inconsistent {
                message: e.to_string(),
            },
        }
    }
}
