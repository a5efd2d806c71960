/* libfuse interposition: the functions of libfuse that pyfuse3 calls and this
 * library stands in for (see fastpath.h). Each looks libfuse's own up, leaves any
 * session but the wrapped one as it is, and hands the rest to the file that owns
 * it: fastpath.c (the handlers), queue.c (the reader thread and the queue),
 * behind.c (the answers to acknowledged writes), warm.c (its threads' stop),
 * stats.c (the latency of the reads, writes and fsyncs Python answers). */
#include "fastpath.h"

struct fuse_session *(*real_new)(struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);
int (*real_fd)(struct fuse_session *);
int (*real_receive)(struct fuse_session *, struct fuse_buf *);
void (*real_process)(struct fuse_session *, const struct fuse_buf *);
void (*real_destroy)(struct fuse_session *);
int (*real_reply_write)(fuse_req_t, size_t);
int (*real_reply_err)(fuse_req_t, int);
int (*real_reply_open)(fuse_req_t, const struct fuse_file_info *);
int (*real_reply_buf)(fuse_req_t, const char *, size_t);

struct fuse_session *wrapped;  /* the one session whose handlers go through here */

int fastpath_sessions_wrapped(void) { return wrapped != NULL; }

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
    real_reply_open = dlsym(lib, "fuse_reply_open");
    real_reply_buf = dlsym(lib, "fuse_reply_buf");
    return real_new && real_fd && real_receive && real_process && real_destroy &&
           real_reply_write && real_reply_err && real_reply_open && real_reply_buf ? 0 : -1;
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    struct fuse_session *se;

    if (real_new == NULL && bind_libfuse() != 0)
        return NULL;  /* pyfuse3.init raises "fuse_session_new() failed" */
    if (wrapped != NULL || !fastpath_can_wrap(op, op_size))
        return real_new(args, op, op_size, userdata);  /* not ours to change: as is */
    se = real_new(args, fastpath_wrap(op, op_size), op_size, userdata);
    wrapped = se;
    return se;
}

int fuse_session_fd(struct fuse_session *se)
{
    if (real_fd == NULL && bind_libfuse() != 0)
        return -1;
    if (se != wrapped || real_fd(se) < 0)
        return real_fd(se);
    return queue_start(se);
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    if (se != wrapped || !queue_started())
        return real_receive(se, buf);
    return queue_take(buf);
}

void fuse_session_destroy(struct fuse_session *se)
{
    if (real_destroy == NULL && bind_libfuse() != 0)
        return;
    warm_stop_all();
    if (se == wrapped && queue_started()) {
        queue_stop();
        wrapped = NULL;
    }
    real_destroy(se);
}

/* The replies to the reads, writes and fsyncs stats.c times: the time is taken just before
 * the reply goes to the kernel, and recorded after. Only pyfuse3's thread notes
 * requests (stats_pending); libfuse may answer from the reader thread too, which must
 * not read the lists. */
#define TIMED_REPLY(call, error) do {                                     \
        struct pending p;                                                 \
        uint64_t at;                                                      \
        int res;                                                          \
        if (!pending_count || in_reader_thread() || !stats_take_pending(req, &p)) \
            return call;                                                  \
        at = now_ns();                                                    \
        res = call;                                                       \
        stats_replied(&p, at, error);                                     \
        return res;                                                       \
    } while (0)

int fuse_reply_write(fuse_req_t req, size_t count)
{
    if (real_reply_write == NULL && bind_libfuse() != 0)
        return -ENOSYS;
    if (drop_acknowledged(req))
        return 0;
    TIMED_REPLY(real_reply_write(req, count), 0);
}

int fuse_reply_err(fuse_req_t req, int err)
{
    if (real_reply_err == NULL && bind_libfuse() != 0)
        return -ENOSYS;
    if (behind_count && !in_reader_thread() && drop_acknowledged(req))
        return 0;
    TIMED_REPLY(real_reply_err(req, err), err != 0);
}

/* (pyfuse3 answers every read with it) */
int fuse_reply_buf(fuse_req_t req, const char *buf, size_t size)
{
    if (real_reply_buf == NULL && bind_libfuse() != 0)
        return -ENOSYS;
    TIMED_REPLY(real_reply_buf(req, buf, size), 0);
}

/* Python's direct-I/O files (the control files, checkpoint views) take writes in
 * parallel: without FOPEN_PARALLEL_DIRECT_WRITES (which libfuse 3.14 cannot set)
 * the kernel holds the inode's lock for the whole of each write, so a command a
 * client sends through ctl would wait for any command another client's write is
 * still running. The reply is libfuse's own (struct fuse_open_out) plus that flag. */
int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    struct fuse_open_out arg;

    if (real_reply_open == NULL && bind_libfuse() != 0)
        return -ENOSYS;
    if (wrapped == NULL || !fi->direct_io)
        return real_reply_open(req, fi);
    memset(&arg, 0, sizeof(arg));
    arg.fh = fi->fh;
    arg.open_flags = FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES;
    if (fi->keep_cache)
        arg.open_flags |= FOPEN_KEEP_CACHE;
    if (fi->nonseekable)
        arg.open_flags |= FOPEN_NONSEEKABLE;
    return fuse_reply_buf(req, (const char *)&arg, sizeof(arg));
}
