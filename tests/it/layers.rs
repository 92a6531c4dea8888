//! The library's layers import downwards only (`docs/architecture.md`):
//! codec <- format <- store <- repo <- remote, and the CLI above them all.
//! Checked on the source text: every `crate::<module>` path and every
//! `use crate::{..}` group in a layer's files must name that layer or one
//! below it (or the test helpers, under `#[cfg(test)]`).

use std::collections::BTreeSet;
use std::path::Path;

/// What each layer may name, besides itself.
const BELOW: &[(&str, &[&str])] = &[
    ("codec", &[]),
    ("format", &["codec"]),
    ("store", &[]),
    ("repo", &["codec", "format", "store"]),
    // The store's ids (`ChunkId`, `CommitId`) are the remote's vocabulary too.
    ("remote", &["codec", "format", "store", "repo"]),
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level modules a file names through `crate::`.
fn crate_modules(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a, b::c, d::{e, f}}`: the first segment of each
            // top-level item.
            let (mut depth, mut start) = (0usize, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_ascii_alphanumeric() || c == '_') => {
                        found.insert(ident(&group[j..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found
}

#[test]
fn library_layers_import_only_from_layers_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    for (layer, below) in BELOW {
        let mut files = Vec::new();
        rust_files(&src.join(layer), &mut files);
        assert!(!files.is_empty(), "src/{layer} has sources");
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for m in crate_modules(&text) {
                if m != *layer && m != "testing" && !below.contains(&m.as_str()) {
                    wrong.push(format!("{} names crate::{m}", f.display()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layering: {wrong:#?}");
}

#[test]
fn the_layer_check_sees_grouped_and_nested_imports() {
    let m = crate_modules("use crate::{codec::{a, b}, store::X};\nlet x = crate::repo::f();");
    assert_eq!(
        m.into_iter().collect::<Vec<_>>(),
        ["codec", "repo", "store"]
    );
}
