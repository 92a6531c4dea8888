//! The chunk codec (being written).
mod dtype;
pub use dtype::DType;
