// Measurement only, never for a server: an LD_PRELOAD shim that gathers the contiguous
// pwrite64s to a *-wal file in memory until the next sync, read, truncate, write
// elsewhere or close of it, to measure what one write per SQLite commit would save
// (docs/benchmarks-journal.md, "A commit's writes gathered into one"). It is only right
// where every commit ends in a sync (durability = "full"), and a crash loses what it holds.
//
//   cc -O2 -shared -fPIC -o /tmp/gather.so crates/oncegate-bench/scripts/gather-wal-writes.c -ldl -lpthread
//   LD_PRELOAD=/tmp/gather.so target/release/oncegate-bench --targets embedded --rounds 2
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
#include <stdio.h>
#include <pthread.h>
#include <sys/types.h>

#define MAXFD 4096
#define CAP (1 << 20)
struct buf { int is_wal; int checked; off_t start; size_t len; char *data; pthread_mutex_t mu; };
static struct buf bufs[MAXFD];
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static int (*real_fdatasync)(int);
static int (*real_fsync)(int);
static int (*real_close)(int);
static int (*real_ftruncate)(int, off_t);
static void init(void) {
  if (!real_pwrite) {
    real_pwrite = dlsym(RTLD_NEXT, "pwrite64");
    real_pread = dlsym(RTLD_NEXT, "pread64");
    real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    real_fsync = dlsym(RTLD_NEXT, "fsync");
    real_close = dlsym(RTLD_NEXT, "close");
    real_ftruncate = dlsym(RTLD_NEXT, "ftruncate64");
    for (int i = 0; i < MAXFD; i++) pthread_mutex_init(&bufs[i].mu, 0);
  }
}
static int wal(int fd) {
  if (fd < 0 || fd >= MAXFD) return 0;
  struct buf *b = &bufs[fd];
  if (!b->checked) {
    char p[64], t[512]; snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(p, t, sizeof t - 1); t[n > 0 ? n : 0] = 0;
    b->is_wal = n > 4 && strcmp(t + n - 4, "-wal") == 0; b->checked = 1;
    if (b->is_wal && !b->data) b->data = malloc(CAP);
  }
  return b->is_wal;
}
static void flush(int fd) {
  struct buf *b = &bufs[fd];
  size_t done = 0;
  while (done < b->len) { ssize_t n = real_pwrite(fd, b->data + done, b->len - done, b->start + done); if (n <= 0) abort(); done += n; }
  b->len = 0;
}
ssize_t pwrite64(int fd, const void *data, size_t n, off_t at) {
  init();
  if (!wal(fd)) return real_pwrite(fd, data, n, at);
  struct buf *b = &bufs[fd]; pthread_mutex_lock(&b->mu);
  if (b->len && (b->start + (off_t)b->len != at || b->len + n > CAP)) flush(fd);
  if (n > CAP) { pthread_mutex_unlock(&b->mu); return real_pwrite(fd, data, n, at); }
  if (!b->len) b->start = at;
  memcpy(b->data + b->len, data, n); b->len += n;
  pthread_mutex_unlock(&b->mu); return n;
}
ssize_t pwrite(int fd, const void *d, size_t n, off_t at) { return pwrite64(fd, d, n, at); }
#define FLUSHING(call) init(); if (fd >= 0 && fd < MAXFD && bufs[fd].is_wal) { pthread_mutex_lock(&bufs[fd].mu); flush(fd); pthread_mutex_unlock(&bufs[fd].mu); } return call;
ssize_t pread64(int fd, void *d, size_t n, off_t at) { FLUSHING(real_pread(fd, d, n, at)) }
ssize_t pread(int fd, void *d, size_t n, off_t at) { FLUSHING(real_pread(fd, d, n, at)) }
int fdatasync(int fd) { FLUSHING(real_fdatasync(fd)) }
int fsync(int fd) { FLUSHING(real_fsync(fd)) }
int ftruncate64(int fd, off_t l) { FLUSHING(real_ftruncate(fd, l)) }
int ftruncate(int fd, off_t l) { FLUSHING(real_ftruncate(fd, l)) }
int close(int fd) { init(); if (fd >= 0 && fd < MAXFD) { if (bufs[fd].is_wal) { pthread_mutex_lock(&bufs[fd].mu); flush(fd); pthread_mutex_unlock(&bufs[fd].mu); } bufs[fd].checked = 0; bufs[fd].is_wal = 0; } return real_close(fd); }
