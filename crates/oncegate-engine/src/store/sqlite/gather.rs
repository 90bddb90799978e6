//! A SQLite VFS that writes a commit's WAL frames with one write instead of two a frame.
//!
//! SQLite writes each WAL frame as its 24-byte header, then its page: a commit of seven
//! frames is fourteen system calls (docs/benchmarks.md). This VFS sits over another one
//! (the files seam's: SQLite's `unix-excl`, or the simulated disk's). A WAL file's writes
//! that append to it are held in memory ([`Held`]) and written with one call of the VFS
//! underneath as soon as the commit's last frame (the one whose header carries the
//! database's size) is complete. Every other file, the database file included, is the
//! underlying VFS's own object (this VFS opens it in SQLite's storage and steps aside).
//!
//! Why nothing a reader or a crash could depend on is ever held:
//! - a commit's frames reach the file when its last frame does, inside SQLite's write of
//!   it: before any sync, before SQLite names them in the WAL index (where the
//!   checkpointer's connection looks), before the commit returns, whatever `synchronous`
//!   says;
//! - only appends are held: a write over bytes already written since the WAL last
//!   started over (a checksum rewrite, a page changed again after its transaction
//!   spilled) writes what is held, then goes straight to the file, as SQLite made it;
//! - so what is held at any other moment is frames of a transaction not yet committed
//!   (a large one that spilled its page cache), which SQLite reads back through this
//!   handle (served from memory) and no other connection reads, or of one that rolled
//!   back, which SQLite had written too (beyond the last commit, where nothing reads);
//! - one connection writes a shard's WAL, the shard's own: the engine's directory lock
//!   keeps a second engine off the file, and the checkpointer's connection only reads
//!   it (`PASSIVE`). A second connection writing the WAL through this VFS would see a
//!   rolled-back transaction's held frames written after its own;
//! - a WAL whose database lacks power-safe overwrite is not gathered: SQLite then pads a
//!   commit with copies of its last frame and splits a write at a sector boundary. SQLite
//!   asks the database file; this VFS asks the WAL's object and the database's `psow`
//!   URI parameter, which is what `unix` answers the database with (fixed at open) and
//!   what its WAL objects do not see. A base VFS that answers otherwise must not be used.
//!
//! A failed write answers the call that made it: SQLite's next write, or its sync, with
//! the write's own error (`SQLITE_FULL` for a full disk), which SQLite treats as a failed
//! write of its own and rolls the whole transaction back; the held bytes are dropped.
//!
//! The C ABI of `sqlite3_vfs` and `sqlite3_io_methods`, as in the simulated disk's VFS:
//! each function checks the pointers SQLite hands it and turns to safe code on [`Held`].
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::ptr;
use std::sync::Mutex;

use rusqlite::ffi;

/// The most bytes a WAL file holds before it writes them: a batch's commit is a few
/// dozen KiB; a larger transaction is written in pieces of at most this. SQLite's unix
/// VFS writes less than 128 KiB a call (`seekAndWrite` masks the length with `0x1ffff`,
/// as SQLite never writes more than a 64 KiB page), and answers a longer write with
/// `SQLITE_FULL`.
const HELD_BYTES_MAX: usize = 96 << 10;

/// The bytes of a WAL frame's header; bytes 4 to 8 of a commit's last frame hold the
/// database's size in pages, zero in every other frame.
const FRAME_HEADER_BYTES: usize = 24;

/// The names registered so far, by the VFS each sits over. Registrations live as long as
/// the process (SQLite keeps the pointers).
static REGISTERED: Mutex<Option<HashMap<Option<String>, String>>> = Mutex::new(None);

/// The name of this VFS over `base` (`None`: SQLite's default VFS), registered on the
/// first call for that base.
pub(crate) fn over(base: Option<&str>) -> Result<String, rusqlite::Error> {
    let mut registered = REGISTERED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let registered = registered.get_or_insert_with(HashMap::new);
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
        let inner = ffi::sqlite3_vfs_find(c_base.as_ref().map_or(ptr::null(), |b| b.as_ptr()));
        if inner.is_null() {
            return Err(misuse("no such VFS to gather WAL writes over"));
        }
        let size = std::mem::size_of::<File>() as c_int + (*inner).szOsFile;
        let vfs = Box::into_raw(Box::new(ffi::sqlite3_vfs {
            iVersion: 2,
            szOsFile: size,
            mxPathname: (*inner).mxPathname,
            pNext: ptr::null_mut(),
            zName: c_name.into_raw(),
            pAppData: inner.cast(),
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

/// Where a WAL file's writes go: the underlying VFS's file.
trait Sink {
    /// Writes `bytes` at `offset`; SQLite's result code.
    fn write(&mut self, bytes: &[u8], offset: i64) -> c_int;
}

/// A WAL file's held writes: `bytes`, to go at `offset`.
struct Held {
    offset: i64,
    bytes: Vec<u8>,
    /// The furthest byte written or held since a write at the file's start (the WAL's
    /// header, when it starts over): a write below it overwrites, and is never held.
    end: i64,
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

impl Held {
    fn new(gathering: bool) -> Held {
        Held { offset: 0, bytes: Vec::new(), end: 0, commit_page_at: None, gathering }
    }

    fn held_end(&self) -> i64 {
        self.offset + self.bytes.len() as i64
    }

    /// SQLite's write of `bytes` at `offset`.
    fn write(&mut self, sink: &mut impl Sink, bytes: &[u8], offset: i64) -> c_int {
        let ends_commit = self.commit_page_at.take() == Some(offset);
        if bytes.len() == FRAME_HEADER_BYTES && bytes[4..8] != [0; 4] {
            self.commit_page_at = Some(offset + FRAME_HEADER_BYTES as i64);
        }
        if !self.bytes.is_empty()
            && (offset != self.held_end() || self.bytes.len() + bytes.len() > HELD_BYTES_MAX)
        {
            let rc = self.flush(sink);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        if offset == 0 {
            self.end = 0;
        }
        let overwrites = self.bytes.is_empty() && offset < self.end;
        self.end = self.end.max(offset + bytes.len() as i64);
        if !self.gathering || overwrites {
            return sink.write(bytes, offset);
        }
        if self.bytes.is_empty() {
            self.offset = offset;
        }
        self.bytes.extend_from_slice(bytes);
        if ends_commit { self.flush(sink) } else { ffi::SQLITE_OK }
    }

    /// Writes what is held; on failure, drops it and returns the write's error.
    fn flush(&mut self, sink: &mut impl Sink) -> c_int {
        if self.bytes.is_empty() {
            return ffi::SQLITE_OK;
        }
        let rc = sink.write(&self.bytes, self.offset);
        self.bytes.clear();
        rc
    }

    /// How much of a read of `len` bytes at `offset` the held bytes cover.
    fn cover(&self, offset: i64, len: usize) -> Cover {
        let end = offset + len as i64;
        if self.bytes.is_empty() || end <= self.offset || offset >= self.held_end() {
            Cover::Nothing
        } else if offset >= self.offset && end <= self.held_end() {
            Cover::Whole
        } else {
            Cover::Part
        }
    }

    /// Fills `buf`, a read at `offset` that [`Held::cover`]s whole.
    fn read(&self, buf: &mut [u8], offset: i64) {
        let from = (offset - self.offset) as usize;
        buf.copy_from_slice(&self.bytes[from..from + buf.len()]);
    }

    /// The file's size with what is held, given its size without.
    fn size(&self, file_bytes: i64) -> i64 {
        if self.bytes.is_empty() { file_bytes } else { file_bytes.max(self.held_end()) }
    }
}

/// SQLite's file object followed by ours, then the underlying VFS's (a WAL file only).
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    held: *mut Held,
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
/// `vfs` must be a VFS registered by [`over`].
unsafe fn inner_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    // SAFETY: `pAppData` is the underlying VFS, which lives for the process.
    unsafe { (*vfs).pAppData.cast() }
}

/// The underlying VFS's file object behind a WAL file of ours.
///
/// # Safety
/// `file` must be a WAL file this VFS opened: `szOsFile` bytes, ours first.
unsafe fn inner(file: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    // SAFETY: the underlying object starts right after ours, inside SQLite's storage.
    unsafe { file.cast::<u8>().add(std::mem::size_of::<File>()).cast() }
}

/// # Safety
/// `file` must be a WAL file this VFS opened and has not closed.
unsafe fn held<'a>(file: *mut ffi::sqlite3_file) -> &'a mut Held {
    // SAFETY: `x_open` set `held` to a live box, freed only by `x_close`.
    unsafe { &mut *(*file.cast::<File>()).held }
}

/// The underlying method `$method` of `$inner`, or `$missing` without one.
macro_rules! call_inner {
    ($inner:expr, $method:ident ($($arg:expr),*) else $missing:expr) => {{
        let inner = $inner;
        match (*(*inner).pMethods).$method {
            Some(method) => method(inner, $($arg),*),
            None => $missing,
        }
    }};
}

/// The underlying object of an open WAL file of ours, where its writes go.
struct Under(*mut ffi::sqlite3_file);

impl Sink for Under {
    fn write(&mut self, bytes: &[u8], offset: i64) -> c_int {
        let Ok(amount) = c_int::try_from(bytes.len()) else { return ffi::SQLITE_IOERR_WRITE };
        // SAFETY: an `Under` is made only by `under`, of an open file's underlying object;
        // the bytes outlive the call.
        unsafe {
            call_inner!(self.0, xWrite(bytes.as_ptr().cast(), amount, offset) else ffi::SQLITE_IOERR_WRITE)
        }
    }
}

/// # Safety
/// `file` must be a WAL file this VFS opened and has not closed.
unsafe fn under(file: *mut ffi::sqlite3_file) -> Under {
    // SAFETY: as the caller promises.
    Under(unsafe { inner(file) })
}

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite hands this VFS's pointer and `szOsFile` bytes at `file`, which hold
    // the underlying object either at their start (a file that is not a WAL: it is then
    // the underlying VFS's own) or after ours.
    unsafe {
        let under = inner_vfs(vfs);
        let Some(open) = (*under).xOpen else { return ffi::SQLITE_CANTOPEN };
        if flags & ffi::SQLITE_OPEN_WAL == 0 {
            return open(under, name, file, flags, out_flags);
        }
        (*file).pMethods = ptr::null();
        let rc = open(under, name, inner(file), flags, out_flags);
        if rc != ffi::SQLITE_OK {
            // A VFS may leave its object open on failure; SQLite would close it.
            if !(*inner(file)).pMethods.is_null() {
                call_inner!(inner(file), xClose() else ffi::SQLITE_OK);
            }
            return rc;
        }
        // SQLite pads a commit when its database file lacks power-safe overwrite, which
        // for `unix` is the database's `psow` URI parameter (a WAL's own answer ignores it).
        let characteristics = call_inner!(inner(file), xDeviceCharacteristics() else 0);
        let gathering = characteristics & ffi::SQLITE_IOCAP_POWERSAFE_OVERWRITE != 0
            && ffi::sqlite3_uri_boolean(name, c"psow".as_ptr(), 1) != 0;
        let held = Box::into_raw(Box::new(Held::new(gathering)));
        ptr::write(file.cast::<File>(), File { base: ffi::sqlite3_file { pMethods: &WAL_METHODS }, held });
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file this VFS opened, once.
    unsafe {
        let flushed = held(file).flush(&mut under(file));
        let closed = call_inner!(inner(file), xClose() else ffi::SQLITE_OK);
        drop(Box::from_raw((*file.cast::<File>()).held));
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
        held(file).write(&mut under(file), std::slice::from_raw_parts(buf.cast::<u8>(), len), offset)
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
        let held = held(file);
        match held.cover(offset, len) {
            Cover::Whole => {
                held.read(std::slice::from_raw_parts_mut(buf.cast::<u8>(), len), offset);
                return ffi::SQLITE_OK;
            }
            Cover::Nothing => {}
            // Never seen: SQLite reads whole frames, and holds whole frames.
            Cover::Part => {
                if held.flush(&mut under(file)) != ffi::SQLITE_OK {
                    return ffi::SQLITE_IOERR_READ;
                }
            }
        }
        call_inner!(inner(file), xRead(buf, amount, offset) else ffi::SQLITE_IOERR_READ)
    }
}

unsafe extern "C" fn x_file_size(file: *mut ffi::sqlite3_file, out: *mut ffi::sqlite3_int64) -> c_int {
    // SAFETY: a WAL file of ours and SQLite's output slot.
    unsafe {
        let rc = call_inner!(inner(file), xFileSize(out) else ffi::SQLITE_IOERR_FSTAT);
        if rc == ffi::SQLITE_OK {
            *out = held(file).size(*out);
        }
        rc
    }
}

unsafe extern "C" fn x_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: a WAL file of ours; the flags are SQLite's, passed on.
    unsafe {
        let rc = held(file).flush(&mut under(file));
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        call_inner!(inner(file), xSync(flags) else ffi::SQLITE_IOERR_FSYNC)
    }
}

unsafe extern "C" fn x_truncate(file: *mut ffi::sqlite3_file, size: ffi::sqlite3_int64) -> c_int {
    // SAFETY: a WAL file of ours.
    unsafe {
        let held = held(file);
        let rc = held.flush(&mut under(file));
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        held.end = held.end.min(size);
        call_inner!(inner(file), xTruncate(size) else ffi::SQLITE_IOERR_TRUNCATE)
    }
}

/// A method of a WAL file that the underlying one answers as it is.
macro_rules! passing {
    ($name:ident, $method:ident ($($arg:ident: $ty:ty),*), $missing:expr) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file, $($arg: $ty),*) -> c_int {
            // SAFETY: a WAL file this VFS opened; the arguments are SQLite's, passed on.
            unsafe { call_inner!(inner(file), $method($($arg),*) else $missing) }
        }
    };
}

passing!(x_file_control, xFileControl(op: c_int, arg: *mut c_void), ffi::SQLITE_NOTFOUND);
passing!(x_lock, xLock(level: c_int), ffi::SQLITE_OK);
passing!(x_unlock, xUnlock(level: c_int), ffi::SQLITE_OK);
passing!(x_check_reserved_lock, xCheckReservedLock(out: *mut c_int), ffi::SQLITE_IOERR_CHECKRESERVEDLOCK);
passing!(x_sector_size, xSectorSize(), 4096);
passing!(x_device_characteristics, xDeviceCharacteristics(), 0);

/// A method of this VFS that the underlying VFS answers.
macro_rules! vfs_passing {
    ($name:ident, $method:ident ($($arg:ident: $ty:ty),*) -> $ret:ty, $missing:expr) => {
        unsafe extern "C" fn $name(vfs: *mut ffi::sqlite3_vfs, $($arg: $ty),*) -> $ret {
            // SAFETY: a VFS registered by `over`; the arguments are SQLite's.
            unsafe {
                let under = inner_vfs(vfs);
                match (*under).$method {
                    Some(method) => method(under, $($arg),*),
                    None => $missing,
                }
            }
        }
    };
}

vfs_passing!(x_delete, xDelete(name: *const c_char, sync_dir: c_int) -> c_int, ffi::SQLITE_IOERR_DELETE);
vfs_passing!(x_access, xAccess(name: *const c_char, flags: c_int, out: *mut c_int) -> c_int, ffi::SQLITE_IOERR_ACCESS);
vfs_passing!(x_full_pathname, xFullPathname(name: *const c_char, n: c_int, out: *mut c_char) -> c_int, ffi::SQLITE_CANTOPEN);
vfs_passing!(x_randomness, xRandomness(n: c_int, out: *mut c_char) -> c_int, 0);
vfs_passing!(x_sleep, xSleep(micros: c_int) -> c_int, 0);
vfs_passing!(x_current_time, xCurrentTime(out: *mut f64) -> c_int, ffi::SQLITE_ERROR);
vfs_passing!(x_get_last_error, xGetLastError(n: c_int, out: *mut c_char) -> c_int, 0);
vfs_passing!(x_current_time_int64, xCurrentTimeInt64(out: *mut ffi::sqlite3_int64) -> c_int, ffi::SQLITE_ERROR);

/// A symbol of a loaded library, as `xDlSym` answers it.
type Symbol = Option<unsafe extern "C" fn(*mut ffi::sqlite3_vfs, *mut c_void, *const c_char)>;

vfs_passing!(x_dl_open, xDlOpen(name: *const c_char) -> *mut c_void, ptr::null_mut());
vfs_passing!(x_dl_error, xDlError(n: c_int, out: *mut c_char) -> (), ());
vfs_passing!(x_dl_sym, xDlSym(library: *mut c_void, name: *const c_char) -> Symbol, None);
vfs_passing!(x_dl_close, xDlClose(library: *mut c_void) -> (), ());

#[cfg(test)]
mod tests {
    use std::path::Path;

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
            header[7] = 9;
        }
        header
    }

    /// Writes frame `n` (counting from 0, after the 32-byte WAL header) to `held`.
    fn frame(held: &mut Held, file: &mut Recorder, n: i64, commit: bool) -> c_int {
        let at = 32 + n * (FRAME_HEADER_BYTES + PAGE) as i64;
        let rc = held.write(file, &header(commit), at);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        held.write(file, &[n as u8; PAGE], at + FRAME_HEADER_BYTES as i64)
    }

    #[test]
    fn a_commits_frames_reach_the_file_in_one_write_when_its_last_frame_does() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        assert_eq!(held.write(&mut file, &[1; 32], 0), ffi::SQLITE_OK);
        for n in 0..3 {
            assert_eq!(frame(&mut held, &mut file, n, false), ffi::SQLITE_OK);
        }
        assert!(file.writes.is_empty(), "nothing before the commit's last frame");
        assert_eq!(frame(&mut held, &mut file, 3, true), ffi::SQLITE_OK);
        assert_eq!(file.writes.len(), 1);
        assert_eq!(file.writes[0].0, 0);
        assert_eq!(file.writes[0].1.len(), 32 + 4 * (FRAME_HEADER_BYTES + PAGE));
        assert!(held.bytes.is_empty());
    }

    #[test]
    fn an_overwrite_goes_to_the_file_as_it_comes_and_the_next_commit_is_still_one_write() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        frame(&mut held, &mut file, 0, false);
        frame(&mut held, &mut file, 1, true);
        assert_eq!(file.writes.len(), 1);
        // A checksum rewrite of the commit's last header: an overwrite, written at once,
        // although no page follows it.
        let at = 32 + (FRAME_HEADER_BYTES + PAGE) as i64;
        assert_eq!(held.write(&mut file, &header(true), at), ffi::SQLITE_OK);
        assert_eq!(file.writes.len(), 2, "the overwrite is not held");
        // The next commit is one frame: its page ends it.
        frame(&mut held, &mut file, 2, true);
        assert_eq!(file.writes.len(), 3);
        assert!(held.bytes.is_empty(), "the one-frame commit is on the file");
    }

    #[test]
    fn a_transaction_after_a_rollback_overwrites_and_a_restarted_wal_is_held_again() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        frame(&mut held, &mut file, 0, false);
        frame(&mut held, &mut file, 1, false);
        // Rolled back: the next transaction writes over frame 0, which is not held.
        frame(&mut held, &mut file, 0, false);
        let writes = file.writes.len();
        assert!(writes >= 2, "the spilled frames, then the overwrite, reached the file");
        assert!(held.bytes.is_empty());
        // The WAL starts over: its header and the frames after it are held until the
        // commit's last frame.
        held.write(&mut file, &[2; 32], 0);
        frame(&mut held, &mut file, 0, false);
        assert_eq!(file.writes.len(), writes);
        frame(&mut held, &mut file, 1, true);
        assert_eq!(file.writes.len(), writes + 1);
    }

    #[test]
    fn held_frames_are_read_back_and_counted_in_the_size() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        frame(&mut held, &mut file, 0, false);
        let page_at = 32 + FRAME_HEADER_BYTES as i64;
        assert_eq!(held.cover(page_at, PAGE), Cover::Whole);
        let mut page = vec![9; PAGE];
        held.read(&mut page, page_at);
        assert_eq!(page, vec![0; PAGE]);
        assert_eq!(held.cover(page_at + PAGE as i64, PAGE), Cover::Nothing);
        assert_eq!(held.cover(page_at, 2 * PAGE), Cover::Part);
        assert_eq!(held.size(0), 32 + (FRAME_HEADER_BYTES + PAGE) as i64);
        assert_eq!(held.size(1 << 20), 1 << 20);
    }

    #[test]
    fn more_than_the_bound_is_written_in_pieces_below_it() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        let frames = (2 * HELD_BYTES_MAX / (FRAME_HEADER_BYTES + PAGE)) as i64;
        for n in 0..frames {
            frame(&mut held, &mut file, n, n == frames - 1);
        }
        assert!(file.writes.len() >= 2);
        assert!(file.writes.iter().all(|(_, bytes)| bytes.len() <= HELD_BYTES_MAX));
        let total: usize = file.writes.iter().map(|(_, bytes)| bytes.len()).sum();
        assert_eq!(total, 32 + frames as usize * (FRAME_HEADER_BYTES + PAGE));
    }

    #[test]
    fn a_failed_write_answers_the_call_that_made_it_and_drops_what_was_held() {
        let (mut held, mut file) = (Held::new(true), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        frame(&mut held, &mut file, 0, false);
        file.fail_next = Some(ffi::SQLITE_FULL);
        assert_eq!(frame(&mut held, &mut file, 1, true), ffi::SQLITE_FULL);
        assert!(held.bytes.is_empty() && file.writes.is_empty());
        // SQLite rolls back and writes the frames again: they reach the file.
        frame(&mut held, &mut file, 0, false);
        frame(&mut held, &mut file, 1, true);
        assert_eq!(
            file.writes.iter().map(|(_, bytes)| bytes.len()).sum::<usize>(),
            2 * (FRAME_HEADER_BYTES + PAGE)
        );
    }

    #[test]
    fn without_power_safe_overwrite_every_write_goes_to_the_file() {
        let (mut held, mut file) = (Held::new(false), Recorder::default());
        held.write(&mut file, &[1; 32], 0);
        frame(&mut held, &mut file, 0, true);
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
    fn crash_image(dir: &Path, path: &Path, round: i64) -> Connection {
        let files = OsFiles;
        let image = dir.join(format!("image-{round}.sqlite"));
        files.write_new(&image, &files.read(path).unwrap()).unwrap();
        let wal = crate::files::companion(path, "-wal");
        files.write_new(&crate::files::companion(&image, "-wal"), &files.read(&wal).unwrap()).unwrap();
        Connection::open_with_flags_and_vfs(&image, OpenFlags::default(), "unix-excl").unwrap()
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
    fn what_goes_through_the_gathering_vfs_is_what_sqlite_wrote() {
        for (synchronous, psow) in [("FULL", 1), ("NORMAL", 1), ("FULL", 0), ("NORMAL", 0)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("gathered.sqlite");
            let uri = format!("file:{}?psow={psow}", path.display());
            let vfs = over(Some("unix-excl")).unwrap();
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
                assert!(rows(&reader) == committed, "the reader sees the large commit ({case})");
                crash_keeps(&crash_image(dir.path(), &path, 2 * round), &committed, round - 1, &case);
                conn.execute("UPDATE one SET n = ?1 WHERE id = 0", [round]).unwrap();
                reader.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())).expect(&case);
                assert!(rows(&reader) == committed, "the reader sees every commit ({case})");
                crash_keeps(&crash_image(dir.path(), &path, 2 * round + 1), &committed, round, &case);
                if round % 10 == 9 {
                    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_base_is_registered_once_and_an_unknown_one_is_an_error() {
        assert_eq!(over(Some("unix-excl")).unwrap(), over(Some("unix-excl")).unwrap());
        assert_ne!(over(Some("unix-excl")).unwrap(), over(None).unwrap());
        assert!(over(Some("no-such-vfs")).is_err());
    }
}
