/* docs/protocol-vectors.json replayed against the real broker through
 * libbaton's own wire code: its line reader, its reply decoder, its map
 * from error codes to errno, and baton_status_json(). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "internal.h"
#include "json.h"

#define HANG_GUARD_MS 10000
#define MAX_CONNS 8

struct conn {
    const char *name;
    baton_t *c;
};

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    rewind(f);
    char *text = malloc((size_t)len + 1);
    CHECK(fread(text, 1, (size_t)len, f) == (size_t)len);
    text[len] = '\0';
    fclose(f);
    return text;
}

static baton_t *conn_named(struct conn *conns, const char *name, const char *path) {
    for (int i = 0; i < MAX_CONNS; i++) {
        if (conns[i].name && strcmp(conns[i].name, name) == 0) return conns[i].c;
        if (!conns[i].name) {
            conns[i].name = name;
            conns[i].c = calloc(1, sizeof(struct baton));
            conns[i].c->fd = broker_connect_raw(path);
            CHECK(conns[i].c->fd >= 0);
            return conns[i].c;
        }
    }
    CHECK(!"more connections than MAX_CONNS");
    return NULL;
}

static struct json *status(baton_t *c) {
    struct timespec deadline = baton_deadline(HANG_GUARD_MS);
    char *text = baton_status_json(c, &deadline);
    CHECK(text);
    struct json *doc = json_parse(text);
    free(text);
    return doc;
}

static int status_matches(baton_t *c, const struct json *expected) {
    struct json *doc = status(c);
    int ok = json_matches(expected, doc);
    json_free(doc);
    return ok;
}

/* What the library makes of a reply line the vector shows. */
static void check_decoded(const char *vector, const char *text) {
    char line[BATON_LINE_MAX], word[32];
    struct baton_reply r;
    snprintf(line, sizeof line, "%.*s", (int)strlen(text) - 1, text);
    if (baton__parse_reply(line, &r) != 0) {
        fprintf(stderr, "%s: the library cannot decode %s", vector, text);
        exit(1);
    }
    sscanf(text, "%31s", word);
    CHECK(strcmp(r.kind, word) == 0);
    if (strcmp(r.kind, "ERR") == 0) {
        sscanf(text, "ERR %31s", word);
        CHECK(strcmp(r.code, word) == 0);
        int e = baton__errno_of(r.code);
        int recoverable = strcmp(r.code, "range") == 0 || strcmp(r.code, "over-release") == 0 || strcmp(r.code, "full") == 0;
        CHECK(recoverable ? e != EPROTO : e == EPROTO);
    }
}

static void step(const char *vector, const struct json *s, struct conn *conns, const char *path, int **fillers,
                 size_t *nfill) {
    const char *who = s->items[0].string, *op = s->items[1].string;
    const struct json *arg = s->count > 2 ? &s->items[2] : NULL;
    if (strcmp(op, "fill") == 0) {
        *fillers = realloc(*fillers, sizeof **fillers * ((size_t)arg->number + *nfill));
        for (int i = 0; i < (int)arg->number; i++) CHECK(((*fillers)[(*nfill)++] = broker_connect_raw(path)) >= 0);
        return;
    }
    baton_t *c = conn_named(conns, who, path);
    struct timespec deadline = baton_deadline(HANG_GUARD_MS);
    char line[BATON_LINE_MAX];
    if (strcmp(op, "send") == 0) {
        CHECK(baton__send(c, arg->string, strlen(arg->string), &deadline) == 0);
    } else if (strcmp(op, "recv") == 0) {
        int len = baton__read_line(c, line, sizeof line, &deadline);
        if (len < 0 || strncmp(line, arg->string, (size_t)len) != 0 || arg->string[len] != '\n' || arg->string[len + 1]) {
            fprintf(stderr, "%s: %s read \"%s\" (%s), expected %s", vector, who, len < 0 ? "" : line, strerror(errno), arg->string);
            exit(1);
        }
        check_decoded(vector, arg->string);
    } else if (strcmp(op, "status") == 0) {
        if (!status_matches(c, arg)) {
            fprintf(stderr, "%s: %s's status does not match\n", vector, who);
            exit(1);
        }
    } else if (strcmp(op, "status_until") == 0) {
        for (int tries = 0; !status_matches(c, arg); tries++) {
            CHECK(tries < HANG_GUARD_MS / 2);
            nanosleep(&(struct timespec){0, 2000000}, NULL);
        }
    } else if (strcmp(op, "closed") == 0) {
        errno = 0;
        CHECK(baton__read_line(c, line, sizeof line, &deadline) == -1 && errno == ECONNRESET);
    } else if (strcmp(op, "close") == 0) {
        close(c->fd);
        c->fd = -1;
    } else {
        fprintf(stderr, "%s: unknown op %s\n", vector, op);
        exit(1);
    }
}

static void replay(const struct json *v) {
    const char *name = json_get(v, "name")->string;
    const struct json *max_clients = json_get(v, "max_clients");
    struct broker b;
    broker_start_with(&b, (unsigned)json_get(v, "jobs")->number, max_clients ? (unsigned)max_clients->number : 0);
    struct conn conns[MAX_CONNS] = {{0}};
    int *fillers = NULL;
    size_t nfill = 0;
    const struct json *steps = json_get(v, "steps");
    for (size_t i = 0; i < steps->count; i++) step(name, &steps->items[i], conns, b.socket, &fillers, &nfill);
    for (int i = 0; i < MAX_CONNS && conns[i].name; i++) baton_close(conns[i].c);
    for (size_t i = 0; i < nfill; i++) close(fillers[i]);
    free(fillers);
    broker_stop(&b);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    signal(SIGPIPE, SIG_DFL);
    char *text = read_file(argv[1]);
    struct json *doc = json_parse(text);
    const struct json *vectors = json_get(doc, "vectors");
    int replayed = 0;
    for (size_t i = 0; i < vectors->count; i++) {
        replay(&vectors->items[i]);
        printf("vector %s ... ok\n", json_get(&vectors->items[i], "name")->string);
        replayed++;
    }
    CHECK(replayed >= 15);
    printf("clients: %d passed, 0 failed, 0 skipped (C vectors)\n", replayed);
    json_free(doc);
    free(text);
    return 0;
}
