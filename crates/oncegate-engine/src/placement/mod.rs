//! The data directory's layout: which shards it has and how keys reach them (the
//! manifest), which shard owns each slot (the slot map), and the token epochs that keep
//! every grant above every earlier one. It reads and writes through `files` only.

mod error;
pub mod manifest;
pub mod slots;
pub mod token;

pub use error::LayoutError;
