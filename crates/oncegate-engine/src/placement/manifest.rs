//! The data directory's files beside the shard files: the manifest, the lock and the
//! token epochs.
//!
//! The manifest records what must not change behind the directory's back: its format
//! version, its shard count and how keys are routed (by the slot map in `slots.rs`, since
//! this version; by `slot % shards` before). It is rewritten only to move a directory
//! from the computed routing to its slot map. A directory
//! that holds shard files but no manifest is refused, never given a new one: the shard
//! count decides where every key lives, and a guess would route completed keys to
//! shards that have never seen them.
//!
//! Each shard's token epoch (see `token.rs`) is its own small file. Every file here is
//! written the same way (`files::write_atomically`): temporary file, fsync, rename, fsync
//! of the directory, so a crash leaves the old or the new contents, never a mix. All of it
//! goes through the `Files` seam, so the power-loss harness sees these writes too.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use oncegate_core::route::Routing;

use super::LayoutError;
use crate::files::{Files, LockGuard, write_atomically};
use crate::placement::slots::{self, SlotMap};

/// The manifest's file name inside the data directory.
pub const MANIFEST_FILE: &str = "oncegate.manifest.toml";
/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "oncegate.lock";
/// The node's name in a shared PostgreSQL store.
pub const NODE_FILE: &str = "oncegate.node";
/// The only manifest format this version reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The routing algorithm of new directories, named so a later version can refuse a
/// directory routed another way: the scope's hash onto 16,384 slots (a derived key's slot
/// from its text before `::bucket`, `Routing::BucketBase`), and the slot map's owner of
/// each slot.
pub const ROUTING: &str = "xxh3-64/len-prefixed/slots-16384/slot-map/bucket-base";
/// The routing of directories made with a slot map but before bucket routing: every
/// key's slot from its whole text (`Routing::WholeKey`). They keep it, since a key of
/// theirs that happens to end `::digits` would otherwise be looked for on another shard.
pub const ROUTING_WHOLE_KEY: &str = "xxh3-64/len-prefixed/slots-16384/slot-map";
/// The routing of directories made before the slot map: the owner of a slot was
/// `slot % shards`. Such a directory is given exactly that map when it opens.
pub const ROUTING_COMPUTED: &str = "xxh3-64/len-prefixed/slots-16384/mod-shards";

/// What a data directory records about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The format of the manifest and of the shard files.
    pub format_version: u32,
    /// The number of shards (raised only by adding shards, `engine/resize.rs`).
    pub shards: u32,
    /// How keys map to shards.
    pub routing: String,
}

impl Manifest {
    /// How this directory hashes keys onto slots.
    pub fn key_routing(&self) -> Routing {
        if self.routing == ROUTING { Routing::BucketBase } else { Routing::WholeKey }
    }
}

/// The shard file name for a shard number: `shard-NNNN.sqlite`.
pub fn shard_file(data_dir: &Path, shard: u32) -> PathBuf {
    data_dir.join(format!("shard-{shard:04}.sqlite"))
}

/// The token epoch file of a shard: `shard-NNNN.epoch`.
pub fn epoch_file(data_dir: &Path, shard: u32) -> PathBuf {
    data_dir.join(format!("shard-{shard:04}.epoch"))
}

/// Reads a shard's token epoch; `None` when the file does not exist.
pub fn read_epoch(files: &dyn Files, path: &Path) -> std::io::Result<Option<u64>> {
    match files.read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            text.trim().parse().map(Some).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("token epoch {text:?}: {e}"))
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Persists a shard's token epoch; returns only once it is durable.
pub fn write_epoch(files: &dyn Files, path: &Path, epoch: u64) -> std::io::Result<()> {
    write_atomically(files, path, format!("{epoch}\n").as_bytes())
}

/// The node's name in a shared PostgreSQL store (its rows of the clock table are named
/// after it): made once per data directory, so that a restarted node takes up its own
/// rows again and two nodes never share one.
pub fn node_name(files: &dyn Files, data_dir: &Path) -> Result<String, LayoutError> {
    let path = data_dir.join(NODE_FILE);
    match files.read(&path) {
        Ok(bytes) => {
            let name = String::from_utf8_lossy(&bytes).trim().to_owned();
            if !name.is_empty() {
                return Ok(name);
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&path)(e)),
    }
    // Unique enough for a handful of nodes: the directory, the process and the instant.
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let seed = format!("{}:{}:{nanos}", data_dir.display(), std::process::id());
    let name = format!("node-{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()));
    write_atomically(files, &path, format!("{name}\n").as_bytes()).map_err(io(&path))?;
    Ok(name)
}

/// Checks that `config`'s store kind (SQLite unless configured) may open its data
/// directory, and returns it. Refused, before anything is created: a directory whose records another store holds (SQLite
/// shards under PostgreSQL, a PostgreSQL node's name under SQLite), and one holding a
/// shard of the log store that earlier versions wrote, which this version cannot read:
/// opened under the wrong store, its records would be invisible and their keys granted
/// again. Called with the directory's lock held, so that no other process creates
/// shards between the look and the open.
pub fn check_store_kind(
    files: &dyn Files,
    config: &crate::config::EngineConfig,
) -> Result<crate::config::StoreKind, LayoutError> {
    use crate::config::StoreKind::{Postgres, Sqlite};
    let dir = &config.data_dir;
    let shards = shard_names(files, dir)?;
    if let Some(log) = shards.iter().find(|name| name.ends_with(LOG_SHARD_SUFFIX)) {
        return Err(LayoutError::LogStore { dir: dir.clone(), example: log.clone() });
    }
    let node = is_node_dir(files, dir)?;
    let configured = format!("\"{}\"", config.store.kind().name());
    let refuse = |found: crate::config::StoreKind, example: &str| LayoutError::OtherStore {
        dir: dir.clone(),
        found: found.name(),
        example: example.to_owned(),
        configured: configured.clone(),
    };
    match (config.store.kind(), shards.first()) {
        (Postgres, Some(name)) => Err(refuse(Sqlite, name)),
        (Postgres, None) => Ok(Postgres),
        (Sqlite, _) if node => Err(refuse(Postgres, NODE_FILE)),
        (Sqlite, _) => Ok(Sqlite),
    }
}

/// Whether `dir` is a PostgreSQL node's directory (it holds the node's name, and no
/// records of its own).
pub(crate) fn is_node_dir(files: &dyn Files, dir: &Path) -> Result<bool, LayoutError> {
    let path = dir.join(NODE_FILE);
    match files.read(&path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(&path)(e)),
    }
}

/// The name ending of a shard of the log store that versions before SQLite-only wrote
/// (`shard-NNNN.log`, a directory of segment files).
const LOG_SHARD_SUFFIX: &str = ".log";

/// How many shards (`shard-*.sqlite` files) a data directory holds.
fn shard_file_count(files: &dyn Files, data_dir: &Path) -> Result<usize, LayoutError> {
    Ok(shard_names(files, data_dir)?.iter().filter(|name| name.ends_with(".sqlite")).count())
}

/// The shards in a data directory (none when it does not exist), sorted:
/// `shard-*.sqlite` files, and `shard-*.log` directories of the log store.
fn shard_names(files: &dyn Files, data_dir: &Path) -> Result<Vec<String>, LayoutError> {
    let names = match files.list(data_dir) {
        Ok(names) => names,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(data_dir)(e)),
    };
    let is_shard = |name: &str| {
        name.strip_prefix("shard-")
            .is_some_and(|rest| rest.ends_with(".sqlite") || rest.ends_with(LOG_SHARD_SUFFIX))
    };
    // Sorted, so that the shard an error names is the same from one run to the next.
    let mut shards: Vec<_> = names.into_iter().filter(|name| is_shard(name)).collect();
    shards.sort();
    Ok(shards)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LayoutError + '_ {
    move |source| LayoutError::Io { path: path.to_owned(), source }
}

/// Takes the directory's exclusive lock; the lock lasts as long as the returned guard.
/// Files an older version (or an operator) made readable by others are made owner-only
/// by the process that owns the directory.
pub fn lock(files: &dyn Files, data_dir: &Path) -> Result<LockGuard, LayoutError> {
    files.create_dir_all(data_dir).map_err(io(data_dir))?;
    let path = data_dir.join(LOCK_FILE);
    let guard =
        files.lock(&path).map_err(io(&path))?.ok_or_else(|| LayoutError::Locked { path: path.clone() })?;
    files.restrict(&path).map_err(io(&path))?;
    let manifest = data_dir.join(MANIFEST_FILE);
    files.restrict(&manifest).map_err(io(&manifest))?;
    Ok(guard)
}

/// Reads the manifest and the slot map, or creates both for a new directory, checks the
/// shard count, and gives a directory routed by `slot % shards` its slot map. Returns the
/// map, the directory's shard count (at least `shards`: a directory that has grown past
/// the configured count opens with all of its shards) and how it routes keys.
pub fn open_or_create(
    files: &dyn Files,
    data_dir: &Path,
    shards: u32,
) -> Result<(SlotMap, u32, Routing), LayoutError> {
    let (manifest, new) = read_or_new(files, data_dir, shards)?;
    let shards = manifest.shards;
    // A map in a new directory is a creation's that did not reach its manifest.
    let found = if new { None } else { slots::read(files, data_dir, shards)? };
    if manifest.routing != ROUTING_COMPUTED {
        // After a slot has moved, no computed map is right: a lost map is never guessed.
        let map = found.ok_or_else(|| LayoutError::SlotMapMissing { path: slots::path(data_dir) })?;
        return Ok((map, shards, manifest.key_routing()));
    }
    // Routed by `slot % shards` until now: the map is that, exactly. A map file already
    // there was written by an upgrade that did not reach the manifest; nothing can have
    // moved since, so it must be the computed one.
    let map = SlotMap::even(shards);
    if found.as_ref().is_some_and(|found| *found != map) {
        let reason = format!("the manifest routes by {ROUTING_COMPUTED}, and this map is not that routing");
        return Err(slots::SlotMapError::Damaged { path: slots::path(data_dir), reason }.into());
    }
    // The map is durable before the manifest names it, so a crash between the two
    // leaves a directory that still opens (by the first branch, or this one again). A
    // new directory takes the same path: its manifest is written once, naming the map
    // and bucket routing; an old one keeps routing whole keys.
    slots::write(files, data_dir, &map)?;
    let routing = if new { ROUTING } else { ROUTING_WHOLE_KEY };
    let manifest = Manifest { routing: routing.to_owned(), ..manifest };
    write_manifest(files, &data_dir.join(MANIFEST_FILE), &manifest)?;
    Ok((map, shards, manifest.key_routing()))
}

fn write_manifest(files: &dyn Files, path: &Path, manifest: &Manifest) -> Result<(), LayoutError> {
    let text = format!(
        "# Written by oncegate when this data directory was created or upgraded; never edit it.\n{}",
        toml::to_string(manifest).expect("the manifest serialises")
    );
    write_atomically(files, path, text.as_bytes()).map_err(io(path))
}

/// Reads the manifest, or makes one (not yet written, routed by the computed map, which
/// [`open_or_create`] turns into the slot map) for a new directory; says which.
fn read_or_new(files: &dyn Files, data_dir: &Path, shards: u32) -> Result<(Manifest, bool), LayoutError> {
    let path = data_dir.join(MANIFEST_FILE);
    if let Some(manifest) = read(files, data_dir)? {
        if manifest.shards < shards {
            return Err(LayoutError::ShardCount {
                path: data_dir.to_owned(),
                found: manifest.shards,
                configured: shards,
            });
        }
        return Ok((manifest, false));
    }
    let shard_files = shard_file_count(files, data_dir)?;
    if shard_files > 0 {
        return Err(LayoutError::ManifestMissing { path, shard_files });
    }
    Ok((Manifest { format_version: FORMAT_VERSION, shards, routing: ROUTING_COMPUTED.to_owned() }, true))
}

/// Reads and checks the manifest; `None` when the directory has none.
pub fn read(files: &dyn Files, data_dir: &Path) -> Result<Option<Manifest>, LayoutError> {
    let path = data_dir.join(MANIFEST_FILE);
    let bytes = match files.read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(LayoutError::Io { path, source }),
    };
    let text = String::from_utf8_lossy(&bytes);
    let manifest: Manifest = toml::from_str(&text)
        .map_err(|e| LayoutError::Manifest { path: path.clone(), reason: e.message().to_owned() })?;
    if manifest.format_version != FORMAT_VERSION {
        let reason =
            format!("format_version is {}; this version reads {FORMAT_VERSION}", manifest.format_version);
        return Err(LayoutError::Manifest { path, reason });
    }
    if ![ROUTING, ROUTING_WHOLE_KEY, ROUTING_COMPUTED].contains(&manifest.routing.as_str()) {
        let reason = format!("routing is {:?}; this version routes by {ROUTING:?}", manifest.routing);
        return Err(LayoutError::Manifest { path, reason });
    }
    Ok(Some(manifest))
}

/// Records a new shard count (adding shards: the new shards own no slot until the map
/// gives them some).
pub(crate) fn set_shards(
    files: &dyn Files,
    data_dir: &Path,
    manifest: &Manifest,
    shards: u32,
) -> Result<(), LayoutError> {
    write_manifest(files, &data_dir.join(MANIFEST_FILE), &Manifest { shards, ..manifest.clone() })
}
