/* The requests that need no Python, answered in C.
 *
 * Every request pyfuse3 serves costs a trip through its loop and our Python
 * (~45 us on a 2-core VM), and a tree walk (git status, tar, an editor's file
 * search) is mostly requests whose answer needs no state. Loaded with
 * RTLD_GLOBAL before pyfuse3 (see kcache.py), this library stands in for four
 * libfuse functions that pyfuse3 calls:
 *
 * - fuse_session_new: wraps eight of pyfuse3's request handlers (below).
 * - fuse_session_fd: starts a reader thread on /dev/fuse and gives pyfuse3 the
 *   read end of a pipe instead. The thread answers the requests below at once
 *   and queues every other one, in order, for pyfuse3's loop.
 * - fuse_session_receive_buf: pyfuse3 takes the next queued request.
 *   kcache_wait_queued lets kcache.py have pyfuse3's loop watch for it here,
 *   without the GIL, before it waits in trio.
 * - fuse_session_destroy: stops and joins the thread first.
 *
 * Answered in C:
 * - open of a file without O_TRUNC: the handle is the inode number marked
 *   with KERNEL_HANDLE; read and write go on to Python and recognise the mark
 *   (fuseops.py), which also hands out marked handles from create and
 *   truncating opens; every release of a marked handle is answered here. A
 *   write then names its process through kcache_request_pid, which the
 *   wrapped write handler sets just before pyfuse3 runs the Python one. The
 *   kernel is asked to keep file pages across opens (FOPEN_KEEP_CACHE): the
 *   daemon is the only writer of what it serves, the kernel drops what changes
 *   through the mount itself, and the daemon invalidates what it changes on
 *   its own (restore, export). Control and checkpoint-view files (inodes >=
 *   cache_below) always go to Python: their handles carry state.
 * - opendir: ENOSYS, so the kernel (5.1 and later) sends no opendir or
 *   releasedir again and keeps every directory's listing (FOPEN_KEEP_CACHE |
 *   FOPEN_CACHE_DIR), under the same rules as file pages. The one listing that changes behind
 *   the kernel's back, the checkpoints directory, reports a new mtime when it
 *   does and keeps no attributes in the kernel: the fstat in opendir(3) fetches
 *   them, and the kernel drops a listing kept under an older mtime. readdirplus and
 *   fsyncdir then get handle 0; the wrappers give Python the marked inode.
 * - getxattr("security.capability"): ENODATA. The kernel asks for it before
 *   every write to a file; file capabilities have no effect on a nosuid mount,
 *   and the daemon refuses to set them, so the answer is exact.
 *
 * Acknowledged in C, served by Python (write-behind, once kcache.py turns it on):
 * - write through a marked handle: the reader thread answers "written" at once
 *   and queues the request for Python, which stores it in order, before any
 *   later request, as it would have; the writer need not wait for it. That is
 *   what a native file system does with a write before fsync, and fsync (which
 *   comes through the queue after the writes) still answers only once they
 *   are stored, with the error of any that failed (fuseops.py). Before it
 *   answers, the reader copies the write into the store's write-behind log, a
 *   file mapped shared (so a killed daemon's copy survives it), which the next
 *   Session.open replays past what Python stored (behind.py). It marks the
 *   handle with ACKNOWLEDGED; the wrapped write handlers take the mark off,
 *   tell Python the record (kcache_request_seq/next) and remember the request,
 *   whose reply fuse_reply_write/fuse_reply_err then drop. At most max_behind
 *   bytes wait at a time, and none while the store's file system has less than
 *   min_free bytes free: a full disk must be reported to the writer itself.
 *
 * And kcache_warm_tree reads the repo's metadata ahead, from threads of its own.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 34
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <linux/openat2.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define KERNEL_HANDLE (1ULL << 63)  /* keep in step with fuseops.KERNEL_HANDLE */
#define ACKNOWLEDGED (1ULL << 62)   /* on a queued write's handle: answered already */
#define MAX_BEHIND_REQUESTS 256     /* pyfuse3 serves at most max_tasks (16) at once */
#define CAPABILITY "security.capability"
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() do { } while (0)
#endif

typedef void (*open_fn)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef void (*getxattr_fn)(fuse_req_t, fuse_ino_t, const char *, size_t);
typedef void (*write_fn)(fuse_req_t, fuse_ino_t, const char *, size_t, off_t, struct fuse_file_info *);
typedef void (*readdir_fn)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef void (*fsyncdir_fn)(fuse_req_t, fuse_ino_t, int, struct fuse_file_info *);
typedef void (*write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t, struct fuse_file_info *);
typedef void (*init_fn)(void *, struct fuse_conn_info *);

static struct fuse_session *(*real_new)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);
static int (*real_fd)(struct fuse_session *);
static int (*real_receive)(struct fuse_session *, struct fuse_buf *);
static void (*real_process)(struct fuse_session *, const struct fuse_buf *);
static void (*real_destroy)(struct fuse_session *);
static int (*real_reply_write)(fuse_req_t, size_t);
static int (*real_reply_err)(fuse_req_t, int);

static struct fuse_lowlevel_ops ops;
static open_fn py_open, py_release;
static getxattr_fn py_getxattr;
static write_buf_fn py_write_buf;
static write_fn py_write;
static readdir_fn py_readdirplus;
static fsyncdir_fn py_fsyncdir;
static init_fn py_init;
static uint64_t cache_below;
int kcache_request_pid;  /* the process of the write being handled (0: page writeback) */
static struct fuse_session *wrapped;  /* the one session whose handlers go through here */
static pthread_t reader;  /* reads /dev/fuse, answers what it can, queues the rest */
static int reader_started;

void kcache_configure(uint64_t below) { cache_below = below; }

int kcache_sessions_wrapped(void) { return wrapped != NULL; }

static int bind_libfuse(void)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return -1;
    real_new = dlsym(lib, "fuse_session_new");
    real_fd = dlsym(lib, "fuse_session_fd");
    real_receive = dlsym(lib, "fuse_session_receive_buf");
    real_process = dlsym(lib, "fuse_session_process_buf");
    real_destroy = dlsym(lib, "fuse_session_destroy");
    real_reply_write = dlsym(lib, "fuse_reply_write");
    real_reply_err = dlsym(lib, "fuse_reply_err");
    return real_new && real_fd && real_receive && real_process && real_destroy &&
           real_reply_write && real_reply_err ? 0 : -1;
}

/* -- which requests C answers (the reader and the handlers must agree) -------- */

static int open_is_fast(uint64_t ino, uint32_t flags)
{
    return ino < cache_below && !(flags & O_TRUNC);  /* truncating is a change: Python's */
}

static int release_is_fast(uint64_t fh) { return (fh & KERNEL_HANDLE) != 0; }

static int getxattr_is_fast(const char *name) { return strcmp(name, CAPABILITY) == 0; }

static int request_is_fast(const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    const char *arg = mem + sizeof(*in);
    size_t arglen = len - sizeof(*in);

    if (len < sizeof(*in))
        return 0;
    switch (in->opcode) {
    case FUSE_OPEN:
        return arglen >= sizeof(struct fuse_open_in) &&
               open_is_fast(in->nodeid, ((const struct fuse_open_in *)arg)->flags);
    case FUSE_OPENDIR:
        return 1;
    case FUSE_RELEASE:
        return arglen >= sizeof(struct fuse_release_in) &&
               release_is_fast(((const struct fuse_release_in *)arg)->fh);
    case FUSE_GETXATTR:
        return arglen > sizeof(struct fuse_getxattr_in) && arg[arglen - 1] == '\0' &&
               getxattr_is_fast(arg + sizeof(struct fuse_getxattr_in));
    default:
        return 0;
    }
}

/* -- write-behind ------------------------------------------------------------------ */

/* A record of the write-behind log (behind.py reads the same layout): the header,
 * then the data padded to 8 bytes. seq is stored last; a header whose size is
 * WRAPPED says the record is at offset 0, as does a tail too short for a header. */
struct record {
    uint64_t seq;
    uint64_t ino;
    uint64_t off;
    uint32_t size;
    uint32_t pid;
};
#define WRAPPED UINT32_MAX
#define PAD8(n) (((n) + 7) & ~(uint64_t)7)

static int log_fd = -1;   /* the log, in the store: its file system's free space is the store's */
static char *ring;         /* the log, mapped shared: it outlives a killed daemon */
static uint64_t ring_size, ring_head, ring_seq;  /* reader: where and which the next record is */
static uint64_t taken;     /* pyfuse3's thread: where the next marked write's record is */
static uint64_t max_behind, min_free;
static uint64_t behind_bytes;  /* log bytes acknowledged and not yet stored (atomic) */
static struct behind { fuse_req_t req; uint64_t bytes; } behind[MAX_BEHIND_REQUESTS];
static int behind_count;  /* used only by pyfuse3's thread */

/* Map the log and start at record seq at offset head (what Python stored last
 * said comes next); max_bytes 0 turns write-behind off again. */
int kcache_write_behind(int fd, uint64_t size, uint64_t seq, uint64_t head,
                        uint64_t max_bytes, uint64_t free_bytes)
{
    if (max_bytes == 0) {
        __atomic_store_n(&max_behind, 0, __ATOMIC_RELEASE);
        return 0;
    }
    if (ring == NULL) {
        void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

        if (map == MAP_FAILED)
            return -errno;
        ring = map;
        ring_size = size;
        ring_seq = seq;
        ring_head = taken = head;
    }
    log_fd = fd;
    min_free = free_bytes;
    __atomic_store_n(&max_behind, max_bytes, __ATOMIC_RELEASE);
    return 0;
}

static int space_left(void)
{
    struct statvfs st;

    return fstatvfs(log_fd, &st) == 0 && (uint64_t)st.f_bavail * st.f_frsize >= min_free;
}

static uint64_t record_at(uint64_t pos, uint64_t need)
{
    return pos + need > ring_size ? 0 : pos;
}

/* In the reader thread: log a write and answer it now if it may wait, and mark
 * it answered. The budget keeps every unstored record from being overwritten:
 * the log is more than twice max_behind plus the largest record. */
static void acknowledge_write(struct fuse_session *se, char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    struct fuse_write_in *arg = (void *)(mem + sizeof(*in));
    uint64_t limit = __atomic_load_n(&max_behind, __ATOMIC_ACQUIRE);
    uint64_t need, pos;
    struct record *rec, *wrap = NULL;
    struct fuse_out_header out;
    struct fuse_write_out written;
    struct iovec iov[2];

    if (limit == 0 || in->opcode != FUSE_WRITE || len < sizeof(*in) + sizeof(*arg) ||
        len - sizeof(*in) - sizeof(*arg) < arg->size || arg->size > limit / 4 ||
        !(arg->fh & KERNEL_HANDLE) || (arg->fh & ~KERNEL_HANDLE) >= cache_below ||
        (arg->write_flags & FUSE_WRITE_CACHE))
        return;  /* page writeback (FUSE_WRITE_CACHE) waits for no one: nothing to gain */
    need = sizeof(*rec) + PAD8(arg->size);
    if (__atomic_load_n(&behind_bytes, __ATOMIC_ACQUIRE) + need > limit || !space_left())
        return;
    pos = record_at(ring_head, need);
    if (pos != ring_head && ring_head + sizeof(*rec) <= ring_size) {
        wrap = (struct record *)(ring + ring_head);
        wrap->size = WRAPPED;
        __atomic_store_n(&wrap->seq, ring_seq, __ATOMIC_RELEASE);
    }
    rec = (struct record *)(ring + pos);
    rec->ino = arg->fh & ~KERNEL_HANDLE;
    rec->off = arg->offset;
    rec->size = arg->size;
    rec->pid = in->pid;
    memcpy(rec + 1, mem + sizeof(*in) + sizeof(*arg), arg->size);
    __atomic_store_n(&rec->seq, ring_seq, __ATOMIC_RELEASE);

    out.len = sizeof(out) + sizeof(written);
    out.error = 0;
    out.unique = in->unique;
    memset(&written, 0, sizeof(written));
    written.size = arg->size;
    iov[0].iov_base = &out;
    iov[0].iov_len = sizeof(out);
    iov[1].iov_base = &written;
    iov[1].iov_len = sizeof(written);
    /* count it before the writer can go on: the budget must hold what is answered */
    __atomic_add_fetch(&behind_bytes, need, __ATOMIC_ACQ_REL);
    if (writev(real_fd(se), iov, 2) != (ssize_t)out.len) {
        /* interrupted or aborted: unlog it, and Python answers as before */
        __atomic_sub_fetch(&behind_bytes, need, __ATOMIC_ACQ_REL);
        __atomic_store_n(&rec->seq, 0, __ATOMIC_RELEASE);
        if (wrap)
            __atomic_store_n(&wrap->seq, 0, __ATOMIC_RELEASE);
        return;
    }
    ring_head = pos + need;
    ring_seq++;
    arg->fh |= ACKNOWLEDGED;
}

uint64_t kcache_request_seq, kcache_request_next;  /* the record of the write being handled */

/* In pyfuse3's thread: a marked write is about to reach Python. Marked writes
 * come in the order of their records, so the next record is this one's. */
static void take_acknowledged(fuse_req_t req, struct fuse_file_info *fi)
{
    struct record *rec;

    kcache_request_seq = 0;
    if (!(fi->fh & ACKNOWLEDGED))
        return;
    fi->fh &= ~ACKNOWLEDGED;
    if (taken + sizeof(*rec) > ring_size || ((struct record *)(ring + taken))->size == WRAPPED)
        taken = 0;
    rec = (struct record *)(ring + taken);
    taken += sizeof(*rec) + PAD8(rec->size);
    kcache_request_seq = rec->seq;
    kcache_request_next = taken;
    if (behind_count == MAX_BEHIND_REQUESTS)
        abort();  /* pyfuse3 serving this many writes at once breaks its own limit */
    behind[behind_count].req = req;
    behind[behind_count].bytes = sizeof(*rec) + PAD8(rec->size);
    behind_count++;
}

/* Whether req was answered already; if so it is forgotten and freed. */
static int drop_acknowledged(fuse_req_t req)
{
    for (int i = 0; i < behind_count; i++) {
        if (behind[i].req == req) {
            __atomic_sub_fetch(&behind_bytes, behind[i].bytes, __ATOMIC_ACQ_REL);
            behind[i] = behind[--behind_count];
            fuse_reply_none(req);
            return 1;
        }
    }
    return 0;
}

int fuse_reply_write(fuse_req_t req, size_t count)
{
    return drop_acknowledged(req) ? 0 : real_reply_write(req, count);
}

/* libfuse may answer errors from the reader thread too, which must not read the list */
int fuse_reply_err(fuse_req_t req, int err)
{
    if (behind_count && !(reader_started && pthread_equal(pthread_self(), reader)) &&
        drop_acknowledged(req))
        return 0;
    return real_reply_err(req, err);
}

/* -- the handlers ----------------------------------------------------------------- */

static void reply_cached_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    fi->fh = KERNEL_HANDLE | ino;
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
}

static void open_fast(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (open_is_fast(ino, fi->flags))
        reply_cached_open(req, ino, fi);
    else
        py_open(req, ino, fi);
}

static void opendir_fast(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    real_reply_err(req, ENOSYS);
}

/* With opendir answered ENOSYS a directory's handle is 0: name it as Python expects. */
static void readdirplus_by_inode(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                                 struct fuse_file_info *fi)
{
    if (fi->fh == 0)
        fi->fh = KERNEL_HANDLE | ino;
    py_readdirplus(req, ino, size, off, fi);
}

static void fsyncdir_by_inode(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    if (fi->fh == 0)
        fi->fh = KERNEL_HANDLE | ino;
    py_fsyncdir(req, ino, datasync, fi);
}

static void release_fast(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (release_is_fast(fi->fh))
        real_reply_err(req, 0);
    else
        py_release(req, ino, fi);
}

static void getxattr_fast(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    if (getxattr_is_fast(name))
        real_reply_err(req, ENODATA);
    else
        py_getxattr(req, ino, name, size);
}

static void write_buf_with_pid(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                               struct fuse_file_info *fi)
{
    kcache_request_pid = fuse_req_ctx(req)->pid;
    take_acknowledged(req, fi);
    py_write_buf(req, ino, bufv, off, fi);  /* the Python handler reads the pid first thing */
}

static void write_with_pid(fuse_req_t req, fuse_ino_t ino, const char *data, size_t size, off_t off,
                           struct fuse_file_info *fi)
{
    kcache_request_pid = fuse_req_ctx(req)->pid;
    take_acknowledged(req, fi);
    py_write(req, ino, data, size, off, fi);
}

/* libfuse has the kernel drop a file's pages whenever a GETATTR shows a new mtime
   (auto_inval_data). After a write through the mount it always does, so a file read
   right after it was written came from Python again (64 MiB: 199 ms instead of 14).
   Pages never change behind the kernel's back unannounced: the daemon invalidates
   what a restore changes and what a failed acknowledged write left behind. */
static void init_keep_written_pages(void *userdata, struct fuse_conn_info *conn)
{
    py_init(userdata, conn);
    conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    struct fuse_session *se;

    if (real_new == NULL && bind_libfuse() != 0)
        return NULL;  /* pyfuse3.init raises "fuse_session_new() failed" */
    if (op_size > sizeof(ops) || cache_below == 0 || wrapped != NULL || !op->open || !op->release ||
        !op->opendir || !op->getxattr || !op->write_buf || !op->write || !op->readdirplus ||
        !op->fsyncdir || !op->init)
        return real_new(args, op, op_size, userdata);  /* not ours to change: as is */
    memcpy(&ops, op, op_size);
    py_open = ops.open;
    py_release = ops.release;
    py_getxattr = ops.getxattr;
    py_write_buf = ops.write_buf;
    py_write = ops.write;
    py_readdirplus = ops.readdirplus;
    py_fsyncdir = ops.fsyncdir;
    py_init = ops.init;
    ops.open = open_fast;
    ops.release = release_fast;
    ops.opendir = opendir_fast;
    ops.getxattr = getxattr_fast;
    ops.write_buf = write_buf_with_pid;
    ops.write = write_with_pid;
    ops.readdirplus = readdirplus_by_inode;
    ops.fsyncdir = fsyncdir_by_inode;
    ops.init = init_keep_written_pages;
    se = real_new(args, &ops, op_size, userdata);
    wrapped = se;
    return se;
}

/* -- the reader thread and the queue pyfuse3 reads from --------------------------- */

struct item {
    struct item *next;
    int res;  /* what fuse_session_receive_buf returned: > 0 a request of that size */
    char mem[];
};

static volatile sig_atomic_t stopping;
static int wake[2] = {-1, -1};  /* one byte per queued item (at most); pyfuse3 polls wake[0] */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
/* the last item is kept queued once it is the end; kcache_wait_queued watches head
   without the lock, so it is stored atomically */
static struct item *head, *tail;

static void push(int res, const char *mem)
{
    struct item *it = malloc(sizeof(*it) + (res > 0 ? (size_t)res : 0));
    char one = 1;

    if (it == NULL)
        abort();  /* a request dropped would hang its caller for ever */
    it->next = NULL;
    it->res = res;
    if (res > 0)
        memcpy(it->mem, mem, (size_t)res);
    pthread_mutex_lock(&lock);
    if (tail)
        tail->next = it;
    else
        __atomic_store_n(&head, it, __ATOMIC_RELEASE);
    tail = it;
    pthread_mutex_unlock(&lock);
    while (write(wake[1], &one, 1) < 0 && errno == EINTR && !stopping)
        ;
}

static void on_stop_signal(int sig) { (void)sig; }

static void *read_requests(void *arg)
{
    struct fuse_session *se = arg;
    struct fuse_buf buf = {0};
    sigset_t others;
    int res;

    /* process-wide signals are the Python main thread's to take */
    sigfillset(&others);
    sigdelset(&others, SIGURG);
    pthread_sigmask(SIG_BLOCK, &others, NULL);
    for (;;) {
        res = real_receive(se, &buf);
        if (res == -EINTR) {
            if (stopping)
                break;
            continue;
        }
        if (res <= 0) {
            push(res, NULL);
            break;
        }
        if (request_is_fast(buf.mem, (size_t)res))
            real_process(se, &buf);
        else {
            acknowledge_write(se, buf.mem, (size_t)res);
            push(res, buf.mem);
        }
    }
    free(buf.mem);
    return NULL;
}

int fuse_session_fd(struct fuse_session *se)
{
    struct sigaction sa;

    if (real_fd == NULL && bind_libfuse() != 0)
        return -1;
    if (se != wrapped || real_fd(se) < 0)
        return real_fd(se);
    if (reader_started)
        return wake[0];
    /* the read end never blocks pyfuse3's loop; the write end blocks the reader
       thread if ever 64 KiB of requests wait, so no wake-up is ever lost */
    if (pipe2(wake, O_CLOEXEC) != 0)
        return real_fd(se);
    fcntl(wake[0], F_SETFL, O_NONBLOCK);
    /* the reader blocks in read(); SIGURG (ignored by default, unused by Python)
       without SA_RESTART interrupts it when the session is destroyed */
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGURG, &sa, NULL);
    if (pthread_create(&reader, NULL, read_requests, se) != 0) {
        close(wake[0]);
        close(wake[1]);
        wake[0] = wake[1] = -1;
        return real_fd(se);
    }
    reader_started = 1;
    return wake[0];
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    struct item *it;
    char one;
    int res;

    if (se != wrapped || !reader_started)
        return real_receive(se, buf);
    pthread_mutex_lock(&lock);
    it = head;
    if (it != NULL && it->res <= 0) {
        res = it->res;  /* the end: leave it queued and the pipe readable */
        pthread_mutex_unlock(&lock);
        return res;
    }
    if (it != NULL) {
        __atomic_store_n(&head, it->next, __ATOMIC_RELEASE);
        if (head == NULL)
            tail = NULL;
    }
    pthread_mutex_unlock(&lock);
    if (it == NULL)
        return -EINTR;  /* woken for nothing: pyfuse3 waits again */
    while (read(wake[0], &one, 1) < 0 && errno == EINTR)
        ;
    res = it->res;
    memmove(it, it->mem, (size_t)res);  /* the request at the start of the block */
    free(buf->mem);  /* pyfuse3 frees what it holds last; hand it ours */
    buf->mem = it;
    buf->size = (size_t)res;
    buf->flags = 0;
    buf->pos = 0;
    return res;
}

/* Whether a request waits for pyfuse3, watching the queue for up to spin_ns.
 * kcache.py calls this (without the GIL) where pyfuse3's loop would go back to
 * trio to wait on the pipe: a trip through trio's lock, scheduler and epoll costs
 * more than most handlers, and a client's next request often follows our reply
 * within microseconds. (Sleeping here on a condition variable instead was no
 * faster, and held trio up: restores, which wait on threads, stalled.) */
int kcache_wait_queued(long spin_ns)
{
    struct timespec start, now;

    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        if (__atomic_load_n(&head, __ATOMIC_ACQUIRE) != NULL)
            return 1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) >= spin_ns)
            return 0;
        cpu_relax();
    }
}

/* -- reading the repo's metadata ahead ------------------------------------------ */

/* On a cold cache each first lookup of a repo file waits for its inode from disk,
 * and the daemon makes them one at a time: a cold `git status` was 1.75x
 * fuse-overlayfs, which makes them from several threads. kcache_warm_tree starts
 * threads that walk the repo once, listing every directory and stat-ing every
 * entry, so that those inodes are in the kernel's cache when the daemon asks. They
 * only read metadata, resolve every path beneath the repo without following a
 * symlink, keep nothing, and stop when the session ends. */
#define WARM_THREADS 4
struct warm_dir { struct warm_dir *next; char path[]; };
static pthread_mutex_t warm_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t warm_more = PTHREAD_COND_INITIALIZER;
static struct warm_dir *warm_queue;
static int warm_root = -1, warm_threads, warm_busy;
static volatile int warm_stop;
uint64_t kcache_warmed_dirs;  /* directories listed so far (status shows it) */
int kcache_warm_done;         /* the walk has ended */

/* A directory to list: parent/name, relative to the repo (whose root is "."). */
static struct warm_dir *warm_new(const char *parent, const char *name)
{
    size_t plen = strlen(parent), nlen = strlen(name);
    struct warm_dir *d = malloc(sizeof(*d) + plen + nlen + 2);

    if (d != NULL) {
        memcpy(d->path, parent, plen);
        d->path[plen] = '/';
        memcpy(d->path + plen + 1, name, nlen + 1);
    }
    return d;
}

/* With warm_lock held. Last in, first out: down the tree before across it. */
static void warm_link(struct warm_dir *d)
{
    d->next = warm_queue;
    warm_queue = d;
    pthread_cond_signal(&warm_more);
}

static void warm_push(const char *parent, const char *name)
{
    struct warm_dir *d = warm_new(parent, name);

    if (d == NULL)
        return;  /* only a cache warmed less */
    pthread_mutex_lock(&warm_lock);
    warm_link(d);
    pthread_mutex_unlock(&warm_lock);
}

static void warm_dir(int root, const char *path)
{
    struct open_how how = {.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, root, path, &how, sizeof(how));
    DIR *dir;
    struct dirent *e;
    struct stat st;

    if (fd < 0)
        return;
    dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return;
    }
    while (!warm_stop && (e = readdir(dir)) != NULL) {
        if (e->d_name[0] == '.' && (e->d_name[1] == '\0' || (e->d_name[1] == '.' && e->d_name[2] == '\0')))
            continue;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
            warm_push(path, e->d_name);
    }
    closedir(dir);
    __atomic_add_fetch(&kcache_warmed_dirs, 1, __ATOMIC_RELAXED);
}

static void *warm_thread(void *arg)
{
    (void)arg;
    /* below the daemon's own threads: a warm cache needs no help, only the CPU */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    pthread_mutex_lock(&warm_lock);
    for (;;) {
        struct warm_dir *d;

        while (warm_queue == NULL && warm_busy > 0 && !warm_stop)
            pthread_cond_wait(&warm_more, &warm_lock);
        if (warm_queue == NULL || warm_stop)
            break;  /* the walk is done (nothing queued, nobody listing) or the session is */
        d = warm_queue;
        warm_queue = d->next;
        warm_busy++;
        pthread_mutex_unlock(&warm_lock);
        warm_dir(warm_root, d->path);
        free(d);
        pthread_mutex_lock(&warm_lock);
        warm_busy--;
        if (warm_busy == 0 && warm_queue == NULL)
            pthread_cond_broadcast(&warm_more);
    }
    if (--warm_threads == 0) {
        while (warm_queue != NULL) {
            struct warm_dir *d = warm_queue;

            warm_queue = d->next;
            free(d);
        }
        close(warm_root);
        warm_root = -1;
        __atomic_store_n(&kcache_warm_done, 1, __ATOMIC_RELEASE);
    }
    pthread_cond_broadcast(&warm_more);
    pthread_mutex_unlock(&warm_lock);
    return NULL;
}

/* Walk the tree below dirfd in the background (Lower asks once per session). */
void kcache_warm_tree(int dirfd)
{
    struct warm_dir *root = warm_new(".", ".");  /* "./.": the root, beneath itself */
    pthread_attr_t attr;

    pthread_mutex_lock(&warm_lock);
    if (root == NULL || warm_root >= 0 || warm_stop ||
        (warm_root = fcntl(dirfd, F_DUPFD_CLOEXEC, 0)) < 0) {
        pthread_mutex_unlock(&warm_lock);
        free(root);
        return;  /* running, ended, or no fd: only a cache warmed less */
    }
    warm_link(root);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < WARM_THREADS; i++) {
        pthread_t t;

        if (pthread_create(&t, &attr, warm_thread, NULL) != 0)
            break;
        warm_threads++;
    }
    pthread_attr_destroy(&attr);
    if (warm_threads == 0) {
        warm_queue = NULL;
        free(root);
        close(warm_root);
        warm_root = -1;
    }
    pthread_mutex_unlock(&warm_lock);
}

void fuse_session_destroy(struct fuse_session *se)
{
    if (real_destroy == NULL && bind_libfuse() != 0)
        return;
    pthread_mutex_lock(&warm_lock);
    warm_stop = 1;
    pthread_cond_broadcast(&warm_more);
    pthread_mutex_unlock(&warm_lock);
    if (se == wrapped && reader_started) {
        struct timespec until;

        stopping = 1;
        do {  /* a signal that lands outside read() is lost: send it again */
            pthread_kill(reader, SIGURG);
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 20 * 1000 * 1000;
            if (until.tv_nsec >= 1000 * 1000 * 1000) {
                until.tv_sec++;
                until.tv_nsec -= 1000 * 1000 * 1000;
            }
        } while (pthread_timedjoin_np(reader, NULL, &until) != 0);
        reader_started = 0;
        wrapped = NULL;
        close(wake[0]);
        close(wake[1]);
        wake[0] = wake[1] = -1;
    }
    real_destroy(se);
}
