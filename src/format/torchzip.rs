//! PyTorch `torch.save` archives: a zip whose entries all sit under one
//! top-level folder `<archive>/`: `data.pkl` (the pickled object, tensors
//! as persistent ids), `data/<key>` (one raw storage each), `byteorder`,
//! `version`, `.data/serialization_id`, ...
//!
//! Each STORED `data/<key>` entry whose dtype is known becomes one tensor
//! segment covering exactly its data bytes; local headers, other entries,
//! data descriptors, the central directory and the end records are opaque.
//! See `docs/format/checkpoint-files.md` for the naming rule.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek};

use super::pickle::{self, Node, Object, Pickle, Value};
use super::zip::{self, Entry};
use super::{read_at, DType, FileKind, FormatError, Layout, TensorInfo};

/// The largest `data.pkl` read into memory. Real ones are kilobytes to a few
/// MiB (about 150 bytes per tensor).
pub const MAX_PICKLE: u64 = 32 << 20;

/// Nesting depth followed when naming storages; deeper tensors get the
/// fallback name.
const MAX_NAME_DEPTH: usize = 64;

/// The longest storage name (and dict key used in one) taken from the
/// pickle; longer ones fall back to `data/<key>` (or `?` for a key), which
/// keeps naming linear in the size of the pickle.
const MAX_NAME_LEN: usize = 1024;

/// Parses a `torch.save` zip archive.
///
/// A sound zip that is not a torch archive (no `<archive>/data.pkl`), or
/// whose entries take more memory than the zip reader's budget, is one
/// opaque segment. A torch archive whose `data.pkl` is compressed or too
/// large to read, or whose `byteorder` is `big`, keeps every storage
/// opaque.
pub fn parse_torch_zip<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    // Entries past the reader's budget: the file is kept whole, opaque.
    let archive = match zip::read_archive(r, len) {
        Err(FormatError::TooLarge { .. }) => return Ok(Layout::opaque(len)),
        archive => archive?,
    };
    let Some(prefix) = archive
        .entries
        .first()
        .and_then(|e| e.name.split_once('/'))
        .map(|(p, _)| format!("{p}/"))
    else {
        return Ok(Layout::opaque(len));
    };
    let find = |suffix: &str| {
        archive
            .entries
            .iter()
            .find(|e| e.name.strip_prefix(&prefix) == Some(suffix))
    };
    let Some(pkl) = find("data.pkl") else {
        return Ok(Layout::opaque(len));
    };
    let all_opaque = Layout::from_tensors(FileKind::TorchZip, len, Vec::new());
    if !pkl.is_plain() {
        return all_opaque;
    }
    if let Some(bo) = find("byteorder") {
        if !bo.is_plain() {
            return all_opaque;
        }
        match read_at(r, len, bo.data_offset, bo.size, 16, "torch byteorder")?.as_slice() {
            b"little" => {}
            b"big" => return all_opaque,
            _ => {
                return Err(FormatError::corrupt(
                    bo.data_offset,
                    "byteorder is neither little nor big",
                ))
            }
        }
    }
    // A pickle longer than the reader reads, or building more than it
    // holds (see `pickle`), keeps every storage opaque: the file is still
    // stored whole, only not by tensor.
    let tree = match read_data_pkl(r, len, pkl) {
        Err(FormatError::TooLarge { .. }) => return all_opaque,
        tree => tree?,
    };
    let storages = storages(&tree, pkl.data_offset)?;

    // Every data entry must be referenced, every reference must have an entry.
    let data_prefix = format!("{prefix}data/");
    let mut entries: BTreeMap<&str, &Entry> = BTreeMap::new();
    for e in &archive.entries {
        if let Some(key) = e.name.strip_prefix(&data_prefix) {
            if entries.insert(key, e).is_some() {
                return Err(FormatError::corrupt(
                    e.header_offset,
                    format!("duplicate entry {:?}", e.name),
                ));
            }
            if !storages.contains_key(key) {
                return Err(FormatError::corrupt(
                    e.header_offset,
                    format!("storage {:?} is not referenced by data.pkl", e.name),
                ));
            }
        }
    }
    if let Some(key) = storages.keys().find(|k| !entries.contains_key(k.as_str())) {
        return Err(FormatError::corrupt(
            pkl.data_offset,
            format!("data.pkl references storage {key:?}, which has no entry"),
        ));
    }

    let names = Namer::new(&tree).name_all(&storages);
    let mut tensors = Vec::with_capacity(storages.len());
    for (key, s) in &storages {
        let (Some(e), Some(n)) = (entries.get(key.as_str()), names.get(key.as_str())) else {
            continue;
        };
        let Some(dtype) = n.dtype else {
            continue; // no dtype: the entry stays opaque
        };
        // An untyped storage counts bytes; typed ones count elements.
        let bytes = if s.untyped {
            Some(s.numel)
        } else {
            s.numel.checked_mul(dtype.width() as u64)
        };
        if bytes != Some(e.size) {
            return Err(FormatError::corrupt(
                e.header_offset,
                format!(
                    "storage {key:?} holds {} bytes, data.pkl says {} x {dtype}",
                    e.size, s.numel
                ),
            ));
        }
        if !e.is_plain() {
            continue;
        }
        tensors.push(TensorInfo {
            name: n.name.clone(),
            dtype,
            shape: n.shape.clone().unwrap_or_else(|| vec![n.elements]),
            offset: e.data_offset,
            len: e.size,
        });
    }
    Layout::from_tensors(FileKind::TorchZip, len, tensors)
}

/// The parameter names an optimizer's `state_dict()` saved with
/// `torch.save` records for its indices: `state.<i>.*` belongs to
/// `names[i]`. Only when every param group lists `param_names` beside its
/// `params` (torch >= 2.6 keeps them when the optimizer was given named
/// parameters), one name per index and no index twice; otherwise `None`
/// (never a guess). Reads only the pickle; errors only for a damaged zip.
pub fn optimizer_param_names<R: Read + Seek>(
    r: &mut R,
    len: u64,
) -> Result<Option<BTreeMap<u64, String>>, FormatError> {
    let archive = match zip::read_archive(r, len) {
        Err(FormatError::TooLarge { .. }) => return Ok(None),
        archive => archive?,
    };
    let Some(pkl) = archive
        .entries
        .iter()
        .find(|e| e.name.ends_with("/data.pkl") && e.name.matches('/').count() == 1)
    else {
        return Ok(None);
    };
    if !pkl.is_plain() {
        return Ok(None);
    }
    Ok(param_names_of(&read_data_pkl(r, len, pkl)?))
}

/// The archive's `data.pkl` entry, read (at most [`MAX_PICKLE`] bytes) and
/// parsed by the non-executing pickle reader.
fn read_data_pkl<R: Read + Seek>(
    r: &mut R,
    len: u64,
    pkl: &zip::Entry,
) -> Result<Pickle, FormatError> {
    let bytes = read_at(
        r,
        len,
        pkl.data_offset,
        pkl.size,
        MAX_PICKLE,
        "torch data.pkl",
    )?;
    pickle::read(&bytes, pkl.data_offset)
}

fn param_names_of(tree: &Pickle) -> Option<BTreeMap<u64, String>> {
    let dict = |v: Value| match tree.node(v)? {
        Node::Dict(d) => Some(d.as_slice()),
        Node::Object(o) if !o.items.is_empty() => Some(o.items.as_slice()),
        _ => None,
    };
    let get = |d: &[(Value, Value)], key: &str| {
        d.iter()
            .find(|(k, _)| tree.str(*k) == Some(key))
            .map(|(_, v)| *v)
    };
    let groups = tree.items(get(dict(tree.root)?, "param_groups")?)?;
    let mut names = BTreeMap::new();
    // Names are copied out of the tree: one string listed many times (by
    // memo) must not be copied without bound. Real names are each in the
    // pickle once.
    let mut copied = 0usize;
    // A real state dict has a dict per group; one listed twice (by memo)
    // would make the scans below quadratic in the pickle.
    let mut seen = HashSet::new();
    for g in groups {
        match g {
            Value::Ref(id) if seen.insert(*id) => {}
            _ => return None,
        }
        let g = dict(*g)?;
        let params = tree.items(get(g, "params")?)?;
        let pnames = tree.items(get(g, "param_names")?)?;
        if params.len() != pnames.len() {
            return None;
        }
        for (i, n) in params.iter().zip(pnames) {
            let (Value::Int(i), Some(n)) = (i, tree.str(*n)) else {
                return None;
            };
            copied += n.len();
            if copied > MAX_PICKLE as usize {
                return None;
            }
            if *i < 0 || names.insert(*i as u64, n.to_string()).is_some() {
                return None;
            }
        }
    }
    (!names.is_empty()).then_some(names)
}

/// The first bytes of every legacy `torch.save` file: protocol 2, then the
/// pickled magic number 0x1950a86a20f9469cfc6c (a LONG1) and STOP.
pub const LEGACY_MAGIC: [u8; 15] = [
    0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, b'.',
];

/// True when the file starts with [`LEGACY_MAGIC`].
pub(crate) fn looks_legacy<R: Read + Seek>(r: &mut R, len: u64) -> Result<bool, FormatError> {
    let n = LEGACY_MAGIC.len() as u64;
    if len < n {
        return Ok(false);
    }
    Ok(read_at(r, len, 0, n, n, "torch magic")? == LEGACY_MAGIC)
}

/// Parses a legacy `torch.save(..., _use_new_zipfile_serialization=False)`
/// file: five pickles one after another (magic number, protocol version
/// 1001, `sys_info`, the object with storages as persistent ids, the list
/// of storage keys in the order they follow), then per key an 8-byte
/// little-endian element count and the storage's raw bytes. Each storage
/// of known dtype becomes a tensor segment named like the zip format's.
///
/// Never an error for content it does not understand: anything else (a
/// big-endian file, a pickle the reader does not implement, sizes that do
/// not add up to the file) keeps the whole file opaque. Only I/O fails.
pub fn parse_torch_legacy<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    match legacy(r, len) {
        Err(FormatError::Io(e)) => Err(FormatError::Io(e)),
        Err(_) => Ok(Layout::opaque(len)),
        Ok(layout) => Ok(layout),
    }
}

fn legacy<R: Read + Seek>(r: &mut R, len: u64) -> Result<Layout, FormatError> {
    let head = read_at(r, len, 0, len.min(MAX_PICKLE), MAX_PICKLE, "torch pickles")?;
    if !head.starts_with(&LEGACY_MAGIC) {
        return Err(FormatError::corrupt(0, "no legacy torch magic number"));
    }
    let mut pos = LEGACY_MAGIC.len();
    // The four pickles are held at once: one budget for all of them.
    let mut spent = 0;
    let mut next = |what: &str| -> Result<Pickle, FormatError> {
        let rest = head
            .get(pos..)
            .ok_or_else(|| FormatError::corrupt(pos as u64, format!("no {what}")))?;
        let (p, n) = pickle::read_prefix_within(rest, pos as u64, &mut spent)?;
        pos += n;
        Ok(p)
    };
    let version = next("protocol version")?;
    if version.root != Value::Int(1001) {
        return Err(FormatError::corrupt(0, "legacy torch protocol is not 1001"));
    }
    let info = next("sys_info")?;
    let little = match info.node(info.root) {
        Some(Node::Dict(items)) => items
            .iter()
            .any(|(k, v)| info.str(*k) == Some("little_endian") && *v == Value::Bool(true)),
        _ => false,
    };
    if !little {
        return Err(FormatError::corrupt(
            0,
            "not a little-endian legacy torch file",
        ));
    }
    let tree = next("object")?;
    let keys_tree = next("storage keys")?;
    let storages = storages(&tree, 0)?;
    let keys: Vec<String> = keys_tree
        .items(keys_tree.root)
        .ok_or_else(|| FormatError::corrupt(0, "storage keys are not a list"))?
        .iter()
        .map(|k| keys_tree.str(*k).map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| FormatError::corrupt(0, "a storage key is not a string"))?;
    let names = Namer::new(&tree).name_all(&storages);
    let mut at = pos as u64;
    let mut tensors = Vec::with_capacity(keys.len());
    for key in &keys {
        let s = storages.get(key).ok_or_else(|| {
            FormatError::corrupt(at, format!("storage {key:?} is not in the object"))
        })?;
        let count = u64::from_le_bytes(
            read_at(r, len, at, 8, 8, "storage size")?
                .try_into()
                .expect("8 bytes"),
        );
        let width = if s.untyped {
            1
        } else {
            s.dtype.map_or(1, |d| d.width() as u64)
        };
        let bytes = count
            .checked_mul(width)
            // Checked: a crafted size near 2^64 must not overflow the end.
            .filter(|&b| {
                at.checked_add(8)
                    .and_then(|e| e.checked_add(b))
                    .is_some_and(|e| e <= len)
            })
            .ok_or_else(|| {
                FormatError::corrupt(at, format!("storage {key:?} runs past the file"))
            })?;
        if count != s.numel {
            return Err(FormatError::corrupt(
                at,
                format!("storage {key:?} size disagrees"),
            ));
        }
        // As in the zip format: a storage of known dtype is a tensor with
        // the one tensor's shape over it, else flat.
        if let Some((n, dtype)) = names.get(key.as_str()).and_then(|n| Some((n, n.dtype?))) {
            tensors.push(TensorInfo {
                name: n.name.clone(),
                dtype,
                shape: n.shape.clone().unwrap_or_else(|| vec![n.elements]),
                offset: at + 8,
                len: bytes,
            });
        }
        at += 8 + bytes;
    }
    if at != len {
        return Err(FormatError::corrupt(
            at,
            "storages do not end at the end of the file",
        ));
    }
    let layout = Layout::from_tensors(FileKind::TorchLegacy, len, tensors)?;
    layout.validate()?;
    Ok(layout)
}

/// One storage as described by its persistent id.
#[derive(Debug)]
struct Storage {
    /// `None` for a storage class ckvc has no dtype for (complex, ...).
    dtype: Option<DType>,
    /// `torch.UntypedStorage`: `numel` counts bytes and the dtype comes
    /// from the `_rebuild_tensor_v3` calls built on it (bytes if they
    /// disagree or there are none).
    untyped: bool,
    numel: u64,
}

/// Collects the storages named by the persistent ids:
/// `('storage', torch.<Class>, key, location, numel)`.
fn storages(tree: &Pickle, base: u64) -> Result<BTreeMap<String, Storage>, FormatError> {
    let mut out: BTreeMap<String, Storage> = BTreeMap::new();
    let bad = |reason: String| FormatError::corrupt(base, format!("data.pkl: {reason}"));
    for &id in &tree.persistent {
        let Some(Node::Persistent(pid)) = tree.nodes.get(id as usize) else {
            continue;
        };
        let items = tree
            .items(*pid)
            .ok_or_else(|| bad("persistent id is not a tuple".into()))?;
        // The legacy format adds a sixth field, the view metadata (None
        // since torch 0.4).
        let (tag, class, key, numel) = match items {
            [tag, class, key, _location, numel]
            | [tag, class, key, _location, numel, Value::None] => (tag, class, key, numel),
            _ => {
                return Err(bad(format!(
                    "persistent id has {} fields, not 5 (or 6 ending in None)",
                    items.len()
                )))
            }
        };
        if tree.str(*tag) != Some("storage") {
            return Err(bad("persistent id is not a storage".into()));
        }
        let (module, class) = tree
            .global(*class)
            .ok_or_else(|| bad("storage class is not a global".into()))?;
        let key = match (tree.str(*key), *key) {
            (Some(s), _) => s.to_string(),
            (None, Value::Int(i)) => i.to_string(),
            _ => return Err(bad("storage key is not a string".into())),
        };
        let numel = match *numel {
            Value::Int(n) if n >= 0 => n as u64,
            _ => return Err(bad(format!("storage {key:?} has no valid element count"))),
        };
        let untyped = class == "UntypedStorage";
        let dtype = match module {
            "torch" | "torch.storage" => storage_dtype(class),
            _ => None,
        };
        let s = Storage {
            dtype,
            untyped,
            numel,
        };
        if let Some(prev) = out.get(&key) {
            if prev.dtype != s.dtype || prev.numel != s.numel {
                return Err(bad(format!(
                    "storage {key:?} is described twice, differently"
                )));
            }
        } else {
            out.insert(key, s);
        }
    }
    Ok(out)
}

/// The dtype of a `torch.<Class>` storage; untyped storages are bytes.
fn storage_dtype(class: &str) -> Option<DType> {
    Some(match class {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "IntStorage" => DType::I32,
        "ShortStorage" => DType::I16,
        "CharStorage" | "QInt8Storage" => DType::I8,
        "ByteStorage" | "QUInt8Storage" | "UntypedStorage" => DType::U8,
        "BoolStorage" => DType::Bool,
        "UInt16Storage" => DType::U16,
        "UInt32Storage" => DType::U32,
        "UInt64Storage" => DType::U64,
        "QInt32Storage" => DType::I32,
        "Float8_e4m3fnStorage" => DType::F8E4M3,
        "Float8_e5m2Storage" => DType::F8E5M2,
        _ => return None,
    })
}

/// A `torch.<dtype>` global, as `_rebuild_tensor_v3` names it.
fn torch_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "float32" | "float" => DType::F32,
        "float64" | "double" => DType::F64,
        "float16" | "half" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" | "long" => DType::I64,
        "int32" | "int" => DType::I32,
        "int16" | "short" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "bool" => DType::Bool,
        "uint16" => DType::U16,
        "uint32" => DType::U32,
        "uint64" => DType::U64,
        "float8_e4m3fn" => DType::F8E4M3,
        "float8_e5m2" => DType::F8E5M2,
        _ => return None,
    })
}

/// A tensor found in the tree: where it sits and how it views its storage.
#[derive(Debug)]
struct TensorRef {
    path: String,
    key: String,
    view: View,
    /// The dtype argument of `_rebuild_tensor_v3`.
    dtype: Option<DType>,
    /// How many tensors use this storage (only the first is kept).
    count: usize,
    /// Whether all of them gave the same `dtype`.
    dtype_agrees: bool,
}

/// `storage_offset`, `size` and `stride` of a rebuilt tensor, when readable.
#[derive(Debug, Default)]
struct View {
    offset: Option<u64>,
    size: Option<Vec<u64>>,
    stride: Option<Vec<u64>>,
}

/// Walks the unpickled tree (dicts by key, lists and tuples by index, each
/// node once, first path wins) to name every storage.
struct Namer<'a> {
    tree: &'a Pickle,
    visited: HashSet<u32>,
    path: Vec<String>,
    /// The first tensor found on each storage, in walk order.
    refs: Vec<TensorRef>,
    ref_index: HashMap<String, usize>,
}

/// What the walk decided for one storage.
#[derive(Debug)]
struct Naming {
    name: String,
    dtype: Option<DType>,
    /// Elements of `dtype` in the storage.
    elements: u64,
    /// The shape of the one tensor covering the storage, if there is one.
    shape: Option<Vec<u64>>,
}

type Names = HashMap<String, Naming>;

impl<'a> Namer<'a> {
    fn new(tree: &'a Pickle) -> Self {
        Namer {
            tree,
            visited: HashSet::new(),
            path: Vec::new(),
            refs: Vec::new(),
            ref_index: HashMap::new(),
        }
    }

    /// Name, dtype and shape of every storage: the path of the first tensor
    /// built on it (`data/<key>` when there is none or it is the root), made
    /// unique with `#<key>`; the tensor's shape if that tensor alone covers
    /// the storage contiguously, else `None` (the caller uses `[elements]`).
    fn name_all(mut self, storages: &BTreeMap<String, Storage>) -> Names {
        self.walk(self.tree.root, 0);
        let mut order: Vec<(&str, Option<&TensorRef>)> = self
            .refs
            .iter()
            .filter(|r| storages.contains_key(&r.key))
            .map(|r| (r.key.as_str(), Some(r)))
            .collect();
        order.extend(
            storages
                .keys()
                .filter(|k| !self.ref_index.contains_key(*k))
                .map(|k| (k.as_str(), None)),
        );
        let mut used = HashSet::new();
        let mut names = Names::new();
        for (key, first) in order {
            let Some(storage) = storages.get(key) else {
                continue;
            };
            let mut name = match first {
                Some(r) if !r.path.is_empty() => r.path.clone(),
                _ => format!("data/{key}"),
            };
            while used.contains(&name) {
                name = format!("{name}#{key}");
            }
            used.insert(name.clone());
            let (dtype, elements) = if storage.untyped {
                let dtype = match first.filter(|r| r.dtype_agrees).and_then(|r| r.dtype) {
                    Some(d) if storage.numel % d.width() as u64 == 0 => d,
                    _ => DType::U8,
                };
                (Some(dtype), storage.numel / dtype.width() as u64)
            } else {
                (storage.dtype, storage.numel)
            };
            let shape = match first {
                Some(only) if only.count == 1 => covering_shape(only, elements),
                _ => None,
            };
            names.insert(
                key.to_string(),
                Naming {
                    name,
                    dtype,
                    elements,
                    shape,
                },
            );
        }
        names
    }

    fn walk(&mut self, v: Value, depth: usize) {
        let Value::Ref(id) = v else { return };
        if depth > MAX_NAME_DEPTH || !self.visited.insert(id) {
            return;
        }
        let tree = self.tree;
        match tree.node(v) {
            Some(Node::Dict(items)) => self.walk_items(items, depth),
            Some(Node::List(items) | Node::Tuple(items)) => {
                for (i, item) in items.iter().enumerate() {
                    self.path.push(i.to_string());
                    self.walk(*item, depth + 1);
                    self.path.pop();
                }
            }
            Some(Node::Persistent(pid)) => {
                // A storage saved as itself (torch.save(storage)).
                if let Some(key) = self.pid_key(*pid) {
                    self.push_ref(key, View::default(), None);
                }
            }
            Some(Node::Object(o)) => self.walk_object(o, depth),
            _ => {}
        }
    }

    fn walk_items(&mut self, items: &[(Value, Value)], depth: usize) {
        for (k, item) in items {
            self.path.push(self.key_name(*k, true));
            self.walk(*item, depth + 1);
            self.path.pop();
        }
    }

    fn walk_object(&mut self, o: &Object, depth: usize) {
        let tree = self.tree;
        let args = tree.items(o.args).unwrap_or(&[]);
        match tree.global(o.callable) {
            Some((
                "torch._utils",
                "_rebuild_tensor" | "_rebuild_tensor_v2" | "_rebuild_tensor_v3",
            )) => {
                self.tensor(args);
                return;
            }
            Some(("torch._tensor", "_rebuild_from_type_v2")) => {
                // (func, type, args, state): func rebuilds the tensor from args.
                if let [func, _, inner, ..] = args {
                    if matches!(tree.global(*func), Some(("torch._utils", _))) {
                        self.tensor(tree.items(*inner).unwrap_or(&[]));
                        return;
                    }
                }
            }
            Some(("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state")) => {
                if let Some(data) = args.first() {
                    self.walk(*data, depth + 1);
                }
                return;
            }
            _ => {}
        }
        // Anything else (an OrderedDict, a custom class): its items, then its
        // arguments and state, under the same path.
        self.walk_items(&o.items, depth);
        for (i, item) in o.list.iter().enumerate() {
            self.path.push(i.to_string());
            self.walk(*item, depth + 1);
            self.path.pop();
        }
        for a in args {
            self.walk(*a, depth + 1);
        }
        if let Some(s) = o.state {
            self.walk(s, depth + 1);
        }
    }

    /// `(storage, storage_offset, size, stride, ...)`.
    fn tensor(&mut self, args: &[Value]) {
        let tree = self.tree;
        let Some(Node::Persistent(pid)) = args.first().and_then(|a| tree.node(*a)) else {
            return;
        };
        let Some(key) = self.pid_key(*pid) else {
            return;
        };
        let offset = match args.get(1) {
            Some(Value::Int(o)) if *o >= 0 => Some(*o as u64),
            _ => None,
        };
        let dims = |i: usize| -> Option<Vec<u64>> {
            tree.items(*args.get(i)?)?
                .iter()
                .map(|d| match d {
                    Value::Int(n) if *n >= 0 => Some(*n as u64),
                    _ => None,
                })
                .collect()
        };
        let view = View {
            offset,
            size: dims(2),
            stride: dims(3),
        };
        // _rebuild_tensor_v3(storage, offset, size, stride, requires_grad,
        // backward_hooks, dtype, ...) on an untyped storage.
        let dtype = match args.get(6).and_then(|d| tree.global(*d)) {
            Some(("torch", name)) => torch_dtype(name),
            _ => None,
        };
        self.push_ref(key, view, dtype);
    }

    fn push_ref(&mut self, key: String, view: View, dtype: Option<DType>) {
        if let Some(r) = self.ref_index.get(&key).and_then(|&i| self.refs.get_mut(i)) {
            r.count += 1;
            r.dtype_agrees &= r.dtype == dtype;
            return;
        }
        let mut path = self.path.join(".");
        if path.len() > MAX_NAME_LEN {
            path.clear(); // falls back to data/<key>
        }
        self.ref_index.insert(key.clone(), self.refs.len());
        self.refs.push(TensorRef {
            path,
            key,
            view,
            dtype,
            count: 1,
            dtype_agrees: true,
        });
    }

    fn pid_key(&self, pid: Value) -> Option<String> {
        let items = self.tree.items(pid)?;
        match items.get(2)? {
            Value::Int(i) => Some(i.to_string()),
            k => self.tree.str(*k).map(str::to_string),
        }
    }

    /// A dict key as a path component.
    ///
    /// A tuple key is spelled out only when it is short and flat: keys can be
    /// shared and self-referential, and a path must stay cheap to build.
    fn key_name(&self, k: Value, outer: bool) -> String {
        const MAX_TUPLE_KEY: usize = 8;
        match k {
            Value::None => "None".into(),
            Value::Bool(b) => if b { "True" } else { "False" }.into(),
            Value::Int(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Ref(_) => match (self.tree.str(k), self.tree.items(k)) {
                (Some(s), _) if s.len() <= MAX_NAME_LEN => s.to_string(),
                (Some(_), _) => "?".into(),
                (None, Some(items)) if outer && items.len() <= MAX_TUPLE_KEY => items
                    .iter()
                    .map(|i| self.key_name(*i, false))
                    .collect::<Vec<_>>()
                    .join(","),
                _ => "?".into(),
            },
        }
    }
}

/// The tensor's shape when it is the whole storage (of `elements`) in C
/// order.
fn covering_shape(r: &TensorRef, elements: u64) -> Option<Vec<u64>> {
    if r.view.offset != Some(0) {
        return None;
    }
    let (size, stride) = (r.view.size.as_ref()?, r.view.stride.as_ref()?);
    if size.len() != stride.len() {
        return None;
    }
    let mut expect = 1u64;
    for (&d, &st) in size.iter().zip(stride).rev() {
        if d != 1 && st != expect {
            return None;
        }
        expect = expect.checked_mul(d)?;
    }
    (expect == elements).then(|| size.clone())
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::format::Segment;

    const SMALL: &[u8] = include_bytes!("../../tests/fixtures/format/small.pt");

    fn parse(f: &[u8]) -> Result<Layout, FormatError> {
        parse_torch_zip(&mut Cursor::new(f), f.len() as u64)
    }

    fn tensor<'a>(l: &'a Layout, name: &str) -> &'a TensorInfo {
        l.tensors()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// A stored zip of `entries`: local headers, central directory, end
    /// record (CRCs 0 in both headers, which the reader compares).
    fn stored_zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let (mut out, mut central) = (Vec::new(), Vec::new());
        let le16 = |v: &mut Vec<u8>, x: usize| v.extend_from_slice(&(x as u16).to_le_bytes());
        let le32 = |v: &mut Vec<u8>, x: usize| v.extend_from_slice(&(x as u32).to_le_bytes());
        for (name, data) in entries {
            let at = out.len();
            out.extend_from_slice(b"PK\x03\x04");
            for x in [20, 0, 0, 0, 0] {
                le16(&mut out, x); // version, flags, method 0, time, date
            }
            for x in [0, data.len(), data.len()] {
                le32(&mut out, x); // CRC, sizes
            }
            for x in [name.len(), 0] {
                le16(&mut out, x);
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(data);
            central.extend_from_slice(b"PK\x01\x02");
            for x in [20, 20, 0, 0, 0, 0] {
                le16(&mut central, x);
            }
            for x in [0, data.len(), data.len()] {
                le32(&mut central, x);
            }
            for x in [name.len(), 0, 0, 0, 0] {
                le16(&mut central, x); // name, extra, comment, disk, internal
            }
            for x in [0, at] {
                le32(&mut central, x); // external attributes, offset
            }
            central.extend_from_slice(name.as_bytes());
        }
        let cd_at = out.len();
        out.extend_from_slice(&central);
        out.extend_from_slice(b"PK\x05\x06");
        for x in [0, 0, entries.len(), entries.len()] {
            le16(&mut out, x);
        }
        for x in [central.len(), cd_at] {
            le32(&mut out, x);
        }
        le16(&mut out, 0);
        out
    }

    #[test]
    fn a_data_pkl_that_builds_past_the_readers_budget_keeps_the_file_opaque() {
        // 9 MB of EMPTY_DICT, MEMOIZE, POP: ~290 MB of nodes and memo
        // entries to read (900 MB of RSS for 30 MB before the budget).
        let mut pkl = b"\x80\x02N".to_vec();
        for _ in 0..3_000_000 {
            pkl.extend_from_slice(b"}\x940");
        }
        pkl.push(b'.');
        let f = stored_zip(&[("archive/data.pkl", &pkl), ("archive/version", b"3\n")]);
        let layout = parse(&f).expect("a sound zip");
        assert_eq!(layout.tensors().count(), 0);
        assert_eq!(layout.segments.len(), 1, "{:?}", layout.segments);
        // The same archive with a short pickle of that kind reads it.
        let f = stored_zip(&[
            ("archive/data.pkl", b"\x80\x02}\x940N."),
            ("archive/version", b"3\n"),
        ]);
        assert_eq!(parse(&f).expect("read").tensors().count(), 0);
    }

    /// The legacy fixture with `k` memo entries built at the start of each
    /// of its four pickles (stack-neutral: `None`, `k` MEMOIZEs, POP).
    fn legacy_with_memo(k: usize) -> Vec<u8> {
        let f = include_bytes!("../../tests/fixtures/format/legacy.bin");
        let mut pos = LEGACY_MAGIC.len();
        let mut out = f[..pos].to_vec();
        for _ in 0..4 {
            let (_, n) = pickle::read_prefix(&f[pos..], 0).unwrap();
            let p = &f[pos..pos + n];
            assert_eq!(&p[..2], b"\x80\x02");
            out.extend_from_slice(&p[..2]);
            out.push(b'N');
            out.extend(std::iter::repeat_n(0x94, k));
            out.push(b'0');
            out.extend_from_slice(&p[2..]);
            pos += n;
        }
        out.extend_from_slice(&f[pos..]);
        out
    }

    #[test]
    fn a_legacy_files_pickles_share_one_budget() {
        let tensors = |f: &[u8]| {
            let l = crate::format::parse("pytorch_model.bin", &mut Cursor::new(f), f.len() as u64);
            l.unwrap().tensors().count()
        };
        assert_eq!(tensors(&legacy_with_memo(1000)), 1);
        // Each pickle builds ~72 MiB, under the budget; the four are held
        // at once (crafted ones of ~256 MiB each took 1.5 GB of RSS).
        assert_eq!(tensors(&legacy_with_memo(1_500_000)), 0);
    }

    #[test]
    fn optimizer_param_names_do_not_copy_one_shared_name_without_bound() {
        // {'param_groups': [{'params': [0..n], 'param_names': [s] * n}]},
        // s a 1 MiB string listed by memo.
        let names = |len: usize, n: u16| {
            let mut p = b"\x80\x02}\x8c\x0cparam_groups]}(\x8c\x06params](".to_vec();
            for i in 0..n {
                p.push(b'M');
                p.extend_from_slice(&i.to_le_bytes());
            }
            p.extend_from_slice(b"e\x8c\x0bparam_names](\x8d");
            p.extend_from_slice(&(len as u64).to_le_bytes());
            p.extend(std::iter::repeat_n(b'p', len));
            p.extend_from_slice(b"q\x00");
            for _ in 1..n {
                p.extend_from_slice(b"h\x00");
            }
            p.extend_from_slice(b"euas.");
            param_names_of(&pickle::read(&p, 0).unwrap()).map(|m| m.len())
        };
        assert_eq!(names(10, 40), Some(40));
        // 40 MiB of names from a 1 MiB pickle.
        assert_eq!(names(1 << 20, 40), None);
    }

    #[test]
    fn optimizer_param_names_only_when_every_group_records_them() {
        let names = |f: &[u8]| optimizer_param_names(&mut Cursor::new(f), f.len() as u64).unwrap();
        let named = names(include_bytes!(
            "../../tests/fixtures/optim/named/checkpoint-1/optimizer.pt"
        ))
        .unwrap();
        let want = [
            "embed.weight",
            "proj.weight",
            "norm.weight",
            "norm.bias",
            "proj.bias",
        ];
        assert_eq!(named.len(), want.len());
        for (i, n) in want.iter().enumerate() {
            assert_eq!(named[&(i as u64)], *n);
        }
        assert_eq!(
            names(include_bytes!(
                "../../tests/fixtures/optim/unnamed/checkpoint-1/optimizer.pt"
            )),
            None
        );
        // A model state dict has no param_groups.
        assert_eq!(names(SMALL), None);
    }

    #[test]
    fn small_fixture_names_dtypes_and_shapes() {
        let l = parse(SMALL).unwrap();
        l.validate().unwrap();
        assert_eq!(l.kind, FileKind::TorchZip);
        let mut names: Vec<_> = l.tensors().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "brain",
                "empty",
                "f8",
                "half",
                "ids",
                "layer.weight",
                "mask",
                "nested.0",
                "nested.1.deep",
                "param",
                "scalar",
                "transposed",
                "u16",
                "view"
            ]
        );
        let check = |name: &str, dtype: DType, shape: &[u64]| {
            let t = tensor(&l, name);
            assert_eq!((t.dtype, t.shape.as_slice()), (dtype, shape), "{name}");
            assert_eq!(t.len, shape.iter().product::<u64>() * dtype.width() as u64);
        };
        check("layer.weight", DType::F32, &[2, 3]);
        check("half", DType::F16, &[3]);
        check("brain", DType::BF16, &[4]);
        check("ids", DType::I64, &[2]);
        check("mask", DType::Bool, &[3]);
        check("scalar", DType::F32, &[]);
        check("nested.0", DType::I32, &[2]);
        check("nested.1.deep", DType::F64, &[1, 2]);
        check("empty", DType::F32, &[0]);
        check("param", DType::F32, &[2, 2]);
        check("u16", DType::U16, &[2]);
        check("f8", DType::F8E4M3, &[3]);
        // complex64 has no DType: its storage stays opaque.
        assert_eq!(l.tensors().count(), 14);
        // A view saves its whole storage; a transposed tensor is not C order.
        check("view", DType::F32, &[12]);
        check("transposed", DType::I16, &[6]);
        // Tensor bytes are the storage bytes.
        let t = tensor(&l, "half");
        let data = &SMALL[t.offset as usize..(t.offset + t.len) as usize];
        assert!(data.chunks(2).all(|c| c != [0, 0]));
    }

    #[test]
    fn naming_handles_odd_keys_depth_cycles_and_collisions() {
        // tests/fixtures/format/names.pkl: a protocol-2 pickle of
        // {(1,'a'): t0, 'x'*2000: t1, 'deep': [[...[t2]...]] (100 levels),
        //  'self': l (l = [l]), ((1,2),3): t3, 'again': t3' (a second view of
        //  storage 3), 'data/2': t5}
        let p = include_bytes!("../../tests/fixtures/format/names.pkl");
        let tree = pickle::read(p, 0).unwrap();
        let storages = storages(&tree, 0).unwrap();
        assert_eq!(storages.len(), 5);
        let names = Namer::new(&tree).name_all(&storages);
        let name = |k: &str| names[k].name.as_str();
        assert_eq!(name("0"), "1,a");
        assert_eq!(name("1"), "?"); // key longer than MAX_NAME_LEN
        assert_eq!(name("3"), "?,3"); // nested tuple keys are not spelled out
        assert_eq!(names["3"].shape, None); // two tensors share it
        assert_eq!(names["0"].shape, Some(vec![2]));
        assert_eq!(name("5"), "data/2");
        assert_eq!(name("2"), "data/2#2"); // beyond MAX_NAME_DEPTH, then deduplicated
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]

        /// Reading and naming any mutation of a real pickle never panics.
        #[test]
        fn mutated_pickles_never_panic(
            flips in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), 1u8..=255), 1..4),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
        ) {
            let mut p = include_bytes!("../../tests/fixtures/format/names.pkl").to_vec();
            for (at, mask) in flips {
                let i = at.index(p.len());
                p[i] ^= mask;
            }
            p.truncate(cut.index(p.len() + 1));
            if let Ok(tree) = pickle::read(&p, 0) {
                if let Ok(storages) = storages(&tree, 0) {
                    let names = Namer::new(&tree).name_all(&storages);
                    proptest::prop_assert_eq!(names.len(), storages.len());
                }
            }
        }
    }

    #[test]
    fn zip64_local_headers_and_deflated_storage() {
        // small.pt rewritten by Python's zipfile (see make_fixtures.py).
        let f = include_bytes!("../../tests/fixtures/format/rezipped.pt");
        let l = parse(f).unwrap();
        l.validate().unwrap();
        let small = parse(SMALL).unwrap();
        // The deflated `half` storage stays opaque; the rest are the same
        // tensors with the same bytes.
        assert_eq!(l.tensors().count(), small.tensors().count() - 1);
        assert!(l.tensors().all(|t| t.name != "half"));
        for t in l.tensors() {
            let s = tensor(&small, &t.name);
            assert_eq!((&t.shape, t.dtype), (&s.shape, s.dtype));
            let range = |t: &TensorInfo| t.offset as usize..(t.offset + t.len) as usize;
            assert_eq!(f[range(t)], SMALL[range(s)], "{}", t.name);
        }
    }

    #[test]
    fn legacy_pickle_bin_is_read_as_tensors() {
        let f = include_bytes!("../../tests/fixtures/format/legacy.bin");
        let l =
            crate::format::parse("pytorch_model.bin", &mut Cursor::new(f), f.len() as u64).unwrap();
        l.validate().unwrap();
        assert_eq!(l.kind, FileKind::TorchLegacy);
        let t = l.tensors().next().unwrap();
        assert_eq!(
            (t.name.as_str(), t.dtype, t.shape.as_slice()),
            ("w", DType::F32, &[2u64][..])
        );
        assert_eq!((t.offset, t.len), (f.len() as u64 - 8, 8));
    }

    /// The offset of the central directory and of the end record.
    fn ends(f: &[u8]) -> (usize, usize) {
        let eocd = f.len() - 22;
        assert_eq!(&f[eocd..eocd + 4], b"PK\x05\x06");
        (
            u32::from_le_bytes(f[eocd + 16..eocd + 20].try_into().unwrap()) as usize,
            eocd,
        )
    }

    #[test]
    fn damaged_end_record_is_corrupt() {
        let (_, eocd) = ends(SMALL);
        let mut f = SMALL.to_vec();
        f[eocd] = b'X';
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
        let mut f = SMALL.to_vec();
        f[eocd + 12] ^= 1; // central directory size
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
        let mut f = SMALL.to_vec();
        f[eocd - 20] = b'X'; // zip64 locator gone: bytes between directory and EOCD
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
    }

    #[test]
    fn damaged_central_directory_is_corrupt() {
        let (cd, _) = ends(SMALL);
        for (at, flip) in [
            (0, 0x01),
            (20, 0x01),
            (24, 0x40),
            (28, 0x01),
            (42, 0x80),
            (46, 0x02),
        ] {
            let mut f = SMALL.to_vec();
            f[cd + at] ^= flip;
            assert!(
                matches!(parse(&f), Err(FormatError::Corrupt { .. })),
                "byte {at}"
            );
        }
    }

    #[test]
    fn damaged_local_header_is_corrupt() {
        let mut f = SMALL.to_vec();
        let at = SMALL.windows(4).rposition(|w| w == b"PK\x03\x04").unwrap();
        f[at + 35] ^= 0x20; // a byte of the name
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
    }

    #[test]
    fn truncated_zip_is_an_error() {
        for cut in [
            SMALL.len() - 1,
            SMALL.len() - 30,
            SMALL.len() / 2,
            100,
            10,
            0,
        ] {
            assert!(parse(&SMALL[..cut]).is_err(), "cut at {cut}");
        }
    }

    /// Replaces `from` by `to` (same length) in a STORED data.pkl.
    fn patch(from: &[u8], to: &[u8]) -> Vec<u8> {
        let mut f = SMALL.to_vec();
        let at = f.windows(from.len()).position(|w| w == from).unwrap();
        f[at..at + to.len()].copy_from_slice(to);
        f
    }

    #[test]
    fn unknown_pickle_opcode_is_reported() {
        // The BINUNICODE of the first key becomes protocol-0 `I`.
        let f = patch(b"X\x0c\x00\x00\x00layer.weight", b"I");
        assert!(matches!(
            parse(&f),
            Err(FormatError::UnsupportedPickle { opcode: b'I', .. })
        ));
    }

    #[test]
    fn storage_without_reference_or_entry_is_corrupt() {
        // Persistent id key '1' renamed to '9': entry data/1 is unreferenced.
        let f = patch(b"X\x01\x00\x00\x001q", b"X\x01\x00\x00\x009q");
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
        // Entry data/1 renamed (in both headers) to data/9.
        let mut f = SMALL.to_vec();
        for _ in 0..2 {
            let at = f.windows(12).position(|w| w == b"small/data/1").unwrap();
            f[at + 11] = b'9';
        }
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
    }

    #[test]
    fn storage_size_mismatch_is_corrupt() {
        // HalfStorage numel 3 -> 4
        let from = b"torch\nHalfStorage\nq\x10X\x01\x00\x00\x001q\x11h\x07K\x03";
        let mut to = *from;
        to[to.len() - 1] = 4;
        let f = patch(from, &to);
        assert!(matches!(parse(&f), Err(FormatError::Corrupt { .. })));
    }

    #[test]
    fn non_torch_zip_is_opaque() {
        // A zip with one STORED entry `hello.txt` (Python zipfile).
        let f = b"PK\x03\x04\x14\x00\x00\x00\x00\x00\x00\x00!\x00\x86\xa6\x106\x05\x00\x00\x00\x05\x00\x00\x00\t\x00\x00\x00hello.txthelloPK\x01\x02\x14\x03\x14\x00\x00\x00\x00\x00\x00\x00!\x00\x86\xa6\x106\x05\x00\x00\x00\x05\x00\x00\x00\t\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80\x01\x00\x00\x00\x00hello.txtPK\x05\x06\x00\x00\x00\x00\x01\x00\x01\x007\x00\x00\x00,\x00\x00\x00\x00\x00";
        let l = parse(f).unwrap();
        assert_eq!(l, Layout::opaque(f.len() as u64));
        assert!(matches!(l.segments[0], Segment::Opaque { .. }));
    }
}
