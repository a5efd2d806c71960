/* The reader thread and the queue pyfuse3 reads from.
 *
 * Once fuse_session_fd is asked for the wrapped session's fd, a thread reads
 * /dev/fuse, answers what fastpath.c says C answers, the LOOKUPs names.c and the
 * GETATTRs dirattrs.c hold the answer to, acknowledges what behind.c
 * may (and queues it all the same), and queues every other request, in order;
 * pyfuse3 is given the read end of a pipe that holds a byte per queued request,
 * and takes them through fuse_session_receive_buf.
 */
#include "fastpath.h"
#include <linux/sched.h>  /* SCHED_FLAG_RESET_ON_FORK */

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() do { } while (0)
#endif

static pthread_t reader;  /* reads /dev/fuse, answers what it can, queues the rest */
static int reader_started;
static int session_fd = -1;  /* /dev/fuse, as the reader reads it */

struct item {
    struct item *next;
    int res;  /* what fuse_session_receive_buf returned: > 0 a request of that size */
    uint64_t arrival;  /* when the reader thread read it (now_ns) */
    char mem[];
};

static volatile sig_atomic_t stopping;
static int wake[2] = {-1, -1};  /* one byte per queued item (at most); pyfuse3 polls wake[0] */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
/* the last item is kept queued once it is the end; fastpath_wait_queued watches head
   without the lock, so it is stored atomically */
static struct item *head, *tail;

static void push(int res, const char *mem, uint64_t arrival)
{
    struct item *it = malloc(sizeof(*it) + (res > 0 ? (size_t)res : 0));
    char one = 1;

    if (it == NULL)
        abort();  /* a request dropped would hang its caller for ever */
    it->next = NULL;
    it->res = res;
    it->arrival = arrival;
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

/* The scheduler's slice of the threads that answer requests (EEVDF, Linux 6.12 on: a
   thread of a shorter slice preempts a longer one when it wakes). A request's caller
   waits while the thread that answers it waits for a core: with the defaults, an
   agent's stat on a 2-core machine waited behind our CLI's start-up and a command's
   work for a millisecond and more. Set on the calling thread only (threads it starts
   get the default: SCHED_FLAG_RESET_ON_FORK), unprivileged, kept to SCHED_OTHER and
   its nice value; older kernels ignore it. 0 if set. */
#define PROMPT_SLICE_NS 100000ULL  /* the least Linux allows */
/* linux/sched/types.h's, which glibc 2.36 lacks and which clashes with its sched.h */
struct sched_attr_ {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
};

int fastpath_serve_promptly(void)
{
    struct sched_attr_ attr;

    memset(&attr, 0, sizeof(attr));
    if (syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) != 0 || attr.policy != SCHED_OTHER)
        return -1;
    attr.size = sizeof(attr);
    attr.flags |= SCHED_FLAG_RESET_ON_FORK;
    attr.runtime = PROMPT_SLICE_NS;
    return (int)syscall(SYS_sched_setattr, 0, &attr, 0);
}

/* The reader thread's own answer to request unique: data after a successful header.
 * Whether the kernel took it whole; if not, it gave the request up (interrupted). */
int reply_raw(struct fuse_session *se, uint64_t unique, const void *data, size_t size)
{
    struct fuse_out_header head = {.len = (uint32_t)(sizeof(head) + size), .error = 0,
                                   .unique = unique};
    struct iovec iov[2] = {{&head, sizeof(head)}, {(void *)data, size}};

    return writev(real_fd(se), iov, 2) == (ssize_t)head.len;
}

static void *read_requests(void *arg)
{
    struct fuse_session *se = arg;
    struct fuse_buf buf = {0};
    sigset_t others;
    uint64_t arrival;
    int res;

    /* process-wide signals are the Python main thread's to take */
    sigfillset(&others);
    sigdelset(&others, SIGURG);
    pthread_sigmask(SIG_BLOCK, &others, NULL);
    fastpath_serve_promptly();
    for (;;) {
        res = real_receive(se, &buf);
        arrival = now_ns();  /* the request's arrival, as near the kernel as we get */
        if (res == -EINTR) {
            if (stopping)
                break;
            continue;
        }
        if (res <= 0) {
            push(res, NULL, 0);
            break;
        }
        names_arriving(buf.mem, (size_t)res);  /* (before a write is acknowledged) */
        lower_arriving(buf.mem, (size_t)res);  /* (a repo directory names.c may then answer) */
        if (names_answer(se, buf.mem, (size_t)res) || listing_answer(se, buf.mem, (size_t)res) ||
            lower_read_answer(se, buf.mem, (size_t)res, arrival) ||
            lower_getattr_answer(se, buf.mem, (size_t)res) ||
            dir_attrs_answer(se, buf.mem, (size_t)res) || attrs_answer(se, buf.mem, (size_t)res))
            continue;
        if (request_is_fast(buf.mem, (size_t)res))
            real_process(se, &buf);
        else {
            acknowledge_write(se, buf.mem, (size_t)res, arrival);
            push(res, buf.mem, arrival);
        }
    }
    free(buf.mem);
    return NULL;
}

int queue_started(void) { return reader_started; }

int in_reader_thread(void) { return reader_started && pthread_equal(pthread_self(), reader); }

/* For fuse_session_fd of the wrapped session: start the reader; the fd to poll. */
int queue_start(struct fuse_session *se)
{
    struct sigaction sa;

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
    session_fd = real_fd(se);
    return wake[0];
}

/* For fuse_session_receive_buf of the wrapped session: the next queued request. */
int queue_take(struct fuse_buf *buf)
{
    struct item *it;
    char one;
    int res;

    pthread_mutex_lock(&lock);
    it = head;
    if (it != NULL && it->res <= 0) {
        res = it->res;  /* the end: leave it queued and the pipe readable */
        pthread_mutex_unlock(&lock);
        return res;
    }
    if (it == NULL) {
        /* Woken for nothing. push() queues an item before it writes its byte, so
           an item can be taken (here, after fastpath_wait_queued saw it) before its
           byte is in the pipe: that byte then comes with the queue empty. Every
           byte in the pipe belongs to a queued item, so with none queued they are
           all such bytes: drop them, or the pipe stays readable and pyfuse3's loop
           spins on it for as long as the mount is idle. */
        for (;;) {
            ssize_t n = read(wake[0], &one, 1);
            if (n > 0 || (n < 0 && errno == EINTR))
                continue;
            break;
        }
        pthread_mutex_unlock(&lock);
        return -EINTR;  /* pyfuse3 waits again */
    }
    __atomic_store_n(&head, it->next, __ATOMIC_RELEASE);
    if (head == NULL)
        tail = NULL;
    pthread_mutex_unlock(&lock);
    /* (EAGAIN: its byte is not written yet; it is dropped when it comes, above) */
    while (read(wake[0], &one, 1) < 0 && errno == EINTR)
        ;
    res = it->res;
    taken_arrival = it->arrival;  /* for the handler process_buf runs next (fastpath.c) */
    dir_attrs_taking(it->mem, (size_t)res);  /* before Python handles what may change them */
    memmove(it, it->mem, (size_t)res);  /* the request at the start of the block */
    free(buf->mem);  /* pyfuse3 frees what it holds last; hand it ours */
    buf->mem = it;
    buf->size = (size_t)res;
    buf->flags = 0;
    buf->pos = 0;
    return res;
}

/* Whether a request waits in /dev/fuse for the reader thread, which the kernel
   woke and which waits for a core. */
static int reader_waits(void)
{
    struct pollfd p = {.fd = session_fd, .events = POLLIN};

    return session_fd >= 0 && poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

/* Whether a request waits for pyfuse3, watching the queue for up to spin_ns.
 * fastpath.py calls this (without the GIL) where pyfuse3's loop would go back to
 * trio to wait on the pipe: a trip through trio's lock, scheduler and epoll costs
 * more than most handlers, and a client's next request often follows our reply
 * within microseconds. (Sleeping here on a condition variable instead was no
 * faster, and held trio up: restores, which wait on threads, stalled.)
 * The watch gives way while a request waits for the reader thread: the kernel
 * wakes the reader on the core it last ran on, often this one, and with the same
 * slice it would wait for the watch to end, so even what C answers would wait
 * for pyfuse3's loop (docs/benchmarks.md, "Small edits' p99"). */
int fastpath_wait_queued(long spin_ns)
{
    struct timespec start, now;

    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        if (__atomic_load_n(&head, __ATOMIC_ACQUIRE) != NULL)
            return 1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) >= spin_ns)
            return 0;
        if (reader_waits())
            sched_yield();  /* it may be queued on this core, behind this very watch */
        else
            cpu_relax();
    }
}

/* For fuse_session_destroy of the wrapped session: stop and join the reader. */
void queue_stop(void)
{
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
    session_fd = -1;
    close(wake[0]);
    close(wake[1]);
    wake[0] = wake[1] = -1;
}
