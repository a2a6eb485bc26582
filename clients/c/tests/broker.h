/* Test fixture: a real `baton serve` in a temporary directory, stopped by
 * pid; and the checks every test shares. */
#ifndef BATON_TEST_BROKER_H
#define BATON_TEST_BROKER_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

struct broker {
    pid_t pid;
    char dir[64];
    char socket[128];
};

/* Starts `$BATON_BIN serve --jobs N` and waits until it listens. */
void broker_start(struct broker *b, unsigned jobs);
/* The same with `--max-clients max_clients` (0: the broker's default). */
void broker_start_with(struct broker *b, unsigned jobs, unsigned max_clients);
/* The same with the socket at DIR/subdir/socket (broker_start: "run"), and
 * run as `uid` (and gid `uid`, no supplementary groups) through setpriv(1)
 * if that is not ours, in a directory made and given to `uid` here (needs
 * root; --no-fuse). */
void broker_start_as(struct broker *b, unsigned jobs, unsigned max_clients, const char *subdir, unsigned uid);

/* broker_start() with more `baton serve` options (NULL-terminated; NULL:
 * none), e.g. {"--no-fuse", NULL}. */
void broker_start_args(struct broker *b, unsigned jobs, const char *const *extra);

/* SIGTERM by pid, reap, remove the directory. */
void broker_stop(struct broker *b);
/* The same with SIGKILL: the broker has no chance to tidy anything (start
 * it with --no-fuse: a killed broker leaves its FUSE mount behind). */
void broker_kill(struct broker *b);

/* A bare connection that says nothing (-1 if nobody listens). */
int broker_connect_raw(const char *path);

#define CHECK(cond)                                                                                    \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                   \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

#endif
