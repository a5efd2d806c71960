/* Directories answered in C: the LOOKUPs and READDIRPLUS of directories Python has
 * listed already.
 *
 * A walk (git status's lstat of every indexed file and its scan for untracked ones,
 * a cold tar, find, the names a restore made the kernel forget) asks a LOOKUP per
 * name and a READDIRPLUS per directory, and each one through pyfuse3's loop costs
 * ~40 us of round trip around the Python. When Python lists a directory (to answer
 * a READDIRPLUS, or a lookup in it: lower.py lists a directory at its second name),
 * it publishes the listing here: ".", "..", then every name in its order (sorted),
 * each with what Python answers for it. The reader thread answers from it the
 * lookups of those names, and a READDIRPLUS from offset 0; it carries on from an
 * offset of its listing whatever changed since (its listing's number is in the
 * offset): a listing read on is a snapshot, as Python's own are (fuse/ops.py
 * readdir). Python hands out the same offsets when it answers a READDIRPLUS from a
 * listing C took, so the ones that carry on (the last, at the end, returns nothing)
 * are C's too. An offset of Python's own, or of a listing replaced since, goes to
 * Python, which keeps its snapshot under that number.
 *
 * What keeps them exact: a clock, and the time each inode last changed. Every change
 * moves the clock and stamps the inodes it changes: the reader thread as a request
 * that may change anything arrives (the inodes it names: a new name's directory, the
 * file written; before C acknowledges a write, behind.c), and Python as it commits
 * a transaction, with every inode whose records the transaction wrote
 * (Store.on_commit). What no inode says (a request of an unknown kind, the repo's
 * cached answers dropped by apply) stamps them all. Python reads the clock before it
 * reads the state it publishes from; a name is answered only while neither its
 * directory nor its inode has changed since, a listing while neither the directory
 * nor any of its names has. The stamps are kept by hash of the inode in
 * a fixed table: inodes that share a slot drop each other's answers, never keep them.
 * The reader answers under the lock the stamps move under, so an answer is on its way
 * to the kernel before a change's commit returns, as in dirattrs.c. Nothing is taken
 * while C has acknowledged a write Python has not taken yet (behind.c): its arrival
 * may predate the clock Python read, and its content is not in what Python read.
 *
 * A create burst (an install, an unpacked archive) looks up each new name before it
 * makes it, and each make changes the directory; so does an editor's save (a temporary
 * name made, then renamed over the file). So a request that makes a name in a
 * directory whose listing is whole is noted as it arrives; when Python has committed
 * it, and nothing else touched the directory since (counted, per stamp slot), Python
 * adds the name (fastpath_listing_change) and the listing's names are whole again: C
 * answers the next name's lookup as absent. The names added are kept beside the
 * listing and go to Python; a rename within the directory, an unlink or an rmdir takes
 * its old name out of them (fastpath_listing_change: the temporary name of the next
 * save is answered absent, and saves under names never used again do not fill them),
 * and keeps the listing whole (a build that deletes its outputs and makes them again
 * has its lookups answered in C). Up to 65,536
 * names are added to one listing (a flat directory of thousands of files made one
 * after the other); beyond, its lookups go to Python until it is listed again. A
 * directory Python makes starts with an empty listing.
 *
 * The same clock keeps inodes' attributes (by hash of inode, a fixed table): a restore
 * makes the kernel drop the attributes of every inode it changed, and a walk after it
 * asks a GETATTR of each. Python answers the first of a run and publishes the next
 * ones' here (fuse/ops.py), which the reader answers while the inode has not changed.
 */
#include "fastpath.h"

#define LISTING_BITS 15                    /* by hash of directory inode; a collision replaces */
#define LISTING_SLOTS (1u << LISTING_BITS)
#define LISTINGS_MAX_BYTES (32u << 20)     /* beyond it they all go, and come back as read */
#define TOUCH_BITS 16
#define TOUCH_SLOTS (1u << TOUCH_BITS)
#define ADDED_MOST (1u << 16)              /* names added to one listing since published */

struct listing {
    uint64_t dir;
    uint64_t stamp;    /* the clock when Python began to read it: its entries' attributes */
    uint64_t names_stamp;  /* the clock until which its names and added are all of dir's */
    uint64_t pending;  /* a new name's request arrived: dir's slot's touches then; or 0 */
    uint32_t added_count, added_room;
    char **added;      /* names made in it since (sorted as memcmp sorts; Python answers them) */
    uint64_t number;   /* 30 bits, in the offsets C hands out */
    uint32_t count;    /* entries: ".", "..", then the names, sorted */
    size_t size;
    uint32_t *starts;  /* each entry's record in buf; starts[count] == size */
    char buf[];        /* struct fuse_direntplus records, their offsets filled in */
};

static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t names_clock = 1;       /* moved under names_lock, read atomically */
static uint64_t changed_all;           /* the clock when everything last changed */
static uint64_t touched[TOUCH_SLOTS];  /* by hash of inode: the clock when it last changed */
static uint64_t touches[TOUCH_SLOTS];  /* and how many times it was stamped */
static struct listing *listings[LISTING_SLOTS];
static size_t listings_bytes;
static uint64_t listings_made;
uint64_t fastpath_names_answered, fastpath_absent_answered, fastpath_listings_answered,
    fastpath_attrs_answered;

#define ATTR_SLOTS_BITS 17  /* 16 MiB of address space, touched only where published */
struct attr_slot {
    uint64_t ino;    /* 0: empty */
    uint64_t stamp;  /* the clock Python read before reading it */
    struct fuse_attr_out out;
};
static struct attr_slot *attr_table;  /* allocated at the first publication, then kept */

static inline uint32_t slot_of(uint64_t ino) { return slot_in(ino, TOUCH_BITS); }

/* With names_lock held: ino changed at clock now. */
static inline void touch_one(uint64_t ino, uint64_t now)
{
    touched[slot_of(ino)] = now;
    touches[slot_of(ino)]++;
    lower_touched(ino);  /* (lowerdirs.c: never listed from the repo again) */
}

/* With names_lock held: whether nothing of ino changed after stamp. */
static inline int unchanged(uint64_t ino, uint64_t stamp)
{
    return stamp >= changed_all && touched[slot_of(ino)] <= stamp;
}

static inline struct listing **listing_slot(uint64_t dir)
{
    return &listings[slot_in(dir, LISTING_BITS)];
}

/* With names_lock held: dir's listing, if one is published. */
static struct listing *listing_of(uint64_t dir)
{
    struct listing *l = *listing_slot(dir);

    return l != NULL && l->dir == dir ? l : NULL;
}

static inline struct fuse_direntplus *entry(const struct listing *l, uint32_t i)
{
    return (struct fuse_direntplus *)(l->buf + l->starts[i]);
}

/* Python: the clock to stamp what it is about to read with. */
uint64_t fastpath_names_clock(void) { return __atomic_load_n(&names_clock, __ATOMIC_ACQUIRE); }

/* Everything changed: every listing published so far is stale. */
void fastpath_names_changed(void)
{
    pthread_mutex_lock(&names_lock);
    changed_all = __atomic_add_fetch(&names_clock, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&names_lock);
}

/* These inodes changed (Python, after a commit: the inodes whose records it wrote). */
void fastpath_names_touch(const uint64_t *inos, size_t count)
{
    uint64_t now;

    pthread_mutex_lock(&names_lock);
    now = __atomic_add_fetch(&names_clock, 1, __ATOMIC_ACQ_REL);
    for (size_t i = 0; i < count; i++)
        touch_one(inos[i], now);
    pthread_mutex_unlock(&names_lock);
}

static void touch_two(uint64_t a, uint64_t b)
{
    uint64_t inos[2] = {a, b};

    fastpath_names_touch(inos, b ? 2 : 1);
}

/* With names_lock held: whether l's names (and added) are all of its directory's now. */
static inline int names_whole(const struct listing *l)
{
    return l->names_stamp >= changed_all && unchanged(l->dir, l->names_stamp);
}

/* A request that makes or removes a name in dir arrives (other: the inode a link names,
 * the directory a rename moves from, or 0):
 * stamp them, and note whether dir's listing was whole until now (fastpath_listing_change). */
static void name_arriving(uint64_t dir, uint64_t other)
{
    struct listing *l;
    int whole;
    uint64_t now;

    pthread_mutex_lock(&names_lock);
    l = listing_of(dir);
    whole = l != NULL && names_whole(l);
    now = __atomic_add_fetch(&names_clock, 1, __ATOMIC_ACQ_REL);
    touch_one(dir, now);
    if (other)
        touch_one(other, now);
    if (l != NULL)
        l->pending = whole ? touches[slot_of(dir)] : 0;
    pthread_mutex_unlock(&names_lock);
}

/* The reader thread, as each request arrives: stamp what it may change (the inodes it
 * names; all of them for a request of a kind not known here). */
void names_arriving(const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    const char *arg = mem + sizeof(*in);
    size_t arglen = len - sizeof(*in), second = 0, need = 0;

    if (len < sizeof(*in)) {
        fastpath_names_changed();
        return;
    }
    switch (in->opcode) {
    case FUSE_LOOKUP: case FUSE_FORGET: case FUSE_BATCH_FORGET: case FUSE_GETATTR:
    case FUSE_READLINK: case FUSE_READ: case FUSE_STATFS: case FUSE_RELEASE:
    case FUSE_FSYNC: case FUSE_GETXATTR: case FUSE_LISTXATTR: case FUSE_FLUSH:
    case FUSE_OPENDIR: case FUSE_READDIR: case FUSE_READDIRPLUS: case FUSE_RELEASEDIR:
    case FUSE_FSYNCDIR: case FUSE_ACCESS: case FUSE_INTERRUPT: case FUSE_POLL:
    case FUSE_LSEEK: case FUSE_IOCTL: case FUSE_SYNCFS: case FUSE_GETLK: case FUSE_SETLK:
    case FUSE_SETLKW: case FUSE_BMAP: case FUSE_NOTIFY_REPLY:
        return;  /* they change nothing (no atime is kept; what a sync stores, it commits) */
    case FUSE_OPEN:  /* but a truncating one */
        if (arglen >= sizeof(struct fuse_open_in) &&
            !(((const struct fuse_open_in *)arg)->flags & O_TRUNC))
            return;
        touch_two(in->nodeid, 0);
        return;
    /* the directory of a new name */
    case FUSE_CREATE: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_SYMLINK:
        name_arriving(in->nodeid, 0);
        return;
    /* and the file it links */
    case FUSE_LINK:
        if (arglen >= sizeof(struct fuse_link_in)) {
            name_arriving(in->nodeid, ((const struct fuse_link_in *)arg)->oldnodeid);
            return;
        }
        break;
    /* the directory of a removed name (fastpath_listing_change may take it out) */
    case FUSE_UNLINK: case FUSE_RMDIR:
        name_arriving(in->nodeid, 0);
        return;
    /* the file changed */
    case FUSE_SETATTR: case FUSE_WRITE: case FUSE_SETXATTR:
    case FUSE_REMOVEXATTR: case FUSE_FALLOCATE:
        touch_two(in->nodeid, 0);
        return;
    /* a rename: the directory it moves to gets a name, the one it moves from changes */
    case FUSE_RENAME: case FUSE_RENAME2:
        if (arglen >= (in->opcode == FUSE_RENAME ? sizeof(struct fuse_rename_in)
                                                 : sizeof(struct fuse_rename2_in))) {
            uint64_t newdir;

            memcpy(&newdir, arg + offsetof(struct fuse_rename_in, newdir), sizeof(newdir));
            name_arriving(newdir, newdir == in->nodeid ? 0 : in->nodeid);
            return;
        }
        break;
    /* and the inode in the argument: the file copied into */
    case FUSE_COPY_FILE_RANGE:
        second = offsetof(struct fuse_copy_file_range_in, nodeid_out);
        need = sizeof(struct fuse_copy_file_range_in);
        break;
    default:
        break;
    }
    if (need && arglen >= need) {
        uint64_t other;

        memcpy(&other, arg + second, sizeof(other));
        touch_two(in->nodeid, other);
        return;
    }
    fastpath_names_changed();
}

/* names_arriving, exported: tests/test_names_pending.py drives a request's arrival and
 * Python's side in the order a race would, with no mount. */
void fastpath_names_arriving(const char *mem, size_t len) { names_arriving(mem, len); }

static void listing_free(struct listing **slot)
{
    if (*slot != NULL) {
        listings_bytes -= (*slot)->size + ((*slot)->count + 1) * sizeof(uint32_t);
        for (uint32_t i = 0; i < (*slot)->added_count; i++) {
            listings_bytes -= 2 + (unsigned char)(*slot)->added[i][0];
            free((*slot)->added[i]);
        }
        free((*slot)->added);
        free((*slot)->starts);
        free(*slot);
        *slot = NULL;
    }
}

/* Python: directory dir's listing (".", "..", then its names, sorted) read at clock
 * stamp, each entry as u32 name length, the name, struct fuse_entry_out (fastpath.py
 * packs them). The listing's number if taken (1 to 2^30 - 1, in its offsets: Python
 * hands out the same, so that C answers the READDIRPLUS that carry on, the last one
 * at the end included), else 0. */
int fastpath_publish_listing(uint64_t stamp, uint64_t dir, const char *in, size_t in_size)
{
    return publish_listing(stamp, dir, in, in_size, NULL);
}

/* With names_lock held: whether l's directory or any of its names was ever changed. */
static int ever_changed(const struct listing *l)
{
    if (lower_changed(l->dir))
        return 1;
    for (uint32_t i = 2; i < l->count; i++)
        if (lower_changed(entry(l, i)->dirent.ino))
            return 1;
    return 0;
}

/* fastpath_publish_listing, and for a listing read from the repo (lowerdirs.c) with
 * changed not NULL: not taken if the directory or any name in it was ever changed,
 * and then *changed is 1. */
int publish_listing(uint64_t stamp, uint64_t dir, const char *in, size_t in_size, int *changed)
{
    size_t at = 0, size = 0;
    uint32_t count = 0, len;
    struct listing *l;
    int number;

    if (dir == 0 || dir >= cache_below)
        return 0;
    while (at < in_size) {  /* check it, and the size of the records it makes */
        if (at + 4 > in_size)
            return 0;
        memcpy(&len, in + at, 4);
        if (len == 0 || len > 255 || at + 4 + len + sizeof(struct fuse_entry_out) > in_size)
            return 0;
        size += FUSE_DIRENTPLUS_SIZE(&(struct fuse_direntplus){.dirent = {.namelen = len}});
        at += 4 + len + sizeof(struct fuse_entry_out);
        count++;
    }
    if (count < 2 || size > LISTINGS_MAX_BYTES / 4)
        return 0;
    l = malloc(sizeof(*l) + size);
    if (l == NULL)
        return 0;
    l->starts = malloc((count + 1) * sizeof(uint32_t));
    if (l->starts == NULL) {
        free(l);
        return 0;
    }
    l->dir = dir;
    l->stamp = l->names_stamp = stamp;
    l->pending = 0;
    l->added_count = l->added_room = 0;
    l->added = NULL;
    l->count = count;
    l->size = size;
    at = size = 0;
    for (uint32_t i = 0; i < count; i++) {
        struct fuse_direntplus *d = (void *)(l->buf + size);
        size_t rec;

        memcpy(&len, in + at, 4);
        memcpy(&d->entry_out, in + at + 4 + len, sizeof(d->entry_out));
        d->dirent.ino = d->entry_out.attr.ino;
        d->dirent.namelen = len;
        d->dirent.type = (d->entry_out.attr.mode & S_IFMT) >> 12;
        memcpy(d->dirent.name, in + at + 4, len);
        rec = FUSE_DIRENTPLUS_SIZE(d);
        memset(d->dirent.name + len, 0, rec - offsetof(struct fuse_direntplus, dirent.name) - len);
        l->starts[i] = (uint32_t)size;
        size += rec;
        at += 4 + len + sizeof(d->entry_out);
    }
    l->starts[count] = (uint32_t)size;
    pthread_mutex_lock(&names_lock);
    if (changed != NULL)
        *changed = ever_changed(l);
    if (stamp < changed_all || behind_pending() || (changed != NULL && *changed)) {
        pthread_mutex_unlock(&names_lock);
        free(l->starts);
        free(l);
        return 0;
    }
    l->number = ++listings_made & LISTING_NUMBER;
    if (l->number == 0)
        l->number = ++listings_made & LISTING_NUMBER;
    for (uint32_t i = 0; i < count; i++)
        entry(l, i)->dirent.off = LISTING_MARK | (l->number << 32) | (i + 1);
    listing_free(listing_slot(dir));
    if (listings_bytes + size > LISTINGS_MAX_BYTES)
        for (uint32_t i = 0; i < LISTING_SLOTS; i++)
            listing_free(&listings[i]);
    *listing_slot(dir) = l;
    listings_bytes += size + (count + 1) * sizeof(uint32_t);
    number = (int)l->number;
    pthread_mutex_unlock(&names_lock);
    return number;
}

/* With names_lock held: the entry of l named name (its names, after "." and "..", are
 * sorted as memcmp sorts), or NULL. */
static struct fuse_direntplus *find(const struct listing *l, const char *name, size_t len)
{
    uint32_t lo = 2, hi = l->count;

    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        struct fuse_direntplus *d = entry(l, mid);
        int c = name_cmp(d->dirent.name, d->dirent.namelen, name, len);

        if (c == 0)
            return d;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* With names_lock held: where name is, or would go, in l's added names (each a length
 * byte, then the name); *found says whether it is there. */
static uint32_t added_at(const struct listing *l, const char *name, size_t len, int *found)
{
    uint32_t lo = 0, hi = l->added_count;

    *found = 0;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        const char *a = l->added[mid];
        int c = name_cmp(a + 1, (unsigned char)a[0], name, len);

        if (c == 0) {
            *found = 1;
            return mid;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* With names_lock held: whether name is among l's added names. */
static int is_added(const struct listing *l, const char *name, size_t len)
{
    int found;

    (void)added_at(l, name, len, &found);
    return found;
}

/* With names_lock held: name (len bytes) into l's added names at at; 0 if out of memory. */
static int added_insert(struct listing *l, uint32_t at, const char *name, size_t len)
{
    char *copy = malloc(len + 2);

    if (copy == NULL)
        return 0;
    if (l->added_count == l->added_room) {  /* (doubled: a burst of thousands in one directory) */
        uint32_t room = l->added_room ? 2 * l->added_room : 16;
        char **grown = realloc(l->added, room * sizeof(char *));

        if (grown == NULL) {
            free(copy);
            return 0;
        }
        l->added = grown;
        l->added_room = room;
    }
    copy[0] = (char)len;
    memcpy(copy + 1, name, len);
    copy[len + 1] = '\0';
    memmove(l->added + at + 1, l->added + at, (l->added_count - at) * sizeof(char *));
    l->added[at] = copy;
    l->added_count++;
    listings_bytes += len + 2;
    return 1;
}

/* With names_lock held: drop name from l's added names, if it is there. */
static void added_remove(struct listing *l, const char *name, size_t len)
{
    int found;
    uint32_t at = added_at(l, name, len, &found);

    if (!found)
        return;
    listings_bytes -= (unsigned char)l->added[at][0] + 2u;
    free(l->added[at]);
    memmove(l->added + at, l->added + at + 1, (l->added_count - at - 1) * sizeof(char *));
    l->added_count--;
}

/* Python: the change that followed the request name_arriving noted is done, and it
 * alone touched dir's slot since: name (len bytes; or NULL) was made in dir, and gone
 * (gone_len bytes; or NULL) left it (a rename's within it, an unlink's, an rmdir's).
 * name joins the names added; gone leaves them, so that its next lookup is answered
 * absent (an editor's temporary name, saved over its target). A gone name the listing
 * was published with stays in it: its entry names an inode the change stamped, so its
 * lookup goes to Python. The listing's names are whole again. 1 if taken (else the
 * listing stays stale). */
int fastpath_listing_change(uint64_t dir, const char *name, size_t len, const char *gone, size_t gone_len)
{
    struct listing *l;
    int ok, found;
    uint32_t at;

    if ((name != NULL && (len == 0 || len > 255)) || (gone != NULL && (gone_len == 0 || gone_len > 255)) ||
        (name == NULL && gone == NULL))
        return 0;
    pthread_mutex_lock(&names_lock);
    l = listing_of(dir);
    ok = l != NULL && l->pending != 0 && touches[slot_of(dir)] == l->pending + 1 &&
         l->names_stamp >= changed_all && l->added_count < ADDED_MOST &&
         listings_bytes + len + 2 <= LISTINGS_MAX_BYTES;
    if (ok && gone != NULL)
        added_remove(l, gone, gone_len);
    if (ok && name != NULL) {
        at = added_at(l, name, len, &found);
        ok = found || added_insert(l, at, name, len);
    }
    if (ok)
        l->names_stamp = __atomic_load_n(&names_clock, __ATOMIC_ACQUIRE);
    if (l != NULL)
        l->pending = 0;
    pthread_mutex_unlock(&names_lock);
    return ok;
}

/* Reply data to request unique, about ino, unless ino was ever changed (lowerdirs.c):
 * under the lock a change's stamp takes, so the reply is on its way before the change
 * is even answered. 1 if it replied. */
int names_reply_unchanged(struct fuse_session *se, uint64_t unique, uint64_t ino, const void *data,
                          size_t size)
{
    int unchanged_ever;

    pthread_mutex_lock(&names_lock);
    unchanged_ever = !lower_changed(ino);
    if (unchanged_ever)
        (void)reply_raw(se, unique, data, size);
    pthread_mutex_unlock(&names_lock);
    return unchanged_ever;
}

/* Whether a listing of dir is published (whole or not). */
int names_listed(uint64_t dir)
{
    int listed;

    pthread_mutex_lock(&names_lock);
    listed = listing_of(dir) != NULL;
    pthread_mutex_unlock(&names_lock);
    return listed;
}

/* Whether a name a listing lacks is one Python answers "no such name" for: not ".",
 * "..", one too long (ENAMETOOLONG), or one in the root (the control directory's name
 * is in no listing). */
static int absent_answerable(uint64_t dir, const char *name, size_t len)
{
    return dir != FUSE_ROOT_ID && len <= 255 && strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
}

/* The reader thread: answer a LOOKUP of a name in a published listing; 0 if it cannot.
 * While the listing's names are whole (the directory unchanged since, but for names
 * added), a name in it is answered while its inode is unchanged since it was read, and a
 * name it lacks as absent, cached by the kernel as long as the directory's own entry: a
 * new name stamps its directory as its request arrives, and Python as it commits; the
 * repo changes only through apply and export, which stamp all. */
int names_answer(struct fuse_session *se, const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    const char *name = mem + sizeof(*in);
    size_t nlen = len > sizeof(*in) ? len - sizeof(*in) : 0;
    struct listing *l;
    struct fuse_direntplus *d;
    int answered = 0;

    if (in->opcode != FUSE_LOOKUP || listings_made == 0 || nlen < 2 || name[nlen - 1] != '\0' ||
        in->nodeid >= cache_below)
        return 0;
    nlen = strnlen(name, nlen);
    pthread_mutex_lock(&names_lock);
    l = listing_of(in->nodeid);
    if (l != NULL && names_whole(l)) {
        d = find(l, name, nlen);
        if (d != NULL && unchanged(d->dirent.ino, l->stamp)) {
            (void)reply_raw(se, in->unique, &d->entry_out, sizeof(d->entry_out));
            answered = 1;
        } else if (d == NULL && !is_added(l, name, nlen) && absent_answerable(l->dir, name, nlen)) {
            struct fuse_entry_out none = {0};  /* nodeid 0: no such name, for entry_valid */

            none.entry_valid = entry(l, 0)->entry_out.entry_valid;
            none.entry_valid_nsec = entry(l, 0)->entry_out.entry_valid_nsec;
            (void)reply_raw(se, in->unique, &none, sizeof(none));
            fastpath_absent_answered++;
            answered = 1;
        }
        fastpath_names_answered += answered;
    }
    pthread_mutex_unlock(&names_lock);
    return answered;
}

/* With names_lock held: whether nothing in l changed since it was published: the
 * directory (".", which a new or removed name changes) and every name. Not "..": the
 * kernel takes no attributes from a listing's "." and "..", and the inode ".." names
 * changes only with a move of the directory, which changes the directory. */
static int listing_unchanged(const struct listing *l)
{
    if (!unchanged(l->dir, l->stamp))
        return 0;
    for (uint32_t i = 2; i < l->count; i++)
        if (!unchanged(entry(l, i)->dirent.ino, l->stamp))
            return 0;
    return 1;
}

/* The reader thread: answer a READDIRPLUS from a published listing; 0 if it cannot. */
int listing_answer(struct fuse_session *se, const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    const struct fuse_read_in *arg = (const void *)(mem + sizeof(*in));
    struct listing *l;
    uint64_t off;
    uint32_t from, to;
    int answered = 0;

    if (in->opcode != FUSE_READDIRPLUS || len < sizeof(*in) + sizeof(*arg) ||
        in->nodeid >= cache_below || listings_made == 0)
        return 0;
    off = arg->offset;
    pthread_mutex_lock(&names_lock);
    l = listing_of(in->nodeid);
    if (l == NULL)
        goto out;
    if (off == 0) {
        if (!listing_unchanged(l))
            goto out;
        from = 0;
    } else if ((off & LISTING_MARK) && ((off >> 32) & LISTING_NUMBER) == l->number &&
               (off & 0xffffffff) <= l->count) {
        from = (uint32_t)(off & 0xffffffff);
    } else {
        goto out;
    }
    for (to = from; to < l->count && l->starts[to + 1] - l->starts[from] <= arg->size; to++)
        ;
    if (to == from && from < l->count)
        goto out;  /* (a buffer too small for one entry: Python's to answer) */
    (void)reply_raw(se, in->unique, l->buf + l->starts[from], l->starts[to] - l->starts[from]);
    fastpath_listings_answered++;
    answered = 1;
out:
    pthread_mutex_unlock(&names_lock);
    return answered;
}

static inline struct attr_slot *attr_slot(uint64_t ino)
{
    return &attr_table[slot_in(ino, ATTR_SLOTS_BITS)];
}

/* Python: count inodes' attributes (struct fuse_attr_out each, the inode in attr.ino),
 * read at clock stamp. How many it took. */
size_t fastpath_publish_attrs(uint64_t stamp, const struct fuse_attr_out *outs, size_t count)
{
    size_t taken = 0;

    pthread_mutex_lock(&names_lock);
    if (attr_table == NULL)
        __atomic_store_n(&attr_table, calloc((size_t)1 << ATTR_SLOTS_BITS, sizeof(*attr_table)),
                         __ATOMIC_RELEASE);
    if (attr_table != NULL && stamp >= changed_all && !behind_pending()) {
        for (size_t i = 0; i < count; i++) {
            uint64_t ino = outs[i].attr.ino;
            struct attr_slot *s;

            if (ino == 0 || ino >= cache_below)
                continue;
            s = attr_slot(ino);
            s->ino = ino;
            s->stamp = stamp;
            s->out = outs[i];
            taken++;
        }
    }
    pthread_mutex_unlock(&names_lock);
    return taken;
}

/* The reader thread: answer a GETATTR from the published attributes; 0 if it cannot. */
int attrs_answer(struct fuse_session *se, const char *mem, size_t len)
{
    const struct fuse_in_header *in = (const void *)mem;
    struct attr_slot *s;
    int answered = 0;

    if (len < sizeof(*in) || in->opcode != FUSE_GETATTR || in->nodeid == 0 ||
        __atomic_load_n(&attr_table, __ATOMIC_ACQUIRE) == NULL)
        return 0;
    pthread_mutex_lock(&names_lock);
    s = attr_slot(in->nodeid);
    if (s->ino == in->nodeid && unchanged(s->ino, s->stamp)) {
        (void)reply_raw(se, in->unique, &s->out, sizeof(s->out));
        fastpath_attrs_answered++;
        answered = 1;
    }
    pthread_mutex_unlock(&names_lock);
    return answered;
}
