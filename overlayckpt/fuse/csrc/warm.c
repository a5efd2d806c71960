/* Reading the repo's metadata ahead: fastpath_warm_tree, from threads of its own.
 *
 * On a cold cache each first lookup of a repo file waits for its inode from disk,
 * and the daemon makes them one at a time: a cold `git status` was 1.75x
 * fuse-overlayfs, which makes them from several threads. fastpath_warm_tree starts
 * threads that walk the repo once, listing every directory and stat-ing every
 * entry, so that those inodes are in the kernel's cache when the daemon asks. They
 * only read metadata, resolve every path beneath the repo without following a
 * symlink, keep nothing, and stop when the session ends. */
#include "fastpath.h"

#define WARM_THREADS 4
struct warm_dir { struct warm_dir *next; char path[]; };
static pthread_mutex_t warm_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t warm_more = PTHREAD_COND_INITIALIZER;
static struct warm_dir *warm_queue;
static int warm_root = -1, warm_threads, warm_busy;
static volatile int warm_stop;
uint64_t fastpath_warmed_dirs;  /* directories listed so far (status shows it) */
int fastpath_warm_done;         /* the walk has ended */

/* A directory to list: parent/name, relative to the repo (whose root is "."). */
static struct warm_dir *warm_new(const char *parent, const char *name)
{
    size_t plen = strlen(parent), nlen = strlen(name);
    struct warm_dir *d = malloc(sizeof(*d) + plen + nlen + 2);

    if (d != NULL) {
        memcpy(d->path, parent, plen);
        d->path[plen] = '/';
        memcpy(d->path + plen + 1, name, nlen + 1);
    }
    return d;
}

/* With warm_lock held. Last in, first out: down the tree before across it. */
static void warm_link(struct warm_dir *d)
{
    d->next = warm_queue;
    warm_queue = d;
    pthread_cond_signal(&warm_more);
}

static void warm_push(const char *parent, const char *name)
{
    struct warm_dir *d = warm_new(parent, name);

    if (d == NULL)
        return;  /* only a cache warmed less */
    pthread_mutex_lock(&warm_lock);
    warm_link(d);
    pthread_mutex_unlock(&warm_lock);
}

static void warm_dir(int root, const char *path)
{
    int fd = open_beneath(root, path, O_RDONLY | O_DIRECTORY);
    DIR *dir;
    struct dirent *e;
    struct stat st;

    if (fd < 0)
        return;
    dir = fdopendir(fd);
    if (dir == NULL) {
        close(fd);
        return;
    }
    while (!warm_stop && (e = readdir(dir)) != NULL) {
        if (e->d_name[0] == '.' && (e->d_name[1] == '\0' || (e->d_name[1] == '.' && e->d_name[2] == '\0')))
            continue;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
            warm_push(path, e->d_name);
    }
    closedir(dir);
    __atomic_add_fetch(&fastpath_warmed_dirs, 1, __ATOMIC_RELAXED);
}

static void *warm_thread(void *arg)
{
    (void)arg;
    /* below the daemon's own threads: a warm cache needs no help, only the CPU */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    pthread_mutex_lock(&warm_lock);
    for (;;) {
        struct warm_dir *d;

        while (warm_queue == NULL && warm_busy > 0 && !warm_stop)
            pthread_cond_wait(&warm_more, &warm_lock);
        if (warm_queue == NULL || warm_stop)
            break;  /* the walk is done (nothing queued, nobody listing) or the session is */
        d = warm_queue;
        warm_queue = d->next;
        warm_busy++;
        pthread_mutex_unlock(&warm_lock);
        warm_dir(warm_root, d->path);
        free(d);
        pthread_mutex_lock(&warm_lock);
        warm_busy--;
        if (warm_busy == 0 && warm_queue == NULL)
            pthread_cond_broadcast(&warm_more);
    }
    if (--warm_threads == 0) {
        while (warm_queue != NULL) {
            struct warm_dir *d = warm_queue;

            warm_queue = d->next;
            free(d);
        }
        close(warm_root);
        warm_root = -1;
        __atomic_store_n(&fastpath_warm_done, 1, __ATOMIC_RELEASE);
    }
    pthread_cond_broadcast(&warm_more);
    pthread_mutex_unlock(&warm_lock);
    return NULL;
}

/* Walk the tree below dirfd in the background (Lower asks once per session). */
void fastpath_warm_tree(int dirfd)
{
    struct warm_dir *root = warm_new(".", ".");  /* "./.": the root, beneath itself */
    pthread_attr_t attr;

    pthread_mutex_lock(&warm_lock);
    if (root == NULL || warm_root >= 0 || warm_stop ||
        (warm_root = fcntl(dirfd, F_DUPFD_CLOEXEC, 0)) < 0) {
        pthread_mutex_unlock(&warm_lock);
        free(root);
        return;  /* running, ended, or no fd: only a cache warmed less */
    }
    warm_link(root);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < WARM_THREADS; i++) {
        pthread_t t;

        if (pthread_create(&t, &attr, warm_thread, NULL) != 0)
            break;
        warm_threads++;
    }
    pthread_attr_destroy(&attr);
    if (warm_threads == 0) {
        warm_queue = NULL;
        free(root);
        close(warm_root);
        warm_root = -1;
    }
    pthread_mutex_unlock(&warm_lock);
}

/* For fuse_session_destroy: the walk stops with the session. */
void warm_stop_all(void)
{
    pthread_mutex_lock(&warm_lock);
    warm_stop = 1;
    pthread_cond_broadcast(&warm_more);
    pthread_mutex_unlock(&warm_lock);
}
