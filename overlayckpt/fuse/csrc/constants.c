/* The constants Python must agree with, exported so that a test can read them
 * from the built library (tests/test_fastpath_constants.py) instead of trusting
 * comments: fuse/ops.py KERNEL_HANDLE, records.CONTROL_INO_BASE, writebehind.py's
 * HEADER and WRAPPED for the write-behind log's records, core/latency.py's
 * histogram layout, and what fastpath.py packs for names.c. */
#include "fastpath.h"

const uint64_t fastpath_KERNEL_HANDLE = KERNEL_HANDLE;
const uint64_t fastpath_LISTING_MARK = LISTING_MARK;
const uint64_t fastpath_ACKNOWLEDGED = ACKNOWLEDGED;
const uint32_t fastpath_WRAPPED = WRAPPED;
const uint32_t fastpath_LARGEST_WRITE_SHARE = LARGEST_WRITE_SHARE;

/* struct record: its size, and each field's offset and size, in the order
   seq, ino, off, size, pid (the order of behind.HEADER's fields) */
#define FIELD(name) {offsetof(struct record, name), sizeof(((struct record *)0)->name)}
const uint32_t fastpath_RECORD_SIZE = sizeof(struct record);
const uint32_t fastpath_RECORD_FIELDS = 5;
const uint32_t fastpath_RECORD_LAYOUT[5][2] = {FIELD(seq), FIELD(ino), FIELD(off), FIELD(size), FIELD(pid)};

/* struct hist (stats.c): its buckets, and its size (three u64, then the buckets) */
const uint32_t fastpath_HIST_SUB_BITS = HIST_SUB_BITS;
const uint32_t fastpath_HIST_BUCKETS = HIST_BUCKETS;
const uint32_t fastpath_HIST_SIZE = sizeof(struct hist);
const uint32_t fastpath_STATS_KINDS = STATS_KINDS;

/* names.c: struct fuse_entry_out, as Python packs it */
const uint32_t fastpath_ENTRY_OUT_SIZE = sizeof(struct fuse_entry_out);
const uint32_t fastpath_ATTR_OUT_SIZE = sizeof(struct fuse_attr_out);
