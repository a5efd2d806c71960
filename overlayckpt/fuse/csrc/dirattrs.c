/* Directory attributes answered in C.
 *
 * With default_permissions the kernel needs a directory's attributes before it
 * creates, unlinks or renames in it, and each of these makes it drop what it has
 * of them: a loop of creates in one directory, or of atomic saves, asks GETATTR
 * of the directory once per file, a Python round trip each. So Python publishes
 * a directory's attributes here at the end of each request that changed them (a
 * create, unlink, rename..., before its reply), and the reader thread answers the
 * GETATTRs that follow (kernel_status counts them).
 *
 * What keeps them exact: a directory is in the table only if it was published
 * after the last request that may change it was taken. pyfuse3's thread drops, as
 * it takes each request (queue_take), the directory a create, unlink, setattr...
 * names, the two a rename names (and Python all of them as it commits a rename that
 * moves or replaces a directory), and all of them for a RENAME_EXCHANGE, an rmdir, a
 * control command or any request not known to change nothing (dir_attrs_taking);
 * Python drops them all where the daemon changes the tree on its own (a restore's
 * kernel invalidations).
 * The reader answers under the table's lock, so an answer from the table is on
 * its way to the kernel before a drop returns, before the change that follows.
 */
#include "fastpath.h"

#define SLOTS 64  /* by inode; a request publishes one or two directories */

struct slot {
    uint64_t ino;  /* 0: empty */
    struct fuse_attr_out out;
};

static struct slot table[SLOTS];
static int used;  /* slots filled; read without the lock only to skip it when 0 */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
uint64_t fastpath_dir_attrs_answered;

/* Python (ops.py) after a change: what its GETATTR of directory ino answers now. */
void fastpath_publish_dir_attrs(uint64_t ino, uint32_t mode, uint32_t nlink, uint32_t uid, uint32_t gid,
                              uint32_t rdev, uint64_t size, uint64_t blocks, uint32_t blksize,
                              uint64_t atime, uint32_t atimensec, uint64_t mtime, uint32_t mtimensec,
                              uint64_t ctime, uint32_t ctimensec, uint64_t attr_valid)
{
    struct slot *s = &table[ino % SLOTS];

    if (ino == 0 || ino >= cache_below || !S_ISDIR(mode))
        return;
    pthread_mutex_lock(&table_lock);
    if (s->ino == 0)
        __atomic_store_n(&used, used + 1, __ATOMIC_RELEASE);
    memset(&s->out, 0, sizeof(s->out));
    s->out.attr_valid = attr_valid;
    s->out.attr = (struct fuse_attr){
        .ino = ino, .size = size, .blocks = blocks,
        .atime = atime, .mtime = mtime, .ctime = ctime,
        .atimensec = atimensec, .mtimensec = mtimensec, .ctimensec = ctimensec,
        .mode = mode, .nlink = nlink, .uid = uid, .gid = gid, .rdev = rdev, .blksize = blksize,
    };
    s->ino = ino;
    pthread_mutex_unlock(&table_lock);
}

/* Forget every published directory (Python: the daemon changed the tree itself). */
void fastpath_drop_dir_attrs(void)
{
    pthread_mutex_lock(&table_lock);
    if (used) {
        memset(table, 0, sizeof(table));
        __atomic_store_n(&used, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&table_lock);
}

static void drop_one(uint64_t ino)
{
    struct slot *s = &table[ino % SLOTS];

    pthread_mutex_lock(&table_lock);
    if (s->ino == ino) {
        s->ino = 0;
        __atomic_store_n(&used, used - 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&table_lock);
}

/* pyfuse3's thread, taking a request to handle: drop what it may change. */
void dir_attrs_taking(const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;

    if (!__atomic_load_n(&used, __ATOMIC_ACQUIRE))
        return;
    if (len < sizeof(*in)) {
        fastpath_drop_dir_attrs();
        return;
    }
    switch (in->opcode) {
    case FUSE_LOOKUP: case FUSE_FORGET: case FUSE_BATCH_FORGET: case FUSE_GETATTR:
    case FUSE_READLINK: case FUSE_OPEN: case FUSE_READ: case FUSE_STATFS: case FUSE_RELEASE:
    case FUSE_FSYNC: case FUSE_GETXATTR: case FUSE_LISTXATTR: case FUSE_FLUSH:
    case FUSE_OPENDIR: case FUSE_READDIR: case FUSE_READDIRPLUS: case FUSE_RELEASEDIR:
    case FUSE_FSYNCDIR: case FUSE_ACCESS: case FUSE_INTERRUPT: case FUSE_POLL: case FUSE_LSEEK:
    case FUSE_IOCTL:  /* (none is served: fastpath.c) */
        return;  /* they change nothing */
    case FUSE_WRITE:  /* to a file of the tree, no directory; a control file's is a command */
        if (in->nodeid < cache_below)
            return;
        break;
    /* the directory the request names, and no other: a new child or a file, not in the
       table (a link's nodeid is the new name's directory; a file's setattr drops nothing) */
    case FUSE_CREATE: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_SYMLINK: case FUSE_UNLINK:
    case FUSE_LINK: case FUSE_SETATTR: case FUSE_SETXATTR: case FUSE_REMOVEXATTR:
    case FUSE_FALLOCATE:
        drop_one(in->nodeid);
        return;
    /* the two directories; a directory it moves or replaces, Python drops as it commits
       (ops.py's rename): the request names neither */
    case FUSE_RENAME: case FUSE_RENAME2:
        if (len >= sizeof(*in) + (in->opcode == FUSE_RENAME ? sizeof(struct fuse_rename_in)
                                                            : sizeof(struct fuse_rename2_in))) {
            const char *arg = mem + sizeof(*in);
            uint64_t newdir;

            if (in->opcode == FUSE_RENAME2 &&
                ((const struct fuse_rename2_in *)arg)->flags & RENAME_EXCHANGE)
                break;  /* both names may be directories */
            memcpy(&newdir, arg + offsetof(struct fuse_rename_in, newdir), sizeof(newdir));
            drop_one(in->nodeid);
            drop_one(newdir);
            return;
        }
        break;
    default:  /* rmdir (it removes one), ... */
        break;
    }
    fastpath_drop_dir_attrs();
}

/* The reader thread: answer a GETATTR of a published directory; 0 if it is not one. */
int dir_attrs_answer(struct fuse_session *se, const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    struct slot *s;
    int answered = 0;

    if (len < sizeof(*in) || in->opcode != FUSE_GETATTR || !__atomic_load_n(&used, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&table_lock);
    s = &table[in->nodeid % SLOTS];
    if (s->ino != 0 && s->ino == in->nodeid) {
        (void)reply_raw(se, in->unique, &s->out, sizeof(s->out));  /* (else interrupted) */
        fastpath_dir_attrs_answered++;
        answered = 1;
    }
    pthread_mutex_unlock(&table_lock);
    return answered;
}
