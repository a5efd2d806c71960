/* Write-behind: writes acknowledged in C, served by Python, once fastpath.py turns
 * it on.
 *
 * - write through a marked handle: the reader thread answers "written" at once
 *   and queues the request for Python, which stores it in order, before any
 *   later request, as it would have; the writer need not wait for it. That is
 *   what a native file system does with a write before fsync, and fsync (which
 *   comes through the queue after the writes) still answers only once they
 *   are stored, with the error of any that failed (fuse/ops.py). Before it
 *   answers, the reader copies the write into the store's write-behind log, a
 *   file mapped shared (so a killed daemon's copy survives it), which the next
 *   Session.open replays past what Python stored (writebehind.py). It marks the
 *   handle with ACKNOWLEDGED; the wrapped write handlers take the mark off,
 *   tell Python the record (fastpath_request_seq/next) and remember the request,
 *   whose reply fuse_reply_write/fuse_reply_err then drop. At most max_behind
 *   bytes wait at a time, and none while the store's file system has less than
 *   min_free bytes free: a full disk must be reported to the writer itself.
 *
 * The record layout (struct record, WRAPPED) is in fastpath.h.
 */
#include "fastpath.h"

#define MAX_BEHIND_REQUESTS 256     /* pyfuse3 serves at most max_tasks (16) at once */

static int log_fd = -1;   /* the log, in the store: its file system's free space is the store's */
static char *ring;         /* the log, mapped shared: it outlives a killed daemon */
static uint64_t ring_size, ring_head, ring_seq;  /* reader: where and which the next record is */
static uint64_t taken;     /* pyfuse3's thread: where the next marked write's record is */
static uint64_t max_behind, min_free;
static uint64_t behind_bytes;  /* log bytes acknowledged and not yet stored (atomic) */
static struct behind { fuse_req_t req; uint64_t bytes; } behind[MAX_BEHIND_REQUESTS];
int behind_count;  /* used only by pyfuse3's thread */

/* Map the log and start at record seq at offset head (what Python stored last
 * said comes next); max_bytes 0 turns write-behind off again. */
int fastpath_write_behind(int fd, uint64_t size, uint64_t seq, uint64_t head,
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
void acknowledge_write(struct fuse_session *se, char *mem, size_t len, uint64_t arrival)
{
    const struct fuse_in_header *in = (const void *)mem;
    struct fuse_write_in *arg = (void *)(mem + sizeof(*in));
    uint64_t limit = __atomic_load_n(&max_behind, __ATOMIC_ACQUIRE);
    uint64_t need, pos;
    struct record *rec, *wrap = NULL;
    struct fuse_write_out written;
    uint64_t answered;

    if (limit == 0 || in->opcode != FUSE_WRITE || len < sizeof(*in) + sizeof(*arg) ||
        len - sizeof(*in) - sizeof(*arg) < arg->size || arg->size > limit / LARGEST_WRITE_SHARE ||
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

    memset(&written, 0, sizeof(written));
    written.size = arg->size;
    /* count it before the writer can go on: the budget must hold what is answered */
    __atomic_add_fetch(&behind_bytes, need, __ATOMIC_ACQ_REL);
    answered = now_ns();
    if (!reply_raw(se, in->unique, &written, sizeof(written))) {
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
    stats_record(&fastpath_stats[STATS_WRITE_EARLY], answered - arrival, 0);
}

uint64_t fastpath_request_seq, fastpath_request_next;  /* the record of the write being handled */

/* In pyfuse3's thread: a marked write is about to reach Python. Marked writes
 * come in the order of their records, so the next record is this one's. */
void take_acknowledged(fuse_req_t req, struct fuse_file_info *fi)
{
    struct record *rec;

    fastpath_request_seq = 0;
    if (!(fi->fh & ACKNOWLEDGED))
        return;
    fi->fh &= ~ACKNOWLEDGED;
    if (taken + sizeof(*rec) > ring_size || ((struct record *)(ring + taken))->size == WRAPPED)
        taken = 0;
    rec = (struct record *)(ring + taken);
    taken += sizeof(*rec) + PAD8(rec->size);
    fastpath_request_seq = rec->seq;
    fastpath_request_next = taken;
    if (behind_count == MAX_BEHIND_REQUESTS)
        abort();  /* pyfuse3 serving this many writes at once breaks its own limit */
    behind[behind_count].req = req;
    behind[behind_count].bytes = sizeof(*rec) + PAD8(rec->size);
    behind_count++;
}

/* Whether C has acknowledged a write Python has not taken yet (any thread). */
int behind_pending(void)
{
    return __atomic_load_n(&behind_bytes, __ATOMIC_ACQUIRE) != 0;
}

/* Whether req was answered already; if so it is forgotten and freed. */
int drop_acknowledged(fuse_req_t req)
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

