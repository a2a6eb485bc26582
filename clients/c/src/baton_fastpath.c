/* A seat in the shared-memory fast path (docs/fastpath.md; FASTPATH in
 * docs/protocol.md), and what a connection does with it, as the Rust
 * client does (crates/baton-client/src/lib.rs: enable_fastpath,
 * on_fastpath; its fastpath.rs: receive_with_fd, Mapping::map). The
 * ring's steps are fastpath_ring.c's. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* The seals a region must carry before it is mapped: nobody may shrink it
 * (a mapping past the end of a file raises SIGBUS), grow it, or change
 * its seals again. */
#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* Room for a few descriptors: one is sent; more would be closed. */
#define FDS_MAX 4

/* Keeps the first descriptor of an SCM_RIGHTS message in `*region`, and
 * closes any other: nothing else may leak into the process. */
static void take_descriptors(struct msghdr *msg, int *region) {
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(msg); cmsg; cmsg = CMSG_NXTHDR(msg, cmsg)) {
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
        size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof fd, sizeof fd);
            if (*region < 0)
                *region = fd;
            else
                close(fd);
        }
    }
}

/* Reads into c->buf until a whole line is there, with recvmsg: the
 * descriptor that rides with the reply's first byte (SCM_RIGHTS, unix(7))
 * comes out in `*region`, close-on-exec as it arrives. A plain recv would
 * discard it. */
static int receive_with_fd(baton_t *c, int *region) {
    while (!memchr(c->buf, '\n', c->len)) {
        if (c->len == sizeof c->buf) {
            errno = EPROTO;
            baton__say("unexpected reply from the broker: %zu bytes without a newline", c->len);
            return -1;
        }
        if (baton__wait(c->fd, POLLIN, NULL) < 0) return -1;
        union {
            struct cmsghdr align;
            char bytes[CMSG_SPACE(FDS_MAX * sizeof(int))];
        } control;
        struct iovec iov = {.iov_base = c->buf + c->len, .iov_len = sizeof c->buf - c->len};
        struct msghdr msg = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.bytes, .msg_controllen = sizeof control.bytes};
        ssize_t n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n < 0) {
            baton__say("reading from the broker: %s", strerror(errno));
            return -1;
        }
        take_descriptors(&msg, region);
        if (n == 0) {
            errno = ECONNRESET;
            baton__say("the broker closed the connection");
            return -1;
        }
        c->len += (size_t)n;
    }
    return 0;
}

/* Maps the region `fd` names, once sure that nobody can resize it, and
 * checks its layout. */
static int map_region(int fd, struct baton_seat *fast) {
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        baton__say("the broker's region: F_GET_SEALS: %s", strerror(errno));
        return -1;
    }
    if ((seals & SEALS) != SEALS) {
        errno = EPROTO;
        baton__say("the broker's region is not sealed against resizing (seals %#x): refusing to map it", seals);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        baton__say("the broker's region: fstat: %s", strerror(errno));
        return -1;
    }
    if (st.st_size <= 0 || st.st_size % 8 != 0) {
        errno = EPROTO;
        baton__say("the broker's region is %lld bytes, not whole 8-byte words", (long long)st.st_size);
        return -1;
    }
    size_t len = (size_t)st.st_size;
    void *words = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (words == MAP_FAILED) {
        baton__say("mapping the broker's region (%zu bytes): %s", len, strerror(errno));
        return -1;
    }
    int attached;
    if (atomic_load((_Atomic uint64_t *)words) == BATON_PILE_MAGIC) {
        fast->is_pile = 1;
        attached = baton__pile_attach(&fast->pile, words, len / 8);
        fast->tokens = attached == 0 ? calloc(fast->pile.tokens, sizeof *fast->tokens) : NULL;
        if (attached == 0 && !fast->tokens) {
            baton__say("no memory for a pile of %zu tokens", fast->pile.tokens);
            attached = -1;
        }
        fast->ring.words = words;
    } else {
        attached = baton__ring_attach(&fast->ring, words, len / 8);
    }
    if (attached < 0) {
        int e = errno;
        munmap(words, len);
        errno = e;
        return -1;
    }
    /* A child this process forks must not use a seat it does not own:
     * the region is not mapped there. */
    madvise(words, len, MADV_DONTFORK);
    fast->bytes = len;
    return 0;
}

/* Takes the seat a FASTPATH reply offers, with the region's descriptor:
 * a region of the layout `version` asked for. */
static int take_seat(baton_t *c, const struct baton_reply *r, int region, int version) {
    if (strcmp(r->kind, "FASTPATH") != 0) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %s where FASTPATH was due", r->kind);
        return -1;
    }
    if (region < 0) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: FASTPATH came without the region's descriptor");
        return -1;
    }
    if (r->num[0] > UINT16_MAX) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: seat %llu out of range", r->num[0]);
        return -1;
    }
    struct baton_seat fast = {.seat = (unsigned)r->num[0]};
    if (map_region(region, &fast) < 0) return -1;
    fast.ring.socket = c->fd;
    fast.pile.socket = c->fd;
    c->fast = fast;
    if (fast.is_pile != (version == 2)) {
        baton__fast_drop(c);
        errno = EPROTO;
        baton__say("FASTPATH %d came with a region of the other layout", version);
        return -1;
    }
    return 0;
}

/* FASTPATH `version`, and the region that comes with its answer. */
static int ask_for_a_seat(baton_t *c, int version) {
    if (c->fast.ring.words) return 0; /* seated already (the broker gives a connection one seat) */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    errno = ENOTSUP;
    baton__say("the fast path's region is little-endian, and this machine is not: the connection stays on the socket");
    return -1;
#endif
    if (c->len > 0) { /* the descriptor rides with its own reply: nothing may be before it */
        errno = EPROTO;
        baton__say("a reply is unread: FASTPATH must come alone");
        return -1;
    }
    char request[16];
    int len = snprintf(request, sizeof request, "FASTPATH %d\n", version);
    if (baton__send(c, request, (size_t)len, NULL) < 0) return -1;
    int region = -1, rc = -1;
    char line[BATON_LINE_MAX];
    struct baton_reply r;
    if (receive_with_fd(c, &region) == 0 && baton__read_reply(c, line, sizeof line, &r, NULL) == 0)
        rc = take_seat(c, &r, region, version);
    if (region >= 0) { /* mapped, or refused: either way the descriptor is done with */
        int e = errno;
        close(region);
        errno = e;
    }
    return rc;
}

int baton_fastpath(baton_t *c) { return ask_for_a_seat(c, 1); }

int baton_fastpath_pile(baton_t *c) { return ask_for_a_seat(c, 2); }

int baton_uses_fastpath(const baton_t *c) { return c->fast.ring.words != NULL; }

void baton__fast_drop(baton_t *c) {
    if (!c->fast.ring.words) return;
    munmap((void *)c->fast.ring.words, c->fast.bytes);
    free(c->fast.tokens);
    c->fast = (struct baton_seat){.ring.words = NULL};
}

/* The seat is given up: what it held is the connection's (the broker
 * booked it there as it let go of the region). */
static void give_up(baton_t *c) {
    c->held += c->fast.held;
    baton__fast_drop(c);
}

/* What the connection makes of an outcome in the region: 1 if the
 * operation happened there, 0 if the socket must do it. A seat revoked,
 * a broker gone or a corrupt region is given up for good, and what the
 * seat held becomes the connection's (a revoking broker booked it there). */
static int settle(baton_t *c, enum baton_fp_outcome outcome) {
    switch (outcome) {
    case BATON_FP_DONE:
    case BATON_FP_RETURNED:
    case BATON_FP_TIMED_OUT: return 1;
    case BATON_FP_BUSY:
    case BATON_FP_FULL:
    case BATON_FP_NOTHING_HELD: return 0;
    default: give_up(c); return 0;
    }
}

/* Before each operation: a broker that is gone would never serve the
 * region again. */
static int usable(const baton_t *c) {
    return c->fast.is_pile ? baton__pile_broker_alive(&c->fast.pile) : baton__ring_broker_alive(&c->fast.ring);
}

/* An acquire on a pile: 1 done there, 0 for the socket, -1 timed out. */
static int pile_acquire(baton_t *c, int try_only, const struct timespec *deadline) {
    size_t token = 0;
    enum baton_pile_outcome got = usable(c) ? baton__pile_acquire(&c->fast.pile, c->fast.seat, try_only, deadline, &token)
                                            : BATON_PILE_GONE;
    switch (got) {
    case BATON_PILE_TOKEN: c->fast.tokens[c->fast.held++] = (uint16_t)token; return 1;
    case BATON_PILE_TIMED_OUT:
        errno = ETIMEDOUT;
        baton__say("the deadline passed before a token came (fast path): nothing is held for the wait");
        return -1;
    case BATON_PILE_BUSY: return 0;
    default: give_up(c); return 0;
    }
}

/* A release of the last token taken on a pile: 1 done, 0 for the socket. */
static int pile_release(baton_t *c) {
    if (c->fast.held == 0) return 0;
    size_t token = c->fast.tokens[c->fast.held - 1];
    enum baton_pile_outcome done =
        usable(c) ? baton__pile_release(&c->fast.pile, c->fast.seat, token) : BATON_PILE_GONE;
    if (done != BATON_PILE_PILED && done != BATON_PILE_TO_BROKER) {
        give_up(c);
        return 0;
    }
    c->fast.held--;
    return 1;
}

int baton__fast_acquire(baton_t *c, const struct timespec *deadline) {
    if (!c->fast.ring.words) return 0;
    if (c->fast.is_pile) return pile_acquire(c, 0, deadline);
    enum baton_fp_outcome got =
        usable(c) ? baton__ring_acquire(&c->fast.ring, c->fast.seat, deadline) : BATON_FP_GONE;
    if (!settle(c, got)) return 0;
    if (got == BATON_FP_TIMED_OUT) {
        errno = ETIMEDOUT;
        baton__say("the deadline passed before a token came (fast path): the wait was withdrawn, nothing is held "
                   "for it");
        return -1;
    }
    c->fast.held++;
    return 1;
}

int baton__fast_try_acquire(baton_t *c) {
    if (!c->fast.ring.words) return 0;
    if (c->fast.is_pile) return pile_acquire(c, 1, NULL) == 1;
    enum baton_fp_outcome got = usable(c) ? baton__ring_try_acquire(&c->fast.ring, c->fast.seat) : BATON_FP_GONE;
    if (!settle(c, got)) return 0;
    c->fast.held++;
    return 1;
}

int baton__fast_release(baton_t *c) {
    if (!c->fast.ring.words) return 0;
    if (c->fast.is_pile) return pile_release(c);
    enum baton_fp_outcome done = usable(c) ? baton__ring_release(&c->fast.ring, c->fast.seat) : BATON_FP_GONE;
    if (!settle(c, done)) return 0;
    c->fast.held--;
    return 1;
}
