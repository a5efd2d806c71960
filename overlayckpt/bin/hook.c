/* overlayckpt-hook: the agent hook as a small program (`overlayckpt-hook AGENT [--mount M]`).

   An agent runs its hooks synchronously, twice per tool call: a hook that starts Python
   costs 20 ms before it does anything. This one does what the Python hook
   (overlayckpt/agents/hooks.py) does up to the conversion, in about a millisecond:

   - reads one event (a JSON object, at most MAX_EVENT bytes) from stdin and checks that
     it is well-formed JSON, no deeper than MAX_DEPTH;
   - finds the live overlayckpt mount to log into exactly as agents/hooks.py does: --mount M,
     else $OVERLAYCKPT_MOUNT, else the innermost mount above the event's cwd (Cursor:
     its first workspace root), among the mounts /proc/self/mountinfo lists with type
     fuse.overlayckpt, root "/" and user_id= this process's uid;
   - opens the mount root, then .overlayckpt, then conversation.jsonl, each relative to
     the one before, O_NOFOLLOW, without O_CREAT, each checked to be on that mount's
     device (and the last a regular file);
   - appends one line {"hook": AGENT, "event": EVENT} with the event as it came (its
     inter-token newlines made spaces). The daemon turns it into the conversation line
     with the same code the Python hook uses (agents.event_to_line).

   It never breaks the agent: whatever goes wrong it prints at most one line on stderr
   and exits 0; outside a mount it does nothing. On stdout it prints only what the agent
   reads as an answer: "{}" (allow) for Gemini CLI and Cursor, nothing for the others. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define MAX_EVENT (4u << 20)   /* agents.MAX_EVENT */
#define MAX_DEPTH 512          /* well inside what the daemon's json module takes */
#define FS_TYPE "fuse.overlayckpt"

static const char *const AGENTS[] = {"claude-code", "codex", "gemini", "qwen", "cursor", "opencode"};

__attribute__((format(printf, 1, 2)))
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("overlayckpt hook: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- JSON: a strict validator that also picks out the top-level cwd ---------------- */

struct scan {
    const unsigned char *p, *end;
    int depth;
    char *cwd;       /* the event's "cwd" (decoded), or NULL */
    char *root;      /* the first of "workspace_roots" (Cursor), or NULL */
};

static void ws(struct scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static int hex4(const unsigned char *p, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return -1;
    }
    *out = v;
    return 0;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F)); return 4;
}

/* A string at s->p (the opening quote); its decoded value into *out when out is given
   (NULL for a lone surrogate, which no path holds). -1: malformed. */
static int string(struct scan *s, char **out)
{
    const unsigned char *start = ++s->p;
    int escaped = 0;
    while (s->p < s->end && *s->p != '"') {
        unsigned c = *s->p;
        if (c < 0x20) return -1;
        if (c == '\\') {
            if (++s->p >= s->end) return -1;
            escaped = 1;
            if (*s->p == 'u') {
                unsigned v;
                if (s->end - s->p < 5 || hex4(s->p + 1, &v)) return -1;
                s->p += 4;
            } else if (!strchr("\"\\/bfnrt", *s->p)) {
                return -1;
            }
        }
        s->p++;
    }
    if (s->p >= s->end) return -1;
    const unsigned char *stop = s->p++;
    if (!out) return 0;
    size_t n = (size_t)(stop - start);
    char *o = malloc(n + 1), *w = o;
    if (!o) return -1;
    if (!escaped) {
        memcpy(o, start, n);
        o[n] = 0;
        *out = o;
        return 0;
    }
    for (const unsigned char *q = start; q < stop; q++) {
        if (*q != '\\') { *w++ = (char)*q; continue; }
        q++;
        switch (*q) {
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            hex4(q + 1, &cp);
            q += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && stop - q > 6 && q[1] == '\\' && q[2] == 'u'
                    && !hex4(q + 3, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                q += 6;
            } else if (cp >= 0xD800 && cp < 0xE000) {
                free(o);
                *out = NULL;
                return 0;
            }
            w += put_utf8(w, cp);   /* never longer than the escape it replaces */
            break;
        }
        default: *w++ = (char)*q;  /* " \ / */
        }
    }
    *w = 0;
    *out = o;
    return 0;
}

static int number(struct scan *s)
{
    const unsigned char *p = s->p;
    if (p < s->end && *p == '-') p++;
    if (p >= s->end) return -1;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') while (p < s->end && *p >= '0' && *p <= '9') p++;
    else return -1;
    if (p < s->end && *p == '.') {
        if (++p >= s->end || *p < '0' || *p > '9') return -1;
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < s->end && (*p == '+' || *p == '-')) p++;
        if (p >= s->end || *p < '0' || *p > '9') return -1;
        while (p < s->end && *p >= '0' && *p <= '9') p++;
    }
    s->p = p;
    return 0;
}

static int word(struct scan *s, const char *w)
{
    size_t n = strlen(w);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, w, n)) return -1;
    s->p += n;
    return 0;
}

/* One value; top: the event object itself, whose cwd and workspace_roots are kept. */
static int value(struct scan *s, int top, char **first_string)
{
    ws(s);
    if (s->p >= s->end) return -1;
    switch (*s->p) {
    case '"':
        return string(s, first_string);
    case '{': {
        if (++s->depth > MAX_DEPTH) return -1;
        s->p++;
        ws(s);
        if (s->p < s->end && *s->p == '}') { s->p++; s->depth--; return 0; }
        for (;;) {
            char *key = NULL;
            ws(s);
            if (s->p >= s->end || *s->p != '"' || string(s, top ? &key : NULL)) { free(key); return -1; }
            ws(s);
            if (s->p >= s->end || *s->p != ':') { free(key); return -1; }
            s->p++;
            int rc;
            if (key && !strcmp(key, "cwd")) {
                char *v = NULL;
                ws(s);
                int is_str = s->p < s->end && *s->p == '"';
                rc = value(s, 0, is_str ? &v : NULL);
                free(s->cwd);  /* a repeated key: the last one counts, as in Python */
                s->cwd = v;
            } else if (key && !strcmp(key, "workspace_roots")) {
                char *v = NULL;
                ws(s);
                int is_list = s->p < s->end && *s->p == '[';
                rc = value(s, 0, is_list ? &v : NULL);
                free(s->root);
                s->root = v;
            } else {
                rc = value(s, 0, NULL);
            }
            free(key);
            if (rc) return -1;
            ws(s);
            if (s->p < s->end && *s->p == ',') { s->p++; continue; }
            if (s->p < s->end && *s->p == '}') { s->p++; s->depth--; return 0; }
            return -1;
        }
    }
    case '[': {
        if (++s->depth > MAX_DEPTH) return -1;
        s->p++;
        ws(s);
        if (s->p < s->end && *s->p == ']') { s->p++; s->depth--; return 0; }
        for (int i = 0;; i++) {
            ws(s);
            /* (first_string here: the first element, if it is a string) */
            int is_str = i == 0 && first_string && s->p < s->end && *s->p == '"';
            if (value(s, 0, is_str ? first_string : NULL)) return -1;
            ws(s);
            if (s->p < s->end && *s->p == ',') { s->p++; continue; }
            if (s->p < s->end && *s->p == ']') { s->p++; s->depth--; return 0; }
            return -1;
        }
    }
    case 't': return word(s, "true");
    case 'f': return word(s, "false");
    case 'n': return word(s, "null");
    default: return number(s);
    }
}

/* ---- paths and mounts ---------------------------------------------------------------- */

/* os.path.abspath: path made absolute against the current directory and normalized
   lexically (no symlink resolved). Malloc'ed; NULL on failure. */
static char *abspath(const char *path)
{
    char cwd[PATH_MAX];
    size_t plen = strlen(path);
    if (path[0] != '/' && !getcwd(cwd, sizeof cwd)) return NULL;
    size_t clen = path[0] == '/' ? 0 : strlen(cwd);
    char *joined = malloc(clen + plen + 2), *out = malloc(clen + plen + 2);
    if (!joined || !out) { free(joined); free(out); return NULL; }
    if (clen) { memcpy(joined, cwd, clen); joined[clen] = '/'; memcpy(joined + clen + 1, path, plen + 1); }
    else memcpy(joined, path, plen + 1);
    size_t n = 0;
    char *save = NULL;
    for (char *part = strtok_r(joined, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        if (!strcmp(part, ".")) continue;
        if (!strcmp(part, "..")) {
            while (n > 0 && out[n - 1] != '/') n--;
            if (n > 0) n--;
            continue;
        }
        out[n++] = '/';
        size_t k = strlen(part);
        memcpy(out + n, part, k);
        n += k;
    }
    if (n == 0) out[n++] = '/';
    out[n] = 0;
    free(joined);
    return out;
}

struct mount { char *where; dev_t dev; };

/* agents.our_mounts: this uid's overlayckpt mounts whose root is "/", as this process
   sees them; of two at one place the later (on top) counts. */
static size_t our_mounts(struct mount **out)
{
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return 0;
    char uid_opt[32];
    snprintf(uid_opt, sizeof uid_opt, "user_id=%u", (unsigned)getuid());
    size_t n = 0, cap = 0;
    struct mount *m = NULL;
    char *line = NULL;
    size_t len = 0;
    while (getline(&line, &len, f) > 0) {
        if (!strstr(line, FS_TYPE)) continue;
        line[strcspn(line, "\n")] = 0;
        char *sep = strstr(line, " - ");
        if (!sep) continue;
        *sep = 0;
        char *sb = sep + 3, *save = NULL;
        char *fstype = strtok_r(sb, " ", &save), *source = strtok_r(NULL, " ", &save);
        char *opts = strtok_r(NULL, " ", &save);
        if (!fstype || !source || !opts || strcmp(fstype, FS_TYPE)) continue;
        int mine = 0;
        for (char *o = strtok_r(opts, ",", &save); o; o = strtok_r(NULL, ",", &save))
            if (!strcmp(o, uid_opt)) mine = 1;
        if (!mine) continue;
        char *fields[5];
        int i = 0;
        save = NULL;
        for (char *fl = strtok_r(line, " ", &save); fl && i < 5; fl = strtok_r(NULL, " ", &save))
            fields[i++] = fl;
        unsigned major, minor;
        if (i < 5 || strcmp(fields[3], "/") || sscanf(fields[2], "%u:%u", &major, &minor) != 2) continue;
        char *w = fields[4], *d = w;  /* \ooo escapes (space, tab, newline, backslash) */
        for (char *q = w; *q; q++) {
            if (q[0] == '\\' && q[1] >= '0' && q[1] <= '7' && q[2] >= '0' && q[2] <= '7'
                    && q[3] >= '0' && q[3] <= '7') {
                *d++ = (char)((q[1] - '0') << 6 | (q[2] - '0') << 3 | (q[3] - '0'));
                q += 3;
            } else {
                *d++ = *q;
            }
        }
        *d = 0;
        size_t k;
        for (k = 0; k < n && strcmp(m[k].where, w); k++)
            ;
        if (k == n) {
            if (n == cap) {
                struct mount *grown = realloc(m, (cap = cap ? 2 * cap : 4) * sizeof *m);
                if (!grown) break;
                m = grown;
            }
            m[n++].where = strdup(w);
        }
        m[k].dev = makedev(major, minor);
    }
    free(line);
    fclose(f);
    *out = m;
    return n;
}

static struct mount *lookup(struct mount *m, size_t n, const char *where)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(m[i].where, where)) return &m[i];
    return NULL;
}

/* agents.open_conversation: an fd appending to the verified mount's conversation; -1
   when there is nothing to log into (said on stderr where the user named the mount). */
static int open_conversation(const char *named, const char *cwd)
{
    struct mount *mounts = NULL, *m = NULL;
    size_t n = our_mounts(&mounts);
    if (named) {
        char *where = abspath(named);
        m = where ? lookup(mounts, n, where) : NULL;
        if (!m) {
            char *real = realpath(where ? where : named, NULL);  /* the user's own spelling of it */
            m = real ? lookup(mounts, n, real) : NULL;
            free(real);
        }
        free(where);
        if (!m) {
            say("%s is not an overlayckpt mount of this user: nothing logged", named);
            return -1;
        }
    } else {
        if (n == 0) return -1;
        char here[PATH_MAX];
        if (!(cwd && *cwd) && !getcwd(here, sizeof here)) return -1;
        char *d = abspath(cwd && *cwd ? cwd : here);
        while (d && !(m = lookup(mounts, n, d))) {
            if (!strcmp(d, "/")) break;
            char *slash = strrchr(d, '/');
            if (slash == d) slash[1] = 0;
            else *slash = 0;
        }
        free(d);
        if (!m) return -1;  /* not inside an overlayckpt mount: nothing to record */
    }
    struct stat st;
    int root = open(m->where, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) { say("%s: %s", m->where, strerror(errno)); return -1; }
    if (fstat(root, &st) || st.st_dev != m->dev) { close(root); return -1; }
    int ctl = openat(root, ".overlayckpt", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int err = errno;
    close(root);
    if (ctl < 0) { say("%s/.overlayckpt: %s", m->where, strerror(err)); return -1; }
    if (fstat(ctl, &st) || st.st_dev != m->dev) { close(ctl); return -1; }
    /* no O_CREAT: the daemon serves the file; O_NONBLOCK: never wait on a fifo */
    int fd = openat(ctl, "conversation.jsonl",
                    O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    err = errno;
    close(ctl);
    if (fd < 0) { say("%s/.overlayckpt/conversation.jsonl: %s", m->where, strerror(err)); return -1; }
    /* The type and device the kernel knows without asking the daemon (a getattr of the
       conversation costs it a pass over the whole history) */
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &sx)
            || makedev(sx.stx_dev_major, sx.stx_dev_minor) != m->dev || !S_ISREG(sx.stx_mode)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- main ------------------------------------------------------------------------- */

static int run(int argc, char **argv)
{
    const char *agent = NULL, *named = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mount") && i + 1 < argc) named = argv[++i];
        else if (!strncmp(argv[i], "--mount=", 8)) named = argv[i] + 8;
        else if (!agent) agent = argv[i];
        else { say("unexpected argument %s", argv[i]); return 0; }
    }
    int known = 0;
    for (size_t i = 0; agent && i < sizeof AGENTS / sizeof *AGENTS; i++)
        known |= !strcmp(agent, AGENTS[i]);
    if (!known) {
        say("usage: overlayckpt-hook AGENT [--mount M], AGENT one of "
            "claude-code, codex, gemini, qwen, cursor, opencode");
        return 0;
    }
    const char *prefix_fmt = "{\"hook\":\"%s\",\"event\":";
    size_t prefix = strlen(prefix_fmt) - 2 + strlen(agent);
    size_t cap = prefix + MAX_EVENT + 3, n = prefix;
    char *buf = malloc(cap);
    if (!buf) { say("out of memory"); return 0; }
    snprintf(buf, prefix + 1, prefix_fmt, agent);
    for (;;) {  /* one byte more than allowed tells an event too large */
        ssize_t r = read(0, buf + n, prefix + MAX_EVENT + 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { say("reading the event: %s", strerror(errno)); return 0; }
        if (r == 0) break;
        n += (size_t)r;
        if (n > prefix + MAX_EVENT) { say("event larger than 4 MiB"); return 0; }
    }
    struct scan s = {(unsigned char *)buf + prefix, (unsigned char *)buf + n, 0, NULL, NULL};
    ws(&s);
    int is_object = s.p < s.end && *s.p == '{';
    if (value(&s, 1, NULL) || (ws(&s), s.p != s.end)) {
        say("the event is not well-formed JSON");
        return 0;
    }
    if (!is_object) { say("event is not a JSON object"); return 0; }
    if (!strcmp(agent, "gemini") || !strcmp(agent, "cursor")) {
        fputs("{}\n", stdout);  /* both read a JSON answer; an empty one allows everything */
        fflush(stdout);
    }
    const char *env = getenv("OVERLAYCKPT_MOUNT");
    if (!named && env && *env) named = env;
    int fd = open_conversation(named, s.cwd && *s.cwd ? s.cwd : s.root);
    if (fd < 0) return 0;
    for (size_t i = prefix; i < n; i++)  /* (valid JSON has newlines only between tokens) */
        if (buf[i] == '\n' || buf[i] == '\r') buf[i] = ' ';
    buf[n++] = '}';
    buf[n++] = '\n';
    for (size_t off = 0; off < n;) {
        ssize_t w = write(fd, buf + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) { say("logging the event: %s", strerror(errno)); break; }
        off += (size_t)w;
    }
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    run(argc, argv);
    return 0;  /* never break the agent */
}
