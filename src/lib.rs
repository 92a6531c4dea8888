//! # ckvc: version control for training checkpoints
//!
//! ckvc keeps the checkpoints of a training run the way git keeps source:
//! each checkpoint directory is a commit, every tensor is cut into
//! content-addressed chunks (blake3 of the raw bytes) and each chunk is stored
//! once, encoded by a lossless codec built for floating-point tensors.
//!
//! The crate is layered; imports point down only:
//!
//! | module | owns |
//! |---|---|
//! | [`codec`] | the chunk codec: bytes in, bytes out, no I/O |
//! | [`format`] | checkpoint files <-> tensors and opaque byte segments |
//! | [`store`] | the object database: key spaces, atomic batches, locking (RocksDB behind a trait) |
//! | [`repo`] | the user's verbs: init, commit, log, checkout, branch, tag, show, diff, status |
//! | [`remote`] | shared storage: push, fetch, pull, clone to a directory or an S3-compatible bucket |
//!
//! The command-line interface and the benchmarks live only in the binary
//! (`src/main.rs`, `src/cli/`, feature `cli`): the library never prints.
//! Feature `git` (default) records the training code's git commit in each
//! commit; feature `testing` exposes the helpers the tests use.
//!
//! ```
//! use ckvc::codec::{decode, encode, DType, Options};
//! let weights: Vec<u8> = (0..1000u32)
//!     .flat_map(|i| half::bf16::from_f32((i as f32 * 0.37).sin() * 0.02).to_le_bytes())
//!     .collect();
//! let frame = encode(&weights, None, DType::BF16, &Options::default());
//! assert!(frame.len() < weights.len());
//! assert_eq!(decode(&frame, None).unwrap(), weights);
//! ```

// The library never prints (the CLI does) and never unwraps outside tests:
// an invariant gets `expect("why")`, anything input-dependent an error.
#![deny(clippy::print_stdout, clippy::print_stderr, clippy::dbg_macro)]
#![deny(clippy::unwrap_used)]

pub mod codec;
pub mod format;
pub mod remote;
pub mod repo;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
