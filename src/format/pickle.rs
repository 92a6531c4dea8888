//! A pickle *reader*: builds an inert tree from a pickle stream and never
//! executes anything. `GLOBAL` becomes a name, `REDUCE`/`NEWOBJ` an object
//! node holding its callable and arguments, `BINPERSID` a persistent-id node.
//!
//! It understands the opcodes of protocols 2 to 5 that describe data
//! (everything `torch.save` writes, and the common rest); the text opcodes of
//! protocols 0 and 1 and out-of-band buffers are refused with
//! [`FormatError::UnsupportedPickle`].
//!
//! Memory is linear in the input: every opcode creates at most one node and
//! pushes at most one 16-byte value, and strings are copied at most once.
//! What the reader builds is counted as it goes and held to [`BUDGET`]:
//! crafted streams of one-byte opcodes that each build a node, a memo
//! entry or an object would otherwise take ~50 bytes a byte (900 MB for a
//! 30 MB `data.pkl`).

use std::collections::HashMap;

use super::FormatError;

/// The bytes of nodes, values, marks and memo entries a stream may make
/// the reader build. The corpora's `torch.save` pickles take 4-20 bytes a
/// byte (an object for every tensor): a `data.pkl` of up to ~13 MB.
const BUDGET: usize = 256 << 20;
/// What a memo entry costs in the map (key, value, control byte, slack).
const MEMO_ENTRY_BYTES: usize = 48;

/// A stack value: scalars inline, everything else a node in the arena.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Ref(u32),
}

/// A node of the unpickled tree.
#[derive(Debug)]
pub(crate) enum Node {
    Str(String),
    Bytes,
    /// An integer that does not fit an `i64`.
    BigInt,
    Tuple(Vec<Value>),
    /// A list, set or frozenset.
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `module.name`, as named by `GLOBAL` or `STACK_GLOBAL`; never imported.
    Global(Box<(String, String)>),
    /// The result of `REDUCE` or `NEWOBJ`, never called.
    Object(Box<Object>),
    /// The result of `BINPERSID`: the persistent id, never loaded.
    Persistent(Value),
}

/// What a call would have built, kept as data.
#[derive(Debug)]
pub(crate) struct Object {
    pub callable: Value,
    pub args: Value,
    /// Items added by `SETITEM(S)` (e.g. an `OrderedDict`).
    pub items: Vec<(Value, Value)>,
    /// Items added by `APPEND(S)`.
    pub list: Vec<Value>,
    /// The argument of `BUILD`.
    pub state: Option<Value>,
}

/// An unpickled tree.
#[derive(Debug)]
pub(crate) struct Pickle {
    pub nodes: Vec<Node>,
    pub root: Value,
    /// Every `Persistent` node, in stream order.
    pub persistent: Vec<u32>,
}

impl Pickle {
    pub fn node(&self, v: Value) -> Option<&Node> {
        match v {
            Value::Ref(i) => self.nodes.get(i as usize),
            _ => None,
        }
    }

    pub fn str(&self, v: Value) -> Option<&str> {
        match self.node(v)? {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Items of a tuple or list.
    pub fn items(&self, v: Value) -> Option<&[Value]> {
        match self.node(v)? {
            Node::Tuple(items) | Node::List(items) => Some(items),
            _ => None,
        }
    }

    pub fn global(&self, v: Value) -> Option<(&str, &str)> {
        match self.node(v)? {
            Node::Global(g) => Some((&g.0, &g.1)),
            _ => None,
        }
    }
}

/// Reads a pickle. `base` is the offset of `data` in the file, for errors.
pub(crate) fn read(data: &[u8], base: u64) -> Result<Pickle, FormatError> {
    read_prefix(data, base).map(|(p, _)| p)
}

/// Reads the pickle at the start of `data`, which may go on after its STOP
/// (`torch.save`'s legacy format writes pickles one after another);
/// returns it and the bytes it took.
pub(crate) fn read_prefix(data: &[u8], base: u64) -> Result<(Pickle, usize), FormatError> {
    read_prefix_within(data, base, &mut 0)
}

/// [`read_prefix`] for one of several pickles held at once: `spent`, the
/// bytes the earlier ones built, counts against the same [`BUDGET`] and
/// grows by what this one builds.
pub(crate) fn read_prefix_within(
    data: &[u8],
    base: u64,
    spent: &mut usize,
) -> Result<(Pickle, usize), FormatError> {
    let mut m = Machine {
        data,
        base,
        pos: 0,
        op_at: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        persistent: Vec::new(),
        spent: *spent,
    };
    loop {
        m.op_at = m.pos;
        let op = m.take(1)?[0];
        match op {
            0x80 => {
                m.take(1)?; // PROTO
            }
            0x95 => {
                m.take(8)?; // FRAME: a hint for buffered readers
            }
            b'.' => {
                // STOP
                let root = m.pop()?;
                *spent = m.spent;
                return Ok((
                    Pickle {
                        nodes: m.nodes,
                        root,
                        persistent: m.persistent,
                    },
                    m.pos,
                ));
            }
            b'(' => {
                m.charge(std::mem::size_of::<usize>())?;
                m.marks.push(m.stack.len());
            }
            b'}' => {
                m.push_node(Node::Dict(Vec::new()))?;
            }
            b']' | 0x8f => {
                m.push_node(Node::List(Vec::new()))?; // EMPTY_LIST, EMPTY_SET
            }
            b')' => {
                m.push_node(Node::Tuple(Vec::new()))?;
            }
            b't' => {
                let items = m.pop_mark()?;
                m.push_node(Node::Tuple(items))?;
            }
            b'l' | 0x91 => {
                // LIST, FROZENSET
                let items = m.pop_mark()?;
                m.push_node(Node::List(items))?;
            }
            b'd' => {
                let items = m.pop_mark()?;
                let pairs = m.pairs(items)?;
                m.push_node(Node::Dict(pairs))?;
            }
            0x85..=0x87 => {
                // TUPLE1..3
                let n = usize::from(op - 0x84);
                let at = m.stack.len().checked_sub(n).filter(|&a| a >= m.floor());
                let at = at.ok_or_else(|| m.corrupt("stack underflow"))?;
                let items = m.stack.split_off(at);
                m.push_node(Node::Tuple(items))?;
            }
            b'X' | 0x8c | 0x8d | b'T' | b'U' => {
                // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8, BINSTRING, SHORT_BINSTRING
                let n = m.length(op)?;
                let s = String::from_utf8_lossy(m.take(n)?).into_owned();
                m.push_node(Node::Str(s))?;
            }
            b'B' | b'C' | 0x8e | 0x96 => {
                // BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                let n = m.length(op)?;
                m.take(n)?;
                m.push_node(Node::Bytes)?;
            }
            b'J' => {
                let b = m.take(4)?;
                let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                m.push(Value::Int(v.into()))?;
            }
            b'K' => {
                let v = m.take(1)?[0];
                m.push(Value::Int(v.into()))?;
            }
            b'M' => {
                let b = m.take(2)?;
                let v = u16::from_le_bytes([b[0], b[1]]);
                m.push(Value::Int(v.into()))?;
            }
            0x8a | 0x8b => {
                // LONG1, LONG4: little-endian two's complement
                let n = m.length(op)?;
                let b = m.take(n)?;
                if b.len() <= 8 {
                    let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
                        0xFF
                    } else {
                        0
                    };
                    let mut full = [fill; 8];
                    full[..b.len()].copy_from_slice(b);
                    m.push(Value::Int(i64::from_le_bytes(full)))?;
                } else {
                    m.push_node(Node::BigInt)?;
                }
            }
            b'G' => {
                let b = m.take(8)?;
                let v = f64::from_be_bytes(b.try_into().expect("8 bytes"));
                m.push(Value::Float(v))?;
            }
            0x88 => m.push(Value::Bool(true))?,
            0x89 => m.push(Value::Bool(false))?,
            b'N' => m.push(Value::None)?,
            b'c' => {
                let module = m.line()?;
                let name = m.line()?;
                m.push_node(Node::Global(Box::new((module, name))))?;
            }
            0x93 => {
                // STACK_GLOBAL
                let name = m.pop()?;
                let module = m.pop()?;
                let g = match (m.str_of(module), m.str_of(name)) {
                    (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                    _ => return Err(m.corrupt("STACK_GLOBAL needs two strings")),
                };
                m.push_node(Node::Global(Box::new(g)))?;
            }
            b'q' | b'r' => {
                // BINPUT, LONG_BINPUT
                let idx = m.index(op)?;
                let top = m.top()?;
                m.memoize(idx, top)?;
            }
            0x94 => {
                // MEMOIZE
                let top = m.top()?;
                let idx = u32::try_from(m.memo.len()).map_err(|_| m.corrupt("memo overflow"))?;
                m.memoize(idx, top)?;
            }
            b'h' | b'j' => {
                // BINGET, LONG_BINGET
                let idx = m.index(op)?;
                let v = *m
                    .memo
                    .get(&idx)
                    .ok_or_else(|| m.corrupt("memo key not defined"))?;
                m.push(v)?;
            }
            b's' => {
                let v = m.pop()?;
                let k = m.pop()?;
                m.set_items(vec![(k, v)])?;
            }
            b'u' => {
                let items = m.pop_mark()?;
                let pairs = m.pairs(items)?;
                m.set_items(pairs)?;
            }
            b'a' => {
                let v = m.pop()?;
                m.append(vec![v])?;
            }
            b'e' | 0x90 => {
                // APPENDS, ADDITEMS
                let items = m.pop_mark()?;
                m.append(items)?;
            }
            b'R' | 0x81 => {
                // REDUCE, NEWOBJ
                let args = m.pop()?;
                let callable = m.pop()?;
                m.push_object(callable, args)?;
            }
            0x92 => {
                // NEWOBJ_EX: keyword arguments are dropped
                m.pop()?;
                let args = m.pop()?;
                let callable = m.pop()?;
                m.push_object(callable, args)?;
            }
            b'b' => {
                // BUILD
                let state = m.pop()?;
                let target = m.top()?;
                if let Some(Node::Object(o)) = m.node_mut(target) {
                    o.state = Some(state);
                }
            }
            b'Q' => {
                // BINPERSID
                let pid = m.pop()?;
                let id = m.push_node(Node::Persistent(pid))?;
                m.persistent.push(id);
            }
            b'0' => {
                // POP: a value, or the mark on top
                if m.stack.len() > m.floor() {
                    m.stack.pop();
                } else {
                    m.pop_mark()?;
                }
            }
            b'1' => {
                m.pop_mark()?; // POP_MARK
            }
            b'2' => {
                let top = m.top()?; // DUP
                m.push(top)?;
            }
            _ => {
                return Err(FormatError::UnsupportedPickle {
                    opcode: op,
                    offset: base + m.op_at as u64,
                })
            }
        }
    }
}

struct Machine<'a> {
    data: &'a [u8],
    base: u64,
    pos: usize,
    op_at: usize,
    nodes: Vec<Node>,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    persistent: Vec<u32>,
    /// Bytes built so far (at most [`BUDGET`]).
    spent: usize,
}

impl Machine<'_> {
    /// Count `bytes` more built; past the budget, an error.
    fn charge(&mut self, bytes: usize) -> Result<(), FormatError> {
        self.spent = self.spent.saturating_add(bytes);
        if self.spent > BUDGET {
            return Err(FormatError::TooLarge {
                what: "memory to read a pickle",
                size: self.spent as u64,
                limit: BUDGET as u64,
            });
        }
        Ok(())
    }

    /// Push a value onto the stack.
    fn push(&mut self, v: Value) -> Result<(), FormatError> {
        self.charge(std::mem::size_of::<Value>())?;
        self.stack.push(v);
        Ok(())
    }

    /// Remember `v` under memo key `idx`.
    fn memoize(&mut self, idx: u32, v: Value) -> Result<(), FormatError> {
        if self.memo.insert(idx, v).is_none() {
            self.charge(MEMO_ENTRY_BYTES)?;
        }
        Ok(())
    }

    fn corrupt(&self, reason: &str) -> FormatError {
        FormatError::corrupt(
            self.base + self.op_at as u64,
            format!("pickle opcode 0x{:02x}: {reason}", self.data[self.op_at]),
        )
    }

    fn take(&mut self, n: usize) -> Result<&[u8], FormatError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return Err(FormatError::corrupt(
                self.base + self.op_at as u64,
                "pickle ends inside an opcode (no STOP)",
            ));
        };
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The length argument of a variable-length opcode.
    fn length(&mut self, op: u8) -> Result<usize, FormatError> {
        let width = match op {
            0x8c | b'U' | b'C' | 0x8a => 1,
            b'X' | b'T' | b'B' | 0x8b => 4,
            _ => 8,
        };
        let b = self.take(width)?;
        let n = b
            .iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
        // Longer than the rest of the stream is caught by `take`.
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    fn index(&mut self, op: u8) -> Result<u32, FormatError> {
        Ok(match op {
            b'q' | b'h' => self.take(1)?[0].into(),
            _ => {
                let b = self.take(4)?;
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
        })
    }

    fn line(&mut self) -> Result<String, FormatError> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.corrupt("GLOBAL name without a newline"))?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    /// The stack index below which the current mark's items begin.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, FormatError> {
        if self.stack.len() <= self.floor() {
            return Err(self.corrupt("stack underflow"));
        }
        self.stack
            .pop()
            .ok_or_else(|| self.corrupt("stack underflow"))
    }

    fn top(&self) -> Result<Value, FormatError> {
        if self.stack.len() <= self.floor() {
            return Err(self.corrupt("stack underflow"));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.corrupt("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, FormatError> {
        let at = self.marks.pop().ok_or_else(|| self.corrupt("no MARK"))?;
        Ok(self.stack.split_off(at.min(self.stack.len())))
    }

    fn pairs(&self, items: Vec<Value>) -> Result<Vec<(Value, Value)>, FormatError> {
        if items.len() % 2 != 0 {
            return Err(self.corrupt("odd number of items for a dict"));
        }
        let mut it = items.into_iter();
        let mut pairs = Vec::with_capacity(it.len() / 2);
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        Ok(pairs)
    }

    fn push_node(&mut self, node: Node) -> Result<u32, FormatError> {
        use std::mem::size_of;
        let held = match &node {
            Node::Str(s) => s.capacity(),
            Node::Tuple(v) | Node::List(v) => v.capacity() * size_of::<Value>(),
            Node::Dict(d) => d.capacity() * size_of::<(Value, Value)>(),
            Node::Global(g) => size_of::<(String, String)>() + g.0.capacity() + g.1.capacity(),
            Node::Object(_) => size_of::<Object>(),
            Node::Bytes | Node::BigInt | Node::Persistent(_) => 0,
        };
        self.charge(size_of::<Node>() + held)?;
        // Nodes never outnumber the bytes of a stream capped well below 4 GiB.
        let id = self.nodes.len() as u32;
        self.nodes.push(node);
        self.push(Value::Ref(id))?;
        Ok(id)
    }

    fn push_object(&mut self, callable: Value, args: Value) -> Result<(), FormatError> {
        self.push_node(Node::Object(Box::new(Object {
            callable,
            args,
            items: Vec::new(),
            list: Vec::new(),
            state: None,
        })))
        .map(|_| ())
    }

    fn node_mut(&mut self, v: Value) -> Option<&mut Node> {
        match v {
            Value::Ref(i) => self.nodes.get_mut(i as usize),
            _ => None,
        }
    }

    fn str_of(&self, v: Value) -> Option<&str> {
        match v {
            Value::Ref(i) => match self.nodes.get(i as usize)? {
                Node::Str(s) => Some(s),
                _ => None,
            },
            _ => None,
        }
    }

    fn set_items(&mut self, pairs: Vec<(Value, Value)>) -> Result<(), FormatError> {
        let target = self.top()?;
        let grown = match self.node_mut(target) {
            Some(Node::Dict(d)) => extend_counted(d, pairs),
            Some(Node::Object(o)) => extend_counted(&mut o.items, pairs),
            _ => return Err(self.corrupt("SETITEM on something that is not a dict")),
        };
        self.charge(grown)
    }

    fn append(&mut self, items: Vec<Value>) -> Result<(), FormatError> {
        let target = self.top()?;
        let grown = match self.node_mut(target) {
            Some(Node::List(l)) => extend_counted(l, items),
            Some(Node::Object(o)) => extend_counted(&mut o.list, items),
            _ => return Err(self.corrupt("APPEND on something that is not a list")),
        };
        self.charge(grown)
    }
}

/// Extend `v` by `items`; the bytes its buffer grew by (a first item
/// allocates room for four: counting items would count a quarter of it).
fn extend_counted<T>(v: &mut Vec<T>, items: Vec<T>) -> usize {
    let before = v.capacity();
    v.extend(items);
    (v.capacity() - before) * std::mem::size_of::<T>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A protocol-2 stream of `body` repeated `n` times after a `None`,
    /// then STOP (the `None` is the root if the body leaves nothing).
    fn repeated(body: &[u8], n: usize) -> Vec<u8> {
        let mut p = b"\x80\x02N".to_vec();
        for _ in 0..n {
            p.extend_from_slice(body);
        }
        p.push(b'.');
        p
    }

    #[test]
    fn one_byte_opcodes_that_build_nodes_stop_at_the_memory_budget() {
        // EMPTY_DICT + MEMOIZE: a node, a value and a memo entry (~96
        // bytes) for two bytes of stream; then POP, so the stack stays
        // short. 9 MB of stream would build ~290 MB: refused past 256
        // MiB. An object the same (~230 bytes for five).
        for (body, n) in [(&b"}\x940"[..], 3_000_000), (b"NN\x81\x940", 3_000_000)] {
            let p = repeated(body, n);
            match read(&p, 0) {
                Err(FormatError::TooLarge { limit, .. }) => assert_eq!(limit, BUDGET as u64),
                Err(e) => panic!("{body:?}: {e}"),
                Ok(_) => panic!("{body:?}: read"),
            }
        }
        // The same streams, short enough, read as before.
        for body in [&b"}\x940"[..], b"NN\x81\x940"] {
            let t = read(&repeated(body, 1000), 0).expect("within the budget");
            assert_eq!(t.nodes.len(), 1000);
        }
    }

    #[test]
    fn a_first_item_counts_the_room_it_allocates() {
        // EMPTY_DICT, SETITEM of two Nones, POP: the item allocates room
        // for four pairs (128 bytes, not 32). 1.4 M of them build ~290 MB
        // (counted at ~157 MB, read, before).
        let p = repeated(b"}NNs0", 1_400_000);
        assert!(matches!(read(&p, 0), Err(FormatError::TooLarge { .. })));
        let p = repeated(b"]Na0", 2_200_000);
        assert!(matches!(read(&p, 0), Err(FormatError::TooLarge { .. })));
    }

    #[test]
    fn pickles_read_within_one_budget_share_it() {
        let p = repeated(b"N\x940", 1_100_000); // ~70 MB each
        let mut spent = 0;
        for _ in 0..3 {
            read_prefix_within(&p, 0, &mut spent).expect("within the budget");
        }
        assert!(matches!(
            read_prefix_within(&p, 0, &mut spent),
            Err(FormatError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_long_string_is_built_once() {
        // 16 MiB of one string: 16 MiB built, once.
        let n = 16 << 20;
        let mut p = b"\x80\x02\x8d".to_vec();
        p.extend_from_slice(&(n as u64).to_le_bytes());
        p.extend(std::iter::repeat_n(b'a', n));
        p.extend_from_slice(b"\x94.");
        let t = read(&p, 0).expect("one long string");
        assert_eq!(t.str(t.root).map(str::len), Some(n));
    }

    #[test]
    fn reads_a_nested_structure() {
        // pickle.dumps({'a': [1, -2, 2**40, 1.5, None, True], 'b': ('x',)}, protocol=2)
        let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01G?\xf8\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bq\x03X\x01\x00\x00\x00xq\x04\x85q\x05u.";
        let t = read(p, 0).unwrap();
        let Some(Node::Dict(d)) = t.node(t.root) else {
            panic!("root is not a dict")
        };
        assert_eq!(t.str(d[0].0), Some("a"));
        assert_eq!(
            t.items(d[0].1).unwrap(),
            &[
                Value::Int(1),
                Value::Int(-2),
                Value::Int(1 << 40),
                Value::Float(1.5),
                Value::None,
                Value::Bool(true)
            ]
        );
        assert_eq!(t.str(t.items(d[1].1).unwrap()[0]), Some("x"));
    }

    #[test]
    fn unknown_opcode_is_reported_with_its_offset() {
        // protocol 0 INT opcode `I`
        let e = read(b"\x80\x02I1\n.", 100).unwrap_err();
        assert!(
            matches!(
                e,
                FormatError::UnsupportedPickle {
                    opcode: b'I',
                    offset: 102
                }
            ),
            "{e:?}"
        );
        let e = read(b"\x80\x02\xff", 0).unwrap_err();
        assert!(matches!(
            e,
            FormatError::UnsupportedPickle { opcode: 0xff, .. }
        ));
    }

    #[test]
    fn malformed_streams_are_corrupt() {
        for p in [
            &b"\x80\x02"[..],             // no STOP
            b"\x80\x02.",                 // STOP on an empty stack
            b"\x80\x02X\xff\xff\xff\xff", // string longer than the stream
            b"\x80\x02h\x05.",            // undefined memo key
            b"\x80\x02K\x01K\x02s.",      // SETITEM on an int
            b"\x80\x02t.",                // TUPLE without MARK
            b"\x80\x02(K\x01\x86.",       // TUPLE2 across a mark
            b"\x80\x02}(K\x01u.",         // odd SETITEMS
            b"\x80\x02cmod",              // GLOBAL without newline
        ] {
            assert!(
                matches!(read(p, 0), Err(FormatError::Corrupt { .. })),
                "{p:?}"
            );
        }
    }

    #[test]
    fn reduce_and_globals_stay_inert() {
        // cos\nsystem\n(S'x'\ntR. is protocol 0; the protocol 2 form:
        let p = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.";
        let t = read(p, 0).unwrap();
        let Some(Node::Object(o)) = t.node(t.root) else {
            panic!("root is not an object")
        };
        assert_eq!(t.global(o.callable), Some(("os", "system")));
    }
}
