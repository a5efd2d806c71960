/* Notifications the daemon sends the kernel on its own (a restore, a backout, an
 * export changed the tree behind the kernel's back), written straight to the
 * session's /dev/fuse fd: libfuse 3.14 does not know FUSE_NOTIFY_INC_EPOCH, and
 * invalidating thousands of inodes one pyfuse3 call at a time costs a trip through
 * Python each.
 *
 * - fastpath_notify_inc_epoch: FUSE_NOTIFY_INC_EPOCH (Linux 6.16+, protocol 7.44):
 *   the connection's epoch goes up by one, and every dentry the kernel holds of
 *   the mount (names and negative names alike) is looked up again at its next use.
 *   It drops names only: attributes, pages and directory listings stay, and are
 *   dropped per inode (below). An older kernel answers EINVAL (an unknown code).
 * - fastpath_notify_inval_entries: FUSE_NOTIFY_INVAL_ENTRY for each (parent, name)
 *   of an array: the kernel forgets those names (and what it cached below them).
 * - fastpath_notify_inval_inodes: FUSE_NOTIFY_INVAL_INODE (attributes, pages and the
 *   listing of a directory) for each inode of an array, in one call that runs
 *   without the GIL (ctypes lets go of it), so a restore that changed 20,000 files
 *   costs 20,000 system calls, not 20,000 trips through Python.
 *
 * The kernel takes a notification whole from one write (the header's len is the
 * write's size, unique 0, error the notify code); /dev/fuse takes writes from any
 * thread, as libfuse's own notifications and replies do.
 */
#include "fastpath.h"

#define NAME_MOST 1024  /* the kernel's FUSE_NAME_MAX: no longer name is ever cached */

#ifndef FUSE_NOTIFY_INC_EPOCH
#define FUSE_NOTIFY_INC_EPOCH 8  /* linux/fuse.h of 6.16+; Debian 12's stops at 7.38 */
#endif

static int session_fd(void)
{
    if (wrapped == NULL || real_fd == NULL)
        return -1;
    return real_fd(wrapped);
}

static int send_notify(int fd, int code, const void *arg, size_t size)
{
    struct fuse_out_header out;
    struct iovec iov[2];
    ssize_t n;

    out.unique = 0;
    out.error = code;  /* a notification: its code, positive, where a reply's error goes */
    out.len = (uint32_t)(sizeof(out) + size);
    iov[0].iov_base = &out;
    iov[0].iov_len = sizeof(out);
    iov[1].iov_base = (void *)arg;
    iov[1].iov_len = size;
    do
        n = writev(fd, iov, size ? 2 : 1);
    while (n < 0 && errno == EINTR);
    return n < 0 ? -errno : 0;
}

/* 0, or -errno: -EINVAL from a kernel older than 6.16 (no such notification),
   -ENOTCONN when no session is served here. */
int fastpath_notify_inc_epoch(void)
{
    int fd = session_fd();

    if (fd < 0)
        return -ENOTCONN;
    return send_notify(fd, FUSE_NOTIFY_INC_EPOCH, NULL, 0);
}

/* How many of the n names the kernel had (and forgot); -errno on a failure other
   than "not cached" (ENOENT), which stops the loop. Name i is lens[i] bytes of names,
   after the ones before it. */
long fastpath_notify_inval_entries(const uint64_t *parents, const char *names,
                                   const uint32_t *lens, size_t n)
{
    struct {
        struct fuse_notify_inval_entry_out head;
        char name[NAME_MOST + 1];
    } arg;
    long had = 0;
    int fd = session_fd(), err;

    if (fd < 0)
        return -ENOTCONN;
    for (size_t i = 0; i < n; names += lens[i], i++) {
        if (lens[i] == 0 || lens[i] > NAME_MOST)
            continue;  /* (no such name can be cached) */
        memset(&arg.head, 0, sizeof(arg.head));
        arg.head.parent = parents[i];
        arg.head.namelen = lens[i];
        memcpy(arg.name, names, lens[i]);
        arg.name[lens[i]] = '\0';  /* the kernel wants it */
        err = send_notify(fd, FUSE_NOTIFY_INVAL_ENTRY, &arg, sizeof(arg.head) + lens[i] + 1);
        if (err == 0)
            had++;
        else if (err != -ENOENT)
            return err;
    }
    return had;
}

/* How many of the n inodes the kernel had (and dropped the caches of); -errno on a
   failure other than "the kernel holds no such inode" (ENOENT), which stops the
   loop. attr_only: attributes only (a directory or file whose content is unchanged),
   else its pages and listing too. */
long fastpath_notify_inval_inodes(const uint64_t *inos, size_t n, int attr_only)
{
    struct fuse_notify_inval_inode_out arg;
    long had = 0;
    int fd = session_fd(), err;

    if (fd < 0)
        return -ENOTCONN;
    for (size_t i = 0; i < n; i++) {
        memset(&arg, 0, sizeof(arg));
        arg.ino = inos[i];
        arg.off = attr_only ? -1 : 0;
        arg.len = 0;  /* (with off 0: to the end) */
        err = send_notify(fd, FUSE_NOTIFY_INVAL_INODE, &arg, sizeof(arg));
        if (err == 0)
            had++;
        else if (err != -ENOENT)
            return err;
    }
    return had;
}
