//! The data directory's manifest and lock.
//!
//! The manifest records what must never change for the life of a directory: its format
//! version and its shard count (and, later, a slot map). It is written once, atomically
//! (temporary file, fsync, rename, fsync of the directory).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::OpenError;

/// The manifest's file name inside the data directory.
pub const MANIFEST_FILE: &str = "oncegate.manifest.toml";
/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "oncegate.lock";
/// The only manifest format this version reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The routing algorithm, named so a later version can refuse a directory routed another way.
pub const ROUTING: &str = "xxh3-64/len-prefixed/slots-16384/mod-shards";

/// What a data directory records about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The format of the manifest and of the shard files.
    pub format_version: u32,
    /// The number of shards; fixed at creation.
    pub shards: u32,
    /// How keys map to shards.
    pub routing: String,
}

/// The shard file name for a shard number: `shard-NNNN.sqlite`.
pub fn shard_file(data_dir: &Path, shard: u32) -> PathBuf {
    data_dir.join(format!("shard-{shard:04}.sqlite"))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OpenError + '_ {
    move |source| OpenError::Io { path: path.to_owned(), source }
}

/// Takes the directory's exclusive lock; the lock lasts as long as the returned file.
pub fn lock(data_dir: &Path) -> Result<File, OpenError> {
    fs::create_dir_all(data_dir).map_err(io(data_dir))?;
    let path = data_dir.join(LOCK_FILE);
    let file = OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(OpenError::Locked { path }),
        Err(fs::TryLockError::Error(source)) => Err(OpenError::Io { path, source }),
    }
}

/// Reads the manifest, or creates it for a new directory, and checks the shard count.
pub fn open_or_create(data_dir: &Path, shards: u32) -> Result<Manifest, OpenError> {
    let path = data_dir.join(MANIFEST_FILE);
    match fs::read_to_string(&path) {
        Ok(text) => {
            let manifest: Manifest = toml::from_str(&text)
                .map_err(|e| OpenError::Manifest { path: path.clone(), reason: e.message().to_owned() })?;
            if manifest.format_version != FORMAT_VERSION {
                return Err(OpenError::Manifest {
                    path,
                    reason: format!(
                        "format_version is {}; this version reads {FORMAT_VERSION}",
                        manifest.format_version
                    ),
                });
            }
            if manifest.routing != ROUTING {
                return Err(OpenError::Manifest {
                    path,
                    reason: format!("routing is {:?}; this version routes by {ROUTING:?}", manifest.routing),
                });
            }
            if manifest.shards != shards {
                return Err(OpenError::ShardCount {
                    path: data_dir.to_owned(),
                    found: manifest.shards,
                    configured: shards,
                });
            }
            Ok(manifest)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let manifest = Manifest { format_version: FORMAT_VERSION, shards, routing: ROUTING.to_owned() };
            let text = format!(
                "# Written once when this data directory was created; never edit it.\n{}",
                toml::to_string(&manifest).expect("the manifest serialises")
            );
            let tmp = data_dir.join(format!("{MANIFEST_FILE}.tmp"));
            let mut file = File::create(&tmp).map_err(io(&tmp))?;
            file.write_all(text.as_bytes()).map_err(io(&tmp))?;
            file.sync_all().map_err(io(&tmp))?;
            fs::rename(&tmp, &path).map_err(io(&path))?;
            File::open(data_dir).and_then(|dir| dir.sync_all()).map_err(io(data_dir))?;
            Ok(manifest)
        }
        Err(source) => Err(OpenError::Io { path, source }),
    }
}
