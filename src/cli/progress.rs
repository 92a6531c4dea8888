//! Progress bars on stderr for long operations (commit, checkout, push,
//! fetch, pull, clone), drawn from the library's [`Progress`] calls. They
//! show only when stderr is a terminal (indicatif draws nothing otherwise),
//! so scripts and `--json` output are never mixed with them.

use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};

use ckvc::repo::Progress;

use super::repo::human;

/// What the bar counts.
#[derive(Clone, Copy)]
enum Unit {
    /// Objects (packs, chunks) on the bar; bytes and rate beside it.
    Objects,
    /// Bytes on the bar (commit, checkout); files and rate beside it.
    Bytes,
}

/// A progress bar per phase, on stderr.
pub struct Bars {
    unit: Unit,
    /// The bar, and the bytes and items done in its phase.
    bar: Mutex<Option<(ProgressBar, u64, u64)>>,
}

impl Bars {
    /// Bars counting objects (transfers).
    pub fn objects() -> Self {
        Bars {
            unit: Unit::Objects,
            bar: Mutex::new(None),
        }
    }

    /// Bars counting bytes (commit, checkout).
    pub fn bytes() -> Self {
        Bars {
            unit: Unit::Bytes,
            bar: Mutex::new(None),
        }
    }
}

impl Progress for Bars {
    fn start(&self, phase: &str, total_bytes: u64, total_items: u64) {
        let (len, template) = match self.unit {
            Unit::Objects => (
                total_items,
                "{prefix:>8} [{bar:30}] {pos}/{len} objects  {msg}  {elapsed}",
            ),
            Unit::Bytes => (
                total_bytes,
                "{prefix:>8} [{bar:30}] {bytes}/{total_bytes}  {msg}  {elapsed}",
            ),
        };
        let pb = ProgressBar::new(len);
        pb.set_style(
            ProgressStyle::with_template(template)
                .expect("a valid template")
                .progress_chars("=> "),
        );
        pb.set_prefix(phase.to_string());
        if let Ok(mut b) = self.bar.lock() {
            *b = Some((pb, 0, 0));
        }
    }

    fn advance(&self, bytes: u64, items: u64) {
        if let Ok(mut b) = self.bar.lock() {
            if let Some((pb, total, count)) = b.as_mut() {
                *total += bytes;
                *count += items;
                let secs = pb.elapsed().as_secs_f64().max(1e-3);
                let rate = human((*total as f64 / secs) as u64);
                match self.unit {
                    Unit::Objects => {
                        pb.inc(items);
                        pb.set_message(format!("{} ({rate}/s)", human(*total)));
                    }
                    Unit::Bytes => {
                        pb.inc(bytes);
                        pb.set_message(format!("{count} files ({rate}/s)"));
                    }
                }
            }
        }
    }

    fn finish(&self) {
        if let Ok(mut b) = self.bar.lock() {
            if let Some((pb, _, _)) = b.take() {
                pb.finish_and_clear();
            }
        }
    }
}
