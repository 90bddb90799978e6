//! The SQLite VFS over a [`Disk`]: SQLite's own file I/O (the shard files, their WAL,
//! their WAL index) goes to the simulated disk, so a cut loses exactly what SQLite had not
//! synced. It behaves as SQLite's unix VFS does where durability is concerned: a new WAL
//! or journal's name is made durable at its first sync (unix syncs the directory then),
//! the database file's name never (whoever creates the file must sync its directory), and
//! sectors are reported as 4 KiB with power-safe overwrite.
//!
//! Locking is single-process (the engine's directory lock keeps other processes out) and
//! follows SQLite's unix VFS between the connections of this one (`disk::Locks`): a shard
//! file has two, the shard's and its checkpointer's, which must exclude each other on the
//! WAL index as they would on a real disk.
//!
//! One of the workspace's two modules with `unsafe` code (the engine's
//! `store/sqlite/gather.rs` is the other): the C ABI of `sqlite3_vfs` and
//! `sqlite3_io_methods`. Every function takes the pointers SQLite hands it, checks them,
//! and turns to safe code on the `Disk` as soon as it can.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rusqlite::ffi;

use crate::disk::{Disk, Inode, SHM_REGION_BYTES, Shm, State, lock, parent};

/// What `pAppData` of the registered VFS points to. It holds the disk weakly: the
/// registration lives for the process, the disk only as long as its owners keep it.
struct VfsContext {
    state: Weak<Mutex<State>>,
    /// SQLite's default VFS, for randomness, sleeping and the time.
    fallback: *mut ffi::sqlite3_vfs,
}

impl VfsContext {
    fn state(&self) -> Option<Arc<Mutex<State>>> {
        self.state.upgrade()
    }
}

/// Numbers the handles, so that locks know whose they are.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// The state of one open file.
struct Handle {
    /// Whose locks these are.
    id: u64,
    state: Arc<Mutex<State>>,
    /// Its file, or `None` once deleted on close.
    inode: u64,
    /// Its name; `None` for a temporary file.
    path: Option<PathBuf>,
    /// The disk's generation when the file was opened.
    generation: u64,
    /// Whether the first sync also makes the name durable (a new WAL or journal).
    sync_dir_pending: bool,
    delete_on_close: bool,
    /// Whether it is a main database (two connections per file at most).
    main_db: bool,
    /// Whether it is a WAL.
    wal: bool,
    /// The WAL index this handle mapped.
    shm: Option<Shm>,
}

/// SQLite's file object followed by ours; `szOsFile` is its size.
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    handle: *mut Handle,
}

static IO_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 2,
    xClose: Some(x_close),
    xRead: Some(x_read),
    xWrite: Some(x_write),
    xTruncate: Some(x_truncate),
    xSync: Some(x_sync),
    xFileSize: Some(x_file_size),
    xLock: Some(x_lock),
    xUnlock: Some(x_unlock),
    xCheckReservedLock: Some(x_check_reserved_lock),
    xFileControl: Some(x_file_control),
    xSectorSize: Some(x_sector_size),
    xDeviceCharacteristics: Some(x_device_characteristics),
    xShmMap: Some(x_shm_map),
    xShmLock: Some(x_shm_lock),
    xShmBarrier: Some(x_shm_barrier),
    xShmUnmap: Some(x_shm_unmap),
    xFetch: None,
    xUnfetch: None,
};

/// Registers a VFS named after `disk`. The registration lives as long as the process.
pub(crate) fn register(disk: &Disk) {
    // SAFETY: `sqlite3_vfs_find(NULL)` returns SQLite's default VFS, which lives for the
    // process; the structures handed to `sqlite3_vfs_register` are leaked, so they live as
    // long as SQLite may read them.
    unsafe {
        let name = CString::new(disk.vfs_name()).expect("a VFS name has no NUL").into_raw();
        let context = Box::into_raw(Box::new(VfsContext {
            state: Arc::downgrade(&disk.state),
            fallback: ffi::sqlite3_vfs_find(ptr::null()),
        }));
        let vfs = Box::into_raw(Box::new(ffi::sqlite3_vfs {
            iVersion: 2,
            szOsFile: std::mem::size_of::<File>() as c_int,
            mxPathname: 1024,
            pNext: ptr::null_mut(),
            zName: name,
            pAppData: context.cast(),
            xOpen: Some(x_open),
            xDelete: Some(x_delete),
            xAccess: Some(x_access),
            xFullPathname: Some(x_full_pathname),
            xDlOpen: None,
            xDlError: None,
            xDlSym: None,
            xDlClose: None,
            xRandomness: Some(x_randomness),
            xSleep: Some(x_sleep),
            xCurrentTime: Some(x_current_time),
            xGetLastError: Some(x_get_last_error),
            xCurrentTimeInt64: Some(x_current_time_int64),
            xSetSystemCall: None,
            xGetSystemCall: None,
            xNextSystemCall: None,
        }));
        let rc = ffi::sqlite3_vfs_register(vfs, 0);
        assert_eq!(rc, ffi::SQLITE_OK, "registering the simulated disk's VFS");
    }
}

/// # Safety
/// `vfs` must be a VFS registered by [`register`].
unsafe fn context<'a>(vfs: *mut ffi::sqlite3_vfs) -> &'a VfsContext {
    // SAFETY: `pAppData` was set to a leaked `VfsContext` by `register`.
    unsafe { &*((*vfs).pAppData as *const VfsContext) }
}

/// # Safety
/// `file` must be a file this VFS opened and has not closed.
unsafe fn handle<'a>(file: *mut ffi::sqlite3_file) -> &'a mut Handle {
    // SAFETY: `xOpen` wrote a `File` whose `handle` is a live box until `xClose`.
    unsafe { &mut *(*(file as *mut File)).handle }
}

/// # Safety
/// `name` must be null or a NUL-terminated string.
unsafe fn path_of(name: *const c_char) -> Option<PathBuf> {
    if name.is_null() {
        return None;
    }
    // SAFETY: SQLite passes NUL-terminated names.
    let name = unsafe { CStr::from_ptr(name) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite hands this VFS's pointer and `szOsFile` bytes of storage at `file`.
    unsafe {
        (*file).pMethods = ptr::null();
        let Some(state) = context(vfs).state() else { return ffi::SQLITE_CANTOPEN };
        let path = path_of(name);
        let opened = open(&state, path.as_deref(), flags);
        let Ok((inode, generation)) = opened else { return ffi::SQLITE_CANTOPEN };
        let creates_journal = flags & ffi::SQLITE_OPEN_CREATE != 0
            && flags
                & (ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_JOURNAL | ffi::SQLITE_OPEN_SUPER_JOURNAL)
                != 0;
        let handle = Box::new(Handle {
            id: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
            state,
            inode,
            path,
            generation,
            sync_dir_pending: creates_journal,
            delete_on_close: flags & ffi::SQLITE_OPEN_DELETEONCLOSE != 0,
            main_db: flags & ffi::SQLITE_OPEN_MAIN_DB != 0,
            wal: flags & ffi::SQLITE_OPEN_WAL != 0,
            shm: None,
        });
        ptr::write(
            file as *mut File,
            File { base: ffi::sqlite3_file { pMethods: &IO_METHODS }, handle: Box::into_raw(handle) },
        );
        if !out_flags.is_null() {
            *out_flags = flags;
        }
        ffi::SQLITE_OK
    }
}

/// Opens (or creates) the file; returns its inode and the disk's generation. A third
/// connection to one database is refused: the engine opens a shard file twice (the shard
/// and its checkpointer), and more would mean two live stores on one file.
fn open(state: &Mutex<State>, path: Option<&Path>, flags: c_int) -> std::io::Result<(u64, u64)> {
    let mut state = lock(state);
    let generation = state.generation;
    state.check(generation)?;
    let inode = match path {
        None => state.create_anonymous(),
        Some(path) => match state.inode_of(path) {
            Ok(inode) => inode,
            Err(_) if flags & ffi::SQLITE_OPEN_CREATE != 0 => state.create_file(path, Inode::default())?,
            Err(error) => return Err(error),
        },
    };
    if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
        let file = state.inodes.get_mut(&inode).ok_or_else(|| std::io::Error::other("no such file"))?;
        if file.db_opens > 1 {
            return Err(std::io::Error::other("a third connection to one database"));
        }
        file.db_opens += 1;
    }
    Ok((inode, generation))
}

unsafe extern "C" fn x_delete(vfs: *mut ffi::sqlite3_vfs, name: *const c_char, sync_dir: c_int) -> c_int {
    // SAFETY: a registered VFS and a NUL-terminated name.
    let (state, path) = unsafe { (context(vfs).state(), path_of(name)) };
    let (Some(state), Some(path)) = (state, path) else { return ffi::SQLITE_IOERR_DELETE };
    let mut state = lock(&state);
    let generation = state.generation;
    if state.check(generation).is_err() {
        return ffi::SQLITE_IOERR_DELETE;
    }
    if state.remove(&path).is_err() {
        return ffi::SQLITE_IOERR_DELETE_NOENT;
    }
    if sync_dir != 0 {
        state.sync_dir(parent(&path));
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn x_access(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    flags: c_int,
    out: *mut c_int,
) -> c_int {
    // SAFETY: a registered VFS, a NUL-terminated name and an output slot.
    unsafe {
        let (Some(state), Some(path)) = (context(vfs).state(), path_of(name)) else {
            return ffi::SQLITE_IOERR_ACCESS;
        };
        let mut state = lock(&state);
        let generation = state.generation;
        if state.check(generation).is_err() {
            return ffi::SQLITE_IOERR_ACCESS;
        }
        // As unix does: an empty file does not "exist" (an empty WAL is no WAL).
        let exists = match state.inode_of(&path) {
            Ok(inode) => flags != ffi::SQLITE_ACCESS_EXISTS || state.inodes[&inode].len() > 0,
            Err(_) => state.exists(&path),
        };
        *out = c_int::from(exists);
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_full_pathname(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    out_len: c_int,
    out: *mut c_char,
) -> c_int {
    // SAFETY: SQLite provides `out_len` bytes at `out` and a NUL-terminated name.
    unsafe {
        let name = CStr::from_ptr(name).to_bytes();
        if name.len() + 1 > out_len as usize || name.first() != Some(&b'/') {
            return ffi::SQLITE_CANTOPEN;
        }
        ptr::copy_nonoverlapping(name.as_ptr().cast::<c_char>(), out, name.len());
        *out.add(name.len()) = 0;
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_randomness(vfs: *mut ffi::sqlite3_vfs, n: c_int, out: *mut c_char) -> c_int {
    // SAFETY: the fallback is SQLite's default VFS, which implements randomness.
    unsafe {
        let fallback = context(vfs).fallback;
        (*fallback).xRandomness.map_or(0, |f| f(fallback, n, out))
    }
}

unsafe extern "C" fn x_sleep(vfs: *mut ffi::sqlite3_vfs, micros: c_int) -> c_int {
    // SAFETY: as above.
    unsafe {
        let fallback = context(vfs).fallback;
        (*fallback).xSleep.map_or(0, |f| f(fallback, micros))
    }
}

unsafe extern "C" fn x_current_time(vfs: *mut ffi::sqlite3_vfs, out: *mut f64) -> c_int {
    // SAFETY: as above.
    unsafe {
        let fallback = context(vfs).fallback;
        (*fallback).xCurrentTime.map_or(ffi::SQLITE_ERROR, |f| f(fallback, out))
    }
}

unsafe extern "C" fn x_current_time_int64(vfs: *mut ffi::sqlite3_vfs, out: *mut ffi::sqlite3_int64) -> c_int {
    // SAFETY: as above.
    unsafe {
        let fallback = context(vfs).fallback;
        (*fallback).xCurrentTimeInt64.map_or(ffi::SQLITE_ERROR, |f| f(fallback, out))
    }
}

unsafe extern "C" fn x_get_last_error(_vfs: *mut ffi::sqlite3_vfs, _n: c_int, _out: *mut c_char) -> c_int {
    0
}

/// Runs `op` on the handle's file while the disk is powered and the handle current;
/// otherwise answers `error`.
fn with_file<T>(handle: &Handle, error: c_int, op: impl FnOnce(&mut State, u64) -> T) -> Result<T, c_int> {
    let mut state = lock(&handle.state);
    state.check(handle.generation).map_err(|_| error)?;
    Ok(op(&mut state, handle.inode))
}

unsafe extern "C" fn x_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file this VFS opened, once.
    unsafe {
        let handle = Box::from_raw((*(file as *mut File)).handle);
        (*file).pMethods = ptr::null();
        // Even without power: a closed connection no longer holds its database.
        let mut state = lock(&handle.state);
        if handle.generation == state.generation
            && let Some(inode) = state.inodes.get_mut(&handle.inode)
        {
            inode.locks.release(handle.id);
            if handle.shm.is_some() {
                inode.shm_maps = inode.shm_maps.saturating_sub(1);
            }
            if handle.main_db {
                inode.db_opens = inode.db_opens.saturating_sub(1);
            }
        }
        if handle.delete_on_close && state.check(handle.generation).is_ok() {
            match &handle.path {
                // A named file loses its name; its contents go when nothing names them
                // (at the next restart).
                Some(path) => {
                    let _ = state.remove(path);
                }
                None => {
                    state.inodes.remove(&handle.inode);
                }
            }
        }
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn x_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite provides `amount` bytes at `buf`.
    unsafe {
        let buf = std::slice::from_raw_parts_mut(buf.cast::<u8>(), amount as usize);
        let read = with_file(handle(file), ffi::SQLITE_IOERR_READ, |state, inode| {
            state.inodes.get(&inode).map_or(0, |inode| inode.read(offset as usize, buf))
        });
        match read {
            Ok(n) if n == buf.len() => ffi::SQLITE_OK,
            Ok(n) => {
                // A short read must zero the rest.
                buf[n..].fill(0);
                ffi::SQLITE_IOERR_SHORT_READ
            }
            Err(code) => code,
        }
    }
}

unsafe extern "C" fn x_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite provides `amount` bytes at `buf`.
    unsafe {
        let bytes = std::slice::from_raw_parts(buf.cast::<u8>(), amount as usize);
        let wal = handle(file).wal;
        match with_file(handle(file), ffi::SQLITE_IOERR_WRITE, |state, inode| {
            if state.fail_planned_write(inode) {
                return ffi::SQLITE_IOERR_WRITE;
            }
            if state.no_room_for(Some(inode), offset as usize + bytes.len()) {
                return ffi::SQLITE_FULL;
            }
            state.write(inode, offset as usize, bytes, wal);
            ffi::SQLITE_OK
        }) {
            Ok(code) | Err(code) => code,
        }
    }
}

unsafe extern "C" fn x_truncate(file: *mut ffi::sqlite3_file, size: ffi::sqlite3_int64) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let truncated = with_file(handle, ffi::SQLITE_IOERR_TRUNCATE, |state, inode| {
        if let Some(inode) = state.inodes.get_mut(&inode) {
            inode.truncate(size as usize);
        }
    });
    truncated.err().unwrap_or(ffi::SQLITE_OK)
}

unsafe extern "C" fn x_sync(file: *mut ffi::sqlite3_file, _flags: c_int) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let sync_dir = std::mem::take(&mut handle.sync_dir_pending);
    let checkpoint = handle.path.as_ref().is_some_and(|p| p.extension().is_some_and(|e| e == "sqlite"));
    let synced = with_file(handle, ffi::SQLITE_IOERR_FSYNC, |state, inode| {
        if state.fail_planned_sync(inode) {
            return false;
        }
        state.sync_inode(inode);
        state.stats.checkpoints += u64::from(checkpoint);
        if let (true, Some(path)) = (sync_dir, &handle.path) {
            state.sync_dir(parent(path));
        }
        true
    });
    match synced {
        Ok(true) => ffi::SQLITE_OK,
        Ok(false) => {
            // The name is as durable as it was: the next sync makes it so.
            handle.sync_dir_pending = sync_dir;
            ffi::SQLITE_IOERR_FSYNC
        }
        Err(code) => code,
    }
}

unsafe extern "C" fn x_file_size(file: *mut ffi::sqlite3_file, out: *mut ffi::sqlite3_int64) -> c_int {
    // SAFETY: a file this VFS opened and an output slot.
    unsafe {
        let size = with_file(handle(file), ffi::SQLITE_IOERR_FSTAT, |state, inode| {
            state.inodes.get(&inode).map_or(0, |i| i.len())
        });
        match size {
            Ok(size) => {
                *out = size as ffi::sqlite3_int64;
                ffi::SQLITE_OK
            }
            Err(code) => code,
        }
    }
}

/// Runs `op` on the locks of `handle`'s file.
fn with_locks<T>(
    handle: &Handle,
    error: c_int,
    op: impl FnOnce(&mut crate::disk::Locks) -> T,
) -> Result<T, c_int> {
    with_file(handle, error, |state, inode| state.inodes.get_mut(&inode).map(|i| op(&mut i.locks)))?
        .ok_or(error)
}

unsafe extern "C" fn x_lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let id = handle.id;
    match with_locks(handle, ffi::SQLITE_IOERR_LOCK, |locks| locks.lock_file(id, level)) {
        Ok(true) => ffi::SQLITE_OK,
        Ok(false) => ffi::SQLITE_BUSY,
        Err(code) => code,
    }
}

unsafe extern "C" fn x_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let id = handle.id;
    with_locks(handle, ffi::SQLITE_IOERR_UNLOCK, |locks| locks.unlock_file(id, level))
        .err()
        .unwrap_or(ffi::SQLITE_OK)
}

unsafe extern "C" fn x_check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    // SAFETY: a file this VFS opened and an output slot.
    let (handle, out) = unsafe { (handle(file), &mut *out) };
    match with_locks(handle, ffi::SQLITE_IOERR_CHECKRESERVEDLOCK, |locks| locks.reserved()) {
        Ok(reserved) => {
            *out = c_int::from(reserved);
            ffi::SQLITE_OK
        }
        Err(code) => code,
    }
}

unsafe extern "C" fn x_file_control(_file: *mut ffi::sqlite3_file, _op: c_int, _arg: *mut c_void) -> c_int {
    ffi::SQLITE_NOTFOUND
}

unsafe extern "C" fn x_sector_size(_file: *mut ffi::sqlite3_file) -> c_int {
    4096
}

unsafe extern "C" fn x_device_characteristics(_file: *mut ffi::sqlite3_file) -> c_int {
    ffi::SQLITE_IOCAP_POWERSAFE_OVERWRITE
}

unsafe extern "C" fn x_shm_map(
    file: *mut ffi::sqlite3_file,
    region: c_int,
    region_bytes: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: a file this VFS opened and an output slot. The region is boxed and kept by
    // the handle's `Shm`, so the pointer stays valid until `xShmUnmap` or `xClose`.
    unsafe {
        *out = ptr::null_mut();
        let handle = handle(file);
        if region_bytes as usize != SHM_REGION_BYTES {
            return ffi::SQLITE_IOERR_SHMMAP;
        }
        let attached = handle.shm.is_some();
        let shm = with_file(handle, ffi::SQLITE_IOERR_SHMMAP, |state, inode| {
            let file = state.inodes.get_mut(&inode)?;
            if !attached {
                // The first to attach starts the index empty (unix truncates `-shm`).
                if file.shm_maps == 0 {
                    file.shm.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
                }
                file.shm_maps += 1;
            }
            Some(file.shm.clone())
        });
        let shm = match shm {
            Ok(Some(shm)) => handle.shm.get_or_insert(shm).clone(),
            Ok(None) | Err(_) => return ffi::SQLITE_IOERR_SHMMAP,
        };
        let mut regions = shm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let region = region as usize;
        if region >= regions.len() {
            if extend == 0 {
                return ffi::SQLITE_OK;
            }
            regions.resize_with(region + 1, || vec![0u8; SHM_REGION_BYTES].into_boxed_slice());
        }
        *out = regions[region].as_mut_ptr().cast();
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let id = handle.id;
    if !(0..8).contains(&offset) || !(1..=8 - offset).contains(&n) {
        return ffi::SQLITE_IOERR_SHMLOCK;
    }
    let mask = (((1u16 << n) - 1) << offset) as u8;
    let unlock = flags & ffi::SQLITE_SHM_UNLOCK != 0;
    let exclusive = flags & ffi::SQLITE_SHM_EXCLUSIVE != 0;
    match with_locks(handle, ffi::SQLITE_IOERR_SHMLOCK, |locks| locks.lock_shm(id, mask, unlock, exclusive)) {
        Ok(true) => ffi::SQLITE_OK,
        Ok(false) => ffi::SQLITE_BUSY,
        Err(code) => code,
    }
}

unsafe extern "C" fn x_shm_barrier(_file: *mut ffi::sqlite3_file) {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// The handle no longer has the WAL index mapped.
fn detach_shm(handle: &Handle) {
    let mut state = lock(&handle.state);
    if handle.generation == state.generation
        && let Some(file) = state.inodes.get_mut(&handle.inode)
    {
        file.shm_maps = file.shm_maps.saturating_sub(1);
    }
}

unsafe extern "C" fn x_shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: a file this VFS opened.
    let handle = unsafe { handle(file) };
    let id = handle.id;
    let _ = with_locks(handle, ffi::SQLITE_IOERR_SHMLOCK, |locks| locks.release_shm(id));
    // SQLite asks to delete only when it holds the file's exclusive lock, that is, as its
    // last connection; the count guards the index the other connection maps anyway.
    let last = with_file(handle, ffi::SQLITE_IOERR_SHMLOCK, |state, inode| {
        state.inodes.get(&inode).is_none_or(|i| i.db_opens <= 1)
    })
    .unwrap_or(true);
    if let Some(shm) = handle.shm.take() {
        detach_shm(handle);
        if delete != 0 && last {
            shm.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        }
    }
    ffi::SQLITE_OK
}
