//! The file operations the engine performs outside SQLite, behind one seam: the
//! operating system's by default ([`OsFiles`]), a simulated disk in the power-loss
//! harness (the `oncegate-simdisk` crate), which also names the SQLite VFS that the shard
//! files are opened with. The seam is primitive on purpose (write, sync, rename, sync the
//! directory), so that the order of the engine's syncs is what the harness checks, not
//! what an implementation of the seam happens to do.
//!
//! On the operating system, directories (and parents the engine creates) are 0700 and
//! files 0600: they hold customers' keys and the responses stored for them. Modes apply
//! when a file or directory is created; files an older version left readable by others
//! are made owner-only when the engine takes the directory.

use std::any::Any;
use std::fs::{DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The mode of the data directory and any parent the engine creates.
pub const DIR_MODE: u32 = 0o700;
/// The mode of every file the engine creates.
pub const FILE_MODE: u32 = 0o600;

/// A held directory lock; dropping it releases the lock.
pub type LockGuard = Box<dyn Any + Send + Sync>;

/// The file operations of the engine outside SQLite, and the SQLite VFS of its shard
/// files. Nothing written is durable until synced: a file's contents by
/// [`Files::sync_file`], its name (creation, rename, removal) by [`Files::sync_dir`] of
/// its directory.
pub trait Files: Send + Sync + std::fmt::Debug + 'static {
    /// Creates `dir` and its missing parents, owner-only, and makes each new name durable.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The contents of a file; `ErrorKind::NotFound` when there is none.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Creates `path` owner-only (it must not exist) holding `bytes`.
    fn write_new(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Creates `path` empty and owner-only unless it exists; returns whether it did.
    fn create(&self, path: &Path) -> io::Result<bool>;
    /// Makes a file's contents durable.
    fn sync_file(&self, path: &Path) -> io::Result<()>;
    /// Renames `from` over `to`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file; one that does not exist is not an error.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes the names in `dir` (files created, renamed or removed there) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// The names of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Takes the exclusive lock on the file at `path` (made if missing) for this process;
    /// `Ok(None)` when another holds it.
    fn lock(&self, path: &Path) -> io::Result<Option<LockGuard>>;
    /// Takes group and other access away from a file made before modes were enforced.
    fn restrict(&self, path: &Path) -> io::Result<()>;
    /// Drops a file's clean pages from the page cache (`posix_fadvise(DONTNEED)`), so
    /// that reads after it come from the device; a file that does not exist is not an
    /// error. Pages not yet written back are kept (and their writeback started), so
    /// nothing written is lost; the pages it drops are those a failed writeback left
    /// marked clean, which hold what the device may not. Best effort on Linux: a page
    /// locked or under writeback at the call is kept, unreported.
    fn drop_cached(&self, path: &Path) -> io::Result<()>;
    /// The SQLite VFS that shard files are opened with; `None` is SQLite's default.
    fn sqlite_vfs(&self) -> Option<&str> {
        None
    }
}

/// The operating system's files.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsFiles;

/// A data directory's lock file, locked (`flock`), unlocked explicitly when dropped. The
/// lock belongs to the open file, which a child process forked at that moment (by
/// anything else in the process) shares until it execs: closing the file alone would
/// leave the directory locked for that instant, and an open right after the owner's
/// drop could find it locked (an engine test did, when parallel tests spawned
/// processes).
struct DirectoryLock(std::fs::File);

impl Drop for DirectoryLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.mode(FILE_MODE);
    options
}

impl Files for OsFiles {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        // The missing ancestors, outermost first: each new name is synced in its parent,
        // or a power cut could take a new data directory, and everything in it, away.
        let missing: Vec<&Path> =
            dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !d.exists()).collect();
        DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)?;
        for created in missing.into_iter().rev() {
            self.sync_dir(parent_of(created))?;
        }
        if let Some(bits) = shared_bits(dir)? {
            tracing::warn!(
                data_dir = %dir.display(),
                mode = format!("{bits:03o}"),
                "the data directory gives its group or others access; keys and stored responses are customer data (chmod 700 it)"
            );
        }
        Ok(())
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn write_new(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        options().write(true).create_new(true).open(path)?.write_all(bytes)
    }

    fn create(&self, path: &Path) -> io::Result<bool> {
        match options().write(true).create_new(true).open(path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        std::fs::File::open(path)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        match std::fs::File::open(dir)?.sync_all() {
            // Some file systems cannot sync a directory and say so; their names are then as
            // durable as they make them, which is all that can be asked. The operator hears
            // it once: every new or renamed file's durability rests on it.
            Err(e) if e.raw_os_error() == Some(22) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(dir = %dir.display(), "this file system cannot sync directories; new and renamed files are as durable as it makes them");
                });
                Ok(())
            }
            other => other,
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn lock(&self, path: &Path) -> io::Result<Option<LockGuard>> {
        let file = options().create(true).truncate(false).write(true).open(path)?;
        match file.try_lock() {
            Ok(()) => Ok(Some(Box::new(DirectoryLock(file)))),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }

    fn drop_cached(&self, path: &Path) -> io::Result<()> {
        match std::fs::File::open(path) {
            Ok(file) => {
                rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).map_err(io::Error::from)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// SQLite's `unix-excl`: the unix VFS, with the file locked against other processes
    /// (one process owns a data directory anyway) and the WAL index in this process's
    /// memory instead of a mapped `-shm` file. A mapped index on a full disk is written
    /// through the mapping, where the kernel answers a page it cannot allocate with
    /// SIGBUS (seen on ext4 with blocks smaller than a page, after a crash, when the
    /// index is rebuilt), and it needed disk space to open at all. The shard's connection
    /// and its checkpointer's, in one process, share the index as before.
    fn sqlite_vfs(&self) -> Option<&str> {
        Some("unix-excl")
    }

    fn restrict(&self, path: &Path) -> io::Result<()> {
        match std::fs::metadata(path) {
            Ok(meta) if meta.permissions().mode() & 0o077 != 0 => {
                tracing::info!(path = %path.display(), "made owner-only (mode 600)");
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(FILE_MODE))
            }
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The directory holding `path` (`.` for a bare name).
pub(crate) fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The mode bits of `path` that give its group or others any access, if there are any.
fn shared_bits(path: &Path) -> io::Result<Option<u32>> {
    let bits = std::fs::metadata(path)?.permissions().mode() & 0o077;
    Ok((bits != 0).then_some(bits))
}

/// Writes `bytes` to `path` so that a crash or power cut leaves either the old file or
/// the new one: a new temporary file, synced, renamed over, and the directory synced. A
/// temporary file a crash left behind is removed first.
pub fn write_atomically(files: &dyn Files, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = parent_of(path);
    let mut tmp_name = path.file_name().unwrap_or_default().to_owned();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    files.remove(&tmp)?;
    files.write_new(&tmp, bytes)?;
    files.sync_file(&tmp)?;
    files.rename(&tmp, path)?;
    files.sync_dir(dir)
}

/// Creates a shard file owner-only before SQLite opens it (SQLite gives the `-wal` file
/// the database file's mode, and would create both as 0644), and makes
/// its name durable: SQLite syncs the directory for a new journal or WAL, never for the
/// database file it is handed.
pub(crate) fn create_shard_file(files: &dyn Files, path: &Path) -> io::Result<()> {
    if files.create(path)? {
        files.sync_dir(parent_of(path))?;
    }
    files.restrict(path)?;
    // An existing journal keeps the mode it was created with.
    files.restrict(&companion(path, "-wal"))
}

/// A file SQLite keeps beside a shard file: `suffix` is `-wal`.
pub(crate) fn companion(path: &Path, suffix: &str) -> std::path::PathBuf {
    let mut companion = path.as_os_str().to_owned();
    companion.push(suffix);
    companion.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory's lock is released when its guard drops, even while another reference
    /// to the same open file lives on, as a child process forked at that moment holds one
    /// until it execs. (Closing alone left the directory locked: an engine test reopening
    /// a directory while parallel tests spawned processes found it `Locked`.)
    #[test]
    fn a_dropped_lock_is_released_while_the_file_is_still_shared() {
        let dir = tempfile::tempdir().unwrap();
        let guard = OsFiles.lock(&dir.path().join("lock")).unwrap().expect("the directory is free");
        let lock = guard.downcast_ref::<DirectoryLock>().expect("the lock file");
        let shared = lock.0.try_clone().unwrap();
        assert!(OsFiles.lock(&dir.path().join("lock")).unwrap().is_none(), "held");
        drop(guard);
        assert!(OsFiles.lock(&dir.path().join("lock")).unwrap().is_some(), "released while `shared` is open");
        drop(shared);
    }
}
