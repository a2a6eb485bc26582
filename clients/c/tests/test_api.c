/* libbaton's public API against the real broker, built as a user builds
 * it: cc test_api.c $(pkg-config --cflags --libs baton). */
#include <baton.h>

#include <errno.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"

#define HANG_GUARD_MS 10000

/* The uid the tests that need a second user run it as (root only). */
#define OTHER_UID 65534u

/* Why the test that just ran could not run here (NULL: it ran). */
static const char *skipped;

/* Whether this process may run things as OTHER_UID: root, with setpriv. */
static int can_act_as_another_user(void) {
    if (getuid() != 0) {
        skipped = "needs root to act as another user";
        return 0;
    }
    if (system("setpriv --version >/dev/null 2>&1") != 0) {
        skipped = "needs setpriv (util-linux) to act as another user";
        return 0;
    }
    return 1;
}

/* baton_errmsg() must be exactly `expected` (printf-style). */
#define CHECK_MESSAGE(...)                                                                             \
    do {                                                                                               \
        char expected_[1024];                                                                          \
        snprintf(expected_, sizeof expected_, __VA_ARGS__);                                            \
        if (strcmp(baton_errmsg(), expected_) != 0) {                                                  \
            fprintf(stderr, "%s:%d: baton_errmsg() is\n  %s\nnot\n  %s\n", __FILE__, __LINE__,          \
                    baton_errmsg(), expected_);                                                        \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

/* A connection, tried again while the broker still counts one just closed
 * (EUSERS) against its maximum. */
static baton_t *connect_when_room(const char *path, const char *label) {
    for (int tries = 0;; tries++) {
        baton_t *c = baton_connect(path, label, NULL);
        if (c) return c;
        CHECK(errno == EUSERS && tries < 5000);
        nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
}

/* A top-level number of the status document ("free", "held", "limit":
 * keys no nested object has). */
static long status_number(baton_t *c, const char *key) {
    char *json = baton_status_json(c, NULL);
    CHECK(json);
    char pattern[32];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    char *at = strstr(json, pattern);
    CHECK(at);
    long n = strtol(at + strlen(pattern), NULL, 10);
    free(json);
    return n;
}

static int status_has(baton_t *c, const char *text) {
    char *json = baton_status_json(c, NULL);
    CHECK(json);
    int found = strstr(json, text) != NULL;
    free(json);
    return found;
}

/* Every token is back and nobody waits: how every test ends. */
static void check_all_free(struct broker *b) {
    baton_t *c = baton_connect(b->socket, "check", NULL);
    CHECK(c);
    CHECK(status_number(c, "free") == status_number(c, "limit"));
    CHECK(status_number(c, "held") == 0);
    CHECK(status_has(c, "\"waiters\":[]"));
    baton_close(c);
}

static void tokens_are_held_and_given_back(void) {
    struct broker b;
    broker_start(&b, 2);
    struct timespec deadline = baton_deadline(HANG_GUARD_MS);
    baton_t *c = baton_connect(b.socket, "c test\tlabel", &deadline);
    CHECK(c);
    CHECK(baton_limit(c) == 2);
    CHECK(baton_acquire(c, 2, &deadline) == 0);
    CHECK(baton_held(c) == 2);
    CHECK(status_has(c, "\"command\":\"c testlabel\""));
    CHECK(status_number(c, "held") == 2);
    CHECK(baton_release(c, 1, NULL) == 0 && baton_held(c) == 1);
    CHECK(baton_release(c, 1, NULL) == 0 && baton_held(c) == 0);
    baton_close(c);
    check_all_free(&b);
    broker_stop(&b);
}

static void try_acquire_takes_only_what_is_free(void) {
    struct broker b;
    broker_start(&b, 1);
    baton_t *a = baton_connect(b.socket, "a", NULL), *other = baton_connect(b.socket, "b", NULL);
    CHECK(a && other);
    CHECK(baton_try_acquire(a, 1, NULL) == 1);
    CHECK(baton_try_acquire(other, 1, NULL) == 0);
    CHECK(baton_held(other) == 0);
    CHECK(baton_release(a, 1, NULL) == 0);
    CHECK(baton_try_acquire(other, 1, NULL) == 1);
    baton_close(a);
    baton_close(other); /* closing gives back what it holds */
    check_all_free(&b);
    broker_stop(&b);
}

static void an_expired_deadline_takes_nothing(void) {
    struct broker b;
    broker_start(&b, 1);
    baton_t *holder = baton_connect(b.socket, "holder", NULL), *waiter = baton_connect(b.socket, "waiter", NULL);
    CHECK(holder && waiter);
    CHECK(baton_acquire(holder, 1, NULL) == 0);
    struct timespec soon = baton_deadline(50);
    errno = 0;
    CHECK(baton_acquire(waiter, 1, &soon) == -1 && errno == ETIMEDOUT);
    CHECK(baton_held(waiter) == 0);
    CHECK(status_has(holder, "\"waiters\":[]"));
    CHECK(baton_release(holder, 1, NULL) == 0);
    /* The withdrawn request is not served: the token stays free. */
    CHECK(status_number(waiter, "free") == 1);
    struct timespec later = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(waiter, 1, &later) == 0);
    CHECK(baton_release(waiter, 1, NULL) == 0);
    baton_close(holder);
    baton_close(waiter);
    check_all_free(&b);
    broker_stop(&b);
}

static void refusals_set_errno_and_keep_the_connection(void) {
    struct broker b;
    broker_start(&b, 2);
    baton_t *c = baton_connect(b.socket, "refused", NULL);
    CHECK(c);
    CHECK(baton_acquire(c, 3, NULL) == -1 && errno == ERANGE);
    CHECK(strstr(baton_refusal(c), "at most 2 tokens") && strstr(baton_refusal(c), "(range)"));
    CHECK(baton_acquire(c, 0, NULL) == -1 && errno == ERANGE);
    CHECK(baton_release(c, 1, NULL) == -1 && errno == EINVAL);
    CHECK(strstr(baton_refusal(c), "(over-release)"));
    CHECK(baton_acquire(c, 2, NULL) == 0);
    CHECK(baton_release(c, 2, NULL) == 0);
    baton_close(c);
    CHECK(baton_connect("/nonexistent/baton/socket", "x", NULL) == NULL && errno == ENOENT);
    CHECK_MESSAGE("no broker at /nonexistent/baton/socket (start one with: baton serve --jobs N)");
    c = baton_connect(b.socket, "refused again", NULL);
    CHECK(c);
    CHECK(baton_release(c, 5, NULL) == -1 && errno == EINVAL);
    CHECK_MESSAGE("broker refused: %s", baton_refusal(c));
    CHECK(strstr(baton_errmsg(), "(over-release)"));
    baton_close(c);
    check_all_free(&b);
    broker_stop(&b);
}

static void a_null_path_is_found_as_the_cli_finds_it(void) {
    char path[256];
    setenv("BATON_SOCKET", "/x/s", 1);
    CHECK(baton_socket_path(path, sizeof path) == 4 && strcmp(path, "/x/s") == 0);
    CHECK(baton_socket_path(path, 4) == -1 && errno == ENAMETOOLONG);
    unsetenv("BATON_SOCKET");
    setenv("XDG_RUNTIME_DIR", "/run/user/7", 1);
    CHECK(baton_socket_path(path, sizeof path) > 0 && strcmp(path, "/run/user/7/baton/socket") == 0);
    unsetenv("XDG_RUNTIME_DIR");
    char expected[64];
    snprintf(expected, sizeof expected, "/tmp/baton-%u/socket", (unsigned)getuid());
    CHECK(baton_socket_path(path, sizeof path) > 0 && strcmp(path, expected) == 0);
    /* Set but empty is unset, as the CLI reads both (baton-core's paths.rs):
     * not "" nor "/baton/socket", which no broker serves. */
    setenv("BATON_SOCKET", "", 1);
    setenv("XDG_RUNTIME_DIR", "", 1);
    CHECK(baton_socket_path(path, sizeof path) > 0 && strcmp(path, expected) == 0);
    unsetenv("BATON_SOCKET");
    unsetenv("XDG_RUNTIME_DIR");

    struct broker b;
    broker_start(&b, 1);
    setenv("BATON_SOCKET", b.socket, 1);
    baton_t *c = baton_connect(NULL, "by environment", NULL);
    CHECK(c && baton_limit(c) == 1);
    baton_close(c);
    unsetenv("BATON_SOCKET");
    check_all_free(&b);
    broker_stop(&b);
}

static void a_holder_killed_with_9_gives_its_tokens_back(void) {
    struct broker b;
    broker_start(&b, 3);
    int ready[2];
    CHECK(pipe(ready) == 0);
    pid_t holder = fork();
    CHECK(holder >= 0);
    if (holder == 0) {
        baton_t *c = baton_connect(b.socket, "doomed", NULL);
        if (!c || baton_acquire(c, 2, NULL) < 0) _exit(1);
        (void)!write(ready[1], "h", 1);
        for (;;) pause();
    }
    char h;
    CHECK(read(ready[0], &h, 1) == 1);
    baton_t *c = baton_connect(b.socket, "watcher", NULL);
    CHECK(c);
    CHECK(status_number(c, "free") == 1);
    CHECK(kill(holder, SIGKILL) == 0);
    CHECK(waitpid(holder, NULL, 0) == holder);
    /* The event, not a time: the broker reclaims when the socket closes. */
    for (int tries = 0; status_number(c, "free") != 3; tries++) {
        CHECK(tries < 5000);
        nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    CHECK(status_has(c, "\"reclaimed\":2"));
    baton_close(c);
    close(ready[0]);
    close(ready[1]);
    check_all_free(&b);
    broker_stop(&b);
}

/* One connection per thread: the documented way to use the library from
 * several threads. */
static const char *thread_socket;
static atomic_int running, peak;

static void *worker(void *arg) {
    (void)arg;
    baton_t *c = baton_connect(thread_socket, "thread", NULL);
    CHECK(c);
    for (int i = 0; i < 20; i++) {
        CHECK(baton_acquire(c, 1, NULL) == 0);
        int now = atomic_fetch_add(&running, 1) + 1;
        for (int p = atomic_load(&peak); now > p && !atomic_compare_exchange_weak(&peak, &p, now);) {
        }
        sched_yield();
        atomic_fetch_sub(&running, 1);
        CHECK(baton_release(c, 1, NULL) == 0);
    }
    baton_close(c);
    return NULL;
}

static void threads_with_a_connection_each_stay_under_the_limit(void) {
    struct broker b;
    broker_start(&b, 2);
    thread_socket = b.socket;
    pthread_t threads[6];
    for (int i = 0; i < 6; i++) CHECK(pthread_create(&threads[i], NULL, worker, NULL) == 0);
    for (int i = 0; i < 6; i++) CHECK(pthread_join(threads[i], NULL) == 0);
    CHECK(atomic_load(&peak) >= 1 && atomic_load(&peak) <= 2);
    baton_t *c = baton_connect(b.socket, "check", NULL);
    CHECK(c);
    CHECK(status_has(c, "\"granted\":120"));
    baton_close(c);
    check_all_free(&b);
    broker_stop(&b);
}

static void a_stopped_broker_is_econnreset(void) {
    struct broker b;
    broker_start(&b, 1);
    baton_t *c = baton_connect(b.socket, "orphan", NULL);
    CHECK(c);
    broker_stop(&b);
    CHECK(baton_acquire(c, 1, NULL) == -1 && errno == ECONNRESET);
    baton_close(c);
}

/* Filling a real broker takes 60,000 connections, more than most systems
 * allow one process (test_vectors replays it where they do); a stand-in
 * sends the broker's line at connect and closes, as the broker does. */
static void a_full_broker_is_eusers(void) {
    char dir[] = "/tmp/baton-c-full-XXXXXX", path[64];
    CHECK(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/socket", dir);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    int server = socket(AF_UNIX, SOCK_STREAM, 0);
    CHECK(server >= 0 && bind(server, (struct sockaddr *)&addr, sizeof addr) == 0 && listen(server, 1) == 0);
    pid_t stand_in = fork();
    CHECK(stand_in >= 0);
    if (stand_in == 0) {
        static const char full[] = "ERR full the broker already serves 60000 clients\n";
        int conn = accept(server, NULL, NULL);
        _exit(conn >= 0 && write(conn, full, sizeof full - 1) == (ssize_t)(sizeof full - 1) ? 0 : 1);
    }
    errno = 0;
    baton_t *c = baton_connect(path, "one too many", NULL);
    CHECK(c == NULL && errno == EUSERS);
    CHECK_MESSAGE("the broker at %s serves its maximum of 60000 clients (try again when some finish, or raise it: "
                  "baton serve --max-clients N, and the broker's open-file limit)", path);
    int status;
    CHECK(waitpid(stand_in, &status, 0) == stand_in && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(server);
    unlink(path);
    rmdir(dir);
}

/* A real broker serving its maximum (--max-clients 2) turns the next one
 * away with ERR full: errno EUSERS, and the maximum in words. */
static void a_full_broker_is_named_with_its_maximum(void) {
    struct broker b;
    broker_start_with(&b, 1, 2);
    baton_t *first = connect_when_room(b.socket, "first"), *second = connect_when_room(b.socket, "second");
    errno = 0;
    CHECK(baton_connect(b.socket, "third", NULL) == NULL && errno == EUSERS);
    CHECK_MESSAGE("the broker at %s serves its maximum of 2 clients (try again when some finish, or raise it: "
                  "baton serve --max-clients N, and the broker's open-file limit)", b.socket);
    baton_close(second);
    baton_t *again = connect_when_room(b.socket, "room again");
    baton_close(again);
    baton_close(first);
    baton_close(connect_when_room(b.socket, "all closed"));
    check_all_free(&b);
    broker_stop(&b);
}

/* A socket in baton's own directory ($XDG_RUNTIME_DIR/baton here) is used
 * only while that directory is a private one of ours, judged by lstat: a
 * real broker serves there, and is refused as soon as its directory is
 * opened to the group, given to another user, or reached through a link. */
static void a_default_directory_not_ours_alone_is_refused_in_words(void) {
    struct broker b;
    broker_start_as(&b, 1, 0, "baton", (unsigned)getuid());
    char dir[96], other[] = "/tmp/baton-c-xdg-XXXXXX", link[96];
    snprintf(dir, sizeof dir, "%s/baton", b.dir);
    CHECK(mkdtemp(other));
    snprintf(link, sizeof link, "%s/baton", other);
    unsetenv("BATON_SOCKET");
    setenv("XDG_RUNTIME_DIR", b.dir, 1);
    baton_t *c = baton_connect(NULL, "private", NULL); /* as the broker made it: 0700, ours */
    CHECK(c && baton_limit(c) == 1);
    baton_close(c);

    CHECK(chmod(dir, 0770) == 0);
    errno = 0;
    CHECK(baton_connect(NULL, "group-writable", NULL) == NULL && errno == EPERM);
    CHECK_MESSAGE("%s is open to other users (mode 0770): refusing to use a broker there (if it is yours: chmod 700 %s)",
                  dir, dir);
    errno = 0; /* the same socket named in full is judged the same */
    CHECK(baton_connect(b.socket, "group-writable", NULL) == NULL && errno == EPERM);
    CHECK(chmod(dir, 0705) == 0);
    CHECK(baton_connect(NULL, "world-readable", NULL) == NULL && errno == EPERM);
    CHECK(strstr(baton_errmsg(), "(mode 0705)"));
    CHECK(chmod(dir, 0700) == 0);

    if (getuid() == 0) {
        CHECK(chown(dir, OTHER_UID, OTHER_UID) == 0);
        errno = 0;
        CHECK(baton_connect(NULL, "theirs", NULL) == NULL && errno == EPERM);
        CHECK_MESSAGE("%s belongs to uid %u, not to you (uid 0): refusing to use a broker there", dir, OTHER_UID);
        CHECK(chown(dir, 0, 0) == 0);
    }

    /* $XDG_RUNTIME_DIR/baton a link to the broker's real, private directory. */
    setenv("XDG_RUNTIME_DIR", other, 1);
    CHECK(symlink(dir, link) == 0);
    errno = 0;
    CHECK(baton_connect(NULL, "through a link", NULL) == NULL && errno == EPERM);
    CHECK_MESSAGE("%s is a symbolic link, which anyone who owns it could point elsewhere: refusing it", link);
    CHECK(unlink(link) == 0);
    FILE *f = fopen(link, "w");
    CHECK(f && fclose(f) == 0);
    errno = 0;
    CHECK(baton_connect(NULL, "a file", NULL) == NULL && errno == EPERM);
    CHECK_MESSAGE("%s is not a directory: refusing it", link);
    CHECK(unlink(link) == 0 && rmdir(other) == 0);

    /* Gone is not refused: connect says nobody is there. */
    CHECK(baton_connect(NULL, "nobody", NULL) == NULL && errno == ENOENT);
    CHECK_MESSAGE("no broker at %s/baton/socket (start one with: baton serve --jobs N)", other);
    unsetenv("XDG_RUNTIME_DIR");
    c = baton_connect(b.socket, "private again", NULL); /* named, not one of baton's own directories */
    CHECK(c);
    baton_close(c);
    check_all_free(&b);
    broker_stop(&b);
}

/* A real `baton serve` of another uid (setpriv): refused right after
 * connect, before a word is sent, naming the socket and both uids. */
static void a_broker_of_another_user_is_refused_in_words(void) {
    if (!can_act_as_another_user()) return;
    struct broker b;
    broker_start_as(&b, 1000000, 0, "theirs", OTHER_UID);
    errno = 0;
    CHECK(baton_connect(b.socket, "victim", NULL) == NULL && errno == EPERM);
    CHECK_MESSAGE("%s is answered by a process of uid %u, not by your own broker (uid 0) or root's: refusing to talk "
                  "to it (someone else's broker or an impostor; remove the socket or choose another path; if it is "
                  "the broker you mean to use, seen from a user namespace or run by a CI runner's user, say so with "
                  "BATON_BROKER_UID=%u)",
                  b.socket, OTHER_UID, OTHER_UID);
    broker_stop(&b);
}

/* Our broker's socket opened to all (0777): a client of another uid is
 * turned away by the broker (ERR denied), which the client words. */
static void a_broker_that_does_not_serve_us_is_named_with_its_words(void) {
    if (!can_act_as_another_user()) return;
    struct broker b;
    broker_start(&b, 1);
    char run[96];
    snprintf(run, sizeof run, "%s/run", b.dir);
    CHECK(chmod(b.dir, 0755) == 0 && chmod(run, 0755) == 0 && chmod(b.socket, 0777) == 0);
    int said[2];
    CHECK(pipe(said) == 0);
    pid_t client = fork();
    CHECK(client >= 0);
    if (client == 0) {
        if (setgroups(0, NULL) < 0 || setresgid(OTHER_UID, OTHER_UID, OTHER_UID) < 0 ||
            setresuid(OTHER_UID, OTHER_UID, OTHER_UID) < 0)
            _exit(2);
        baton_t *c = baton_connect(b.socket, "intruder", NULL);
        const char *text = baton_errmsg();
        (void)!write(said[1], text, strlen(text));
        _exit(c == NULL && errno == EACCES ? 0 : 1);
    }
    close(said[1]);
    char text[1024] = "";
    size_t len = 0;
    for (ssize_t n; (n = read(said[0], text + len, sizeof text - 1 - len)) > 0;) len += (size_t)n;
    text[len] = '\0';
    close(said[0]);
    int status;
    CHECK(waitpid(client, &status, 0) == client);
    char expected[256];
    snprintf(expected, sizeof expected, "the broker at %s refuses you: uid %u may not use this broker", b.socket,
             OTHER_UID);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0 && strncmp(text, expected, strlen(expected)) == 0)) {
        fprintf(stderr, "the client of uid %u (exit %d) said:\n  %s\nnot what starts\n  %s\n", OTHER_UID,
                WIFEXITED(status) ? WEXITSTATUS(status) : -1, text, expected);
        exit(1);
    }
    check_all_free(&b);
    broker_stop(&b);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* the library must not need SIGPIPE ignored */
    struct {
        const char *name;
        void (*run)(void);
    } tests[] = {
        {"tokens_are_held_and_given_back", tokens_are_held_and_given_back},
        {"try_acquire_takes_only_what_is_free", try_acquire_takes_only_what_is_free},
        {"an_expired_deadline_takes_nothing", an_expired_deadline_takes_nothing},
        {"refusals_set_errno_and_keep_the_connection", refusals_set_errno_and_keep_the_connection},
        {"a_null_path_is_found_as_the_cli_finds_it", a_null_path_is_found_as_the_cli_finds_it},
        {"a_holder_killed_with_9_gives_its_tokens_back", a_holder_killed_with_9_gives_its_tokens_back},
        {"threads_with_a_connection_each_stay_under_the_limit", threads_with_a_connection_each_stay_under_the_limit},
        {"a_stopped_broker_is_econnreset", a_stopped_broker_is_econnreset},
        {"a_full_broker_is_eusers", a_full_broker_is_eusers},
        {"a_full_broker_is_named_with_its_maximum", a_full_broker_is_named_with_its_maximum},
        {"a_default_directory_not_ours_alone_is_refused_in_words", a_default_directory_not_ours_alone_is_refused_in_words},
        {"a_broker_of_another_user_is_refused_in_words", a_broker_of_another_user_is_refused_in_words},
        {"a_broker_that_does_not_serve_us_is_named_with_its_words", a_broker_that_does_not_serve_us_is_named_with_its_words},
    };
    size_t n = sizeof tests / sizeof *tests, passed = 0;
    for (size_t i = 0; i < n; i++) {
        skipped = NULL;
        tests[i].run();
        if (skipped) {
            printf("test %s ... skipped (%s)\n", tests[i].name, skipped);
        } else {
            printf("test %s ... ok\n", tests[i].name);
            passed++;
        }
    }
    printf("clients: %zu passed, 0 failed, %zu skipped (C API)\n", passed, n - passed);
    return 0;
}
