//! A SQLite VFS that writes a commit's WAL frames with one write instead of two a frame.
//!
//! SQLite writes each WAL frame as its 24-byte header, then its page: a commit of seven
//! frames is fourteen system calls (docs/benchmarks.md). This VFS is stacked on another
//! one, its base (the `Files` seam's: SQLite's `unix-excl`, or the simulated disk's). A
//! WAL file's appends are held in memory ([`WalGather`]) and written with one call of the
//! base as soon as the commit's last frame (the one whose header carries the database's
//! size) is complete. Every other file, the database file included, is the base's own
//! object (this VFS opens it in SQLite's storage and steps aside).
//!
//! Why nothing a reader or a crash could depend on is ever held:
//! - a commit's frames reach the file when its last frame does, inside SQLite's write of
//!   it: before any sync, before SQLite names them in the WAL index (where the
//!   checkpointer's connection looks), before the commit returns, whatever `synchronous`
//!   says;
//! - only appends are held: a write over bytes already written since the WAL last
//!   started over (a checksum rewrite, a page changed again after its transaction
//!   spilled) writes what is held, then goes straight to the file, as SQLite made it;
//! - so what is held at any other moment belongs to a transaction not yet committed (its
//!   frames, after a large one spilled its page cache, and a restarted WAL's header),
//!   which SQLite reads back through this handle (served from memory) and no other
//!   connection reads, or to one that rolled back, which SQLite had written too, beyond
//!   the last commit, where nothing reads;
//! - one connection writes a shard's WAL, the shard's own: the engine's directory lock
//!   keeps a second engine off the file, and the checkpointer's connection only reads
//!   it (`PASSIVE`). A second connection writing the WAL through this VFS would see a
//!   rolled-back transaction's held frames written after its own;
//! - a WAL whose database lacks power-safe overwrite is not gathered: SQLite then pads a
//!   commit with copies of its last frame and splits a write at a sector boundary. SQLite
//!   asks the database file; this VFS asks the WAL's object and the database's `psow`
//!   URI parameter, which is what `unix` answers the database with (fixed at open) and
//!   what its WAL objects do not see. A base that answers otherwise must not be used.
//!
//! A failed write of what is held answers the call that wrote it: a write or a sync with
//! the write's own error (`SQLITE_FULL` for a full disk), which SQLite treats as a failed
//! write of its own and rolls the whole transaction back; a read with
//! `SQLITE_IOERR_READ` (never `SQLITE_FULL`, after which SQLite may undo only the
//! statement, keeping earlier ones whose frames were dropped); a truncation or a close
//! with the write's error. What was held is dropped.
//!
//! The C ABI of `sqlite3_vfs` and `sqlite3_io_methods`: each function trusts the
//! pointers SQLite hands it, as the VFS contract allows, and turns to safe code on
//! [`WalGather`] as soon as it can.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::ptr;
use std::sync::Mutex;

use rusqlite::ffi;

/// The most bytes a WAL file holds before it writes them: a batch's commit is a few
/// dozen KiB; a larger transaction is written in pieces of at most this. SQLite's unix
/// VFS writes less than 128 KiB a call (`seekAndWrite` masks the length with `0x1ffff`)
/// and answers a longer write with `SQLITE_FULL`; a frame is at most a 64 KiB page and
/// its header.
const HELD_BYTES_MAX: usize = 96 << 10;
const _: () = assert!(HELD_BYTES_MAX < 128 << 10 && HELD_BYTES_MAX >= (64 << 10) + FRAME_HEADER_BYTES);

/// The bytes of a WAL frame's header; bytes 4 to 8 of a commit's last frame hold the
/// database's size in pages, zero in every other frame.
const FRAME_HEADER_BYTES: usize = 24;

/// The names registered so far, by their base's name. Registrations live as long as the
/// process (SQLite keeps the pointers).
static REGISTERED: Mutex<BTreeMap<Option<String>, String>> = Mutex::new(BTreeMap::new());

/// Registers this VFS stacked on `base` (`None`: SQLite's default VFS), once per base,
/// and returns its name.
pub(super) fn vfs_over(base: Option<&str>) -> Result<String, rusqlite::Error> {
    let mut registered = REGISTERED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(name) = registered.get(&base.map(str::to_owned)) {
        return Ok(name.clone());
    }
    let name = format!("oncegate-gather/{}", base.unwrap_or("default"));
    let c_name = CString::new(name.clone()).map_err(|_| misuse("a VFS name holds a NUL"))?;
    let c_base = base.map(CString::new).transpose().map_err(|_| misuse("a VFS name holds a NUL"))?;
    // SAFETY: `sqlite3_vfs_find` returns a registered VFS or null; a registered VFS lives
    // for the process. The structures handed to `sqlite3_vfs_register` are leaked, so they
    // live as long as SQLite may read them.
    unsafe {
        let base_vfs = ffi::sqlite3_vfs_find(c_base.as_ref().map_or(ptr::null(), |b| b.as_ptr()));
        if base_vfs.is_null() {
            return Err(misuse("no such VFS to gather WAL writes over"));
        }
        let vfs = Box::into_raw(Box::new(ffi::sqlite3_vfs {
            iVersion: 2,
            szOsFile: std::mem::size_of::<File>() as c_int + (*base_vfs).szOsFile,
            mxPathname: (*base_vfs).mxPathname,
            pNext: ptr::null_mut(),
            zName: c_name.into_raw(),
            pAppData: base_vfs.cast(),
            xOpen: Some(x_open),
            xDelete: Some(x_delete),
            xAccess: Some(x_access),
            xFullPathname: Some(x_full_pathname),
            xDlOpen: Some(x_dl_open),
            xDlError: Some(x_dl_error),
            xDlSym: Some(x_dl_sym),
            xDlClose: Some(x_dl_close),
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
        if rc != ffi::SQLITE_OK {
            return Err(rusqlite::Error::SqliteFailure(ffi::Error::new(rc), Some(name)));
        }
    }
    registered.insert(base.map(str::to_owned), name.clone());
    Ok(name)
}

fn misuse(message: &str) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(ffi::Error::new(ffi::SQLITE_MISUSE), Some(message.to_owned()))
}

/// Where a WAL file's writes go: its base object.
trait Sink {
    /// Writes `bytes` at `offset`; SQLite's result code.
    fn write(&mut self, bytes: &[u8], offset: i64) -> c_int;
}

/// A WAL file's gathering: the writes it holds, how far the WAL has been written, and
/// whether the last write was a commit's last frame header.
struct WalGather {
    /// The held bytes, which go at `held_at`.
    held: Vec<u8>,
    held_at: i64,
    /// The furthest byte written or held since a write at the file's start (the WAL's
    /// header, when it starts over): a write below it overwrites, and is never held.
    /// While bytes are held, they end here.
    written_end: i64,
    /// Where the page of a commit's last frame goes, once its header was the last write:
    /// that page ends the commit.
    commit_page_at: Option<i64>,
    /// Whether writes are held at all (not without power-safe overwrite).
    gathering: bool,
}

/// How much of a read the held bytes cover.
#[derive(Debug, PartialEq)]
enum Cover {
    Whole,
    Nothing,
    Part,
}

impl WalGather {
    fn new(gathering: bool) -> WalGather {
        WalGather { held: Vec::new(), held_at: 0, written_end: 0, commit_page_at: None, gathering }
    }

    fn held_end(&self) -> i64 {
        self.held_at + self.held.len() as i64
    }

    /// SQLite's write of `bytes` at `offset`: held when it appends, passed to `sink`
    /// when it overwrites; a commit's last page writes everything held.
    fn write(&mut self, sink: &mut impl Sink, bytes: &[u8], offset: i64) -> c_int {
        // A commit's last frame header (a database size in bytes 4 to 8): its page, next,
        // ends the commit.
        let ends_commit = self.commit_page_at.take() == Some(offset);
        if bytes.len() == FRAME_HEADER_BYTES && bytes[4..8] != [0; 4] {
            self.commit_page_at = Some(offset + FRAME_HEADER_BYTES as i64);
        }
        // What is held goes first unless this write continues it within the bound.
        if !self.held.is_empty()
            && (offset != self.held_end() || self.held.len() + bytes.len() > HELD_BYTES_MAX)
        {
            let rc = self.flush(sink);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        // The WAL's header: the file starts over, and nothing after it was written yet.
        if offset == 0 {
            self.written_end = 0;
        }
        let overwrites = offset < self.written_end;
        self.written_end = self.written_end.max(offset + bytes.len() as i64);
        if !self.gathering || overwrites {
            return sink.write(bytes, offset);
        }
        if self.held.is_empty() {
            self.held_at = offset;
        }
        self.held.extend_from_slice(bytes);
        if ends_commit { self.flush(sink) } else { ffi::SQLITE_OK }
    }

    /// Writes what is held; on failure, drops it and returns the write's error.
    fn flush(&mut self, sink: &mut impl Sink) -> c_int {
        if self.held.is_empty() {
            return ffi::SQLITE_OK;
        }
        let rc = sink.write(&self.held, self.held_at);
        self.held.clear();
        rc
    }

    /// How much of a read of `len` bytes at `offset` the held bytes cover.
    fn cover(&self, offset: i64, len: usize) -> Cover {
        let end = offset + len as i64;
        if self.held.is_empty() || end <= self.held_at || offset >= self.held_end() {
            Cover::Nothing
        } else if offset >= self.held_at && end <= self.held_end() {
            Cover::Whole
        } else {
            Cover::Part
        }
    }

    /// Fills `buf`, a read at `offset` that [`WalGather::cover`]s whole.
    fn read(&self, buf: &mut [u8], offset: i64) {
        let from = (offset - self.held_at) as usize;
        buf.copy_from_slice(&self.held[from..from + buf.len()]);
    }

    /// The file's size with what is held, given its size without.
    fn size(&self, file_bytes: i64) -> i64 {
        if self.held.is_empty() { file_bytes } else { file_bytes.max(self.held_end()) }
    }
}

/// SQLite's file object followed by ours, then the base's (a WAL file only).
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    gather: *mut WalGather,
}

/// The methods of a WAL file. Version 1: SQLite maps memory and shares the WAL index only
/// through a database file.
static WAL_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 1,
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
    xShmMap: None,
    xShmLock: None,
    xShmBarrier: None,
    xShmUnmap: None,
    xFetch: None,
    xUnfetch: None,
};

/// # Safety
/// `vfs` must be a VFS registered by [`vfs_over`].
unsafe fn base_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    // SAFETY: `pAppData` is the base VFS, which lives for the process.
    unsafe { (*vfs).pAppData.cast() }
}

/// The base's object behind a WAL file of ours.
///
/// # Safety
/// `file` must be a WAL file this VFS opened: `szOsFile` bytes, ours first.
unsafe fn base_file(file: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    // SAFETY: the base's object starts right after ours, inside SQLite's storage.
    unsafe { file.cast::<u8>().add(std::mem::size_of::<File>()).cast() }
}

/// # Safety
/// `file` must be a WAL file this VFS opened and has not closed.
unsafe fn gather_of<'a>(file: *mut ffi::sqlite3_file) -> &'a mut WalGather {
    // SAFETY: `x_open` set `gather` to a live box, freed only by `x_close`.
    unsafe { &mut *(*file.cast::<File>()).gather }
}

/// The base method `$method` of the base object `$file`, called with `$args`, or
/// `$missing` when the base has none.
macro_rules! call_base {
    ($file:expr, $method:ident ($($arg:expr),*), or $missing:expr) => {{
        let file = $file;
        match (*(*file).pMethods).$method {
            Some(method) => method(file, $($arg),*),
            None => $missing,
        }
    }};
}

/// The base object of an open WAL file of ours, where its writes go.
struct BaseSink(*mut ffi::sqlite3_file);

impl Sink for BaseSink {
    fn write(&mut self, bytes: &[u8], offset: i64) -> c_int {
        let Ok(amount) = c_int::try_from(bytes.len()) else { return ffi::SQLITE_IOERR_WRITE };
        // SAFETY: a `BaseSink` is made only by `sink`, of an open file's base object; the
        // bytes outlive the call.
        unsafe {
            call_base!(self.0, xWrite(bytes.as_ptr().cast(), amount, offset), or ffi::SQLITE_IOERR_WRITE)
        }
    }
}

/// # Safety
/// `file` must be a WAL file this VFS opened and has not closed.
unsafe fn sink(file: *mut ffi::sqlite3_file) -> BaseSink {
    // SAFETY: as the caller promises.
    BaseSink(unsafe { base_file(file) })
}

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite hands this VFS's pointer and `szOsFile` bytes at `file`, which hold
    // the base's object either at their start (a file that is not a WAL: it is then the
    // base's own) or after ours.
    unsafe {
        let base = base_vfs(vfs);
        let Some(open) = (*base).xOpen else { return ffi::SQLITE_CANTOPEN };
        if flags & ffi::SQLITE_OPEN_WAL == 0 {
            return open(base, name, file, flags, out_flags);
        }
        (*file).pMethods = ptr::null();
        let rc = open(base, name, base_file(file), flags, out_flags);
        if rc != ffi::SQLITE_OK {
            // SQLite closes a failed open only through our `pMethods`, which is null: a
            // base that left its object open is closed here.
            if !(*base_file(file)).pMethods.is_null() {
                call_base!(base_file(file), xClose(), or ffi::SQLITE_OK);
            }
            return rc;
        }
        // SQLite pads a commit when its database file lacks power-safe overwrite, which
        // for `unix` is the database's `psow` URI parameter (a WAL's own answer ignores it).
        let characteristics = call_base!(base_file(file), xDeviceCharacteristics(), or 0);
        let gathering = characteristics & ffi::SQLITE_IOCAP_POWERSAFE_OVERWRITE != 0
            && ffi::sqlite3_uri_boolean(name, c"psow".as_ptr(), 1) != 0;
        let gather = Box::into_raw(Box::new(WalGather::new(gathering)));
        ptr::write(file.cast::<File>(), File { base: ffi::sqlite3_file { pMethods: &WAL_METHODS }, gather });
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file this VFS opened, once.
    unsafe {
        let flushed = gather_of(file).flush(&mut sink(file));
        let closed = call_base!(base_file(file), xClose(), or ffi::SQLITE_OK);
        drop(Box::from_raw((*file.cast::<File>()).gather));
        (*file).pMethods = ptr::null();
        if flushed != ffi::SQLITE_OK { flushed } else { closed }
    }
}

unsafe extern "C" fn x_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite provides `amount` bytes at `buf`, on a WAL file of ours.
    unsafe {
        let Ok(len) = usize::try_from(amount) else { return ffi::SQLITE_IOERR_WRITE };
        if len == 0 {
            return ffi::SQLITE_OK;
        }
        gather_of(file).write(&mut sink(file), std::slice::from_raw_parts(buf.cast::<u8>(), len), offset)
    }
}

unsafe extern "C" fn x_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite provides `amount` bytes at `buf`, on a WAL file of ours.
    unsafe {
        let Ok(len) = usize::try_from(amount) else { return ffi::SQLITE_IOERR_READ };
        let gather = gather_of(file);
        match gather.cover(offset, len) {
            Cover::Whole => {
                gather.read(std::slice::from_raw_parts_mut(buf.cast::<u8>(), len), offset);
                return ffi::SQLITE_OK;
            }
            Cover::Nothing => {}
            // A frame whose header was written before the bound was reached, and whose
            // page is held: rare, so what is held is written first.
            Cover::Part => {
                if gather.flush(&mut sink(file)) != ffi::SQLITE_OK {
                    return ffi::SQLITE_IOERR_READ;
                }
            }
        }
        call_base!(base_file(file), xRead(buf, amount, offset), or ffi::SQLITE_IOERR_READ)
    }
}

unsafe extern "C" fn x_file_size(file: *mut ffi::sqlite3_file, out: *mut ffi::sqlite3_int64) -> c_int {
    // SAFETY: a WAL file of ours and SQLite's output slot.
    unsafe {
        let rc = call_base!(base_file(file), xFileSize(out), or ffi::SQLITE_IOERR_FSTAT);
        if rc == ffi::SQLITE_OK {
            *out = gather_of(file).size(*out);
        }
        rc
    }
}

unsafe extern "C" fn x_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: a WAL file of ours; the flags are SQLite's, passed on.
    unsafe {
        let rc = gather_of(file).flush(&mut sink(file));
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        call_base!(base_file(file), xSync(flags), or ffi::SQLITE_IOERR_FSYNC)
    }
}

unsafe extern "C" fn x_truncate(file: *mut ffi::sqlite3_file, size: ffi::sqlite3_int64) -> c_int {
    // SAFETY: a WAL file of ours.
    unsafe {
        let gather = gather_of(file);
        let rc = gather.flush(&mut sink(file));
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        gather.written_end = gather.written_end.min(size);
        call_base!(base_file(file), xTruncate(size), or ffi::SQLITE_IOERR_TRUNCATE)
    }
}

/// Defines `$name`, a method of a WAL file that its base object answers as it is
/// (`x_file_control`, `x_lock`, `x_unlock`, `x_check_reserved_lock`, `x_sector_size`,
/// `x_device_characteristics`).
macro_rules! passing {
    ($name:ident, $method:ident ($($arg:ident: $ty:ty),*), or $missing:expr) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file, $($arg: $ty),*) -> c_int {
            // SAFETY: a WAL file this VFS opened; the arguments are SQLite's, passed on.
            unsafe { call_base!(base_file(file), $method($($arg),*), or $missing) }
        }
    };
}

passing!(x_file_control, xFileControl(op: c_int, arg: *mut c_void), or ffi::SQLITE_NOTFOUND);
passing!(x_lock, xLock(level: c_int), or ffi::SQLITE_IOERR_LOCK);
passing!(x_unlock, xUnlock(level: c_int), or ffi::SQLITE_IOERR_UNLOCK);
passing!(x_check_reserved_lock, xCheckReservedLock(out: *mut c_int), or ffi::SQLITE_IOERR_CHECKRESERVEDLOCK);
passing!(x_sector_size, xSectorSize(), or 4096);
passing!(x_device_characteristics, xDeviceCharacteristics(), or 0);

/// Defines `$name`, a method of this VFS that its base answers (`x_delete`, `x_access`,
/// `x_full_pathname`, `x_randomness`, `x_sleep`, `x_current_time`, `x_get_last_error`,
/// `x_current_time_int64` and the `x_dl_*` of loadable extensions).
macro_rules! vfs_passing {
    ($name:ident, $method:ident ($($arg:ident: $ty:ty),*) -> $ret:ty, or $missing:expr) => {
        unsafe extern "C" fn $name(vfs: *mut ffi::sqlite3_vfs, $($arg: $ty),*) -> $ret {
            // SAFETY: a VFS registered by `vfs_over`; the arguments are SQLite's.
            unsafe {
                let base = base_vfs(vfs);
                match (*base).$method {
                    Some(method) => method(base, $($arg),*),
                    None => $missing,
                }
            }
        }
    };
}

vfs_passing!(x_delete, xDelete(name: *const c_char, sync_dir: c_int) -> c_int, or ffi::SQLITE_IOERR_DELETE);
vfs_passing!(x_access, xAccess(name: *const c_char, flags: c_int, out: *mut c_int) -> c_int, or ffi::SQLITE_IOERR_ACCESS);
vfs_passing!(x_full_pathname, xFullPathname(name: *const c_char, n: c_int, out: *mut c_char) -> c_int, or ffi::SQLITE_CANTOPEN);
vfs_passing!(x_randomness, xRandomness(n: c_int, out: *mut c_char) -> c_int, or 0);
vfs_passing!(x_sleep, xSleep(micros: c_int) -> c_int, or 0);
vfs_passing!(x_current_time, xCurrentTime(out: *mut f64) -> c_int, or ffi::SQLITE_ERROR);
vfs_passing!(x_get_last_error, xGetLastError(n: c_int, out: *mut c_char) -> c_int, or 0);
vfs_passing!(x_current_time_int64, xCurrentTimeInt64(out: *mut ffi::sqlite3_int64) -> c_int, or ffi::SQLITE_ERROR);

/// A symbol of a loaded library, as `xDlSym` answers it.
type Symbol = Option<unsafe extern "C" fn(*mut ffi::sqlite3_vfs, *mut c_void, *const c_char)>;

vfs_passing!(x_dl_open, xDlOpen(name: *const c_char) -> *mut c_void, or ptr::null_mut());
vfs_passing!(x_dl_error, xDlError(n: c_int, out: *mut c_char) -> (), or ());
vfs_passing!(x_dl_sym, xDlSym(library: *mut c_void, name: *const c_char) -> Symbol, or None);
vfs_passing!(x_dl_close, xDlClose(library: *mut c_void) -> (), or ());

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use rusqlite::{Connection, OpenFlags, params};

    use super::*;
    use crate::files::{Files, OsFiles};

    /// The writes that reached the file, and the answer of the next one.
    #[derive(Default)]
    struct Recorder {
        writes: Vec<(i64, Vec<u8>)>,
        fail_next: Option<c_int>,
    }

    impl Sink for Recorder {
        fn write(&mut self, bytes: &[u8], offset: i64) -> c_int {
            if let Some(rc) = self.fail_next.take() {
                return rc;
            }
            self.writes.push((offset, bytes.to_vec()));
            ffi::SQLITE_OK
        }
    }

    const PAGE: usize = 512;

    fn header(commit: bool) -> Vec<u8> {
        let mut header = vec![0; FRAME_HEADER_BYTES];
        if commit {
            // A database size of 9 pages marks a commit's last frame.
            header[7] = 9;
        }
        header
    }

    /// Writes frame `n` (counting from 0, after the 32-byte WAL header) to `held`.
    fn frame(gather: &mut WalGather, file: &mut Recorder, n: i64, commit: bool) -> c_int {
        let at = 32 + n * (FRAME_HEADER_BYTES + PAGE) as i64;
        let rc = gather.write(file, &header(commit), at);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        gather.write(file, &[(n as u8).wrapping_add(1); PAGE], at + FRAME_HEADER_BYTES as i64)
    }

    #[test]
    fn a_commits_frames_reach_the_file_in_one_write_when_its_last_frame_does() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        assert_eq!(gather.write(&mut file, &[1; 32], 0), ffi::SQLITE_OK);
        for n in 0..3 {
            assert_eq!(frame(&mut gather, &mut file, n, false), ffi::SQLITE_OK);
        }
        assert!(file.writes.is_empty(), "nothing before the commit's last frame");
        assert_eq!(frame(&mut gather, &mut file, 3, true), ffi::SQLITE_OK);
        assert_eq!(file.writes.len(), 1);
        assert_eq!(file.writes[0].0, 0);
        assert_eq!(file.writes[0].1.len(), 32 + 4 * (FRAME_HEADER_BYTES + PAGE));
        assert!(gather.held.is_empty());
    }

    #[test]
    fn an_overwrite_goes_to_the_file_as_it_comes_and_the_next_commit_is_still_one_write() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        frame(&mut gather, &mut file, 0, false);
        frame(&mut gather, &mut file, 1, true);
        assert_eq!(file.writes.len(), 1);
        // A checksum rewrite of the commit's last header: an overwrite, written at once,
        // although no page follows it.
        let at = 32 + (FRAME_HEADER_BYTES + PAGE) as i64;
        assert_eq!(gather.write(&mut file, &header(true), at), ffi::SQLITE_OK);
        assert_eq!(file.writes.len(), 2, "the overwrite is not held");
        // The next commit is one frame: its page ends it.
        frame(&mut gather, &mut file, 2, true);
        assert_eq!(file.writes.len(), 3);
        assert!(gather.held.is_empty(), "the one-frame commit is on the file");
    }

    #[test]
    fn a_transaction_after_a_rollback_overwrites_and_a_restarted_wal_is_held_again() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        frame(&mut gather, &mut file, 0, false);
        frame(&mut gather, &mut file, 1, false);
        // Rolled back: the next transaction writes over frame 0, which is not held.
        frame(&mut gather, &mut file, 0, false);
        // The spilled frames (one write), then frame 0's header and page as they came.
        assert_eq!(file.writes.len(), 3);
        assert!(gather.held.is_empty());
        // The WAL starts over: its header and the frames after it are held until the
        // commit's last frame, and written at once.
        gather.write(&mut file, &[2; 32], 0);
        frame(&mut gather, &mut file, 0, false);
        assert_eq!(file.writes.len(), 3);
        frame(&mut gather, &mut file, 1, true);
        assert_eq!(file.writes.len(), 4);
        assert_eq!(file.writes[3].1.len(), 32 + 2 * (FRAME_HEADER_BYTES + PAGE));
    }

    #[test]
    fn held_frames_are_read_back_and_counted_in_the_size() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        frame(&mut gather, &mut file, 0, false);
        let page_at = 32 + FRAME_HEADER_BYTES as i64;
        assert_eq!(gather.cover(page_at, PAGE), Cover::Whole);
        let mut page = vec![9; PAGE];
        gather.read(&mut page, page_at);
        assert_eq!(page, vec![1; PAGE]);
        assert_eq!(gather.cover(page_at + PAGE as i64, PAGE), Cover::Nothing);
        assert_eq!(gather.cover(page_at, 2 * PAGE), Cover::Part);
        assert_eq!(gather.size(0), 32 + (FRAME_HEADER_BYTES + PAGE) as i64);
        assert_eq!(gather.size(1 << 20), 1 << 20);
    }

    #[test]
    fn more_than_the_bound_is_written_in_pieces_below_it() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        let frames = (2 * HELD_BYTES_MAX / (FRAME_HEADER_BYTES + PAGE)) as i64;
        for n in 0..frames {
            frame(&mut gather, &mut file, n, n == frames - 1);
        }
        assert!(file.writes.iter().all(|(_, bytes)| bytes.len() <= HELD_BYTES_MAX));
        let total: usize = file.writes.iter().map(|(_, bytes)| bytes.len()).sum();
        assert_eq!(total, 32 + frames as usize * (FRAME_HEADER_BYTES + PAGE));
    }

    #[test]
    fn a_failed_write_answers_the_call_that_made_it_and_drops_what_was_held() {
        let (mut gather, mut file) = (WalGather::new(true), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        frame(&mut gather, &mut file, 0, false);
        file.fail_next = Some(ffi::SQLITE_FULL);
        assert_eq!(frame(&mut gather, &mut file, 1, true), ffi::SQLITE_FULL);
        assert!(gather.held.is_empty() && file.writes.is_empty());
        // SQLite rolls back and writes the frames again: they reach the file.
        frame(&mut gather, &mut file, 0, false);
        frame(&mut gather, &mut file, 1, true);
        assert_eq!(
            file.writes.iter().map(|(_, bytes)| bytes.len()).sum::<usize>(),
            2 * (FRAME_HEADER_BYTES + PAGE)
        );
    }

    #[test]
    fn without_power_safe_overwrite_every_write_goes_to_the_file() {
        let (mut gather, mut file) = (WalGather::new(false), Recorder::default());
        gather.write(&mut file, &[1; 32], 0);
        frame(&mut gather, &mut file, 0, true);
        assert_eq!(file.writes.len(), 3);
    }

    fn open(path: &str, vfs: &str, synchronous: &str) -> Connection {
        let flags = OpenFlags::default() | OpenFlags::SQLITE_OPEN_URI;
        let conn = Connection::open_with_flags_and_vfs(path, flags, vfs).unwrap();
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0)).unwrap();
        assert_eq!(mode, "wal");
        conn.pragma_update(None, "synchronous", synchronous).unwrap();
        conn
    }

    fn rows(conn: &Connection) -> Vec<(i64, Vec<u8>)> {
        let mut stmt = conn.prepare("SELECT id, body FROM t ORDER BY id").unwrap();
        stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?))).unwrap().map(Result::unwrap).collect()
    }

    /// What a process crash would leave: the database file and its WAL as the files hold
    /// them now (the writer still open), opened as a new process would.
    fn crash_image(dir: &Path, path: &Path, round: i64, vfs: &str) -> (PathBuf, Connection) {
        let files = OsFiles;
        let image = dir.join(format!("image-{round}.sqlite"));
        files.write_new(&image, &files.read(path).unwrap()).unwrap();
        let wal = crate::files::companion(path, "-wal");
        files.write_new(&crate::files::companion(&image, "-wal"), &files.read(&wal).unwrap()).unwrap();
        let conn = Connection::open_with_flags_and_vfs(&image, OpenFlags::default(), vfs).unwrap();
        (image, conn)
    }

    /// Checks that `image` holds the rows `committed` and the one-page table's `n`.
    fn crash_keeps(image: &Connection, committed: &[(i64, Vec<u8>)], n: i64, case: &str) {
        let check: String = image.query_row("PRAGMA integrity_check", [], |row| row.get(0)).unwrap();
        assert_eq!(check, "ok", "{case}");
        assert!(rows(image) == committed, "a crash keeps every commit ({case})");
        let found: i64 = image.query_row("SELECT n FROM one", [], |row| row.get(0)).unwrap();
        assert_eq!(found, n, "a crash keeps the one-page commit ({case})");
    }

    /// SQLite through the VFS, under both settings of `synchronous`, with and without
    /// power-safe overwrite: transactions larger than the page cache (SQLite spills frames
    /// and reads them back, and rewrites their checksums when it changes a spilled page),
    /// rolled back after spilling, one-page commits, checkpoints that truncate the WAL. After
    /// every commit a second connection, which reads the frames the shared WAL index names
    /// and checkpoints them as the checkpointer does, sees it, and so does a crash image of
    /// the files.
    #[test]
    fn every_commit_is_seen_by_a_reader_and_kept_by_a_crash_image() {
        for (synchronous, psow) in [("FULL", 1), ("NORMAL", 1), ("FULL", 0), ("NORMAL", 0)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("gathered.sqlite");
            let uri = format!("file:{}?psow={psow}", path.display());
            let vfs = vfs_over(Some("unix-excl")).unwrap();
            let mut conn = open(&uri, &vfs, synchronous);
            conn.pragma_update(None, "cache_size", 8).unwrap();
            conn.execute_batch(
                "CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL, n INTEGER NOT NULL);
                 CREATE TABLE one (id INTEGER PRIMARY KEY, n INTEGER NOT NULL);
                 INSERT INTO one VALUES (0, -1);",
            )
            .unwrap();
            let reader = open(&uri, &vfs, synchronous);
            let mut committed: Vec<(i64, Vec<u8>)> = Vec::new();
            let mut seed = 7_u64;
            let mut next = || {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                seed >> 33
            };
            for round in 0..24_i64 {
                let tx = conn.transaction().unwrap();
                let mut written = Vec::new();
                for row in 0..(40 + next() % 80) as i64 {
                    let id = round * 1_000 + row;
                    let body = vec![(next() % 251) as u8; 1 + (next() % 6_000) as usize];
                    tx.execute("INSERT INTO t (id, body, n) VALUES (?1, ?2, 0)", params![id, body]).unwrap();
                    written.push((id, body));
                }
                // Changes every page of the transaction again, spilled ones included:
                // SQLite overwrites their frames and rewrites the checksums after them.
                tx.execute("UPDATE t SET n = n + 1 WHERE id >= ?1", [round * 1_000]).unwrap();
                let (id, body) = &written[0];
                let read: Vec<u8> =
                    tx.query_row("SELECT body FROM t WHERE id = ?1", [id], |row| row.get(0)).unwrap();
                assert_eq!(&read, body);
                if round % 5 == 3 {
                    tx.rollback().unwrap();
                } else {
                    tx.commit().unwrap();
                    committed.extend(written);
                }
                let case = format!("round {round}, synchronous {synchronous}, psow {psow}");
                // The second connection and a crash now see the large commit; then a
                // one-page commit, checkpointed by the second connection, and a crash after
                // it keeps both.
                // (`assert!` on the rows: a failing `assert_eq!` would print megabytes.)
                assert!(rows(&reader) == committed, "the reader sees the large commit ({case})");
                // `one` holds the round of the last one-page commit (-1 before the first).
                crash_keeps(
                    &crash_image(dir.path(), &path, 2 * round, "unix-excl").1,
                    &committed,
                    round - 1,
                    &case,
                );
                conn.execute("UPDATE one SET n = ?1 WHERE id = 0", [round]).unwrap();
                reader.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())).expect(&case);
                assert!(rows(&reader) == committed, "the reader sees every commit ({case})");
                // This image is recovered through this VFS, which then appends a commit to
                // a WAL that already holds frames; a plain connection finds all of it.
                let (image, recovered) = crash_image(dir.path(), &path, 2 * round + 1, &vfs);
                crash_keeps(&recovered, &committed, round, &case);
                recovered.execute("UPDATE one SET n = n + 100 WHERE id = 0", []).unwrap();
                drop(recovered);
                let reopened =
                    Connection::open_with_flags_and_vfs(&image, OpenFlags::default(), "unix-excl").unwrap();
                crash_keeps(&reopened, &committed, round + 100, &case);
                if round % 10 == 9 {
                    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_base_is_registered_once_and_an_unknown_one_is_an_error() {
        assert_eq!(vfs_over(Some("unix-excl")).unwrap(), vfs_over(Some("unix-excl")).unwrap());
        assert_ne!(vfs_over(Some("unix-excl")).unwrap(), vfs_over(None).unwrap());
        assert!(vfs_over(Some("no-such-vfs")).is_err());
    }
}
