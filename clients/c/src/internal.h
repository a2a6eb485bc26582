/* What the library's files share: the connection and the wire. */
#ifndef BATON_INTERNAL_H
#define BATON_INTERNAL_H

#include <stddef.h>
#include <time.h>

#include "baton.h"
#include "fastpath.h"

/* A request line is at most 256 bytes; a reply line (an ERR message
 * included) stays well below this. */
#define BATON_LINE_MAX 1024

/* baton_errmsg()'s buffer: a socket path, a reply line and words around
 * them. */
#define BATON_MSG_MAX 2048

/* A connection's seat in its build's fast-path region (baton_fastpath()). */
struct baton_seat {
    struct baton_ring ring;     /* ring.words NULL: no seat, the socket for everything */
    size_t bytes;               /* the mapping's length */
    unsigned seat;
    unsigned held;              /* tokens held through the region (its record says the same) */
    /* A pile instead of a ring (FASTPATH 2): ring.words still marks the
     * seat (the mapping), and `tokens` lists the words this seat holds. */
    int is_pile;
    struct baton_pile pile;
    uint16_t *tokens;
};

struct baton {
    int fd;
    unsigned limit;
    unsigned held;              /* tokens the broker's books hold on the connection */
    struct baton_seat fast;
    size_t len;                 /* bytes in buf not yet consumed */
    char buf[4096];
    char refusal[BATON_LINE_MAX];
};

/* One decoded reply line. kind: "OK", "GRANTED", "ERR", ...; num: its
 * numbers; code, message: for ERR. Points into the line it came from. */
struct baton_reply {
    const char *kind;
    unsigned long long num[3];
    int count;
    const char *code;
    const char *message;
};

/* Sets this thread's baton_errmsg() (printf-style); errno is kept. Every
 * failure of a public function says something here, at the place that
 * knows what went wrong. */
void baton__say(const char *format, ...) __attribute__((format(printf, 1, 2)));

/* Decodes `line` (no newline; modified in place). 0, or -1 with EPROTO. */
int baton__parse_reply(char *line, struct baton_reply *r);

/* The errno a refusal's code stands for. */
int baton__errno_of(const char *code);

/* Writes all of `data`; -1 with ETIMEDOUT, ECONNRESET, ... */
int baton__send(baton_t *c, const char *data, size_t len, const struct timespec *deadline);

/* Reads the next line into `line` (newline stripped, NUL-terminated).
 * Returns its length; -1 with ETIMEDOUT, ECONNRESET (end of file), EPROTO
 * (longer than `size`). */
int baton__read_line(baton_t *c, char *line, size_t size, const struct timespec *deadline);

/* Reads exactly `len` bytes. */
int baton__read_exact(baton_t *c, char *out, size_t len, const struct timespec *deadline);

/* Reads and decodes the next reply. An ERR reply is kept in c->refusal
 * and returns -1 with errno from its code. GRANTED and RELEASED update
 * c->held. */
int baton__read_reply(baton_t *c, char *line, size_t size, struct baton_reply *r, const struct timespec *deadline);

/* Sends `request` and reads its reply, which must be of kind `want` (or,
 * if not NULL, `also`). */
int baton__call(baton_t *c, const char *request, const char *want, const char *also, char *line, size_t size,
                struct baton_reply *r, const struct timespec *deadline);

/* Waits in poll() for `events` on fd until the deadline: 0, or -1 with
 * ETIMEDOUT. */
int baton__wait(int fd, short events, const struct timespec *deadline);

/* One operation in the region, for a connection with a seat, as the Rust
 * client's `on_fastpath` does it: 1 when done there; 0 when the socket
 * must do it (no seat; or the region refused, changing nothing: no token
 * free for a TRY, a full ring, nothing held; or the seat is given up for
 * good, what it held moved to c->held: revoked, the broker gone, a
 * corrupt word). baton__fast_acquire also returns -1 with ETIMEDOUT when
 * the deadline passed first (the wait withdrawn). */
int baton__fast_acquire(baton_t *c, const struct timespec *deadline);
int baton__fast_try_acquire(baton_t *c);
int baton__fast_release(baton_t *c);

/* Unmaps the region, if any (the seat is the broker's to repair when the
 * connection closes). */
void baton__fast_drop(baton_t *c);

#endif
