/* The shared-memory fast path (docs/fastpath.md): the region's words, the
 * ring's steps on them, and the host those steps call (futexes, NUDGE on
 * the socket, the broker's liveness word). A port of the Rust code, word
 * for word and step for step: crates/baton-core/src/fastpath/words.rs
 * (the words), crates/baton-core/src/fastpath/ring.rs (the steps), and the
 * host of crates/baton-client (futex calls, `Sleeper`). Only the client's
 * operations are here: the broker's moves (repair, regrant, barrier) are
 * the broker's. */
#ifndef BATON_FASTPATH_H
#define BATON_FASTPATH_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* The region is shared with other processes: its atomics must be the
 * hardware's own, never a lock that lives in one process. */
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to be shared between processes");
_Static_assert(sizeof(_Atomic uint64_t) == 8, "a region's word is 8 bytes");

/* A party, as a slot stores it: 0 for the broker, seat + 1 for a client,
 * in 11 bits (2047 seats). */
#define BATON_FP_BROKER 0u
#define BATON_FP_PARTY_BITS 11
#define BATON_FP_MAX_SEATS ((1u << BATON_FP_PARTY_BITS) - 1)
/* The largest ring: tickets' low 32 bits tell laps apart only while the
 * ring is far smaller than 2^31. */
#define BATON_FP_MAX_CAPACITY ((size_t)1 << 20)
/* The first word of every region: "BATONFP1", little-endian. */
#define BATON_FP_MAGIC 0x3150464e4f544142ull

/* A slot's claim half: who takes the ticket's token. */
enum baton_fp_claim { BATON_FP_UNCLAIMED, BATON_FP_CLAIMED, BATON_FP_TAKEN, BATON_FP_CANCELLED };
/* Its grant half: whether the ticket has its token (STOP: the broker's
 * barrier). */
enum baton_fp_grant { BATON_FP_OPEN, BATON_FP_STOP, BATON_FP_GIVEN };
/* A record's operation in flight. */
enum baton_fp_intent { BATON_FP_IDLE, BATON_FP_TAKING, BATON_FP_RELEASING };

/* A slot's word, decoded (docs/fastpath.md, "The region"). */
struct baton_fp_slot {
    uint32_t gen;              /* the ticket it carries now (low 32 bits) */
    enum baton_fp_claim claim;
    unsigned claimer;          /* a party; 0 while UNCLAIMED */
    enum baton_fp_grant grant;
    unsigned giver;            /* a party, once GIVEN */
    int acked;                 /* GIVEN: the giver's record needs the slot no more */
    int sleeping;              /* the claimer is in, or about to enter, futex_wait */
};

/* A record's word, decoded. */
struct baton_fp_record {
    uint16_t held;             /* tokens the seat holds */
    uint8_t returned;          /* released past the barrier, for the broker to collect */
    enum baton_fp_intent intent;
    uint32_t ticket;           /* TAKING: the ticket's low 24 bits; else 0 */
    uint16_t changes;          /* how many times the record changed, modulo 2^14 */
};

/* Why a word does not decode: none that a correct client or broker writes. */
enum baton_fp_word { BATON_FP_WORD_OK, BATON_FP_BAD_STATE, BATON_FP_BAD_STRAY };

/* The word a compare-and-swap stores. Fields a state does not have (the
 * claimer of an unclaimed slot, the giver and `acked` of one not given)
 * are left out, so that every word packs from one slot only. */
uint64_t baton__fp_slot_pack(const struct baton_fp_slot *s);
/* The slot `word` says, or why no correct party wrote it (`s` is then
 * not to be used). */
enum baton_fp_word baton__fp_slot_unpack(uint64_t word, struct baton_fp_slot *s);
uint64_t baton__fp_record_pack(const struct baton_fp_record *r);
enum baton_fp_word baton__fp_record_unpack(uint64_t word, struct baton_fp_record *r);

/* A region's words as a client maps them, and where its notices go. */
struct baton_ring {
    _Atomic uint64_t *words;   /* NULL: no region */
    size_t capacity;           /* slots in the ring */
    size_t seats;
    int socket;                /* the connection, for NUDGE */
};

/* How an operation in the region ended. The first three are done; the
 * others are refusals (ring.rs's `Refused`): the client then uses the
 * socket for the operation. */
enum baton_fp_outcome {
    BATON_FP_DONE,             /* acquire: a token, now in the seat's record; release: given */
    BATON_FP_RETURNED,         /* release: the barrier stood (or the ring was full): returned, the broker told */
    BATON_FP_TIMED_OUT,        /* acquire: the deadline passed first; the wait is withdrawn */
    BATON_FP_BUSY,             /* TRY: no free token; the client did not join the queue */
    BATON_FP_FULL,             /* every slot is still used by a ticket a lap before */
    BATON_FP_REVOKED,          /* the broker dropped this seat to the socket path */
    BATON_FP_CORRUPT,          /* a word no correct party writes */
    BATON_FP_NOTHING_HELD,     /* a release with no token held */
    BATON_FP_GONE,             /* the broker that made the region is gone */
};

/* Checks the header of the `nwords` words at `words` (mapped by the
 * caller) and fills `r`. 0, or -1 with EPROTO and the reason said. */
int baton__ring_attach(struct baton_ring *r, _Atomic uint64_t *words, size_t nwords);

/* Whether the broker's thread that holds the liveness word (line 1, a
 * robust mutex) still lives: one load. */
int baton__ring_broker_alive(const struct baton_ring *r);

/* The client's operations, as ring.rs's `acquire`, `try_acquire` and
 * `release`. `deadline` (CLOCK_MONOTONIC, NULL: none) bounds a wait. */
enum baton_fp_outcome baton__ring_acquire(const struct baton_ring *r, unsigned seat, const struct timespec *deadline);
enum baton_fp_outcome baton__ring_try_acquire(const struct baton_ring *r, unsigned seat);
enum baton_fp_outcome baton__ring_release(const struct baton_ring *r, unsigned seat);

/* The host's calls, shared by the ring and the pile. */
struct timespec baton__fp_now(void);
int baton__fp_before(const struct timespec *a, const struct timespec *b);
/* Sleeps while the low half of `word` is `expected`, a second at most
 * (to look at the broker's liveness), or until `deadline`. */
void baton__fp_wait(_Atomic uint64_t *word, uint32_t expected, const struct timespec *deadline);
/* Wakes one process waiting on `word`; whether there was one. */
int baton__fp_wake_one(_Atomic uint64_t *word);
/* NUDGE on the connection: the broker looks at the region. */
void baton__fp_nudge(int socket);

/* --- The pile (docs/fastpath.md, "The pile"): a port of
 * crates/baton-core/src/fastpath/pile.rs, step for step. */

/* The first word of a pile: "BATONPL1", little-endian. */
#define BATON_PILE_MAGIC 0x314c504e4f544142ull
#define BATON_PILE_MAX_TOKENS 4096u
#define BATON_PILE_MAX_SEATS 2047u

/* A pile's words as a client maps them, and where its notices go. */
struct baton_pile {
    _Atomic uint64_t *words;   /* NULL: no pile */
    size_t tokens;             /* token words */
    size_t seats;
    int socket;                /* the connection, for NUDGE */
};

/* How an operation on a pile ended (pile.rs's `Acquired`, `Released` and
 * `Refused`). */
enum baton_pile_outcome {
    BATON_PILE_TOKEN,          /* acquire: `*token` now names the seat */
    BATON_PILE_PILED,          /* release: back on the pile */
    BATON_PILE_TO_BROKER,      /* release: recalled, the broker's now (it was told) */
    BATON_PILE_TIMED_OUT,      /* acquire: the deadline passed first */
    BATON_PILE_BUSY,           /* TRY: no token on the pile */
    BATON_PILE_NOT_HELD,       /* release: the seat does not hold that token */
    BATON_PILE_GONE,           /* the broker that made the pile is gone */
};

/* Checks a pile's header; 0, or -1 with EPROTO and the reason said. */
int baton__pile_attach(struct baton_pile *p, _Atomic uint64_t *words, size_t nwords);
/* Whether the broker's thread holding the liveness word still lives. */
int baton__pile_broker_alive(const struct baton_pile *p);
/* Takes a token (`try_only`: only if one is free now), waiting until
 * `deadline` (CLOCK_MONOTONIC, NULL: none). */
enum baton_pile_outcome baton__pile_acquire(const struct baton_pile *p, unsigned seat, int try_only,
                                            const struct timespec *deadline, size_t *token);
/* Gives token `token` back. */
enum baton_pile_outcome baton__pile_release(const struct baton_pile *p, unsigned seat, size_t token);

#endif
