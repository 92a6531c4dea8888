//! Progress reports of long operations (commit, checkout, push, fetch):
//! the library never prints, it calls a [`Progress`] the caller gives, and
//! the CLI draws bars from those calls.

/// What a long operation reports while it runs. Called from the worker
/// threads of the operation, so implementations must be `Sync`.
pub trait Progress: Sync {
    /// A new phase (`"commit"`, `"checkout"`, `"upload"`, `"download"`,
    /// `"verify"`) and its totals (0 when unknown).
    fn start(&self, _phase: &str, _total_bytes: u64, _total_items: u64) {}
    /// Work done since the last call.
    fn advance(&self, _bytes: u64, _items: u64) {}
    /// The phase ended.
    fn finish(&self) {}
}

/// No progress reporting.
pub struct NoProgress;
impl Progress for NoProgress {}
