/* The requests that need no Python, answered in C: what the files share.
 *
 * Every request pyfuse3 serves costs a trip through its loop and our Python
 * (~45 us on a 2-core VM), and a tree walk (git status, tar, an editor's file
 * search) is mostly requests whose answer needs no state. Loaded with
 * RTLD_GLOBAL before pyfuse3 (see fastpath.py), this library stands in for four
 * libfuse functions that pyfuse3 calls:
 *
 * - fuse_session_new: wraps eight of pyfuse3's request handlers (fastpath.c).
 * - fuse_session_fd: starts a reader thread on /dev/fuse and gives pyfuse3 the
 *   read end of a pipe instead. The thread answers the requests fastpath.c names
 *   at once and queues every other one, in order, for pyfuse3's loop (queue.c).
 * - fuse_session_receive_buf: pyfuse3 takes the next queued request.
 *   fastpath_wait_queued lets fastpath.py have pyfuse3's loop watch for it here,
 *   without the GIL, before it waits in trio.
 * - fuse_session_destroy: stops and joins the thread first.
 *
 * The files, one thing each (built into one shared library, overlayckpt/fuse/libfastpath.so,
 * by setup.py: not a Python extension, fuse/fastpath.py loads it with ctypes):
 * - interpose.c: the libfuse functions above and fuse_reply_write/fuse_reply_err,
 *   which only dispatch to the others.
 * - fastpath.c: which requests C answers, and the wrapped handlers.
 * - queue.c: the reader thread, the queue pyfuse3 reads from, the wait, and the
 *   scheduler slice of the threads that answer requests.
 * - behind.c: write-behind (writes acknowledged before Python stores them) and
 *   its log.
 * - warm.c: fastpath_warm_tree, reading the repo's metadata ahead.
 * - dirattrs.c: directory attributes Python publishes after a change, and the
 *   GETATTRs of them that follow, answered by the reader thread.
 * - names.c: the listings of directories Python publishes as it lists them, and the
 *   LOOKUPs and READDIRPLUS of them that follow, answered by the reader thread while
 *   nothing in them changes; so are the GETATTRs a walk sends after a restore.
 * - lowerdirs.c: repo directories nothing changed, listed from the repo by the
 *   reader thread and published as names.c's.
 * - stats.c: the latency of writes, reads and fsyncs, from their arrival off
 *   /dev/fuse to their reply, in log-bucket histograms Python reads (overlayckpt
 *   stats).
 * - constants.c: the constants below that Python must agree with, exported for
 *   tests/test_fastpath_constants.py.
 */
#ifndef FASTPATH_H
#define FASTPATH_H

#define _GNU_SOURCE
#define FUSE_USE_VERSION 34
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <linux/openat2.h>
#include <linux/fs.h>  /* RENAME_EXCHANGE */
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* -- shared with Python (constants.c exports them; the test compares) ---------- */

#define KERNEL_HANDLE (1ULL << 63)  /* keep in step with fuse/ops.py KERNEL_HANDLE */
/* in a listing's offset: numbered by C (names.c), the number in bits 32-61 (pyfuse3's
   offsets are signed); fuse/ops.py LISTING_MARK, whose own numbers are below 2^30 */
#define LISTING_MARK (1ULL << 62)
#define LISTING_NUMBER 0x3fffffffULL
#define ACKNOWLEDGED (1ULL << 62)   /* on a queued write's handle: answered already;
                                       records.CONTROL_INO_BASE, above every repo inode */

/* A record of the write-behind log (writebehind.py reads the same layout: HEADER,
 * "=QQQII"): the header, then the data padded to 8 bytes. seq is stored last; a
 * header whose size is WRAPPED says the record is at offset 0, as does a tail too
 * short for a header. */
struct record {
    uint64_t seq;
    uint64_t ino;
    uint64_t off;
    uint32_t size;
    uint32_t pid;
};
#define WRAPPED UINT32_MAX
#define PAD8(n) (((n) + 7) & ~(uint64_t)7)
/* the largest write acknowledged is max_behind / LARGEST_WRITE_SHARE (writebehind.py's
   LOG_SIZE must be more than twice fastpath.MAX_BEHIND plus that) */
#define LARGEST_WRITE_SHARE 4

/* Latency histograms (stats.c; core/latency.py reads the same layout): a value of
 * v ns is counted in bucket v below 16, else, with s = bitlength(v) - 4, in bucket
 * s * 8 + (v >> s): 8 buckets per power of two, each within 12.5% of its values,
 * up to 2^37 ns (137 s; longer ones go to the last bucket, max_ns stays exact). */
#define HIST_SUB_BITS 3
#define HIST_BUCKETS 280
struct hist {
    uint64_t sum_ns;
    uint64_t max_ns;
    uint64_t errors;   /* answered with an error */
    uint64_t buckets[HIST_BUCKETS];
};
/* fastpath_stats[kind]: each written by one thread only (the reader thread for
   STATS_WRITE_EARLY and STATS_READ_C, pyfuse3's for the others) */
enum { STATS_WRITE, STATS_WRITE_EARLY, STATS_READ, STATS_FSYNC, STATS_READ_C, STATS_KINDS };
extern struct hist fastpath_stats[STATS_KINDS];
extern uint64_t fastpath_request_arrival;  /* the write being handled: its arrival */

static inline uint64_t now_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);  /* Python's time.monotonic_ns() */
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

/* -- shared between the files (hidden: the library is loaded RTLD_GLOBAL) ------ */

#pragma GCC visibility push(hidden)

/* ino's slot in a table of 2^bits (Fibonacci hashing: neighbouring inodes spread). */
static inline uint32_t slot_in(uint64_t ino, unsigned bits)
{
    return (uint32_t)((ino * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

/* How name a (alen bytes) sorts against b, as memcmp sorts, the shorter first (as
 * Python sorts bytes). */
static inline int name_cmp(const char *a, size_t alen, const char *b, size_t blen)
{
    int c = memcmp(a, b, alen < blen ? alen : blen);

    return c != 0 ? c : alen < blen ? -1 : alen > blen;
}

/* path beneath the repo's fd root, opened with flags, no symlink followed, and
 * O_NOATIME where we may (lower.py open_noatime: reading the repo through the
 * overlay leaves its attributes, which the mount shows, as they are). */
static inline int open_beneath(int root, const char *path, uint64_t flags)
{
    struct open_how how = {.flags = flags | (flags & O_PATH ? 0 : O_NOATIME) | O_NOFOLLOW | O_CLOEXEC,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, root, path, &how, sizeof(how));

    if (fd < 0 && errno == EPERM) {  /* (not the owner: as natively, its atime moves) */
        how.flags &= ~(uint64_t)O_NOATIME;
        fd = (int)syscall(SYS_openat2, root, path, &how, sizeof(how));
    }
    return fd;
}

/* interpose.c: libfuse's own functions, and the one session whose handlers go
   through here */
extern struct fuse_session *(*real_new)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);
extern int (*real_fd)(struct fuse_session *);
extern int (*real_receive)(struct fuse_session *, struct fuse_buf *);
extern void (*real_process)(struct fuse_session *, const struct fuse_buf *);
extern void (*real_destroy)(struct fuse_session *);
extern int (*real_reply_write)(fuse_req_t, size_t);
extern int (*real_reply_err)(fuse_req_t, int);
extern int (*real_reply_open)(fuse_req_t, const struct fuse_file_info *);
extern int (*real_reply_buf)(fuse_req_t, const char *, size_t);
extern struct fuse_session *wrapped;

/* fastpath.c */
extern uint64_t cache_below;  /* inodes from here on (control, views) are Python's */
int request_is_fast(const char *mem, size_t len);
int fastpath_can_wrap(const struct fuse_lowlevel_ops *op, size_t op_size);
const struct fuse_lowlevel_ops *fastpath_wrap(const struct fuse_lowlevel_ops *op, size_t op_size);

/* queue.c */
int queue_start(struct fuse_session *se);
int queue_take(struct fuse_buf *buf);
void queue_stop(void);
int queue_started(void);
int in_reader_thread(void);

/* queue.c: the reader thread's answers (names.c, dirattrs.c, behind.c) */
int reply_raw(struct fuse_session *se, uint64_t unique, const void *data, size_t size);

/* behind.c */
extern int behind_count;  /* used only by pyfuse3's thread */
void acknowledge_write(struct fuse_session *se, char *mem, size_t len, uint64_t arrival);
void take_acknowledged(fuse_req_t req, struct fuse_file_info *fi);
int drop_acknowledged(fuse_req_t req);
int behind_pending(void);

/* stats.c (pyfuse3's thread, but stats_record) */
extern uint64_t taken_arrival;  /* when the request pyfuse3 took last arrived */
void stats_record(struct hist *h, uint64_t ns, int error);
void stats_pending(fuse_req_t req, int kind);
extern int pending_count;
struct pending { fuse_req_t req; uint64_t arrival; int kind; };
int stats_take_pending(fuse_req_t req, struct pending *out);
void stats_replied(const struct pending *p, uint64_t at, int error);

/* warm.c */
void warm_stop_all(void);

/* dirattrs.c */
int dir_attrs_answer(struct fuse_session *se, const char *mem, size_t len);
void dir_attrs_taking(const char *mem, size_t len);

/* names.c */
void names_arriving(const char *mem, size_t len);
int names_answer(struct fuse_session *se, const char *mem, size_t len);
int listing_answer(struct fuse_session *se, const char *mem, size_t len);
int attrs_answer(struct fuse_session *se, const char *mem, size_t len);
int names_listed(uint64_t dir);
int publish_listing(uint64_t stamp, uint64_t dir, const char *in, size_t in_size, int *changed);
int names_reply_unchanged(struct fuse_session *se, uint64_t unique, uint64_t ino, const void *data,
                          size_t size);

/* lowerdirs.c */
void lower_touched(uint64_t ino);
int lower_changed(uint64_t ino);
void lower_arriving(const char *mem, size_t len);
int lower_read_answer(struct fuse_session *se, const char *mem, size_t len, uint64_t arrival);
int lower_getattr_answer(struct fuse_session *se, const char *mem, size_t len);

#pragma GCC visibility pop

uint64_t fastpath_names_clock(void);  /* (exported: Python reads it too) */

#endif
