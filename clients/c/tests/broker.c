#include "broker.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Brokers still running, stopped at exit: a failed CHECK exits at once,
 * and a broker left behind would keep the pipe of whoever ran the tests
 * open. */
static struct broker *running[8];
static pid_t owner;

static void stop_left_over(void) {
    if (getpid() != owner) return; /* a forked test child exiting */
    for (size_t i = 0; i < sizeof running / sizeof *running; i++)
        if (running[i]) broker_stop(running[i]);
}

static void track(struct broker *b, struct broker *instead) {
    for (size_t i = 0; i < sizeof running / sizeof *running; i++)
        if (running[i] == instead) {
            running[i] = b;
            return;
        }
    CHECK(!"more brokers at once than tracked");
}

static const char *baton_bin(void) {
    const char *bin = getenv("BATON_BIN");
    return bin && *bin ? bin : "../../target/debug/baton";
}

int broker_connect_raw(const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) return fd;
    if (fd >= 0) close(fd);
    return -1;
}

void broker_start(struct broker *b, unsigned jobs) {
    broker_start_with(b, jobs, 0);
}

void broker_start_with(struct broker *b, unsigned jobs, unsigned max_clients) {
    broker_start_as(b, jobs, max_clients, "run", (unsigned)getuid());
}

static void start(struct broker *b, unsigned jobs, unsigned max_clients, const char *subdir, unsigned uid,
                  const char *const *extra);

void broker_start_args(struct broker *b, unsigned jobs, const char *const *extra) {
    start(b, jobs, 0, "run", (unsigned)getuid(), extra);
}

void broker_start_as(struct broker *b, unsigned jobs, unsigned max_clients, const char *subdir, unsigned uid) {
    start(b, jobs, max_clients, subdir, uid, NULL);
}

static void start(struct broker *b, unsigned jobs, unsigned max_clients, const char *subdir, unsigned uid,
                  const char *const *extra) {
    int other = uid != (unsigned)getuid();
    if (access(baton_bin(), X_OK) != 0) {
        fprintf(stderr, "%s not found (BATON_BIN unset or wrong): run scripts/test, which builds it\n", baton_bin());
        exit(1);
    }
    snprintf(b->dir, sizeof b->dir, "/tmp/baton-c-XXXXXX");
    CHECK(mkdtemp(b->dir));
    snprintf(b->socket, sizeof b->socket, "%s/%s/socket", b->dir, subdir);
    char log[96], jobs_text[16], max_text[16], uid_text[32], gid_text[32];
    if (other) { /* theirs to make their socket in, and reachable by them */
        char run[96];
        snprintf(run, sizeof run, "%s/%s", b->dir, subdir);
        CHECK(chmod(b->dir, 0755) == 0);
        CHECK(mkdir(run, 0700) == 0 && chown(run, uid, uid) == 0);
    }
    snprintf(uid_text, sizeof uid_text, "--reuid=%u", uid);
    snprintf(gid_text, sizeof gid_text, "--regid=%u", uid);
    snprintf(log, sizeof log, "%s/broker.log", b->dir);
    snprintf(jobs_text, sizeof jobs_text, "%u", jobs);
    snprintf(max_text, sizeof max_text, "%u", max_clients ? max_clients : 60000);
    if (!owner) {
        owner = getpid();
        atexit(stop_left_over);
    }
    b->pid = fork();
    CHECK(b->pid >= 0);
    track(b, NULL);
    if (b->pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 1);
        dup2(fd, 2);
        if (other)
            execlp("setpriv", "setpriv", uid_text, gid_text, "--clear-groups", baton_bin(), "serve", "--jobs", jobs_text,
                   "--socket", b->socket, "--max-clients", max_text, "--no-fuse", (char *)NULL);
        else {
            const char *argv[32] = {"baton", "serve", "--jobs", jobs_text, "--socket", b->socket, "--max-clients",
                                    max_text};
            size_t n = 8;
            for (; extra && *extra && n < sizeof argv / sizeof *argv - 1; extra++) argv[n++] = *extra;
            argv[n] = NULL;
            execv(baton_bin(), (char *const *)argv);
        }
        _exit(127);
    }
    /* A bare connect, no HELLO: the probe takes no client id. */
    for (int tries = 0;; tries++) {
        int fd = broker_connect_raw(b->socket);
        if (fd >= 0) {
            close(fd);
            return;
        }
        CHECK(tries < 5000); /* a hang guard: 10 s */
        nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
}

static void stop(struct broker *b, int sig) {
    track(NULL, b);
    kill(b->pid, sig);
    CHECK(waitpid(b->pid, NULL, 0) == b->pid);
    /* Whatever the broker leaves (its log, lock, an emptied mount point). */
    pid_t rm = fork();
    if (rm == 0) {
        execlp("rm", "rm", "-rf", b->dir, (char *)NULL);
        _exit(127);
    }
    waitpid(rm, NULL, 0);
}

void broker_stop(struct broker *b) { stop(b, SIGTERM); }

void broker_kill(struct broker *b) { stop(b, SIGKILL); }
