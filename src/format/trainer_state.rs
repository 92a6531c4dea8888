//! HF Trainer's `trainer_state.json`: the step a checkpoint directory was
//! saved at and the metrics a commit records, read streamed in bounded
//! memory.
//!
//! Owns: reading the file (never a FIFO; any length: a long run's
//! `log_history` passes 64 MiB at ~480k logged steps) without building its
//! JSON tree, which held ~9 bytes per byte of file (a 55 MB file peaked a
//! commit at ~500 MB). Only `global_step`, the top level's numeric metrics
//! and, per `log_history` entry, its `step` and numeric metrics are kept,
//! at most [`MAX_METRICS`] metric names of at most [`MAX_NAME`] bytes. A
//! string longer than [`MAX_STRING`] bytes or a number longer than
//! [`MAX_NUMBER`] makes the file not understood, as a JSON error does, so
//! the parser's own buffers stay bounded too. What a metric is, and which
//! entry's value is kept: [`TrainerState::metrics`].
//!
//! A file is read once, or twice when a `global_step` comes after the
//! `log_history` it filters (transformers writes keys sorted, step first).
//! Stands on serde_json's streaming deserializer and `format::json`.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::json::{map_gives, scalars_give, seq_gives, JsonScalar, SkipJson};

/// Longest JSON string (key or value) read, in bytes of the file.
pub const MAX_STRING: usize = 1 << 20;
/// Longest number read, in bytes of the file.
pub const MAX_NUMBER: usize = 4096;
/// Most metric names kept from the top level, from `log_history`, and in
/// all (`log_history`'s first).
pub const MAX_METRICS: usize = 256;
/// Longest metric name kept, in bytes.
pub const MAX_NAME: usize = 256;

/// What a checkpoint directory's `trainer_state.json` says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrainerState {
    /// The top level's `global_step`, when a whole number of 0 or more.
    pub global_step: Option<u64>,
    /// The numeric metrics (`loss`, `train_loss`, `learning_rate`,
    /// `grad_norm`, `epoch`, `global_step`, `eval_*`) at the top level,
    /// then, over them, for each metric name, its value in the last
    /// `log_history` entry whose `step` is not after `global_step` (where
    /// HF Trainer keeps `loss` and `eval_*`; an entry with no whole-number
    /// `step` counts). At most [`MAX_METRICS`] names.
    pub metrics: Map<String, Value>,
}

impl TrainerState {
    /// The file at `path`; `None` when it is missing, not a regular file,
    /// not a JSON object, or past the limits above.
    pub fn read(path: &Path) -> Option<TrainerState> {
        let first = pass(path, None)?;
        let upto = first.global_step.unwrap_or(u64::MAX);
        let pass = match first.history_upto {
            // Filtered by a step that a later `global_step` changed.
            Some(used) if used != upto => pass(path, Some(upto))?,
            _ => first,
        };
        let global_step = pass.global_step;
        // log_history's values over the top level's; at most MAX_METRICS
        // names in all, log_history's first.
        let mut metrics: Map<String, Value> = pass
            .history
            .into_iter()
            .map(|(k, v)| (k, Value::Number(v)))
            .collect();
        for (k, v) in pass.top {
            if metrics.len() < MAX_METRICS && !metrics.contains_key(&k) {
                metrics.insert(k, Value::Number(v));
            }
        }
        Some(TrainerState {
            global_step,
            metrics,
        })
    }
}

/// Whether the file at `path` is one whole JSON value (any), within the
/// limits above: how `watch` knows HF Trainer finished writing it.
pub fn is_whole_json(path: &Path) -> bool {
    let Ok(f) = super::open_regular(path) else {
        return false;
    };
    let mut de = serde_json::Deserializer::from_reader(reader(f));
    // Skipped as the reader skips, checked and nested at most as deep:
    // serde's `IgnoredAny` let serde_json skip any depth, keeping a byte
    // a level (100 MiB of `[`, 103 MB).
    <SkipJson as de::Deserialize>::deserialize(&mut de).is_ok() && de.end().is_ok()
}

/// Whether a top-level or `log_history` key is a metric worth keeping with
/// the commit (for `log` and `gc --keep best=`).
fn is_metric(k: &str) -> bool {
    matches!(
        k,
        "loss" | "train_loss" | "learning_rate" | "grad_norm" | "epoch" | "global_step"
    ) || (k.starts_with("eval_") && k.len() <= MAX_NAME)
}

/// The file through [`Bounded`], buffered for serde_json's byte reads.
fn reader(f: std::fs::File) -> impl Read {
    std::io::BufReader::new(Bounded {
        inner: f,
        in_string: false,
        escaped: false,
        run: 0,
    })
}

/// One read of the file; `fixed_upto` filters `log_history` by the step
/// a first read found (`u64::MAX`: none), whatever comes before it.
fn pass(path: &Path, fixed_upto: Option<u64>) -> Option<Pass> {
    let f = super::open_regular(path).ok()?;
    let mut de = serde_json::Deserializer::from_reader(reader(f));
    let mut p = Pass {
        fixed_upto,
        ..Pass::default()
    };
    Top(&mut p).deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(p)
}

/// What a read keeps. Keys repeated in an object: the last one counts, as
/// in a parsed JSON tree.
#[derive(Default)]
struct Pass {
    fixed_upto: Option<u64>,
    /// The last top-level `global_step`, when a whole number of 0 or more.
    global_step: Option<u64>,
    top: BTreeMap<String, Number>,
    /// From the last `log_history` array.
    history: BTreeMap<String, Number>,
    /// The step the last `log_history` was filtered by (`u64::MAX`: none).
    history_upto: Option<u64>,
}

/// Keeps `v` under `k` in `m` unless `m` is full and lacks `k`.
fn keep(m: &mut BTreeMap<String, Number>, k: String, v: Number) {
    if m.len() < MAX_METRICS || m.contains_key(&k) {
        m.insert(k, v);
    }
}

/// The top-level object.
struct Top<'a>(&'a mut Pass);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        let p = self.0;
        while let Some(k) = a.next_key::<String>()? {
            if k == "log_history" {
                let upto = p.fixed_upto.or(p.global_step).unwrap_or(u64::MAX);
                p.history.clear();
                p.history_upto = Some(upto);
                a.next_value_seed(History {
                    upto,
                    out: &mut p.history,
                })?;
                continue;
            }
            let v: JsonScalar = a.next_value()?;
            if k == "global_step" {
                p.global_step = v.as_u64();
            }
            if is_metric(&k) {
                match v {
                    JsonScalar::Num(n) => keep(&mut p.top, k, n),
                    _ => {
                        p.top.remove(&k);
                    }
                }
            }
        }
        Ok(())
    }
}

/// `log_history`: an array of entries, each applied as it ends; anything
/// else keeps no history.
struct History<'a> {
    upto: u64,
    out: &'a mut BTreeMap<String, Number>,
}

impl<'de> DeserializeSeed<'de> for History<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for History<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        while let Some(entry) = a.next_element::<Entry>()? {
            if !entry.is_object || entry.step.is_some_and(|s| s > self.upto) {
                continue;
            }
            for (k, v) in entry.metrics {
                if let Some(v) = v {
                    keep(self.out, k, v);
                }
            }
        }
        Ok(())
    }
    scalars_give!(());
    map_gives!(());
}

/// One `log_history` entry: its last `step`, and its metric names with the
/// last value of each (`None`: not a number, which hides an earlier one).
#[derive(Default)]
struct Entry {
    is_object: bool,
    /// The last `step`, when a whole number of 0 or more.
    step: Option<u64>,
    metrics: BTreeMap<String, Option<Number>>,
}

impl<'de> de::Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EntryVisitor)
    }
}

struct EntryVisitor;

impl<'de> Visitor<'de> for EntryVisitor {
    type Value = Entry;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Entry, A::Error> {
        let mut e = Entry {
            is_object: true,
            ..Entry::default()
        };
        while let Some(k) = a.next_key::<String>()? {
            let v: JsonScalar = a.next_value()?;
            if k == "step" {
                e.step = v.as_u64();
            } else if is_metric(&k) && k != "global_step" {
                let v = match v {
                    JsonScalar::Num(n) => Some(n),
                    _ => None,
                };
                if e.metrics.len() < MAX_METRICS || e.metrics.contains_key(&k) {
                    e.metrics.insert(k, v);
                }
            }
        }
        Ok(e)
    }
    scalars_give!(Entry::default());
    seq_gives!(Entry::default());
}

/// A reader that fails once a JSON string passes [`MAX_STRING`] bytes or
/// a number [`MAX_NUMBER`]: serde_json gathers each string, and a long
/// number's digits, whole in a buffer before it looks at them.
struct Bounded<R> {
    inner: R,
    in_string: bool,
    escaped: bool,
    /// Bytes of the string, or number-like bytes in a row, so far.
    run: usize,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for &b in &buf[..n] {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    self.run = 0;
                    continue;
                }
                self.run += 1;
                if self.run > MAX_STRING {
                    return Err(too_long("string"));
                }
            } else if b == b'"' {
                self.in_string = true;
                self.run = 0;
            } else if matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                self.run += 1;
                if self.run > MAX_NUMBER {
                    return Err(too_long("number"));
                }
            } else {
                self.run = 0;
            }
        }
        Ok(n)
    }
}

fn too_long(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("a JSON {what} too long for trainer_state.json"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_str(s: &str) -> Option<TrainerState> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("trainer_state.json");
        std::fs::write(&p, s).unwrap();
        TrainerState::read(&p)
    }

    /// The old reading, a whole `serde_json::Value` tree, for comparison.
    fn by_tree(s: &str) -> Option<TrainerState> {
        let Ok(Value::Object(m)) = serde_json::from_str::<Value>(s) else {
            return None;
        };
        let global_step = m.get("global_step").and_then(|v| v.as_u64());
        let mut out = Map::new();
        for (k, v) in &m {
            if is_metric(k) && v.is_number() {
                out.insert(k.clone(), v.clone());
            }
        }
        let upto = global_step.unwrap_or(u64::MAX);
        if let Some(h) = m.get("log_history").and_then(|h| h.as_array()) {
            for e in h.iter().filter_map(|e| e.as_object()) {
                if e.get("step")
                    .and_then(|s| s.as_u64())
                    .is_some_and(|s| s > upto)
                {
                    continue;
                }
                for (k, v) in e {
                    if is_metric(k) && v.is_number() && k != "global_step" {
                        out.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        Some(TrainerState {
            global_step,
            metrics: out,
        })
    }

    #[test]
    fn streamed_reading_agrees_with_the_whole_tree_on_every_shape_of_file() {
        let cases = [
            // As transformers writes it: keys sorted, step before history.
            r#"{"epoch": 0.2, "global_step": 20, "log_history": [
                {"loss": 2.5, "step": 10, "learning_rate": 5e-5},
                {"eval_loss": 2.2, "eval_runtime": 1.5, "step": 20},
                {"loss": 2.0, "grad_norm": 0.5, "step": 20},
                {"loss": 0.1, "eval_loss": 0.1, "step": 30}], "total_flos": 1.0}"#,
            // The step after the history it filters (a second read).
            r#"{"log_history": [{"loss": 1, "step": 5}, {"loss": 2, "step": 9}], "global_step": 5}"#,
            // A repeated global_step: the last counts.
            r#"{"global_step": 9, "log_history": [{"loss": 1, "step": 5}, {"loss": 2, "step": 9}], "global_step": 5}"#,
            r#"{"global_step": 5, "global_step": "x", "log_history": [{"loss": 1, "step": 5}, {"loss": 2, "step": 9}]}"#,
            // A repeated log_history: the last counts.
            r#"{"global_step": 5, "log_history": [{"loss": 1}], "log_history": [{"grad_norm": 3}]}"#,
            r#"{"log_history": [{"loss": 1}], "log_history": 7}"#,
            // Entries that are not objects, steps that are not whole numbers.
            r#"{"global_step": 5, "log_history": [1, "a", null, [1, 2], {"loss": 4, "step": -1}, {"loss": 5, "step": "9"}, {"eval_x": 6, "step": 5.5}]}"#,
            // Repeated keys in an entry; a later non-number hides a number.
            r#"{"log_history": [{"loss": 1, "loss": "nan", "epoch": 2, "step": 99, "step": 1}], "global_step": 3}"#,
            r#"{"log_history": [{"loss": 1}, {"loss": null}]}"#,
            // Top-level metrics, shadowed and not.
            r#"{"loss": 3, "loss": [1], "eval_acc": 0.5, "epoch": {"a": 1}, "global_step": 0}"#,
            r#"{"global_step": -4, "epoch": 1e300, "eval_big": 123456789012345678901234567890}"#,
            r#"{"global_step": 18446744073709551615, "log_history": [{"loss": 1, "step": 18446744073709551615}]}"#,
            // Not an object, not JSON, not whole.
            "[1, 2]",
            "7",
            "",
            r#"{"global_step": 5"#,
            r#"{"global_step": 5} {}"#,
            r#"{"global_step": 5,}"#,
            "{}",
        ];
        for c in cases {
            assert_eq!(read_str(c), by_tree(c), "{c}");
        }
    }

    /// JSON text (objects may repeat keys) over the keys that matter.
    fn json_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let key = prop::sample::select(vec![
            "global_step",
            "log_history",
            "step",
            "loss",
            "eval_loss",
            "epoch",
            "grad_norm",
            "x",
        ]);
        let leaf = prop_oneof![
            (0u64..40).prop_map(|n| n.to_string()),
            Just("18446744073709551615".to_string()),
            (-5i64..0).prop_map(|n| n.to_string()),
            (-1e3f64..1e3).prop_map(|f| format!("{f:?}")),
            Just("null".to_string()),
            Just("true".to_string()),
            Just("\"s\"".to_string()),
        ];
        leaf.prop_recursive(4, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key.clone(), inner), 0..6).prop_map(|v| {
                    let items: Vec<String> =
                        v.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                    format!("{{{}}}", items.join(", "))
                }),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]
        /// Random files over the keys that matter: the streamed reading
        /// and the whole tree agree.
        #[test]
        fn streamed_reading_agrees_with_the_whole_tree_on_random_files(
            top in proptest::collection::vec(
                (proptest::sample::select(vec!["global_step", "log_history", "loss", "x"]), json_text()),
                0..8,
            ),
            any in json_text(),
        ) {
            let items: Vec<String> = top.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            for s in [format!("{{{}}}", items.join(", ")), any] {
                proptest::prop_assert_eq!(read_str(&s), by_tree(&s), "{}", s);
            }
        }
    }

    /// Values the reader keeps nothing of (inside arrays and objects)
    /// were skipped unchecked: invalid UTF-8, a lone surrogate escape or a
    /// number out of range there, which make the whole tree fail to parse
    /// (the step then comes from the directory's name), gave a step and
    /// metrics.
    #[test]
    fn a_file_not_json_inside_a_skipped_value_is_not_understood_as_before() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("trainer_state.json");
        // Past serde_json's 128 levels (skipped, the nesting was kept a
        // byte a level: a file of 300 MiB of `[` took as much memory).
        let deep = format!(
            r#"{{"global_step": 5, "x": {}{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        for s in [
            deep.as_bytes(),
            &b"{\"global_step\": 5, \"x\": [\"\xff\"]}"[..],
            &b"{\"global_step\": 5, \"x\": {\"\xc3\": 1}}"[..],
            br#"{"global_step": 5, "x": {"a": ["\ud800"]}}"#,
            br#"{"global_step": 5, "log_history": [{"loss": 1, "x": [1e400]}]}"#,
            br#"{"global_step": 5, "log_history": {"\udc00": 1}}"#,
            br#"{"global_step": 5, "log_history": [[-1e999]]}"#,
            br#"{"global_step": 5, "loss": {"a": [2E+400]}}"#,
        ] {
            assert!(serde_json::from_slice::<Value>(s).is_err());
            std::fs::write(&p, s).unwrap();
            assert_eq!(
                TrainerState::read(&p),
                None,
                "{}",
                String::from_utf8_lossy(s)
            );
        }
    }

    #[test]
    fn a_string_or_number_past_its_limit_makes_the_file_not_understood() {
        let long = "a".repeat(MAX_STRING);
        let ok = format!(r#"{{"global_step": 3, "note": "{long}"}}"#);
        assert_eq!(read_str(&ok).unwrap().global_step, Some(3));
        let over = format!(r#"{{"global_step": 3, "note": "{long}b"}}"#);
        assert_eq!(read_str(&over), None);
        // Escapes count as the bytes they take in the file.
        let escaped = format!(
            r#"{{"global_step": 3, "note": "{}"}}"#,
            "\\n".repeat(MAX_STRING / 2 + 1)
        );
        assert_eq!(read_str(&escaped), None);
        let digits = "1".repeat(MAX_NUMBER + 1);
        assert_eq!(
            read_str(&format!(r#"{{"global_step": 3, "x": {digits}}}"#)),
            None
        );
        let digits = "1".repeat(MAX_NUMBER - 2);
        assert_eq!(
            read_str(&format!(r#"{{"global_step": 3, "x": 0.{digits}}}"#))
                .unwrap()
                .global_step,
            Some(3)
        );
    }

    #[test]
    fn metric_names_kept_are_bounded_in_number_and_length() {
        let mut s = String::from(r#"{"log_history": [{"#);
        for i in 0..MAX_METRICS + 50 {
            s.push_str(&format!(r#""eval_{i:04}": {i}, "#));
        }
        s.push_str(&format!(
            r#""eval_{}": 1, "loss": 2}}]}}"#,
            "x".repeat(MAX_NAME)
        ));
        let t = read_str(&s).unwrap();
        assert_eq!(t.metrics.len(), MAX_METRICS);
        assert!(t.metrics.keys().all(|k| k.len() <= MAX_NAME));
    }

    /// README and CHANGELOG: at most 256 metric names. The top level and
    /// `log_history` each kept 256, and a commit recorded both: 512.
    #[test]
    fn metric_names_top_level_and_history_together_are_at_most_max_metrics() {
        let top: Vec<String> = (1..MAX_METRICS)
            .map(|i| format!(r#""eval_t{i:04}": {i}"#))
            .collect();
        let history: Vec<String> = (1..MAX_METRICS)
            .map(|i| format!(r#""eval_h{i:04}": {i}"#))
            .collect();
        let s = format!(
            r#"{{"loss": 1, {}, "log_history": [{{"loss": 2, {}}}]}}"#,
            top.join(", "),
            history.join(", ")
        );
        let t = read_str(&s).unwrap();
        assert_eq!(t.metrics.len(), MAX_METRICS);
        // log_history's values win over the top level's, as before.
        assert_eq!(t.metrics["loss"], 2);
    }

    #[test]
    fn is_whole_json_wants_one_whole_value_within_the_limits() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("trainer_state.json");
        for (s, whole) in [
            ("{}", true),
            ("[1, {\"a\": [2]}]", true),
            ("{\"a\": 1", false),
            ("{} x", false),
            ("", false),
        ] {
            std::fs::write(&p, s).unwrap();
            assert_eq!(is_whole_json(&p), whole, "{s}");
        }
        std::fs::write(&p, format!("\"{}\"", "a".repeat(MAX_STRING + 1))).unwrap();
        assert!(!is_whole_json(&p));
        // Nesting the reader refuses (past serde_json's 128 levels) is not
        // whole either: skipping it kept a byte a level, unbounded.
        for depth in [100, 200] {
            let (open, close) = ("[".repeat(depth), "]".repeat(depth));
            std::fs::write(&p, format!("{{\"global_step\": 3, \"x\": {open}{close}}}")).unwrap();
            assert_eq!(is_whole_json(&p), depth == 100, "{depth} levels");
            assert_eq!(
                TrainerState::read(&p).is_some(),
                depth == 100,
                "{depth} levels, read"
            );
        }
        assert!(!is_whole_json(&dir.path().join("missing")));
        assert!(!is_whole_json(dir.path()));
    }
}
