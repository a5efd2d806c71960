/* Repo directories nothing has changed, listed in C.
 *
 * A walk of the repo after mount (a first `git status`, `tar`, `find`) asks a LOOKUP
 * of each name and a READDIRPLUS of each directory, and Python answered the first of
 * each directory: it listed the repo's directory, stat'ed every entry and published
 * the listing to names.c, about 300 us of the daemon's one thread per directory (most
 * of a 4 s cold `git status` at 100,000 files, where git's threads waited on it). A
 * repo directory that nothing has changed shows what the repo has: its names, each
 * numbered lower_ino(st_ino), with the attributes lstat gives (tree.py
 * node_from_stat, attrs.py entry_record). So the reader thread lists such a directory
 * itself, from the repo, at the first LOOKUP (the second, in a directory bigger than
 * a block) or READDIRPLUS in it that finds no listing published, and publishes the
 * listing as Python does (names.c answers from it and keeps it exact from then on).
 *
 * Which directories: one whose path in the repo C knows (Python names those it
 * answers lookups and listings with, fastpath_lower_hint; C the subdirectories of
 * those it lists), found at that path under its own number (read through a copy of
 * Python's fd of the repo, every path beneath it, no symlink followed), that neither
 * it nor any of its entries was ever changed: every repo inode stamped (names.c) is
 * kept in an exact set, which Python fills at mount with the repo inodes the store
 * has records of. Not the root (the control directory), a directory with a
 * hard-linked file (the removal of another of its names changes its link count
 * unseen), nor one of more than lower_most names (the reader would stall on it). Once
 * the repo changed behind the overlay or pins were made (apply, export), never
 * again this session (fastpath_lower_stop).
 *
 * Python learns from here where the entries it was never told of are
 * (fastpath_lower_entry; tree.py LowerPaths), when the kernel asks about them.
 *
 * The reader answers the READs of such a file too (a handle C opened), from the repo
 * file, while the file was never changed: the first read of each file after mount (a
 * cold `tar`, a first build) went through Python, which reads the same bytes. And the
 * GETATTRs of such a file or directory: the kernel drops a file's atime after each
 * read from it (fuse_invalidate_atime), so the fstat that follows (tar's) asked
 * Python for what lstat of the repo's file says.
 */
#include "fastpath.h"

#define KNOWN_MOST (1u << 20)    /* entries remembered; beyond, no more directories listed */
#define SMALL_DIR_BYTES 4096     /* lower.py SMALL_DIR_BYTES: listed at the first name */

struct known {
    uint64_t ino;     /* 0: empty */
    uint64_t parent;
    char *name;       /* a directory's whole path in the repo, else the name */
    uint16_t name_at; /* where the name begins in it */
    uint8_t is_dir, verified, unlistable;  /* verified: seen so in a listing of C's */
    uint8_t eager;    /* list it at the first lookup in it (at most a block, or looked in before) */
};

static pthread_mutex_t known_lock = PTHREAD_MUTEX_INITIALIZER;
static struct known *known;
static uint32_t known_bits, known_count;
static int lower_fd = -1, lower_on, listing_on = 1;  /* listing_on: room left to remember names */
static uint64_t first_upper, ino_one, lower_timeout;
static uint32_t lower_blksize, lower_most;
uint64_t fastpath_lower_listed;  /* directories the reader listed from the repo */
uint64_t fastpath_lower_reads;   /* READs it answered from the repo */
uint64_t fastpath_lower_attrs;   /* GETATTRs it answered from the repo */

/* names_lock's: the repo inodes ever changed (exact; 0 never is one) */
static uint64_t *ever;
static uint32_t ever_bits, ever_count;

static int ever_insert(uint64_t *table, uint32_t bits, uint64_t ino)
{
    uint32_t mask = (1u << bits) - 1, i = slot_in(ino, bits);

    while (table[i] != 0 && table[i] != ino)
        i = (i + 1) & mask;
    if (table[i] == ino)
        return 0;
    table[i] = ino;
    return 1;
}

/* With names_lock held: ino was stamped (names.c touch_one). */
void lower_touched(uint64_t ino)
{
    if (!lower_on || ino == 0 || ino >= first_upper)
        return;
    if (ever == NULL || (ever_count + 1) * 2 > (1u << ever_bits)) {
        uint32_t bits = ever == NULL ? 14 : ever_bits + 1;
        uint64_t *grown = bits > 30 ? NULL : calloc((size_t)1 << bits, sizeof(*grown));

        if (grown == NULL) {
            __atomic_store_n(&lower_on, 0, __ATOMIC_RELEASE);  /* (changes no longer all known) */
            return;
        }
        for (uint32_t i = 0; ever != NULL && i < (1u << ever_bits); i++)
            if (ever[i] != 0)
                (void)ever_insert(grown, bits, ever[i]);
        free(ever);
        ever = grown;
        ever_bits = bits;
    }
    ever_count += ever_insert(ever, ever_bits, ino);
}

/* With names_lock held: whether ino was ever changed (or C lists nothing now). */
int lower_changed(uint64_t ino)
{
    uint32_t mask, i;

    if (!lower_on)
        return 1;
    if (ever == NULL)
        return 0;
    mask = (1u << ever_bits) - 1;
    for (i = slot_in(ino, ever_bits); ever[i] != 0; i = (i + 1) & mask)
        if (ever[i] == ino)
            return 1;
    return 0;
}

/* With known_lock held: ino's entry, or where it goes (ino 0 there), NULL if full. */
static struct known *known_slot(uint64_t ino)
{
    uint32_t mask, i;

    if (known == NULL)
        return NULL;
    mask = (1u << known_bits) - 1;
    for (i = slot_in(ino, known_bits); known[i].ino != 0; i = (i + 1) & mask)
        if (known[i].ino == ino)
            return &known[i];
    return &known[i];
}

static struct known *known_find(uint64_t ino)
{
    struct known *k = known_slot(ino);

    return k != NULL && k->ino == ino ? k : NULL;
}

/* With known_lock held: room for one more entry. */
static int known_room(void)
{
    struct known *old = known, *grown;
    uint32_t old_bits = known_bits;

    if (known != NULL && (known_count + 1) * 2 <= (1u << known_bits))
        return 1;
    if (known_count >= KNOWN_MOST)
        return 0;
    grown = calloc((size_t)1 << (known ? known_bits + 1 : 12), sizeof(*grown));
    if (grown == NULL)
        return 0;
    known = grown;
    known_bits = old ? old_bits + 1 : 12;
    for (uint32_t i = 0; old != NULL && i < (1u << old_bits); i++)
        if (old[i].ino != 0)
            *known_slot(old[i].ino) = old[i];
    free(old);
    return 1;
}

/* With known_lock held: remember ino as parent's entry name (len bytes); for a
 * directory, at path (plen bytes, its last part the name). A verified entry keeps
 * what it says. 0 if there is no room for it. */
static int known_put(uint64_t ino, uint64_t parent, const char *path, size_t plen, size_t len,
                     int is_dir, int verified, int eager)
{
    struct known *k = known_find(ino);
    char *copy;

    if (k != NULL && (k->verified || !verified)) {
        if (eager && is_dir)
            k->eager = 1;
        return 1;
    }
    if (k == NULL && !known_room())
        return 0;
    if (plen > UINT16_MAX || (copy = malloc(plen + 1)) == NULL)
        return 0;
    memcpy(copy, path, plen);
    copy[plen] = '\0';
    if (k == NULL) {
        k = known_slot(ino);
        known_count++;
    } else {
        free(k->name);
    }
    *k = (struct known){.ino = ino, .parent = parent, .name = copy, .name_at = (uint16_t)(plen - len),
                        .is_dir = (uint8_t)is_dir, .verified = (uint8_t)verified,
                        .eager = (uint8_t)eager};
    return 1;
}

/* Python, at mount when no pins exist: list repo directories from fd (a copy is
 * kept), answering with blksize and timeout (seconds) as Python does; repo inodes
 * are below upper, 1 is numbered one; at most most names a directory. Then it stamps
 * the repo inodes the store has records of (fastpath_names_touch). */
void fastpath_lower_start(int fd, uint32_t blksize, uint64_t timeout, uint64_t upper, uint64_t one,
                          uint32_t most)
{
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);

    if (copy < 0)
        return;
    lower_fd = copy;
    lower_blksize = blksize;
    lower_timeout = timeout;
    first_upper = upper;
    ino_one = one;
    lower_most = most;
    __atomic_store_n(&lower_on, 1, __ATOMIC_RELEASE);
}

/* Python: the repo changed behind the overlay, or pins were made: list nothing more. */
void fastpath_lower_stop(void) { __atomic_store_n(&lower_on, 0, __ATOMIC_RELEASE); }

/* Python: records of count directories, each u64 inode, u64 parent, u8 small (at most
 * a block), u16 path length, the path: where they are in the repo (checked before
 * C lists one). */
void fastpath_lower_hint(const char *in, size_t size)
{
    size_t at = 0;

    pthread_mutex_lock(&known_lock);
    while (at + 19 <= size) {
        uint64_t ino, parent;
        uint16_t plen;
        const char *path = in + at + 19, *slash;

        memcpy(&ino, in + at, 8);
        memcpy(&parent, in + at + 8, 8);
        memcpy(&plen, in + at + 17, 2);
        if (at + 19 + plen > size || plen == 0 || memchr(path, '\0', plen) != NULL)
            break;
        slash = memrchr(path, '/', plen);
        if (ino != 0 && ino < first_upper)
            (void)known_put(ino, parent, path, plen, slash ? (size_t)(path + plen - slash - 1) : plen, 1, 0,
                            in[at + 16] != 0);
        at += 19 + plen;
    }
    pthread_mutex_unlock(&known_lock);
}

/* Python: where ino is in the repo, if a listing of C's had it: its directory in
 * *parent, whether it is one in *is_dir, its name in buf (cap bytes); the name's length,
 * or -1. */
int fastpath_lower_entry(uint64_t ino, uint64_t *parent, int *is_dir, char *buf, size_t cap)
{
    struct known *k;
    int len = -1;

    pthread_mutex_lock(&known_lock);
    k = known_find(ino);
    if (k != NULL && k->verified) {
        size_t n = strlen(k->name + k->name_at);

        if (n <= cap) {
            memcpy(buf, k->name + k->name_at, n);
            *parent = k->parent;
            *is_dir = k->is_dir;
            len = (int)n;
        }
    }
    pthread_mutex_unlock(&known_lock);
    return len;
}

/* Python: every entry fastpath_lower_entry knows, as u64 inode, u64 parent, u8 is_dir,
 * u8 name length, the name, into buf if cap bytes hold them all; the bytes they take. */
size_t fastpath_lower_known(char *buf, size_t cap)
{
    size_t need = 0;

    pthread_mutex_lock(&known_lock);
    for (uint32_t i = 0; known != NULL && i < (1u << known_bits); i++) {
        struct known *k = &known[i];
        size_t n;

        if (k->ino == 0 || !k->verified)
            continue;
        n = strlen(k->name + k->name_at);
        if (need + 18 + n <= cap) {
            memcpy(buf + need, &k->ino, 8);
            memcpy(buf + need + 8, &k->parent, 8);
            buf[need + 16] = (char)k->is_dir;
            buf[need + 17] = (char)n;
            memcpy(buf + need + 18, k->name + k->name_at, n);
        }
        need += 18 + n;
    }
    pthread_mutex_unlock(&known_lock);
    return need;
}

/* -- listing a directory ------------------------------------------------------ */

struct lentry {
    struct stat st;
    uint8_t len;
    char name[256];
};

static struct lentry *ents;  /* the reader thread's */
static size_t ents_room, order_room;
static struct lentry **order;
static char *out;
static size_t out_room;

static inline uint64_t lower_ino(uint64_t st_ino) { return st_ino != FUSE_ROOT_ID ? st_ino : ino_one; }

static int by_name(const void *a, const void *b)
{
    const struct lentry *x = *(struct lentry *const *)a, *y = *(struct lentry *const *)b;

    return name_cmp(x->name, x->len, y->name, y->len);
}

/* What Python answers for an untouched repo entry numbered ino (attrs.py entry_record
 * of tree.py node_from_stat). */
static void entry_of(struct fuse_entry_out *e, uint64_t ino, const struct stat *st)
{
    uint64_t size = S_ISDIR(st->st_mode) ? 0 : (uint64_t)st->st_size;

    memset(e, 0, sizeof(*e));
    e->nodeid = ino;
    e->entry_valid = e->attr_valid = lower_timeout;
    e->attr.ino = ino;
    e->attr.size = size;
    e->attr.blocks = (size + 511) / 512;
    e->attr.atime = (uint64_t)st->st_atim.tv_sec;
    e->attr.mtime = (uint64_t)st->st_mtim.tv_sec;
    e->attr.ctime = (uint64_t)st->st_ctim.tv_sec;
    e->attr.atimensec = (uint32_t)st->st_atim.tv_nsec;
    e->attr.mtimensec = (uint32_t)st->st_mtim.tv_nsec;
    e->attr.ctimensec = (uint32_t)st->st_ctim.tv_nsec;
    e->attr.mode = st->st_mode;
    e->attr.nlink = (uint32_t)st->st_nlink;
    e->attr.uid = st->st_uid;
    e->attr.gid = st->st_gid;
    e->attr.rdev = (uint32_t)st->st_rdev;
    e->attr.blksize = lower_blksize;
}

/* Append a publication record (u32 length, name, struct fuse_entry_out) to out at *at. */
static void put_record(size_t *at, const char *name, uint32_t len, const struct fuse_entry_out *e)
{
    memcpy(out + *at, &len, 4);
    memcpy(out + *at + 4, name, len);
    memcpy(out + *at + 4 + len, e, sizeof(*e));
    *at += 4 + len + sizeof(*e);
}

static int grow(void **p, size_t *room, size_t need, size_t each)
{
    void *grown;

    if (need <= *room)
        return 1;
    grown = realloc(*p, need * 2 * each);
    if (grown == NULL)
        return 0;
    *p = grown;
    *room = need * 2;
    return 1;
}

/* The entries of the repo directory open at fd, into ents: their count, or -1 if C
 * must not list it (too many names, a hard-linked file, an error). */
static int read_entries(int fd)
{
    DIR *d = fdopendir(fd);
    struct dirent *de;
    uint32_t n = 0;

    if (d == NULL) {
        close(fd);
        return -1;
    }
    while ((de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        struct lentry *e;

        if ((len == 1 && de->d_name[0] == '.') || (len == 2 && de->d_name[0] == '.' && de->d_name[1] == '.'))
            continue;
        if (n >= lower_most || !grow((void **)&ents, &ents_room, n + 1, sizeof(*ents)) ||
            !grow((void **)&order, &order_room, n + 1, sizeof(*order))) {
            n = UINT32_MAX;
            break;
        }
        e = &ents[n];
        if (fstatat(dirfd(d), de->d_name, &e->st, AT_SYMLINK_NOFOLLOW) != 0) {
            if (errno == ENOENT)
                continue;  /* (gone behind our back, as lower.py skips it) */
            n = UINT32_MAX;
            break;
        }
        if ((!S_ISDIR(e->st.st_mode) && e->st.st_nlink > 1) || e->st.st_rdev > UINT32_MAX ||
            lower_ino(e->st.st_ino) >= first_upper) {
            n = UINT32_MAX;
            break;
        }
        e->len = (uint8_t)len;
        memcpy(e->name, de->d_name, len);
        n++;
    }
    closedir(d);
    if (n == UINT32_MAX)
        return -1;
    for (uint32_t i = 0; i < n; i++)
        order[i] = &ents[i];
    qsort(order, n, sizeof(*order), by_name);
    return (int)n;
}

/* The reader thread: list directory dir from the repo and publish it (names.c), if it
 * is one C may list. */
static void list_lower(uint64_t dir, int first_lookup)
{
    struct known *k;
    char path[PATH_MAX];
    uint64_t parent, stamp;
    struct stat st;
    int fd, n, listable = 0, changed = 0, all_known = 1;
    size_t size, at = 0;
    struct fuse_entry_out e;

    pthread_mutex_lock(&known_lock);
    k = known_find(dir);
    if (k != NULL && k->is_dir && !k->unlistable && strlen(k->name) < sizeof(path)) {
        if (k->eager || !first_lookup)
            listable = 1;
        else
            k->eager = 1;  /* (the next lookup in it lists it: a walk's second name) */
        strcpy(path, k->name);
        parent = k->parent;
    }
    pthread_mutex_unlock(&known_lock);
    if (!listable)
        return;
    stamp = fastpath_names_clock();
    fd = open_beneath(lower_fd, path[0] ? path : ".", O_RDONLY | O_DIRECTORY);
    if (fd >= 0 && (fstat(fd, &st) != 0 || lower_ino(st.st_ino) != dir)) {
        close(fd);
        fd = -1;
    }
    n = fd >= 0 ? read_entries(fd) : -1;
    size = 2 * (4 + 2 + sizeof(e));
    for (int i = 0; i < n; i++)
        size += 4 + order[i]->len + sizeof(e);
    if (n < 0 || !grow((void **)&out, &out_room, size, 1)) {
        pthread_mutex_lock(&known_lock);
        if ((k = known_find(dir)) != NULL)
            k->unlistable = 1;
        pthread_mutex_unlock(&known_lock);
        return;
    }
    entry_of(&e, dir, &st);
    put_record(&at, ".", 1, &e);
    memset(&e, 0, sizeof(e));  /* (the kernel takes no attributes from ".." in a listing) */
    e.nodeid = e.attr.ino = parent;
    e.attr.mode = S_IFDIR;
    e.entry_valid = e.attr_valid = lower_timeout;
    put_record(&at, "..", 2, &e);
    for (int i = 0; i < n; i++) {
        entry_of(&e, lower_ino(order[i]->st.st_ino), &order[i]->st);
        put_record(&at, order[i]->name, order[i]->len, &e);
    }
    pthread_mutex_lock(&known_lock);
    for (int i = 0; i < n && all_known; i++) {
        struct lentry *le = order[i];
        size_t plen = strlen(path);
        int is_dir = S_ISDIR(le->st.st_mode);
        char child[PATH_MAX];

        if (is_dir && plen + 1 + le->len < sizeof(child)) {
            memcpy(child, path, plen);
            child[plen] = '/';
            memcpy(child + plen + 1, le->name, le->len);
            all_known = known_put(lower_ino(le->st.st_ino), dir, plen ? child : child + 1,
                                  plen ? plen + 1 + le->len : le->len, le->len, 1, 1,
                                  le->st.st_size <= SMALL_DIR_BYTES);
        } else {  /* (a directory whose path is too long is never listed: opened by its name, it is not found) */
            all_known = known_put(lower_ino(le->st.st_ino), dir, le->name, le->len, le->len, is_dir, 1, 0);
        }
    }
    pthread_mutex_unlock(&known_lock);
    if (!all_known) {  /* (Python could not learn where its names are: no more listings) */
        __atomic_store_n(&listing_on, 0, __ATOMIC_RELEASE);
        return;
    }
    if (publish_listing(stamp, dir, out, at, &changed))
        fastpath_lower_listed++;
    else if (changed) {
        pthread_mutex_lock(&known_lock);
        if ((k = known_find(dir)) != NULL)
            k->unlistable = 1;  /* (changed: for good) */
        pthread_mutex_unlock(&known_lock);
    }
}

/* The reader thread, before names.c answers: a LOOKUP, or a READDIRPLUS from the
 * start, in a repo directory with no listing published: list it here if C may. */
void lower_arriving(const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    int lookup;

    if (!__atomic_load_n(&lower_on, __ATOMIC_ACQUIRE) || !__atomic_load_n(&listing_on, __ATOMIC_ACQUIRE) ||
        len < sizeof(*in) || in->nodeid == FUSE_ROOT_ID || in->nodeid >= first_upper)
        return;
    lookup = in->opcode == FUSE_LOOKUP;
    if (!lookup && !(in->opcode == FUSE_READDIRPLUS && len >= sizeof(*in) + sizeof(struct fuse_read_in) &&
                     ((const struct fuse_read_in *)(mem + sizeof(*in)))->offset == 0))
        return;
    if (!names_listed(in->nodeid))
        list_lower(in->nodeid, lookup);
}

/* -- reading a file ------------------------------------------------------------ */

#define READ_FDS 16      /* repo files kept open: a big file is read in several READs */
#define READ_MOST (1u << 20)

static struct { uint64_t ino; int fd; } read_fds[READ_FDS];  /* the reader thread's */
static unsigned read_next;
static char *read_buf;
static size_t read_room;

/* With known_lock held: the repo path of an entry C listed (into path), or 0; a
 * directory's, only if dirs. */
static int entry_path(uint64_t ino, char *path, size_t cap, int dirs)
{
    struct known *k = known_find(ino), *dir;
    size_t dlen, nlen;

    if (k != NULL && k->verified && k->is_dir && dirs && strlen(k->name) < cap) {
        strcpy(path, k->name);
        return 1;
    }
    if (k == NULL || !k->verified || k->is_dir || (dir = known_find(k->parent)) == NULL || !dir->is_dir)
        return 0;
    dlen = strlen(dir->name);
    nlen = strlen(k->name);
    if (dlen + 1 + nlen >= cap)
        return 0;
    memcpy(path, dir->name, dlen);
    path[dlen] = '/';
    memcpy(path + dlen + 1, k->name, nlen + 1);
    return 1;
}

/* The fd of repo file ino if it is one kept open, else -1. */
static int kept_fd(uint64_t ino)
{
    for (unsigned i = 0; i < READ_FDS; i++)
        if (read_fds[i].ino == ino)
            return read_fds[i].fd;
    return -1;
}

/* An fd of repo file ino (opened at its path, checked to be it), or -1. */
static int read_fd(uint64_t ino)
{
    char path[PATH_MAX];
    struct stat st;
    int ok, fd = kept_fd(ino);

    if (fd >= 0)
        return fd;
    pthread_mutex_lock(&known_lock);
    ok = entry_path(ino, path, sizeof(path), 0);
    pthread_mutex_unlock(&known_lock);
    if (!ok || (fd = open_beneath(lower_fd, path, O_RDONLY | O_NONBLOCK)) < 0)  /* (not a fifo's wait) */
        return -1;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || lower_ino(st.st_ino) != ino) {
        close(fd);
        return -1;
    }
    if (read_fds[read_next].ino != 0)
        close(read_fds[read_next].fd);
    read_fds[read_next].ino = ino;
    read_fds[read_next].fd = fd;
    read_next = (read_next + 1) % READ_FDS;
    return fd;
}

/* The reader thread: answer a READ of a repo file nothing changed, through a handle C
 * opened, from the repo; 0 if Python must. */
int lower_read_answer(struct fuse_session *se, const char *mem, size_t len, uint64_t arrival)
{
    const struct fuse_in_header *in = (const void *)mem;
    const struct fuse_read_in *arg = (const void *)(mem + sizeof(*in));
    ssize_t got;
    int fd;

    if (!__atomic_load_n(&lower_on, __ATOMIC_ACQUIRE) || len < sizeof(*in) + sizeof(*arg) ||
        in->opcode != FUSE_READ || !(arg->fh & KERNEL_HANDLE) || in->nodeid == FUSE_ROOT_ID ||
        in->nodeid >= first_upper || arg->size > READ_MOST || arg->offset > INT64_MAX ||
        !grow((void **)&read_buf, &read_room, arg->size ? arg->size : 1, 1))
        return 0;
    fd = read_fd(in->nodeid);
    if (fd < 0 || (got = pread(fd, read_buf, arg->size, (off_t)arg->offset)) < 0 ||
        !names_reply_unchanged(se, in->unique, in->nodeid, read_buf, (size_t)got))
        return 0;
    stats_record(&fastpath_stats[STATS_READ_C], now_ns() - arrival, 0);
    fastpath_lower_reads++;
    return 1;
}

/* The reader thread: answer a GETATTR of a repo entry nothing changed, C listed, from
 * the repo (lstat's, as Python answers it: attrs.py entry_attrs); 0 if Python must. */
int lower_getattr_answer(struct fuse_session *se, const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    char path[PATH_MAX];
    struct fuse_entry_out e;
    struct fuse_attr_out out = {0};
    struct stat st;
    int fd, ok;

    if (!__atomic_load_n(&lower_on, __ATOMIC_ACQUIRE) || len < sizeof(*in) || in->opcode != FUSE_GETATTR ||
        in->nodeid == FUSE_ROOT_ID || in->nodeid >= first_upper)
        return 0;
    ok = (fd = kept_fd(in->nodeid)) >= 0 && fstat(fd, &st) == 0;
    if (!ok) {
        pthread_mutex_lock(&known_lock);
        ok = entry_path(in->nodeid, path, sizeof(path), 1);
        pthread_mutex_unlock(&known_lock);
        if (!ok || (fd = open_beneath(lower_fd, path, O_PATH)) < 0)
            return 0;
        ok = fstat(fd, &st) == 0;
        close(fd);
    }
    if (!ok || lower_ino(st.st_ino) != in->nodeid)
        return 0;
    entry_of(&e, in->nodeid, &st);
    out.attr_valid = e.attr_valid;
    out.attr = e.attr;
    if (!names_reply_unchanged(se, in->unique, in->nodeid, &out, sizeof(out)))
        return 0;
    fastpath_lower_attrs++;
    return 1;
}
