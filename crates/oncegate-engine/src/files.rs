//! How the engine creates its directory and files: owner-only, because they hold
//! customers' keys and the responses stored for them. Modes apply when a file or
//! directory is created; what an operator made beforehand is left alone (and a loose
//! data directory is reported at open).

use std::fs::{DirBuilder, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The mode of the data directory and any parent the engine creates.
pub const DIR_MODE: u32 = 0o700;
/// The mode of every file the engine creates.
pub const FILE_MODE: u32 = 0o600;

/// Creates `path` and its missing parents, owner-only.
pub(crate) fn create_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(DIR_MODE).create(path)
}

/// Options that create a file owner-only; the caller adds read, write and truncation.
pub(crate) fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.mode(FILE_MODE);
    options
}

/// Creates `path` empty and owner-only if it does not exist. SQLite gives a database's
/// `-wal` and `-shm` files the database file's mode, so creating the shard file first is
/// what keeps those owner-only too (SQLite alone would create all three as 0644).
pub(crate) fn create_file(path: &Path) -> io::Result<()> {
    options().write(true).create(true).truncate(false).open(path).map(drop)?;
    restrict(path)?;
    // An existing journal keeps the mode it was created with.
    for suffix in ["-wal", "-shm"] {
        let mut companion = path.as_os_str().to_owned();
        companion.push(suffix);
        restrict(Path::new(&companion))?;
    }
    Ok(())
}

/// Takes group and other access away from a file made before modes were enforced (by
/// an older version, or by hand), if it exists.
pub(crate) fn restrict(path: &Path) -> io::Result<()> {
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

/// The mode bits of `path` that give its group or others any access, if there are any.
pub(crate) fn shared_bits(path: &Path) -> io::Result<Option<u32>> {
    let bits = std::fs::metadata(path)?.permissions().mode() & 0o077;
    Ok((bits != 0).then_some(bits))
}
