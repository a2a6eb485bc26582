/* The pile: a client's operations, as crates/baton-core/src/fastpath/
 * pile.rs's machines run them (`Acquire`, `Release`, `Ring`), each atomic
 * access in the same order, so that the model test's proof of those
 * machines holds for this port too. Only the client's side is here: the
 * broker's moves (lend, recall, seize, repair) are the broker's. */
#include <errno.h>
#include <linux/futex.h>
#include <string.h>

#include "internal.h"

/* The layout (pile.rs): word 0 the magic, word 1 the sizes (tokens in the
 * low 32 bits, seats above), words 2 to 6 the liveness word (a robust
 * mutex the broker holds), word 7 the closed word, word 8 the bell, then
 * a word per token and a record word per seat. */
#define SIZES 1
#define LIVENESS 2
#define CLOSED 7
#define BELL 8
#define TOKENS 16

/* A token word: 0 free, seat + 1 held, plus RECALL; BROKER taken out. */
#define FREE 0ull
#define RECALL (1ull << 16)
#define BROKER (1ull << 17)
/* A record word: counted among the bell's sleepers. */
#define COUNTED 1ull

/* The bell: the sequence sleepers wait on (low 32 bits), their count,
 * and the marks of a wake-up in flight (PENDING) and of a token freed
 * while it was (DIRTY). */
#define SEQ_MASK 0xffffffffull
#define SLEEPER (1ull << 32)
#define SLEEPERS_MASK (((1ull << 30) - 1) << 32)
#define DIRTY (1ull << 62)
#define PENDING (1ull << 63)

static _Atomic uint64_t *bell(const struct baton_pile *p) { return &p->words[BELL]; }
static _Atomic uint64_t *token_word(const struct baton_pile *p, size_t i) { return &p->words[TOKENS + i]; }
static _Atomic uint64_t *record(const struct baton_pile *p, unsigned seat) {
    return &p->words[TOKENS + p->tokens + seat];
}

static int cas(_Atomic uint64_t *word, uint64_t old, uint64_t new) {
    return atomic_compare_exchange_strong(word, &old, new);
}

int baton__pile_attach(struct baton_pile *p, _Atomic uint64_t *words, size_t nwords) {
    if (nwords < TOKENS || atomic_load(&words[0]) != BATON_PILE_MAGIC) {
        errno = EPROTO;
        baton__say("the broker's region is not a baton pile of this version");
        return -1;
    }
    uint64_t sizes = atomic_load(&words[SIZES]);
    size_t tokens = (size_t)(sizes & SEQ_MASK), seats = (size_t)(sizes >> 32);
    if (tokens < 1 || tokens > BATON_PILE_MAX_TOKENS || seats < 1 || seats > BATON_PILE_MAX_SEATS ||
        nwords < TOKENS + tokens + seats) {
        errno = EPROTO;
        baton__say("the broker's pile says %zu tokens and %zu seats in %zu words", tokens, seats, nwords);
        return -1;
    }
    *p = (struct baton_pile){.words = words, .tokens = tokens, .seats = seats, .socket = p->socket};
    return 0;
}

int baton__pile_broker_alive(const struct baton_pile *p) {
    uint32_t word = (uint32_t)atomic_load(&p->words[LIVENESS]);
    return (word & FUTEX_TID_MASK) != 0 && (word & FUTEX_OWNER_DIED) == 0;
}

/* Takes the first free token for `me` (Take's steps): its index, or -1. */
static long take_any(const struct baton_pile *p, uint64_t me) {
    for (size_t i = 0; i < p->tokens; i++)
        if (cas(token_word(p, i), FREE, me)) return (long)i;
    return -1;
}

/* Whether any token lies free (Look's and PassLook's steps). */
static int any_free(const struct baton_pile *p) {
    for (size_t i = 0; i < p->tokens; i++)
        if (atomic_load(token_word(p, i)) == FREE) return 1;
    return 0;
}

/* Rings the bell (pile.rs's `Ring`): wakes one sleeper unless nobody
 * sleeps or a wake-up is in flight, in which case it marks the bell
 * dirty for whoever clears the mark; a wake that found nobody clears the
 * mark, and looks again if it was dirty. */
static void ring(const struct baton_pile *p) {
    for (;;) {
        uint64_t old = atomic_load(bell(p));
        if ((old & SLEEPERS_MASK) == 0 || (old & DIRTY)) return;
        if (old & PENDING) {
            if (cas(bell(p), old, old | DIRTY)) return;
            continue;
        }
        uint64_t next = (old & SLEEPERS_MASK) | PENDING | (uint64_t)(uint32_t)((uint32_t)old + 1);
        if (!cas(bell(p), old, next)) continue;
        if (baton__fp_wake_one(bell(p))) return;
        uint64_t was = atomic_fetch_and(bell(p), ~(PENDING | DIRTY));
        if (!(was & DIRTY) || !any_free(p)) return;
    }
}

/* Whoever cleared a dirty mark rings for a token freed while it stood. */
static void pass_on(const struct baton_pile *p, int cleared) {
    if (cleared && any_free(p)) ring(p);
}

/* Out of the sleepers' count: record first, then the bell. */
static void uncount(const struct baton_pile *p, unsigned seat) {
    atomic_store(record(p, seat), 0);
    atomic_fetch_sub(bell(p), SLEEPER);
}

enum baton_pile_outcome baton__pile_acquire(const struct baton_pile *p, unsigned seat, int try_only,
                                            const struct timespec *deadline, size_t *token) {
    uint64_t me = (uint64_t)seat + 1;
    int cleared = 0;
    for (;;) {
        long got = take_any(p, me);
        if (got >= 0) {
            *token = (size_t)got;
            pass_on(p, cleared);
            return BATON_PILE_TOKEN;
        }
        if (try_only) {
            pass_on(p, cleared);
            return BATON_PILE_BUSY;
        }
        uint32_t seq = (uint32_t)atomic_load(bell(p));
        atomic_fetch_add(bell(p), SLEEPER);
        atomic_store(record(p, seat), COUNTED);
        got = take_any(p, me);
        if (got >= 0) {
            *token = (size_t)got;
            uncount(p, seat);
            pass_on(p, cleared);
            return BATON_PILE_TOKEN;
        }
        /* Asleep. A pile the broker closed gets its tokens from the pool's
         * queue: the broker asks for one when told that somebody sleeps. */
        if (atomic_load(&p->words[CLOSED]) != 0) baton__fp_nudge(p->socket);
        baton__fp_wait(bell(p), seq, deadline);
        struct timespec at = baton__fp_now();
        int late = deadline && !baton__fp_before(&at, deadline);
        int gone = !baton__pile_broker_alive(p);
        uncount(p, seat);
        /* Clearing the mark of the wake-up that may have been its own. */
        cleared = (atomic_fetch_and(bell(p), ~(PENDING | DIRTY)) & DIRTY) != 0;
        if (gone || late) {
            pass_on(p, cleared);
            return gone ? BATON_PILE_GONE : BATON_PILE_TIMED_OUT;
        }
    }
}

enum baton_pile_outcome baton__pile_release(const struct baton_pile *p, unsigned seat, size_t token) {
    uint64_t me = (uint64_t)seat + 1;
    if (token >= p->tokens) return BATON_PILE_NOT_HELD;
    uint64_t now = me;
    if (atomic_compare_exchange_strong(token_word(p, token), &now, FREE)) {
        ring(p);
        return BATON_PILE_PILED;
    }
    if (now != (me | RECALL) || !cas(token_word(p, token), me | RECALL, BROKER)) return BATON_PILE_NOT_HELD;
    baton__fp_nudge(p->socket);
    return BATON_PILE_TO_BROKER;
}
