//! A simulated disk under oncegate's engine, and the power-loss harness that cuts its
//! power.
//!
//! Tests that kill the process keep the operating system's page cache, so they cannot
//! see a missing, misplaced or misordered fsync. Here every byte the engine writes (its
//! SQLite files through a VFS, its manifest and epoch files through the `Files` seam)
//! lands on a [`Disk`] that keeps what was synced apart from what was only written, and
//! a cut keeps only the former (or, torn, a random part of the latter too). The
//! [`harness`] runs traffic, cuts, reopens and checks every acknowledged call.

pub mod disk;
pub mod harness;
mod vfs;

pub use disk::{Cut, Disk, DiskStats};
