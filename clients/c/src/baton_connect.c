#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

#define LABEL_MAX 200

/* Whether $BATON_BROKER_UID names `uid`: a broker the user says to trust
 * although it is neither their own nor root's (the host's broker seen from
 * a user namespace that does not map its uid shows as 65534;
 * docs/containers.md). */
static int is_named_broker_uid(uid_t uid) {
    const char *named = getenv("BATON_BROKER_UID");
    if (!named || !*named) return 0;
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(named, &end, 10);
    if (errno || *end || value > (unsigned long)(uid_t)-1) return 0;
    return (uid_t)value == uid;
}

/* A socket path (at most 107 bytes) and more: room for what we compare. */
#define PATH_TEXT_MAX 512

/* The label as the broker accepts it: no control characters, at most
 * LABEL_MAX bytes, not cut inside a UTF-8 sequence. */
static void clean_label(const char *label, char *out) {
    const unsigned char *p = (const unsigned char *)(label ? label : "");
    size_t n = 0;
    for (; *p && n < LABEL_MAX; p++)
        if (*p >= 0x20 && *p != 0x7f) out[n++] = (char)*p;
    if (*p) { /* cut short: drop the last UTF-8 sequence, which the cut may have split */
        while (n > 0 && ((unsigned char)out[n - 1] & 0xc0) == 0x80) n--;
        if (n > 0 && ((unsigned char)out[n - 1] & 0xc0) == 0xc0) n--;
    }
    out[n] = '\0';
}

/* `dir` without the slashes that end it (but "/" stays "/"). */
static void trim_slashes(char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') dir[--n] = '\0';
}

/* Whether `dir` is one of the directories baton picks itself:
 * $XDG_RUNTIME_DIR/baton, /tmp/baton-$UID. */
static int is_default_dir(const char *dir) {
    char own[PATH_TEXT_MAX];
    snprintf(own, sizeof own, "/tmp/baton-%u", (unsigned)getuid());
    if (strcmp(dir, own) == 0) return 1;
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    if (!runtime || !*runtime) return 0;
    char base[PATH_TEXT_MAX];
    snprintf(base, sizeof base, "%s", runtime);
    trim_slashes(base);
    int n = snprintf(own, sizeof own, "%s%sbaton", base, strcmp(base, "/") == 0 ? "" : "/");
    return n > 0 && (size_t)n < sizeof own && strcmp(dir, own) == 0;
}

/* Refuses a socket in one of baton's own directories unless that directory
 * is a private one of ours (by lstat, never following a link): another
 * user may have made it first, or pointed it elsewhere (docs/security.md).
 * Any other directory is the caller's choice, and is not judged here. */
static int refuse_squatted_dir(const char *path) {
    char dir[PATH_TEXT_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash || (size_t)(slash - path) >= sizeof dir) return 0; /* ".", or too long to be one of ours */
    snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    trim_slashes(dir);
    if (!is_default_dir(dir)) return 0;
    struct stat st;
    if (lstat(dir, &st) < 0) return 0; /* no directory, no broker: connect says so */
    unsigned me = (unsigned)getuid();
    if (S_ISLNK(st.st_mode))
        baton__say("%s is a symbolic link, which anyone who owns it could point elsewhere: refusing it", dir);
    else if (!S_ISDIR(st.st_mode))
        baton__say("%s is not a directory: refusing it", dir);
    else if ((unsigned)st.st_uid != me)
        baton__say("%s belongs to uid %u, not to you (uid %u): refusing to use a broker there", dir,
                   (unsigned)st.st_uid, me);
    else if (st.st_mode & 077)
        baton__say("%s is open to other users (mode %04o): refusing to use a broker there (if it is yours: chmod 700 %s)",
                   dir, (unsigned)(st.st_mode & 07777), dir);
    else
        return 0;
    errno = EPERM;
    return -1;
}

/* Words for a failed connect(2) to `path`. */
static void say_not_connected(const char *path, int e) {
    struct stat st;
    if ((e == ENOENT || e == ECONNREFUSED) && stat(path, &st) == 0 && !S_ISSOCK(st.st_mode))
        baton__say("%s is not a socket (is the path or BATON_SOCKET right?)", path);
    else if (e == ENOENT || e == ECONNREFUSED)
        baton__say("no broker at %s (start one with: baton serve --jobs N)", path);
    else if (e == EACCES)
        baton__say("permission denied connecting to %s (the broker belongs to another user? its owner admits others with baton serve --allow-uid UID or --allow-group GROUP)", path);
    else
        baton__say("connecting to %s: %s", path, strerror(e));
}

static int open_socket(const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        baton__say("%s is too long for a Unix socket address (at most %zu bytes)", path, sizeof addr.sun_path - 1);
        return -1;
    }
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        baton__say("making a socket to connect to %s: %s", path, strerror(errno));
        return -1;
    }
    /* A blocking connect: a Unix socket's connect never waits on a network,
     * only, briefly, on a full backlog. */
    while (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        close(fd);
        say_not_connected(path, e);
        errno = e;
        return -1;
    }
    /* Only our own uid's broker, or root's: a process of another user at
     * the path (a squatted directory, a socket opened to all) could lie
     * about tokens or read our labels (docs/security.md). */
    struct ucred peer = {0};
    socklen_t len = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) < 0) {
        int e = errno;
        close(fd);
        baton__say("asking who serves %s: %s", path, strerror(e));
        errno = e;
        return -1;
    }
    if (peer.uid != getuid() && peer.uid != 0 && !is_named_broker_uid(peer.uid)) {
        close(fd);
        baton__say("%s is answered by a process of uid %u, not by your own broker (uid %u) or root's: refusing to "
                   "talk to it (someone else's broker or an impostor; remove the socket or choose another path; "
                   "if it is the broker you mean to use, seen from a user namespace or run by a CI runner's user, "
                   "say so with BATON_BROKER_UID=%u)",
                   path, (unsigned)peer.uid, (unsigned)getuid(), (unsigned)peer.uid);
        errno = EPERM;
        return -1;
    }
    return fd;
}

/* A refusal of HELLO in words that name the broker at `path`: ERR full
 * with its maximum (the first number of the broker's message), ERR denied
 * with the broker's words. */
static void say_refused_at_connect(const char *path, const struct baton_reply *r) {
    if (!r->kind || strcmp(r->kind, "ERR") != 0) return;
    if (strcmp(r->code, "full") == 0) {
        const char *digits = r->message + strcspn(r->message, "0123456789");
        int n = (int)strspn(digits, "0123456789");
        baton__say("the broker at %s serves its maximum of %.*s clients (try again when some finish, or raise it: "
                   "baton serve --max-clients N, and the broker's open-file limit)",
                   path, n > 0 && n <= 20 ? n : 3, n > 0 && n <= 20 ? digits : "its");
    } else if (strcmp(r->code, "denied") == 0) {
        baton__say("the broker at %s refuses you: %s", path, r->message);
    }
}

static int hello(baton_t *c, const char *path, const char *label, const struct timespec *deadline) {
    char clean[LABEL_MAX + 1], request[LABEL_MAX + 16], line[BATON_LINE_MAX];
    clean_label(label, clean);
    snprintf(request, sizeof request, *clean ? "HELLO 1 %s\n" : "HELLO 1\n", clean);
    struct baton_reply r = {0};
    if (baton__call(c, request, "OK", NULL, line, sizeof line, &r, deadline) < 0) {
        say_refused_at_connect(path, &r);
        return -1;
    }
    c->limit = (unsigned)r.num[2];
    return 0;
}

baton_t *baton_connect(const char *path, const char *label, const struct timespec *deadline) {
    char resolved[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (!path) {
        if (baton_socket_path(resolved, sizeof resolved) < 0) return NULL;
        path = resolved;
    }
    if (refuse_squatted_dir(path) < 0) return NULL;
    baton_t *c = calloc(1, sizeof *c);
    if (!c) {
        baton__say("out of memory connecting to %s", path);
        return NULL;
    }
    c->fd = open_socket(path);
    if (c->fd < 0 || hello(c, path, label, deadline) < 0) {
        int e = errno;
        baton_close(c);
        errno = e;
        return NULL;
    }
    return c;
}
