//! An online backup: a consistent copy of every shard file, taken while the engine
//! serves, with the directory's manifest, slot map and token epochs beside it. Restoring
//! is starting a server on the copy.
//!
//! Each shard file is copied by SQLite's `VACUUM INTO` on a connection of its own: one
//! read transaction, so the copy is the file as of one commit, and the shard's writes go
//! on meanwhile (a reader in WAL mode blocks neither the writer nor, beyond its snapshot,
//! the checkpointer). Every commit acknowledged before the backup began is in the copy.
//! Shards are copied one after another, each at its own instant; keys never span shards,
//! so each key is as of one commit. The slot map must not change meanwhile: a backup is
//! refused while slots move, and an add-shards while a backup runs. The copy's token
//! epochs are the original's at the end of the copy; a server started on it opens above
//! every epoch the original used since, by the clock floor (`token.rs`).

use std::path::{Path, PathBuf};

use super::Engine;
use super::error::BackupError;
use crate::files::{Files, write_atomically};
use crate::placement::{manifest, slots};

/// What a backup copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackedUp {
    /// The shards copied.
    pub shards: u32,
    /// The bytes of the shard files' copies.
    pub bytes: u64,
    /// Where the copy is.
    pub to: PathBuf,
}

impl Engine {
    /// Copies every shard file and the directory's own files into the new directory
    /// `to` while the engine serves; calls `progress(shards_copied, shards)` after each
    /// shard. Refused on PostgreSQL (the database has its own backups), while slots move,
    /// and when `to` exists and is not empty.
    pub fn backup(&self, to: &Path, progress: &mut dyn FnMut(u32, u32)) -> Result<BackedUp, BackupError> {
        let inner = &self.inner;
        if inner.cx.postgres.is_some() {
            return Err(BackupError::Unsupported {
                what: "a node on PostgreSQL keeps no records of its own: back up the database instead",
            });
        }
        // The slot map stays as it is until the copy is done.
        let _no_moves = inner
            .map_unchanged()
            .ok_or(BackupError::Busy { what: "an add-shards or another backup is running on this server" })?;
        if inner.table().moving.is_some() {
            return Err(BackupError::Busy { what: "a slot is moving" });
        }
        let files = &*inner.cx.files;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| BackupError::Io { path, source }
        };
        match files.list(to) {
            Ok(names) if !names.is_empty() => return Err(BackupError::NotEmpty { path: to.to_owned() }),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(to)(e)),
        }
        files.create_dir_all(to).map_err(io(to))?;
        let dir = &inner.cx.config.data_dir;
        let shards = inner.handles().len() as u32;
        let mut bytes = 0;
        progress(0, shards);
        for shard in 0..shards {
            let copy = manifest::shard_file(to, shard);
            // Owner-only before SQLite writes it (it would create it 0644).
            files.create(&copy).map_err(io(&copy))?;
            bytes +=
                crate::store::sqlite::copy_file(&manifest::shard_file(dir, shard), &copy, files.sqlite_vfs())
                    .map_err(|source| BackupError::Copy { shard, source })?;
            files.sync_file(&copy).map_err(io(&copy))?;
            progress(shard + 1, shards);
        }
        for name in [manifest::MANIFEST_FILE.to_owned(), slots::SLOTS_FILE.to_owned()]
            .into_iter()
            .chain((0..shards).map(|shard| file_name(&manifest::epoch_file(dir, shard))))
        {
            copy_small(files, &dir.join(&name), &to.join(&name))?;
        }
        files.sync_dir(to).map_err(io(to))?;
        tracing::info!(to = %to.display(), shards, bytes, "backup written");
        Ok(BackedUp { shards, bytes, to: to.to_owned() })
    }
}

/// The last component of `path`.
fn file_name(path: &Path) -> String {
    path.file_name().unwrap_or_default().to_string_lossy().into_owned()
}

/// Copies a small file of the directory (the manifest, the map, an epoch), durably; one
/// that does not exist (a directory without a slot map yet) is skipped.
fn copy_small(files: &dyn Files, from: &Path, to: &Path) -> Result<(), BackupError> {
    match files.read(from) {
        Ok(bytes) => write_atomically(files, to, &bytes)
            .map_err(|source| BackupError::Io { path: to.to_owned(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BackupError::Io { path: from.to_owned(), source }),
    }
}
