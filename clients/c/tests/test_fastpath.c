/* libbaton's fast path (baton_fastpath(); docs/fastpath.md) against the
 * real broker, built as a user builds it: cc test_fastpath.c
 * $(pkg-config --cflags --libs baton). Counted from the jobs themselves
 * (a lock per running job, which the kernel drops when its process dies)
 * and from the broker's books (STATUS).
 *
 * The clients of one test join one build: the test's own process says
 * BUILD on a connection it keeps (raw protocol: the library has no call
 * for it), and the broker puts every later connection of it and of its
 * children in that build. A region serves one build: without BUILD each
 * connection would be a build of its own, and the broker would keep every
 * region closed (each token served by the broker, at the socket's cost). */
#include <baton.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "json.h"

/* How long a test waits for what must happen at once, before it fails
 * rather than hangs (a hang guard, not a timing check). */
#define HANG_GUARD_MS 20000

/* The uid the test that needs a second user runs it as (root only). */
#define OTHER_UID 65534u

/* Why the test that just ran could not run here (NULL: it ran). */
static const char *skipped;

static void pause_ms(long ms) { nanosleep(&(struct timespec){ms / 1000, (ms % 1000) * 1000000L}, NULL); }

static long ms_since(const struct timespec *t) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t->tv_sec) * 1000L + (now.tv_nsec - t->tv_nsec) / 1000000L;
}

/* Waits, a hang guard long at most, until `cond` holds. */
#define WAIT_FOR(cond, what)                                                                           \
    do {                                                                                               \
        struct timespec start_;                                                                        \
        clock_gettime(CLOCK_MONOTONIC, &start_);                                                       \
        while (!(cond)) {                                                                              \
            if (ms_since(&start_) > HANG_GUARD_MS) {                                                   \
                fprintf(stderr, "%s:%d: waited %d ms for %s\n", __FILE__, __LINE__, HANG_GUARD_MS, what); \
                exit(1);                                                                               \
            }                                                                                          \
            pause_ms(2);                                                                               \
        }                                                                                              \
    } while (0)

/* A connection that starts a build, in raw protocol: HELLO, then BUILD,
 * answered `BUILD <id> <weight>`. Kept open while the test runs. */
static int build_root(const char *socket) {
    int fd = broker_connect_raw(socket);
    CHECK(fd >= 0);
    static const char say[] = "HELLO 1 c fast-path test\nBUILD 1 c fast-path test\n";
    CHECK(write(fd, say, sizeof say - 1) == (ssize_t)(sizeof say - 1));
    char reply[256];
    size_t len = 0;
    int lines = 0;
    while (lines < 2 && len < sizeof reply - 1) {
        CHECK(read(fd, reply + len, 1) == 1);
        lines += reply[len++] == '\n';
    }
    reply[len] = '\0';
    char *second = strchr(reply, '\n') + 1;
    if (strncmp(reply, "OK ", 3) != 0 || strncmp(second, "BUILD ", 6) != 0) {
        fprintf(stderr, "HELLO and BUILD answered:\n%s", reply);
        exit(1);
    }
    return fd;
}

/* Whether the tests running now ask for a pile (FASTPATH 2) instead of
 * a ring: the same tests run for both layouts. */
static int use_pile;

static int enable(baton_t *c) { return use_pile ? baton_fastpath_pile(c) : baton_fastpath(c); }

/* A connection with a seat in the build's region. */
static baton_t *fast_client(const char *socket, const char *label) {
    baton_t *c = baton_connect(socket, label, NULL);
    CHECK(c);
    if (enable(c) != 0) {
        fprintf(stderr, "baton_fastpath: %s\n", baton_errmsg());
        exit(1);
    }
    CHECK(baton_uses_fastpath(c));
    return c;
}

static struct json *status_of(baton_t *c) {
    char *text = baton_status_json(c, NULL);
    CHECK(text);
    struct json *doc = json_parse(text);
    free(text);
    return doc;
}

/* A top-level number of the status document. */
static long status_number(baton_t *c, const char *key) {
    struct json *doc = status_of(c);
    const struct json *value = json_get(doc, key);
    CHECK(value && value->type == JSON_NUMBER);
    long n = (long)value->number;
    json_free(doc);
    return n;
}

/* The tokens STATUS lists for the connection labelled `label` (0 if it is
 * not a holder): what the socket gave it, and what its seat's record in
 * the region says it holds there (exact between operations). */
static long booked_on(baton_t *c, const char *label) {
    struct json *doc = status_of(c);
    const struct json *holders = json_get(doc, "holders");
    CHECK(holders && holders->type == JSON_ARRAY);
    long tokens = 0;
    for (size_t i = 0; i < holders->count; i++) {
        const struct json *command = json_get(&holders->items[i], "command");
        if (command && command->type == JSON_STRING && strcmp(command->string, label) == 0)
            tokens += (long)json_get(&holders->items[i], "tokens")->number;
    }
    json_free(doc);
    return tokens;
}

/* Every token back in the pool and nobody waiting: how every test ends.
 * The broker ends a region when its last seated client's connection
 * closes, which it learns in its own time. */
static void wait_all_free(struct broker *b) {
    baton_t *c = baton_connect(b->socket, "check", NULL);
    CHECK(c);
    long limit = status_number(c, "limit");
    WAIT_FOR(status_number(c, "held") == 0 && status_number(c, "free") == limit, "every token back in the pool");
    struct json *doc = status_of(c);
    CHECK(json_get(doc, "waiters")->count == 0);
    json_free(doc);
    baton_close(c);
}

/* The broker found nothing wrong in a region (its audit, its repairs). */
static void check_no_fastpath_warning(struct broker *b) {
    char path[128], line[1024];
    snprintf(path, sizeof path, "%s/broker.log", b->dir);
    FILE *log = fopen(path, "r");
    CHECK(log);
    while (fgets(line, sizeof line, log))
        if (strstr(line, "WARN") && strstr(line, "fast path")) {
            fprintf(stderr, "the broker found something wrong:\n%s", line);
            exit(1);
        }
    fclose(log);
}

/* Grants the pool made since the broker started (`totals.granted`): the
 * region's tokens pass from client to client without one. */
static long pool_grants(baton_t *c) {
    struct json *doc = status_of(c);
    const struct json *granted = json_get(json_get(doc, "totals"), "granted");
    CHECK(granted && granted->type == JSON_NUMBER);
    long n = (long)granted->number;
    json_free(doc);
    return n;
}

static void a_seat_is_asked_for_once_and_baton_held_counts_both_paths(void) {
    struct broker b;
    broker_start(&b, 4);
    int root = build_root(b.socket);
    baton_t *c = fast_client(b.socket, "fast c");
    /* A second call is a no-op (the broker gives a connection one seat,
     * and would refuse a second FASTPATH). */
    CHECK(baton_fastpath(c) == 0 && baton_uses_fastpath(c));
    baton_t *watch = baton_connect(b.socket, "watch", NULL);
    CHECK(watch);
    struct timespec guard = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(c, 1, &guard) == 0 && baton_held(c) == 1);
    /* The broker lends the pool's free tokens at its next round: until
     * then a TRY finds none, in the region or the pool. */
    WAIT_FOR(baton_try_acquire(c, 1, NULL) == 1, "the region to be lent a free token");
    CHECK(baton_held(c) == 2 && booked_on(watch, "fast c") == 2);
    /* Every token is lent to the region now; what its clients pass among
     * themselves there is no grant of the pool's. */
    CHECK(status_number(watch, "held") == 4 && status_number(watch, "free") == 0);
    long grants = pool_grants(watch);
    CHECK(baton_release(c, 1, NULL) == 0 && baton_held(c) == 1);
    CHECK(baton_acquire(c, 1, &guard) == 0 && baton_try_acquire(c, 1, NULL) == 1 && baton_held(c) == 3);
    CHECK(baton_release(c, 1, NULL) == 0 && baton_held(c) == 2 && booked_on(watch, "fast c") == 2);
    CHECK(pool_grants(watch) == grants);
    /* Two at once go over the socket: the broker takes the region's free
     * ones back to grant them. */
    CHECK(baton_acquire(c, 2, &guard) == 0 && baton_held(c) == 4);
    CHECK(pool_grants(watch) >= grants + 2 && booked_on(watch, "fast c") == 4);
    /* More than it holds: refused whole, nothing given back anywhere. */
    errno = 0;
    CHECK(baton_release(c, 5, NULL) == -1 && errno == EINVAL);
    CHECK(strstr(baton_refusal(c), "(over-release)"));
    CHECK(baton_held(c) == 4 && booked_on(watch, "fast c") == 4);
    /* The region's two first, then one over the socket. */
    CHECK(baton_release(c, 3, NULL) == 0 && baton_held(c) == 1);
    CHECK(booked_on(watch, "fast c") == 1);
    CHECK(baton_release(c, 1, NULL) == 0 && baton_held(c) == 0);
    CHECK(baton_uses_fastpath(c));
    baton_close(c);
    baton_close(watch);
    close(root);
    wait_all_free(&b);
    check_no_fastpath_warning(&b);
    broker_stop(&b);
}

static void a_deadline_is_honoured_in_the_region(void) {
    struct broker b;
    broker_start(&b, 1);
    int root = build_root(b.socket);
    baton_t *holder = fast_client(b.socket, "holder"), *waiter = fast_client(b.socket, "waiter");
    struct timespec guard = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(holder, 1, &guard) == 0);
    struct timespec deadline = baton_deadline(100);
    errno = 0;
    CHECK(baton_acquire(waiter, 1, &deadline) == -1 && errno == ETIMEDOUT);
    /* Not before the deadline; and well before the second after which a
     * sleeper looks at the broker anyway: the wait itself ended at the
     * deadline (a hang guard against a sleep that ignores it). */
    long late = ms_since(&deadline);
    CHECK(late >= 0 && late < 900);
    /* Withdrawn in the region, not over the socket; nothing held for it. */
    CHECK(strstr(baton_errmsg(), "(fast path)"));
    CHECK(baton_held(waiter) == 0 && baton_uses_fastpath(waiter));
    /* Nothing free in the region (nor in the pool: TRY goes on to ask it). */
    CHECK(baton_try_acquire(waiter, 1, NULL) == 0);
    CHECK(baton_release(holder, 1, NULL) == 0 && baton_held(holder) == 0);
    guard = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(waiter, 1, &guard) == 0 && baton_held(waiter) == 1);
    CHECK(baton_try_acquire(holder, 1, NULL) == 0);
    CHECK(baton_release(waiter, 1, NULL) == 0 && baton_held(waiter) == 0);
    CHECK(baton_uses_fastpath(holder) && baton_uses_fastpath(waiter));
    baton_close(holder);
    baton_close(waiter);
    close(root);
    wait_all_free(&b);
    check_no_fastpath_warning(&b);
    broker_stop(&b);
}

/* Context switches of every thread of `pid`: how often it slept. */
static unsigned long long switches(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *tasks = opendir(path);
    CHECK(tasks);
    unsigned long long total = 0;
    for (struct dirent *task; (task = readdir(tasks));) {
        if (task->d_name[0] == '.') continue;
        char status[300];
        snprintf(status, sizeof status, "/proc/%d/task/%s/status", (int)pid, task->d_name);
        FILE *f = fopen(status, "r");
        if (!f) continue; /* a thread that just ended */
        while (fgets(line, sizeof line, f))
            if (strstr(line, "ctxt_switches:")) total += strtoull(strchr(line, ':') + 1, NULL, 10);
        fclose(f);
    }
    closedir(tasks);
    return total;
}

#define THREADS 6
#define ROUNDS 300
static atomic_int running, peak;
static struct timespec threads_guard; /* a hang guard for all the rounds */

/* A thread's rounds: NULL, or what went wrong (for the main thread to
 * report: exit() from several threads at once is undefined). */
static void *worker(void *arg) {
    baton_t *c = arg;
    for (int i = 0; i < ROUNDS; i++) {
        if (baton_acquire(c, 1, &threads_guard) < 0) return "baton_acquire failed (or the hang guard passed)";
        int now = atomic_fetch_add(&running, 1) + 1;
        for (int p = atomic_load(&peak); now > p && !atomic_compare_exchange_weak(&peak, &p, now);) {
        }
        sched_yield();
        atomic_fetch_sub(&running, 1);
        if (baton_release(c, 1, NULL) < 0) return "baton_release failed";
    }
    return baton_held(c) == 0 && baton_uses_fastpath(c) ? NULL : "a token held at the end, or the seat given up";
}

static void threads_pass_tokens_in_the_region_without_waking_the_broker(void) {
    struct broker b;
    broker_start(&b, 2);
    int root = build_root(b.socket);
    baton_t *clients[THREADS];
    for (int i = 0; i < THREADS; i++) clients[i] = fast_client(b.socket, "thread");
    pthread_t threads[THREADS];
    unsigned long long before = switches(b.pid);
    threads_guard = baton_deadline(HANG_GUARD_MS);
    for (int i = 0; i < THREADS; i++) CHECK(pthread_create(&threads[i], NULL, worker, clients[i]) == 0);
    for (int i = 0; i < THREADS; i++) {
        void *failed;
        CHECK(pthread_join(threads[i], &failed) == 0);
        if (failed) {
            fprintf(stderr, "thread %d: %s\n", i, (const char *)failed);
            exit(1);
        }
    }
    unsigned long long woken = switches(b.pid) - before, operations = 2ull * THREADS * ROUNDS;
    CHECK(atomic_load(&peak) >= 1 && atomic_load(&peak) <= 2);
    if (woken * 10 >= operations) {
        fprintf(stderr, "the broker slept and woke %llu times for %llu acquires and releases\n", woken, operations);
        exit(1);
    }
    for (int i = 0; i < THREADS; i++) baton_close(clients[i]);
    close(root);
    wait_all_free(&b);
    check_no_fastpath_warning(&b);
    broker_stop(&b);
}

/* The kill test's client processes. */
#define JOBS 5
#define KILLS 300
#define LIMIT 2

static char job_dir[64];
/* The job clients running, killed and reaped by the test's process at
 * exit however it exits (a failed CHECK included). */
static pid_t job_pids[JOBS];
static pid_t test_pid;

static void remove_job_dir(void) {
    if (!*job_dir) return;
    char command[96];
    snprintf(command, sizeof command, "rm -rf %s", job_dir);
    CHECK(system(command) == 0);
    *job_dir = '\0';
}

static void kill_jobs_left(void) {
    if (getpid() != test_pid) return;
    for (int i = 0; i < JOBS; i++)
        if (job_pids[i] > 0) {
            kill(job_pids[i], SIGKILL);
            waitpid(job_pids[i], NULL, 0);
            job_pids[i] = 0;
        }
    remove_job_dir();
}

/* A child's failure, for the parent to find: the file `name` says why.
 * No exit(): the parent's atexit handlers and stdio buffers are not the
 * child's to run. */
_Noreturn static void child_fails(const char *name, const char *why, int status) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", job_dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        (void)!write(fd, why, strlen(why));
        close(fd);
    }
    _exit(status);
}

static int open_in_dir(const char *name, int flags) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", job_dir, name);
    return open(path, flags | O_CLOEXEC, 0600);
}

/* A POSIX record lock on all of `fd` (fcntl(2)): `type` F_WRLCK, F_RDLCK
 * or F_UNLCK, waiting for it or not. 0, or -1 if another process holds a
 * conflicting one (and `wait` is 0). */
static int record_lock(int fd, short type, int wait) {
    struct flock l = {.l_type = type, .l_whence = SEEK_SET};
    return fcntl(fd, wait ? F_SETLKW : F_SETLK, &l);
}

/* Runs jobs one token at a time until killed, each under a lock of its
 * own, and counts the jobs running at once from the others' locks. A
 * job's lock is taken and dropped only under the scan lock, which the
 * count is taken under too: no job starts or ends during a count but by a
 * death, which only lowers it, so a count never sees one job twice.
 *
 * The locks are POSIX record locks, which the kernel drops as it closes a
 * dying process's descriptors, before it releases any of their files: so
 * a killed job's lock is gone before its connection reads as closed to the
 * broker, which then takes its token back. Not flock(2): a flock goes
 * with its file's release, which on exit comes in no set order with the
 * socket's (measured: after it, in most deaths), so a dead job would be
 * counted beside the job its token went to.
 *
 * Its tokens come three ways in turn: a wait, a TRY (then a wait), and
 * waits with a short deadline, tried again (the withdrawal races the
 * grants). */
_Noreturn static void job_here(int index, const char *socket) {
    char name[32], why[512];
    int scan = open_in_dir("scan", O_RDWR), locks[JOBS];
    for (int j = 0; j < JOBS; j++) {
        snprintf(name, sizeof name, "job-%d", j);
        locks[j] = open_in_dir(name, O_RDWR);
    }
    snprintf(name, sizeof name, "progress-%d", index);
    int progress = open_in_dir(name, O_WRONLY | O_APPEND), at_limit = open_in_dir("at-limit", O_WRONLY | O_APPEND);
    if (scan < 0 || progress < 0 || at_limit < 0) child_fails("failed", "opening the job files", 2);
    baton_t *c = baton_connect(socket, "job", NULL);
    if (!c || enable(c) != 0) {
        snprintf(why, sizeof why, "job %d: connect or baton_fastpath: %s", index, baton_errmsg());
        child_fails("failed", why, 2);
    }
    for (unsigned round = 0;; round++) {
        int got = 0;
        if (round % 3 == 1) got = baton_try_acquire(c, 1, NULL);
        while (round % 3 == 2 && got == 0) {
            struct timespec soon = baton_deadline(1 + round % 5);
            got = baton_acquire(c, 1, &soon) == 0;
            if (!got && errno != ETIMEDOUT) break;
            if (!got && baton_held(c) != 0) child_fails("failed", "a withdrawn wait left a token held", 4);
        }
        if (got < 0 || (!got && baton_acquire(c, 1, NULL) < 0)) {
            snprintf(why, sizeof why, "job %d: acquire: %s", index, baton_errmsg());
            child_fails("failed", why, 4);
        }
        if (baton_held(c) != 1) child_fails("failed", "a token taken, and not one held", 4);
        record_lock(scan, F_WRLCK, 1);
        record_lock(locks[index], F_WRLCK, 1);
        int jobs = 1;
        for (int j = 0; j < JOBS; j++) {
            if (j == index) continue;
            if (record_lock(locks[j], F_RDLCK, 0) == 0)
                record_lock(locks[j], F_UNLCK, 0);
            else
                jobs++;
        }
        if (jobs > LIMIT) {
            snprintf(why, sizeof why, "%d jobs on %d tokens", jobs, LIMIT);
            child_fails("over", why, 3);
        }
        record_lock(scan, F_UNLCK, 0);
        (void)!write(progress, ".", 1);
        if (jobs == LIMIT) (void)!write(at_limit, ".", 1);
        record_lock(scan, F_WRLCK, 1);
        record_lock(locks[index], F_UNLCK, 0);
        record_lock(scan, F_UNLCK, 0);
        if (baton_release(c, 1, NULL) < 0) {
            snprintf(why, sizeof why, "job %d: release: %s", index, baton_errmsg());
            child_fails("failed", why, 4);
        }
    }
}

static pid_t spawn_job(int index, const char *socket, int root) {
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(root); /* the build's connection is the parent's */
        job_here(index, socket);
    }
    return pid;
}

static off_t size_of(const char *name) {
    char path[128];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", job_dir, name);
    CHECK(stat(path, &st) == 0);
    return st.st_size;
}

static off_t progress_of(int index) {
    char name[32];
    snprintf(name, sizeof name, "progress-%d", index);
    return size_of(name);
}

static void check_no_child_failed(int kills) {
    static const char *const names[] = {"over", "failed"};
    for (int i = 0; i < 2; i++) {
        char path[128], why[512] = "";
        snprintf(path, sizeof path, "%s/%s", job_dir, names[i]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t n = fread(why, 1, sizeof why - 1, f);
        why[n] = '\0';
        fclose(f);
        fprintf(stderr, "after %d kills, a client found: %s\n", kills, why);
        exit(1);
    }
}

/* Every client runs jobs after every 20 kills: none is left waiting
 * (first come, first served); and every token still goes round: some job
 * runs beside LIMIT - 1 others (a token lost by a kill would make that
 * never happen again). */
/* Jobs run so far, by every client. */
static off_t all_progress(void) {
    off_t all = 0;
    for (int i = 0; i < JOBS; i++) all += progress_of(i);
    return all;
}

static void each_makes_progress(void) {
    off_t at[JOBS], full = size_of("at-limit"), all = all_progress();
    for (int i = 0; i < JOBS; i++) at[i] = progress_of(i);
    /* A pile promises no order: a client can be passed over while others
     * keep coming back, so only the jobs as a whole must go on there. */
    for (int i = 0; i < JOBS && !use_pile; i++) WAIT_FOR(progress_of(i) > at[i], "every client to go on running jobs");
    WAIT_FOR(all_progress() > all, "the jobs to go on");
    WAIT_FOR(size_of("at-limit") > full, "a job to run beside as many others as there are tokens");
}

static void clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one(void) {
    struct broker b;
    broker_start(&b, LIMIT);
    int root = build_root(b.socket);
    snprintf(job_dir, sizeof job_dir, "/tmp/baton-c-jobs-XXXXXX");
    CHECK(mkdtemp(job_dir));
    const char *files[] = {"scan",       "job-0",      "job-1",      "job-2",      "job-3",     "job-4",
                           "progress-0", "progress-1", "progress-2", "progress-3", "progress-4", "at-limit"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        int fd = open_in_dir(files[i], O_WRONLY | O_CREAT | O_TRUNC);
        CHECK(fd >= 0);
        close(fd);
    }
    pid_t *children = job_pids;
    for (int i = 0; i < JOBS; i++) children[i] = spawn_job(i, b.socket, root);
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    for (int kill_no = 0; kill_no < KILLS; kill_no++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        nanosleep(&(struct timespec){0, (long)(seed % 15000) * 1000L}, NULL);
        int victim = (int)((seed >> 20) % JOBS);
        CHECK(kill(children[victim], SIGKILL) == 0);
        int status;
        CHECK(waitpid(children[victim], &status, 0) == children[victim]);
        check_no_child_failed(kill_no + 1);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
        children[victim] = spawn_job(victim, b.socket, root);
        if (kill_no % 20 == 19) each_makes_progress();
    }
    each_makes_progress();
    for (int i = 0; i < JOBS; i++) {
        CHECK(kill(children[i], SIGKILL) == 0);
        CHECK(waitpid(children[i], NULL, 0) == children[i]);
        children[i] = 0;
    }
    check_no_child_failed(KILLS + JOBS);
    /* The jobs ran on tokens passed in the region: the pool granted only
     * what it lent the region again after each death. */
    long jobs = 0;
    for (int i = 0; i < JOBS; i++) jobs += (long)progress_of(i);
    baton_t *watch = baton_connect(b.socket, "watch", NULL);
    CHECK(watch);
    long grants = pool_grants(watch);
    if (grants * 10 >= jobs) {
        fprintf(stderr, "the pool granted %ld times for %ld jobs: the region was not used\n", grants, jobs);
        exit(1);
    }
    baton_close(watch);
    close(root);
    wait_all_free(&b);
    check_no_fastpath_warning(&b);
    broker_stop(&b);
    remove_job_dir();
}

/* The waiter of the test below: a thread with its own connection. */
struct sleeper {
    baton_t *c;
    pid_t tid;
    int result, error;
    int done[2];
};

static void *sleep_in_the_region(void *arg) {
    struct sleeper *s = arg;
    s->tid = (pid_t)syscall(SYS_gettid);
    s->result = baton_acquire(s->c, 1, NULL);
    s->error = errno;
    (void)!write(s->done[1], "d", 1);
    return NULL;
}

/* Whether thread `tid` of this process sleeps in futex_wait (its wchan). */
static int asleep_in_a_futex(pid_t tid) {
    char path[64], wchan[128] = "";
    snprintf(path, sizeof path, "/proc/self/task/%d/wchan", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(wchan, 1, sizeof wchan - 1, f);
    wchan[n] = '\0';
    fclose(f);
    return strstr(wchan, "futex") != NULL;
}

static void a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever(void) {
    struct broker b;
    broker_start_args(&b, 1, (const char *const[]){"--no-fuse", NULL}); /* a killed broker leaves no mount */
    int root = build_root(b.socket);
    baton_t *holder = fast_client(b.socket, "holder");
    struct sleeper s = {.c = fast_client(b.socket, "sleeper")};
    CHECK(pipe(s.done) == 0);
    struct timespec guard = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(holder, 1, &guard) == 0);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, sleep_in_the_region, &s) == 0);
    /* In the kernel, in futex_wait: nothing but the region knows it waits. */
    WAIT_FOR(s.tid != 0 && asleep_in_a_futex(s.tid), "the waiter to sleep in futex_wait");
    broker_kill(&b);
    /* It looks at the broker's liveness word at least once a second. */
    struct pollfd p = {.fd = s.done[0], .events = POLLIN};
    if (poll(&p, 1, 5000) != 1) {
        fprintf(stderr, "the waiter still sleeps 5 s after its broker was killed\n");
        exit(1);
    }
    CHECK(pthread_join(thread, NULL) == 0);
    CHECK(s.result == -1 && s.error == ECONNRESET);
    CHECK(!baton_uses_fastpath(s.c) && baton_held(s.c) == 0);
    /* The holder finds its broker gone too: the token it held in the
     * region is counted on its connection, which is dead. */
    errno = 0;
    CHECK(baton_release(holder, 1, NULL) == -1 && errno == ECONNRESET);
    CHECK(!baton_uses_fastpath(holder) && baton_held(holder) == 1);
    baton_close(s.c);
    baton_close(holder);
    close(root);
    close(s.done[0]);
    close(s.done[1]);
}

/* A broker that serves another uid (--allow-uid) never shares its memory
 * with it: ERR unavailable, which the client of that uid reads as ENOTSUP
 * with the broker's words, and goes on over the socket. */
static void a_broker_that_offers_no_seat_is_enotsup_and_the_socket_serves_on(void) {
    if (getuid() != 0) {
        skipped = "needs root to act as another user";
        return;
    }
    char uid_text[16];
    snprintf(uid_text, sizeof uid_text, "%u", OTHER_UID);
    struct broker b;
    broker_start_args(&b, 1, (const char *const[]){"--allow-uid", uid_text, "--no-fuse", NULL});
    char run[96];
    snprintf(run, sizeof run, "%s/run", b.dir);
    CHECK(chmod(b.dir, 0755) == 0 && chmod(run, 0755) == 0 && chmod(b.socket, 0777) == 0);
    int said[2];
    CHECK(pipe(said) == 0);
    fflush(NULL);
    pid_t client = fork();
    CHECK(client >= 0);
    if (client == 0) {
        char text[1200];
        if (setgroups(0, NULL) < 0 || setresgid(OTHER_UID, OTHER_UID, OTHER_UID) < 0 ||
            setresuid(OTHER_UID, OTHER_UID, OTHER_UID) < 0)
            _exit(2);
        baton_t *c = baton_connect(b.socket, "other user", NULL);
        if (!c) _exit(3);
        errno = 0;
        int rc = baton_fastpath(c), e = errno;
        snprintf(text, sizeof text, "%s\n%s\n", baton_refusal(c), baton_errmsg());
        (void)!write(said[1], text, strlen(text));
        struct timespec guard = baton_deadline(HANG_GUARD_MS);
        int served = baton_acquire(c, 1, &guard) == 0 && baton_held(c) == 1 && baton_release(c, 1, NULL) == 0 &&
                     baton_held(c) == 0;
        _exit(rc == -1 && e == ENOTSUP && !baton_uses_fastpath(c) && served ? 0 : 1);
    }
    close(said[1]);
    char text[1200] = "";
    size_t len = 0;
    for (ssize_t n; (n = read(said[0], text + len, sizeof text - 1 - len)) > 0;) len += (size_t)n;
    text[len] = '\0';
    close(said[0]);
    int status;
    CHECK(waitpid(client, &status, 0) == client);
    char expected[128];
    snprintf(expected, sizeof expected, "only its own user gets it, not uid %u (unavailable)\nbroker refused: ",
             OTHER_UID);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0 && strstr(text, expected))) {
        fprintf(stderr, "the client of uid %u (exit %d) was told:\n%s\nnot what has\n  %s\n", OTHER_UID,
                WIFEXITED(status) ? WEXITSTATUS(status) : -1, text, expected);
        exit(1);
    }
    wait_all_free(&b);
    broker_stop(&b);
}

/* The same tests with every client in a pile. */
static void in_a_pile(void (*test)(void)) {
    use_pile = 1;
    test();
    use_pile = 0;
}

static void pile_a_deadline_is_honoured(void) { in_a_pile(a_deadline_is_honoured_in_the_region); }

static void pile_threads_pass_tokens_without_waking_the_broker(void) {
    in_a_pile(threads_pass_tokens_in_the_region_without_waking_the_broker);
}

static void pile_clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one(void) {
    in_a_pile(clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one);
}

static void pile_a_waiter_whose_broker_is_killed_gives_up(void) {
    in_a_pile(a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever);
}

/* A build's first fast-path client chose a ring: asking it for a pile is
 * ENOTSUP with the broker's reason, and the socket serves on. */
static void a_pile_asked_of_a_ring_build_is_enotsup(void) {
    struct broker b;
    broker_start(&b, 1);
    int root = build_root(b.socket);
    baton_t *ringed = fast_client(b.socket, "ringed"), *c = baton_connect(b.socket, "piled", NULL);
    CHECK(c);
    errno = 0;
    CHECK(baton_fastpath_pile(c) == -1 && errno == ENOTSUP && !baton_uses_fastpath(c));
    CHECK(strstr(baton_errmsg(), "FASTPATH 1"));
    struct timespec guard = baton_deadline(HANG_GUARD_MS);
    CHECK(baton_acquire(c, 1, &guard) == 0 && baton_release(c, 1, NULL) == 0);
    baton_close(c);
    baton_close(ringed);
    close(root);
    wait_all_free(&b);
    broker_stop(&b);
}

int main(void) {
    signal(SIGPIPE, SIG_DFL); /* the library must not need SIGPIPE ignored */
    test_pid = getpid();
    atexit(kill_jobs_left);
    struct {
        const char *name;
        void (*run)(void);
    } tests[] = {
        {"a_seat_is_asked_for_once_and_baton_held_counts_both_paths",
         a_seat_is_asked_for_once_and_baton_held_counts_both_paths},
        {"a_deadline_is_honoured_in_the_region", a_deadline_is_honoured_in_the_region},
        {"threads_pass_tokens_in_the_region_without_waking_the_broker",
         threads_pass_tokens_in_the_region_without_waking_the_broker},
        {"clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one",
         clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one},
        {"a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever",
         a_waiter_whose_broker_is_killed_gives_up_instead_of_sleeping_forever},
        {"a_broker_that_offers_no_seat_is_enotsup_and_the_socket_serves_on",
         a_broker_that_offers_no_seat_is_enotsup_and_the_socket_serves_on},
        {"pile_a_deadline_is_honoured", pile_a_deadline_is_honoured},
        {"pile_threads_pass_tokens_without_waking_the_broker", pile_threads_pass_tokens_without_waking_the_broker},
        {"pile_clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one",
         pile_clients_killed_at_random_moments_never_run_more_jobs_than_tokens_nor_lose_one},
        {"pile_a_waiter_whose_broker_is_killed_gives_up", pile_a_waiter_whose_broker_is_killed_gives_up},
        {"a_pile_asked_of_a_ring_build_is_enotsup", a_pile_asked_of_a_ring_build_is_enotsup},
    };
    size_t n = sizeof tests / sizeof *tests, passed = 0;
    for (size_t i = 0; i < n; i++) {
        skipped = NULL;
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        tests[i].run();
        if (skipped) {
            printf("test %s ... skipped (%s)\n", tests[i].name, skipped);
        } else {
            printf("test %s ... ok (%ld ms)\n", tests[i].name, ms_since(&start));
            passed++;
        }
        fflush(stdout);
    }
    printf("clients: %zu passed, 0 failed, %zu skipped (C fast path against the broker)\n", passed, n - passed);
    return 0;
}
