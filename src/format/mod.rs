//! Checkpoint file formats (placeholder: being written).
