/* Request latency for `overlayckpt stats`: writes, reads and fsyncs of the live
 * tree's files, from their arrival (the reader thread has just read them off
 * /dev/fuse) to their reply (just before it is written back), which is never more
 * than what the process that made the request waited.
 *
 * - A write acknowledged early (behind.c) is answered by the reader thread itself:
 *   it records it in fastpath_stats[STATS_WRITE_EARLY].
 * - Every other read, write or fsync of a marked handle (files of the live tree;
 *   control and view files are Python's and left out) is answered by Python: the
 *   wrapped handler (fastpath.c) notes the request and when it arrived
 *   (stats_pending), and the interposed fuse_reply_write/_buf/_err (interpose.c)
 *   find it there and record it.
 *
 * A histogram is a fixed array of counters (fastpath.h), so recording costs two clock
 * reads (vDSO) and a few adds, whatever has been recorded before. Each histogram has
 * one writer thread; Python reads them from pyfuse3's thread (fastpath.py).
 */
#include "fastpath.h"

#define PENDING_MAX 256  /* pyfuse3 serves at most max_tasks (16) requests at once */

struct hist fastpath_stats[STATS_KINDS];
uint64_t fastpath_stats_untimed;      /* requests not timed: the pending table was full */
uint64_t fastpath_request_arrival;    /* when the write being handled arrived (0: unknown) */
uint64_t taken_arrival;

static struct pending pending[PENDING_MAX];
int pending_count;

static unsigned bucket_of(uint64_t ns)
{
    unsigned shift, i;

    if (ns < (2u << HIST_SUB_BITS))
        return (unsigned)ns;
    shift = 64 - (unsigned)__builtin_clzll(ns) - (HIST_SUB_BITS + 1);
    i = (shift << HIST_SUB_BITS) + (unsigned)(ns >> shift);
    return i < HIST_BUCKETS ? i : HIST_BUCKETS - 1;
}

void stats_record(struct hist *h, uint64_t ns, int error)
{
    h->buckets[bucket_of(ns)]++;
    h->sum_ns += ns;
    if (ns > h->max_ns)
        h->max_ns = ns;
    if (error)
        h->errors++;
}

/* For Python to check bucket_of against core/latency.py's (tests/core). */
unsigned fastpath_hist_bucket(uint64_t ns) { return bucket_of(ns); }

/* In a wrapped handler: req, which arrived at taken_arrival, is Python's to answer. */
void stats_pending(fuse_req_t req, int kind)
{
    if (pending_count == PENDING_MAX || taken_arrival == 0) {
        fastpath_stats_untimed++;
        return;
    }
    pending[pending_count].req = req;
    pending[pending_count].arrival = taken_arrival;
    pending[pending_count].kind = kind;
    pending_count++;
}

/* In a reply: whether req was noted (then *out holds it, and it is forgotten). */
int stats_take_pending(fuse_req_t req, struct pending *out)
{
    for (int i = 0; i < pending_count; i++) {
        if (pending[i].req == req) {
            *out = pending[i];
            pending[i] = pending[--pending_count];
            return 1;
        }
    }
    return 0;
}

void stats_replied(const struct pending *p, uint64_t at, int error)
{
    stats_record(&fastpath_stats[p->kind], at > p->arrival ? at - p->arrival : 0, error);
}
