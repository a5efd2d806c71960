/* The fast path: which requests C answers, and the handlers that answer them.
 *
 * Answered in C:
 * - open of a file without O_TRUNC: the handle is the inode number marked
 *   with KERNEL_HANDLE; read and write go on to Python and recognise the mark
 *   (fuse/ops.py), which also hands out marked handles from create and
 *   truncating opens; every release of a marked handle is answered here. A
 *   write then names its process through fastpath_request_pid, which the
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
 * - ioctl: ENOSYS, from libfuse (pyfuse3 serves none). Python's open() asks
 *   the terminal's attributes of every file it opens (isatty).
 * - getxattr("security.capability"): ENODATA. The kernel asks for it before
 *   every write to a file; file capabilities have no effect on a nosuid mount,
 *   and the daemon refuses to set them, so the answer is exact.
 */
#include "fastpath.h"

#define CAPABILITY "security.capability"

typedef void (*open_fn)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);
typedef void (*getxattr_fn)(fuse_req_t, fuse_ino_t, const char *, size_t);
typedef void (*write_fn)(fuse_req_t, fuse_ino_t, const char *, size_t, off_t, struct fuse_file_info *);
typedef void (*readdir_fn)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef void (*read_fn)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef void (*fsyncdir_fn)(fuse_req_t, fuse_ino_t, int, struct fuse_file_info *);
typedef void (*fsync_fn)(fuse_req_t, fuse_ino_t, int, struct fuse_file_info *);
typedef void (*write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t, struct fuse_file_info *);
typedef void (*init_fn)(void *, struct fuse_conn_info *);

static struct fuse_lowlevel_ops ops;
static open_fn py_open, py_release;
static getxattr_fn py_getxattr;
static write_buf_fn py_write_buf;
static write_fn py_write;
static readdir_fn py_readdirplus;
static read_fn py_read;
static fsync_fn py_fsync;
static fsyncdir_fn py_fsyncdir;
static init_fn py_init;
uint64_t cache_below;  /* inodes from here on (control, views) are Python's */
int fastpath_request_pid;  /* the process of the write being handled (0: page writeback) */

void fastpath_configure(uint64_t below) { cache_below = below; }

/* -- which requests C answers (the reader and the handlers must agree) -------- */

static int open_is_fast(uint64_t ino, uint32_t flags)
{
    return ino < cache_below && !(flags & O_TRUNC);  /* truncating is a change: Python's */
}

static int release_is_fast(uint64_t fh) { return (fh & KERNEL_HANDLE) != 0; }

static int getxattr_is_fast(const char *name) { return strcmp(name, CAPABILITY) == 0; }

int request_is_fast(const char *mem, size_t len)
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
    case FUSE_IOCTL:
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
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

/* Python keeps no lookup counts (fuse/ops.py's forget does nothing): the kernel's
   forgets end here, not one trip each through pyfuse3's loop (an rm -rf sends one per
   file, between its unlinks). They have no reply. */
static void forget_here(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    (void)ino;
    (void)nlookup;
    fuse_reply_none(req);
}

static void forget_multi_here(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    (void)count;
    (void)forgets;
    fuse_reply_none(req);
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

/* A write on its way to Python: its process, its arrival (Python times its capture
   from it), its write-behind record if C answered it already (behind.c), else it is
   timed until Python answers (stats.c). */
static void write_arrives(fuse_req_t req, struct fuse_file_info *fi)
{
    uint64_t fh = fi->fh;

    fastpath_request_pid = fuse_req_ctx(req)->pid;
    fastpath_request_arrival = taken_arrival;
    take_acknowledged(req, fi);
    if ((fh & (KERNEL_HANDLE | ACKNOWLEDGED)) == KERNEL_HANDLE)
        stats_pending(req, STATS_WRITE);
}

static void write_buf_with_pid(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                               struct fuse_file_info *fi)
{
    write_arrives(req, fi);
    py_write_buf(req, ino, bufv, off, fi);  /* the Python handler reads the pid first thing */
}

static void write_with_pid(fuse_req_t req, fuse_ino_t ino, const char *data, size_t size, off_t off,
                           struct fuse_file_info *fi)
{
    write_arrives(req, fi);
    py_write(req, ino, data, size, off, fi);
}

static void read_timed(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    if (fi->fh & KERNEL_HANDLE)  /* (not the control and view files: Python's handles) */
        stats_pending(req, STATS_READ);
    py_read(req, ino, size, off, fi);
}

/* (an O_DSYNC or O_SYNC write is a WRITE and then an FSYNC: its writer waits for both) */
static void fsync_timed(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    if (fi->fh & KERNEL_HANDLE)
        stats_pending(req, STATS_FSYNC);
    py_fsync(req, ino, datasync, fi);
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

/* Whether pyfuse3's handlers are ours to wrap: every one we wrap is there. */
int fastpath_can_wrap(const struct fuse_lowlevel_ops *op, size_t op_size)
{
    return !(op_size > sizeof(ops) || cache_below == 0 || !op->open || !op->release ||
             !op->opendir || !op->getxattr || !op->write_buf || !op->write || !op->readdirplus ||
             !op->fsyncdir || !op->init || !op->read || !op->fsync);
}

/* pyfuse3's handlers with ours in front, for fuse_session_new. */
const struct fuse_lowlevel_ops *fastpath_wrap(const struct fuse_lowlevel_ops *op, size_t op_size)
{
    memcpy(&ops, op, op_size);
    py_open = ops.open;
    py_release = ops.release;
    py_getxattr = ops.getxattr;
    py_write_buf = ops.write_buf;
    py_write = ops.write;
    py_readdirplus = ops.readdirplus;
    py_fsyncdir = ops.fsyncdir;
    py_init = ops.init;
    py_read = ops.read;
    py_fsync = ops.fsync;
    ops.open = open_fast;
    ops.release = release_fast;
    ops.opendir = opendir_fast;
    ops.getxattr = getxattr_fast;
    ops.write_buf = write_buf_with_pid;
    ops.write = write_with_pid;
    ops.readdirplus = readdirplus_by_inode;
    ops.fsyncdir = fsyncdir_by_inode;
    ops.init = init_keep_written_pages;
    ops.read = read_timed;
    ops.fsync = fsync_timed;
    ops.forget = forget_here;
    ops.forget_multi = forget_multi_here;
    return &ops;
}
