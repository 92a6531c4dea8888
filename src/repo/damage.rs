//! Typed names for damaged data: which object ([`ObjectRef`]), where it is
//! used ([`Place`]) and why it is unusable ([`CorruptReason`]), so a repair
//! tool, the Python package or a script reading `fsck --json` can tell which
//! chunk of which file of which commit is damaged without parsing text.
//! A damage error's message is rendered from these fields ([`Site`]), never
//! pieced together from strings.

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
    /// A branch, tag or remote-tracking ref (`heads/main`, `tags/v1`).
    Ref {
        name: String,
    },
    /// The ref log (of ref `name`, when known).
    RefLog {
        name: Option<String>,
    },
    /// A repository setting kept in the store's meta space
    /// (`remotes`, `config`, `shallow`).
    Meta {
        key: String,
    },
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectRef::Chunk { id } => write!(f, "chunk {}", id.short(12)),
            ObjectRef::Manifest { id, path } if path.is_empty() => {
                write!(f, "manifest {}", id.short(12))
            }
            ObjectRef::Manifest { path, .. } => write!(f, "manifest of {path}"),
            ObjectRef::Tree { id } => write!(f, "tree {}", id.short(12)),
            ObjectRef::Commit { id } => write!(f, "commit {}", id.short(12)),
            ObjectRef::Ref { name } => write!(f, "ref {name}"),
            ObjectRef::RefLog { name: Some(n) } => write!(f, "ref log of {n}"),
            ObjectRef::RefLog { name: None } => f.write_str("ref log"),
            ObjectRef::Meta { key } => write!(f, "repository setting meta/{key}"),
        }
    }
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

impl Place {
    /// True when nothing is known.
    pub fn is_empty(&self) -> bool {
        self == &Place::default()
    }

    /// Fill every field not known yet from `outer` (what is known already
    /// was learnt closer to the damage, so it is kept).
    pub fn fill(&mut self, outer: &Place) {
        fn or<T: Clone>(f: &mut Option<T>, v: &Option<T>) {
            if f.is_none() {
                f.clone_from(v);
            }
        }
        or(&mut self.commit, &outer.commit);
        or(&mut self.step, &outer.step);
        or(&mut self.file, &outer.file);
        or(&mut self.tensor, &outer.tensor);
    }

    /// `tensor w in model.safetensors (commit 3632c89a351f, step 10)`,
    /// leaving out the file when `named_file` already names it.
    fn describe(&self, named_file: Option<&str>) -> String {
        let file = self.file.as_deref().filter(|f| Some(*f) != named_file);
        let mut s = match (&self.tensor, file) {
            (Some(t), Some(f)) => format!("tensor {t} in {f}"),
            (Some(t), None) => format!("tensor {t}"),
            (None, Some(f)) => f.to_string(),
            (None, None) => String::new(),
        };
        let at = match (&self.commit, self.step) {
            (Some(c), Some(n)) => format!("commit {}, step {n}", c.short(12)),
            (Some(c), None) => format!("commit {}", c.short(12)),
            (None, Some(n)) => format!("step {n}"),
            (None, None) => return s,
        };
        if s.is_empty() {
            at
        } else {
            s.push_str(&format!(" ({at})"));
            s
        }
    }
}

/// What damaged or missing data is, as fields: the stored object (none
/// when the damage is in data assembled from several objects), where it
/// is used, and where the bytes came from when they are not this
/// repository's own (a fetch). Damage errors carry one and render their
/// message from it: `chunk 3632c89a351f of tensor w in model.safetensors
/// (commit 9d1e07a2c4b8, step 10)`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Site {
    pub object: Option<ObjectRef>,
    pub place: Place,
    /// `received from remote origin` for data a fetch brought.
    pub from: Option<String>,
}

impl Site {
    /// The site of stored object `object`, place not known yet.
    pub fn of(object: ObjectRef) -> Box<Site> {
        Box::new(Site {
            object: Some(object),
            ..Site::default()
        })
    }

    /// The site of data at `place` that is not one stored object.
    pub fn at(place: Place) -> Box<Site> {
        Box::new(Site {
            place,
            ..Site::default()
        })
    }

    /// A chunk's site.
    pub fn chunk(id: ChunkId) -> Box<Site> {
        Site::of(ObjectRef::Chunk { id })
    }

    /// This site, used at `place`.
    pub fn with_place(mut self: Box<Self>, place: Place) -> Box<Site> {
        self.place = place;
        self
    }

    /// This site, with its bytes received from `from`.
    pub fn received(mut self: Box<Self>, from: &str) -> Box<Site> {
        if !from.is_empty() {
            self.from = Some(from.to_string());
        }
        self
    }
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let named_file = match &self.object {
            Some(ObjectRef::Manifest { path, .. }) => Some(path.as_str()),
            _ => None,
        };
        let place = self.place.describe(named_file);
        match (&self.object, place.is_empty()) {
            (Some(o), true) => write!(f, "{o}")?,
            (Some(o), false) => write!(f, "{o} of {place}")?,
            (None, false) => write!(f, "data of {place}")?,
            (None, true) => f.write_str("data")?,
        }
        if let Some(from) = &self.from {
            write!(f, " {from}")?;
        }
        Ok(())
    }
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
            e => CorruptReason::Inconsistent {
                message: e.to_string(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place() -> Place {
        Place {
            commit: Some(CommitId::from_bytes([0xab; 32])),
            step: Some(10),
            file: Some("model.safetensors".into()),
            tensor: Some("w".into()),
        }
    }

    /// The message of a damage error is rendered from its fields.
    #[test]
    fn site_messages_are_rendered_from_fields() {
        let chunk = ChunkId::from_bytes([0x36; 32]);
        let mut s = *Site::chunk(chunk);
        assert_eq!(s.to_string(), "chunk 363636363636");
        s.place = place();
        assert_eq!(
            s.to_string(),
            "chunk 363636363636 of tensor w in model.safetensors (commit abababababab, step 10)"
        );
        let manifest = Site {
            object: Some(ObjectRef::Manifest {
                id: ObjectId::from_bytes([1; 32]),
                path: "model.safetensors".into(),
            }),
            place: Place {
                tensor: None,
                ..place()
            },
            from: None,
        };
        // The file is named once.
        assert_eq!(
            manifest.to_string(),
            "manifest of model.safetensors of commit abababababab, step 10"
        );
        let received = *Site::chunk(chunk).received("received from remote origin");
        assert_eq!(
            received.to_string(),
            "chunk 363636363636 received from remote origin"
        );
        assert_eq!(Site::at(Place::default()).to_string(), "data");
    }

    /// Placing damage fills what is not known and keeps what is: the
    /// place learnt closest to the damage wins (replaces the text rule
    /// "name the place once").
    #[test]
    fn placing_damage_keeps_the_innermost_place() {
        let chunk = ChunkId::from_bytes([7; 32]);
        let inner = Place {
            tensor: Some("inner".into()),
            ..Place::default()
        };
        let e = RepoError::Missing {
            site: Box::new(Site {
                object: Some(ObjectRef::Chunk { id: chunk }),
                place: inner,
                from: None,
            }),
        };
        let e = e.placed(&place()).placed(&Place {
            step: Some(99),
            ..Place::default()
        });
        let site = e.site().expect("damage has a site");
        assert_eq!(site.place.tensor.as_deref(), Some("inner"));
        assert_eq!(site.place.file.as_deref(), Some("model.safetensors"));
        assert_eq!(site.place.step, Some(10));
        assert_eq!(CorruptReason::of(&e), CorruptReason::Missing);
        // Not damage: unchanged.
        let e = RepoError::Empty.placed(&place());
        assert!(matches!(e, RepoError::Empty));
    }

    /// The storage engine's own damage report for a chunk key becomes a
    /// placed `Corrupt` naming that chunk.
    #[test]
    fn store_corruption_of_a_chunk_is_placed_with_the_chunk() {
        let chunk = ChunkId::from_bytes([9; 32]);
        let e = RepoError::Store(StoreError::Corrupt {
            space: crate::store::Space::Chunks,
            key_hex: chunk.to_string(),
            reason: "block checksum mismatch".into(),
        })
        .placed(&place());
        let site = e.site().expect("placed");
        assert_eq!(site.object, Some(ObjectRef::Chunk { id: chunk }));
        assert_eq!(site.place, place());
        assert!(e.is_corruption());
    }
}
