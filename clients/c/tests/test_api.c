/* libbaton's public API against the real broker, built as a user builds
 * it: cc test_api.c $(pkg-config --cflags --libs baton). */
#include <baton.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"

#define HANG_GUARD_MS 10000

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
    int status;
    CHECK(waitpid(stand_in, &status, 0) == stand_in && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(server);
    unlink(path);
    rmdir(dir);
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
    };
    size_t n = sizeof tests / sizeof *tests;
    for (size_t i = 0; i < n; i++) {
        tests[i].run();
        printf("test %s ... ok\n", tests[i].name);
    }
    printf("clients: %zu passed, 0 failed, 0 skipped (C API)\n", n);
    return 0;
}
