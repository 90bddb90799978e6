//! The simulated disk: files and directories in memory, with what has been made durable
//! kept apart from what has only been written.
//!
//! The fault model:
//! - A file's contents are durable up to its last sync; a write changes 512-byte sectors
//!   that stay volatile until then. A sector is atomic: it is written whole or not at all.
//! - A name (a file created, renamed or removed, a directory created) is durable once its
//!   directory is synced; until then a cut may undo it.
//! - A sync is a barrier: everything written before it is durable after it.
//! - A **power cut** stops all I/O (every later operation fails) and, at restart, leaves
//!   exactly what was durable. A **torn cut** leaves what was durable plus a random subset
//!   of the volatile sectors, names and truncations, as a disk that reorders its writes
//!   may.
//!
//! Handles opened before a restart stay dead afterwards (each carries the disk's
//! generation), so a thread of a dropped engine can never write to the next boot.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use oncegate_engine::files::{Files, LockGuard};
use rand::Rng;

/// The unit of atomicity of the simulated disk.
pub const SECTOR_BYTES: usize = 512;

/// The size of a region of SQLite's WAL index (its `-shm` file, kept in memory here).
pub(crate) const SHM_REGION_BYTES: usize = 32 * 1024;

/// What a cut leaves behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Exactly what was durable.
    Plain,
    /// What was durable, plus a random subset of what was not.
    Torn,
}

/// Where a failed writeback's data ended up (see [`Disk::fail_next_sync_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writeback {
    /// Not on the device: the sectors stay readable but are marked clean, so no later
    /// sync writes them and a cut or a drop of the page cache loses them.
    Lost,
    /// On the device despite the error (the data and the flush reached it, and the
    /// report failed): durable at once, so the next process reads it back.
    Reached,
    /// In the device's volatile cache and nowhere else: reads return it, the page cache
    /// dropped or not, but no later sync makes it durable and a cut loses it. The worst a
    /// device can do, and what a reopen must not build on.
    Cached,
}

/// An entry of the namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Node {
    Dir,
    File(u64),
}

/// The regions of a file's WAL index. Each region is boxed, so its address never moves
/// while SQLite holds a pointer to it.
pub(crate) type Shm = Arc<Mutex<Vec<Box<[u8]>>>>;

/// One file's contents.
#[derive(Default)]
pub(crate) struct Inode {
    /// What reads see.
    data: Vec<u8>,
    /// What survives a plain cut.
    durable: Vec<u8>,
    /// Sectors written (or exposed by growing) since the last sync.
    dirty: BTreeSet<usize>,
    /// Sectors a failed sync left in the device's volatile cache ([`Writeback::Cached`]):
    /// read back whole, even past a drop of the page cache, never made durable by a later
    /// sync, and lost at a cut; a new write of the sector replaces them.
    cached: BTreeSet<usize>,
    /// The byte ranges written since the last sync.
    written: Vec<Range<usize>>,
    /// The WAL index, volatile by nature.
    pub shm: Shm,
    /// Handles that have the WAL index mapped. The first to map it while none does
    /// starts it empty, as SQLite's unix VFS truncates the `-shm` file when the first
    /// connection attaches, so that the index is rebuilt from the WAL as it reads.
    pub shm_maps: u32,
    /// Connections that have it open as a main database (a shard's and its
    /// checkpointer's at most: see `vfs.rs`).
    pub db_opens: u32,
    /// The file locks and WAL-index locks its open handles hold, volatile like the index.
    pub locks: Locks,
}

/// SQLite's file lock levels (`SQLITE_LOCK_*`).
const LOCK_SHARED: i32 = 1;
const LOCK_RESERVED: i32 = 2;
const LOCK_PENDING: i32 = 3;

/// The locks of one file, by handle, with the rules of SQLite's unix VFS: a handle's
/// file lock (shared, reserved, pending, exclusive) and its shared and exclusive locks on
/// the WAL index's eight lock slots. Two connections to one file (a shard's and its
/// checkpointer's) then exclude each other exactly as they would on a real disk.
#[derive(Default)]
pub(crate) struct Locks {
    file: HashMap<u64, i32>,
    /// (shared, exclusive) bits over the WAL index's lock slots.
    shm: HashMap<u64, (u8, u8)>,
}

impl Locks {
    /// Raises `handle`'s file lock to `level`; false (busy) if another handle's lock
    /// forbids it.
    pub fn lock_file(&mut self, handle: u64, level: i32) -> bool {
        let others = self.file.iter().filter(|(h, _)| **h != handle).map(|(_, l)| *l).max().unwrap_or(0);
        let granted = match level {
            LOCK_SHARED => others < LOCK_PENDING,
            LOCK_RESERVED => others < LOCK_RESERVED,
            _ => others < LOCK_SHARED,
        };
        if granted {
            let held = self.file.entry(handle).or_default();
            *held = (*held).max(level);
        }
        granted
    }

    /// Lowers `handle`'s file lock to `level` (shared or none).
    pub fn unlock_file(&mut self, handle: u64, level: i32) {
        if level < LOCK_SHARED {
            self.file.remove(&handle);
        } else if let Some(held) = self.file.get_mut(&handle) {
            *held = (*held).min(level);
        }
    }

    /// Whether any handle holds a reserved lock or more.
    pub fn reserved(&self) -> bool {
        self.file.values().any(|l| *l >= LOCK_RESERVED)
    }

    /// Takes or releases `handle`'s locks on the slots in `mask`; false (busy) if another
    /// handle's locks forbid it.
    pub fn lock_shm(&mut self, handle: u64, mask: u8, unlock: bool, exclusive: bool) -> bool {
        let (others_shared, others_exclusive) = self
            .shm
            .iter()
            .filter(|(h, _)| **h != handle)
            .fold((0u8, 0u8), |(s, e), (_, (hs, he))| (s | hs, e | he));
        let held = self.shm.entry(handle).or_default();
        if unlock {
            *held = (held.0 & !mask, held.1 & !mask);
        } else if exclusive {
            if (others_shared | others_exclusive) & mask != 0 {
                return false;
            }
            held.1 |= mask;
        } else {
            if others_exclusive & mask != 0 {
                return false;
            }
            held.0 |= mask;
        }
        true
    }

    /// Releases every lock `handle` holds on the WAL index.
    pub fn release_shm(&mut self, handle: u64) {
        self.shm.remove(&handle);
    }

    /// Releases every lock `handle` holds.
    pub fn release(&mut self, handle: u64) {
        self.file.remove(&handle);
        self.shm.remove(&handle);
    }
}

impl Inode {
    fn with(bytes: &[u8]) -> Inode {
        let mut inode = Inode::default();
        inode.write(0, bytes);
        inode
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn read(&self, offset: usize, buf: &mut [u8]) -> usize {
        let available = self.data.len().saturating_sub(offset).min(buf.len());
        if available > 0 {
            buf[..available].copy_from_slice(&self.data[offset..offset + available]);
        }
        available
    }

    /// Writes `bytes` at `offset`; returns whether it overwrites bytes written since
    /// the last sync.
    pub fn write(&mut self, offset: usize, bytes: &[u8]) -> bool {
        let end = offset + bytes.len();
        let overwrites = self.written.iter().any(|range| range.start < end && offset < range.end);
        match self.written.last_mut() {
            Some(last) if last.end == offset => last.end = end,
            _ if bytes.is_empty() => {}
            _ => self.written.push(offset..end),
        }
        if end > self.data.len() {
            self.grow(end);
        }
        self.data[offset..end].copy_from_slice(bytes);
        if !bytes.is_empty() {
            let sectors = offset / SECTOR_BYTES..=(end - 1) / SECTOR_BYTES;
            for sector in sectors.clone() {
                self.cached.remove(&sector);
            }
            self.dirty.extend(sectors);
        }
        overwrites
    }

    pub fn truncate(&mut self, len: usize) {
        if len > self.data.len() {
            self.grow(len);
        } else {
            self.data.truncate(len);
        }
    }

    /// Grows with zeros; the new sectors are volatile like written ones.
    fn grow(&mut self, len: usize) {
        let from = self.data.len();
        self.data.resize(len, 0);
        self.dirty.extend(from / SECTOR_BYTES..len.div_ceil(SECTOR_BYTES));
    }

    pub fn sync(&mut self) {
        self.written.clear();
        self.durable.resize(self.data.len(), 0);
        for sector in std::mem::take(&mut self.dirty) {
            copy_sector(&self.data, &mut self.durable, sector);
        }
    }

    /// A failed writeback as Linux leaves it: the unsynced sectors stay readable, but
    /// are marked clean, so no later sync writes them and a cut loses them.
    fn lose_unsynced(&mut self) {
        self.dirty.clear();
        self.written.clear();
    }

    /// A failed sync whose data the device keeps in its volatile cache only: readable as
    /// it is, never durable (see [`Writeback::Cached`]).
    fn cache_unsynced(&mut self) {
        self.cached.append(&mut self.dirty);
        self.written.clear();
    }

    /// The page cache's clean pages dropped: every sector not written since the last
    /// sync reads what the disk holds (zeros past its durable end, whose size the kernel
    /// still knows), so what a failed writeback left readable is gone.
    fn drop_clean(&mut self) {
        for sector in 0..self.data.len().div_ceil(SECTOR_BYTES) {
            if !self.dirty.contains(&sector) && !self.cached.contains(&sector) {
                let start = sector * SECTOR_BYTES;
                let end = (start + SECTOR_BYTES).min(self.data.len());
                let durable = self.durable.get(start..end.min(self.durable.len())).unwrap_or(&[]);
                self.data[start..start + durable.len()].copy_from_slice(durable);
                self.data[start + durable.len()..end].fill(0);
            }
        }
    }

    /// What the file holds after a cut.
    fn survive(&mut self, cut: Cut, rng: &mut impl Rng) {
        let mut image = self.durable.clone();
        if cut == Cut::Torn {
            if self.data.len() < image.len() && rng.random_bool(0.5) {
                image.truncate(self.data.len());
            }
            for &sector in &self.dirty {
                if rng.random_bool(0.5) {
                    copy_sector(&self.data, &mut image, sector);
                }
            }
        }
        self.data = image.clone();
        self.durable = image;
        self.dirty.clear();
        self.cached.clear();
        self.written.clear();
        self.shm = Shm::default();
        self.shm_maps = 0;
        self.db_opens = 0;
        self.locks = Locks::default();
    }

    /// Whether it holds writes not yet synced.
    fn unsynced(&self) -> bool {
        !self.dirty.is_empty() || self.data.len() != self.durable.len()
    }
}

/// Copies one sector of `from` (as much of it as `from` holds) into `to`, growing `to`.
fn copy_sector(from: &[u8], to: &mut Vec<u8>, sector: usize) {
    let start = sector * SECTOR_BYTES;
    let end = (start + SECTOR_BYTES).min(from.len());
    if start >= end {
        return;
    }
    if to.len() < end {
        to.resize(end, 0);
    }
    to[start..end].copy_from_slice(&from[start..end]);
}

/// Counts of what the disk was asked to do, for the harness's report.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiskStats {
    /// File syncs (SQLite's and the seam's).
    pub file_syncs: u64,
    /// Directory syncs.
    pub dir_syncs: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Writes (calls, SQLite's and the seam's).
    pub writes: u64,
    /// Power cuts.
    pub cuts: u64,
    /// Syncs of shard files (`*.sqlite`): in WAL mode, one per checkpoint (and one when
    /// a new file is switched to WAL).
    pub checkpoints: u64,
    /// Writes to a WAL over bytes written since its last sync: frames (or their
    /// checksums) written again before their commit, as a transaction that spills its
    /// page cache does. Database files are not counted: a checkpoint that stops short
    /// of the WAL's end does not sync them, so the next one may overwrite its writes.
    pub wal_overwrites: u64,
    /// Operations the disk was asked to do (the fuse counts these).
    pub ops: u64,
    /// Cuts that found a shard file (`*.sqlite`) with writes not yet synced: cuts in the
    /// middle of a checkpoint.
    pub cuts_mid_checkpoint: u64,
}

pub(crate) struct State {
    powered: bool,
    pub generation: u64,
    next_inode: u64,
    pub inodes: HashMap<u64, Inode>,
    entries: BTreeMap<PathBuf, Node>,
    durable_entries: BTreeMap<PathBuf, Node>,
    locks: HashSet<PathBuf>,
    /// Operations left before the power goes, if a cut is planned.
    fuse: Option<u64>,
    /// Names changed together by a rename since their directory was last synced: a torn
    /// cut keeps or undoes a rename whole, as journaling file systems do.
    rename_links: HashMap<PathBuf, u64>,
    next_link: u64,
    /// The files (their inodes) whose next sync is planned to fail as a failed writeback
    /// does, how many of their writes fail after it, and where the writeback's data ends
    /// up (see [`Disk::fail_next_sync_of`]).
    failing_syncs: Vec<(u64, u32, Writeback)>,
    /// That file's writes left to fail: its inode, and how many.
    failing_writes: (u64, u32),
    /// The most bytes the files may hold together, if the disk is given a size: a write
    /// that would grow them past it fails as a full disk does (see [`Disk::set_capacity`]).
    capacity: Option<u64>,
    pub stats: DiskStats,
}

fn power_off() -> io::Error {
    io::Error::other("the simulated disk has no power")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{}: no such file", path.display()))
}

impl State {
    /// Fails every operation once the power is cut, and every operation of a handle
    /// opened before the last restart. Counts the operation down a fuse, if one is lit.
    pub fn check(&mut self, generation: u64) -> io::Result<()> {
        if !self.powered || generation != self.generation {
            return Err(power_off());
        }
        self.stats.ops += 1;
        match self.fuse {
            Some(0) => {
                self.powered = false;
                self.fuse = None;
                self.stats.cuts += 1;
                Err(power_off())
            }
            Some(n) => {
                self.fuse = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }

    pub fn inode_of(&self, path: &Path) -> io::Result<u64> {
        match self.entries.get(path) {
            Some(Node::File(inode)) => Ok(*inode),
            Some(Node::Dir) => Err(io::Error::other(format!("{} is a directory", path.display()))),
            None => Err(not_found(path)),
        }
    }

    pub fn exists(&self, path: &Path) -> bool {
        self.entries.contains_key(path)
    }

    /// Creates a file (its name volatile until its directory is synced).
    pub fn create_file(&mut self, path: &Path, inode: Inode) -> io::Result<u64> {
        let parent = parent(path);
        if self.entries.get(parent) != Some(&Node::Dir) {
            return Err(not_found(parent));
        }
        self.next_inode += 1;
        let id = self.next_inode;
        self.stats.bytes_written += inode.len() as u64;
        self.stats.writes += u64::from(inode.len() > 0);
        self.inodes.insert(id, inode);
        self.entries.insert(path.to_owned(), Node::File(id));
        Ok(id)
    }

    /// A file with no name (SQLite's temporary files).
    pub fn create_anonymous(&mut self) -> u64 {
        self.next_inode += 1;
        self.inodes.insert(self.next_inode, Inode::default());
        self.next_inode
    }

    pub fn remove(&mut self, path: &Path) -> io::Result<()> {
        match self.entries.remove(path) {
            Some(_) => Ok(()),
            None => Err(not_found(path)),
        }
    }

    pub fn sync_dir(&mut self, dir: &Path) {
        self.stats.dir_syncs += 1;
        self.rename_links.retain(|path, _| parent(path) != dir);
        let names: BTreeSet<PathBuf> = self
            .entries
            .keys()
            .chain(self.durable_entries.keys())
            .filter(|path| parent(path) == dir)
            .cloned()
            .collect();
        for name in names {
            match self.entries.get(&name) {
                Some(node) => self.durable_entries.insert(name, *node),
                None => self.durable_entries.remove(&name),
            };
        }
    }

    pub fn sync_inode(&mut self, inode: u64) {
        self.stats.file_syncs += 1;
        if let Some(inode) = self.inodes.get_mut(&inode) {
            inode.sync();
        }
    }

    /// Fails the sync of `inode` if one was planned ([`Disk::fail_next_sync_of`]): its
    /// unsynced data goes where the plan says, and its next writes fail. Returns whether
    /// it did.
    pub fn fail_planned_sync(&mut self, inode: u64) -> bool {
        let Some(at) = self.failing_syncs.iter().position(|(planned, ..)| *planned == inode) else {
            return false;
        };
        let (_, writes_after, writeback) = self.failing_syncs.remove(at);
        self.failing_writes = (inode, writes_after);
        if let Some(file) = self.inodes.get_mut(&inode) {
            match writeback {
                Writeback::Lost => file.lose_unsynced(),
                Writeback::Reached => file.sync(),
                Writeback::Cached => file.cache_unsynced(),
            }
        }
        true
    }

    /// Whether this write of `inode` fails, as the writes after a failed sync do.
    pub fn fail_planned_write(&mut self, inode: u64) -> bool {
        let (failing, left) = &mut self.failing_writes;
        if *failing != inode || *left == 0 {
            return false;
        }
        *left -= 1;
        true
    }

    /// Drops the clean cached pages of the file at `path` (see [`Files::drop_cached`]).
    fn drop_cached(&mut self, path: &Path) -> io::Result<()> {
        let inode = match self.inode_of(path) {
            Ok(inode) => inode,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if let Some(file) = self.inodes.get_mut(&inode) {
            file.drop_clean();
        }
        Ok(())
    }

    /// The bytes the files hold together.
    fn used_bytes(&self) -> u64 {
        self.inodes.values().map(|inode| inode.len() as u64).sum()
    }

    /// Whether growing `inode` to `len` bytes (a new file, when it has none) passes the
    /// disk's capacity.
    pub fn no_room_for(&self, inode: Option<u64>, len: usize) -> bool {
        let Some(capacity) = self.capacity else { return false };
        let now = inode.and_then(|i| self.inodes.get(&i)).map_or(0, Inode::len);
        len > now && self.used_bytes() + (len - now) as u64 > capacity
    }

    /// Writes `bytes` at `offset` of `inode`, a WAL if `wal`.
    pub fn write(&mut self, inode: u64, offset: usize, bytes: &[u8], wal: bool) {
        self.stats.bytes_written += bytes.len() as u64;
        self.stats.writes += 1;
        if let Some(inode) = self.inodes.get_mut(&inode) {
            let overwrites = inode.write(offset, bytes);
            self.stats.wal_overwrites += u64::from(wal && overwrites);
        }
    }
}

impl State {
    /// Renames `from` over `to`; the two names change together at a torn cut.
    pub fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        let node = self.entries.remove(from).ok_or_else(|| not_found(from))?;
        self.entries.insert(to.to_owned(), node);
        self.next_link += 1;
        self.rename_links.insert(from.to_owned(), self.next_link);
        self.rename_links.insert(to.to_owned(), self.next_link);
        Ok(())
    }

    /// Whether a shard file holds writes not yet synced.
    fn shard_file_unsynced(&self) -> bool {
        self.entries.iter().any(|(path, node)| match node {
            Node::File(inode) => {
                path.extension().is_some_and(|e| e == "sqlite" || e == "seg")
                    && self.inodes.get(inode).is_some_and(Inode::unsynced)
            }
            Node::Dir => false,
        })
    }
}

/// The disk's state, locked (a panicking holder leaves it as it was: nothing half-done
/// is kept across operations).
pub(crate) fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The directory holding `path`.
pub(crate) fn parent(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new("/"))
}

static DISKS: AtomicU64 = AtomicU64::new(0);

/// A simulated disk. Clones share it. It is the engine's files seam
/// ([`oncegate_engine::files::Files`]) and, through a SQLite VFS registered for it, the
/// shard files' storage, so that everything the engine writes is on it.
#[derive(Clone)]
pub struct Disk {
    pub(crate) state: Arc<Mutex<State>>,
    vfs_name: Arc<str>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk").field("vfs", &self.vfs_name).finish_non_exhaustive()
    }
}

impl Default for Disk {
    fn default() -> Self {
        Disk::new()
    }
}

impl Disk {
    /// An empty, powered disk with its root directory, and its SQLite VFS registered.
    pub fn new() -> Disk {
        let mut entries = BTreeMap::new();
        entries.insert(PathBuf::from("/"), Node::Dir);
        let state = State {
            powered: true,
            generation: 0,
            next_inode: 0,
            inodes: HashMap::new(),
            durable_entries: entries.clone(),
            entries,
            locks: HashSet::new(),
            fuse: None,
            rename_links: HashMap::new(),
            next_link: 0,
            failing_syncs: Vec::new(),
            failing_writes: (0, 0),
            capacity: None,
            stats: DiskStats::default(),
        };
        let name = format!("oncegate-simdisk-{}", DISKS.fetch_add(1, Ordering::SeqCst));
        let disk = Disk { state: Arc::new(Mutex::new(state)), vfs_name: name.into() };
        crate::vfs::register(&disk);
        disk
    }

    pub(crate) fn lock_state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The VFS name SQLite knows this disk by.
    pub fn vfs_name(&self) -> &str {
        &self.vfs_name
    }

    /// Cuts the power: every operation from now on fails, until [`Disk::restart`].
    pub fn cut(&self) {
        let mut state = self.lock_state();
        if std::mem::replace(&mut state.powered, false) {
            state.stats.cuts += 1;
        }
    }

    /// Cuts the power after `ops` more operations (reads, writes, syncs, opens, names),
    /// wherever the engine is then: opening, writing a batch, checkpointing, writing an
    /// epoch file.
    pub fn cut_after_ops(&self, ops: u64) {
        self.lock_state().fuse = Some(ops);
    }

    /// Makes the next sync of the file at `path` (a shard's `-wal`, say) fail as a failed
    /// writeback does on Linux: `EIO` (SQLite's `SQLITE_IOERR_FSYNC`), and what it would
    /// have made durable ends up where `writeback` says (lost, on the device, or in its
    /// volatile cache only): the error does not say which. The `writes_after` writes of
    /// the file that follow fail too (a disk failing for a while). Several files may
    /// have a failure planned at once.
    pub fn fail_next_sync_of(&self, path: &Path, writes_after: u32, writeback: Writeback) -> io::Result<()> {
        let mut state = self.lock_state();
        let inode = state.inode_of(path)?;
        state.failing_syncs.push((inode, writes_after, writeback));
        Ok(())
    }

    /// Gives the disk a size (`None`: unbounded): from now on a write that would grow the
    /// files past `bytes` together fails as on a full file system (`ENOSPC`; SQLite's
    /// `SQLITE_FULL`), and writes within a file's length still succeed.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock_state().capacity = bytes;
    }

    /// The bytes the files hold together.
    pub fn used_bytes(&self) -> u64 {
        self.lock_state().used_bytes()
    }

    /// Whether the power is on.
    pub fn powered(&self) -> bool {
        self.lock_state().powered
    }

    /// Powers the disk up again with what survived the cut.
    pub fn restart(&self, cut: Cut, rng: &mut impl Rng) {
        let mut state = self.lock_state();
        let state = &mut *state;
        state.stats.cuts_mid_checkpoint += u64::from(state.shard_file_unsynced());
        let names: BTreeSet<PathBuf> =
            state.entries.keys().chain(state.durable_entries.keys()).cloned().collect();
        let mut survived = BTreeMap::new();
        let mut link_coins: HashMap<u64, bool> = HashMap::new();
        for name in names {
            let durable = state.durable_entries.get(&name).copied();
            let keep_new = match state.rename_links.get(&name) {
                Some(link) => *link_coins.entry(*link).or_insert_with(|| rng.random_bool(0.5)),
                None => rng.random_bool(0.5),
            };
            let node = match (cut, state.entries.get(&name).copied()) {
                (Cut::Torn, current) if keep_new => current,
                _ => durable,
            };
            if let Some(node) = node {
                survived.insert(name, node);
            }
        }
        // Entries whose directory did not survive go with it (shortest paths first, so a
        // parent is settled before its children).
        let mut kept = BTreeMap::new();
        let mut by_depth: Vec<(PathBuf, Node)> = survived.into_iter().collect();
        by_depth.sort_by_key(|(path, _)| path.components().count());
        for (path, node) in by_depth {
            if path == Path::new("/") || kept.get(parent(&path)) == Some(&Node::Dir) {
                kept.insert(path, node);
            }
        }
        let live: HashSet<u64> =
            kept.values().filter_map(|n| if let Node::File(i) = n { Some(*i) } else { None }).collect();
        state.inodes.retain(|id, _| live.contains(id));
        for inode in state.inodes.values_mut() {
            inode.survive(cut, rng);
        }
        state.durable_entries = kept.clone();
        state.entries = kept;
        state.locks.clear();
        state.rename_links.clear();
        state.fuse = None;
        state.failing_syncs.clear();
        state.failing_writes = (0, 0);
        state.generation += 1;
        state.powered = true;
    }

    /// What the disk was asked to do so far.
    pub fn stats(&self) -> DiskStats {
        self.lock_state().stats
    }

    /// The disk as one boot of an engine sees it: the engine's `Files` seam. Its
    /// operations fail after the next cut and stay failed after the restart, like the
    /// VFS handles opened in the same boot.
    pub fn boot(&self) -> Boot {
        let generation = self.lock_state().generation;
        Boot { disk: self.clone(), generation }
    }
}

/// One boot of the disk: the `Files` seam an engine is opened on.
#[derive(Clone, Debug)]
pub struct Boot {
    disk: Disk,
    generation: u64,
}

impl Boot {
    fn with<T>(&self, op: impl FnOnce(&mut State) -> io::Result<T>) -> io::Result<T> {
        let mut state = self.disk.lock_state();
        state.check(self.generation)?;
        op(&mut state)
    }
}

/// The directory lock of a simulated disk: released when dropped.
struct SimLock {
    disk: Disk,
    path: PathBuf,
    generation: u64,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        let mut state = self.disk.lock_state();
        if state.generation == self.generation {
            state.locks.remove(&self.path);
        }
    }
}

impl Files for Boot {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.with(|state| {
            for ancestor in dir.ancestors().collect::<Vec<_>>().into_iter().rev() {
                match state.entries.get(ancestor) {
                    Some(Node::Dir) => {}
                    Some(Node::File(_)) => {
                        return Err(io::Error::other(format!("{} is a file", ancestor.display())));
                    }
                    None => {
                        state.entries.insert(ancestor.to_owned(), Node::Dir);
                        state.sync_dir(parent(ancestor));
                    }
                }
            }
            Ok(())
        })
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.with(|state| {
            let inode = state.inode_of(path)?;
            Ok(state.inodes[&inode].data.clone())
        })
    }

    fn write_new(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        self.with(|state| {
            if state.exists(path) {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, path.display().to_string()));
            }
            if state.no_room_for(None, bytes.len()) {
                return Err(io::Error::from_raw_os_error(28));
            }
            state.create_file(path, Inode::with(bytes)).map(drop)
        })
    }

    fn create(&self, path: &Path) -> io::Result<bool> {
        self.with(|state| {
            if state.exists(path) {
                return Ok(false);
            }
            state.create_file(path, Inode::default()).map(|_| true)
        })
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.with(|state| {
            let inode = state.inode_of(path)?;
            state.sync_inode(inode);
            Ok(())
        })
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.with(|state| state.rename(from, to))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.with(|state| {
            let _ = state.remove(path);
            Ok(())
        })
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.with(|state| {
            state.sync_dir(dir);
            Ok(())
        })
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.with(|state| {
            Ok(state
                .entries
                .keys()
                .filter(|path| path.as_path() != dir && parent(path) == dir)
                .filter_map(|path| path.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect())
        })
    }

    fn lock(&self, path: &Path) -> io::Result<Option<LockGuard>> {
        self.with(|state| {
            if !state.locks.insert(path.to_owned()) {
                return Ok(None);
            }
            let guard =
                SimLock { disk: self.disk.clone(), path: path.to_owned(), generation: state.generation };
            Ok(Some(Box::new(guard) as LockGuard))
        })
    }

    fn restrict(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }

    fn drop_cached(&self, path: &Path) -> io::Result<()> {
        self.with(|state| state.drop_cached(path))
    }

    fn sqlite_vfs(&self) -> Option<&str> {
        Some(self.disk.vfs_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(7)
    }

    /// Two connections to one file (a shard's and its checkpointer's) exclude each other
    /// as on a real disk: one writer at a time, and a connection that closes while the
    /// other is open neither checkpoints nor deletes the WAL under it.
    #[test]
    fn two_connections_to_one_file_take_turns() {
        use rusqlite::{Connection, OpenFlags};
        let disk = Disk::new();
        let files = disk.boot();
        files.create_dir_all(Path::new("/d")).unwrap();
        let vfs = files.sqlite_vfs().unwrap().to_owned();
        let open = || {
            Connection::open_with_flags_and_vfs("/d/f.sqlite", OpenFlags::default(), vfs.as_str()).unwrap()
        };
        let first = open();
        let _: String = first.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0)).unwrap();
        first.execute_batch("CREATE TABLE t (n INTEGER); INSERT INTO t VALUES (1);").unwrap();
        let second = open();
        second.busy_timeout(std::time::Duration::ZERO).unwrap();
        first.execute_batch("BEGIN IMMEDIATE; INSERT INTO t VALUES (2);").unwrap();
        let busy = second.execute_batch("BEGIN IMMEDIATE").unwrap_err();
        assert_eq!(busy.sqlite_error_code(), Some(rusqlite::ErrorCode::DatabaseBusy), "{busy}");
        first.execute_batch("COMMIT").unwrap();
        let rows: i64 = second.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).unwrap();
        assert_eq!(rows, 2, "the second connection reads the first's commit from the WAL");
        drop(second);
        let rows: i64 = first.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).unwrap();
        assert_eq!(rows, 2);
        assert!(files.read(Path::new("/d/f.sqlite-wal")).is_ok(), "the WAL outlives the first close");
        assert!(open().execute_batch("PRAGMA wal_checkpoint(PASSIVE)").is_ok());
    }

    #[test]
    fn a_plain_cut_keeps_only_what_was_synced() {
        let disk = Disk::new();
        let files = disk.boot();
        let dir = Path::new("/d");
        files.create_dir_all(dir).unwrap();
        files.write_new(&dir.join("synced"), b"kept").unwrap();
        files.sync_file(&dir.join("synced")).unwrap();
        files.sync_dir(dir).unwrap();
        files.write_new(&dir.join("unsynced-name"), b"x").unwrap();
        files.sync_file(&dir.join("unsynced-name")).unwrap();
        disk.cut();
        assert!(files.read(&dir.join("synced")).is_err(), "no I/O without power");
        disk.restart(Cut::Plain, &mut rng());
        assert!(files.read(&dir.join("synced")).is_err(), "an old boot stays dead");
        let files = disk.boot();
        assert_eq!(files.read(&dir.join("synced")).unwrap(), b"kept");
        assert!(files.read(&dir.join("unsynced-name")).is_err(), "a name not synced is lost");
    }

    #[test]
    fn a_write_over_bytes_written_since_the_last_sync_is_an_overwrite_and_an_append_is_not() {
        let mut inode = Inode::with(&[1; 100]);
        inode.sync();
        assert!(!inode.write(0, &[2; 10]), "over synced bytes");
        assert!(!inode.write(10, &[2; 10]), "an append to what was written");
        assert!(!inode.write(50, &[2; 10]), "beside it");
        assert!(inode.write(15, &[3; 2]), "inside it");
        assert!(inode.write(45, &[3; 6]), "over the start of a later write");
        assert!(!inode.write(30, &[3; 10]), "between two writes");
        inode.sync();
        assert!(!inode.write(0, &[4; 100]), "after a sync");
    }

    #[test]
    fn dropping_the_cache_reads_what_a_failed_writeback_left_on_disk_and_keeps_what_is_dirty() {
        let mut inode = Inode::with(&[1; SECTOR_BYTES]);
        inode.sync();
        // A failed writeback of a sector rewritten and of one that grew the file.
        inode.write(0, &[2; 2 * SECTOR_BYTES]);
        inode.lose_unsynced();
        // Written after it, not yet synced.
        inode.write(2 * SECTOR_BYTES, &[3; 10]);
        assert_eq!(inode.data[0], 2, "the page cache still reads the lost writes");
        inode.drop_clean();
        assert_eq!(inode.len(), 2 * SECTOR_BYTES + 10, "the size is kept");
        assert_eq!(&inode.data[..SECTOR_BYTES], &[1; SECTOR_BYTES][..], "the disk's old sector");
        assert_eq!(
            &inode.data[SECTOR_BYTES..2 * SECTOR_BYTES],
            &[0; SECTOR_BYTES][..],
            "past its durable end"
        );
        assert_eq!(&inode.data[2 * SECTOR_BYTES..], &[3; 10][..], "a dirty sector is kept");
    }

    #[test]
    fn a_sync_failed_into_the_devices_cache_reads_back_until_a_cut_and_no_sync_keeps_it() {
        let mut inode = Inode::with(&[1; 2 * SECTOR_BYTES]);
        inode.sync();
        inode.write(0, &[2; 2 * SECTOR_BYTES]);
        inode.cache_unsynced();
        // A new write replaces the device's cached copy of its sector.
        inode.write(SECTOR_BYTES, &[3; SECTOR_BYTES]);
        inode.drop_clean();
        assert_eq!(inode.data[0], 2, "the device still returns its cached sector");
        inode.sync();
        inode.survive(Cut::Plain, &mut rng());
        assert_eq!(&inode.data[..SECTOR_BYTES], &[1; SECTOR_BYTES][..], "no sync made it durable");
        assert_eq!(&inode.data[SECTOR_BYTES..], &[3; SECTOR_BYTES][..], "the sector written again was");
    }

    #[test]
    fn unsynced_sectors_are_lost_whole_or_kept_whole() {
        let mut inode = Inode::with(&[1; 2 * SECTOR_BYTES]);
        inode.sync();
        inode.write(SECTOR_BYTES - 1, &[9; 2]);
        inode.survive(Cut::Plain, &mut rng());
        assert_eq!(inode.data, vec![1; 2 * SECTOR_BYTES], "a plain cut keeps the synced image");
        let mut seen = BTreeSet::new();
        let mut rng = rng();
        for _ in 0..64 {
            let mut inode = Inode::with(&[1; 2 * SECTOR_BYTES]);
            inode.sync();
            inode.write(SECTOR_BYTES - 1, &[9; 2]);
            inode.survive(Cut::Torn, &mut rng);
            seen.insert((inode.data[SECTOR_BYTES - 1], inode.data[SECTOR_BYTES]));
        }
        // Each of the two sectors the write touched survives or not on its own.
        assert_eq!(seen, BTreeSet::from([(1, 1), (1, 9), (9, 1), (9, 9)]));
    }

    #[test]
    fn old_handles_stay_dead_after_a_restart() {
        let disk = Disk::new();
        let generation = disk.lock_state().generation;
        disk.cut();
        disk.restart(Cut::Plain, &mut rng());
        assert!(disk.lock_state().check(generation).is_err());
        disk.cut_after_ops(1);
        let files = disk.boot();
        assert!(files.create_dir_all(Path::new("/one")).is_ok());
        assert!(files.create_dir_all(Path::new("/two")).is_err(), "the fuse blew");
        assert!(!disk.powered());
        disk.restart(Cut::Plain, &mut rng());
        assert!(disk.boot().create_dir_all(Path::new("/fresh")).is_ok());
    }

    #[test]
    fn a_torn_cut_keeps_or_undoes_a_rename_whole() {
        let mut rng = rng();
        for _ in 0..32 {
            let disk = Disk::new();
            let files = disk.boot();
            let dir = Path::new("/d");
            files.create_dir_all(dir).unwrap();
            files.write_new(&dir.join("target"), b"old").unwrap();
            files.sync_file(&dir.join("target")).unwrap();
            files.write_new(&dir.join("target.tmp"), b"new").unwrap();
            files.sync_file(&dir.join("target.tmp")).unwrap();
            files.sync_dir(dir).unwrap();
            files.rename(&dir.join("target.tmp"), &dir.join("target")).unwrap();
            disk.cut();
            disk.restart(Cut::Torn, &mut rng);
            let files = disk.boot();
            let (target, tmp) =
                (files.read(&dir.join("target")).unwrap(), files.read(&dir.join("target.tmp")));
            match target.as_slice() {
                b"old" => assert_eq!(tmp.unwrap(), b"new", "undone whole"),
                b"new" => assert!(tmp.is_err(), "done whole"),
                other => panic!("{other:?}"),
            }
        }
    }
}
