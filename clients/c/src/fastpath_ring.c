/* The ring: a client's operations in the region, step by step as
 * crates/baton-core/src/fastpath/ring.rs does them (the same words, the
 * same steps, in the same order; each step is one atomic operation on one
 * word, plus the retries of a compare-and-swap that others raced), and
 * the host those steps call, as crates/baton-client's `Sleeper`: futexes
 * on a slot's low half, NUDGE on the socket, the broker's liveness word.
 * Every access is sequentially consistent, as the model assumes.
 *
 * Tickets are 64-bit here and in the hints; a slot keeps the low 32 bits
 * (`gen`). Slot t % capacity carries ticket t once somebody touched it:
 * until then it still carries ticket t - capacity, and it may be taken
 * over only once that ticket is finished (both halves done, the giver's
 * acknowledgement in). */
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fastpath.h"
#include "internal.h"

/* Words in a 64-byte line: the header's fields and each seat get a line
 * of their own, so that no two writers share one. */
#define LINE 8
/* Header words (line 0): magic, capacity, seats, tokens lent. */
#define CAPACITY 1
#define SEATS 2
/* Line 1: the broker's liveness word, a robust mutex. */
#define LIVENESS LINE
/* No ticket before the `tail` hint is unclaimed; none before `serve`
 * awaits a token. Hints only say where a search starts. */
#define TAIL (2 * LINE)
#define SERVE (3 * LINE)
/* Where the ring starts; the seats' lines follow it. */
#define RING (4 * LINE)
/* A seat's line: its record, then the broker's revoked flag. */
#define RECORD 0
#define REVOKED 1

/* "Go on": a step that neither finished nor was refused. */
#define OK BATON_FP_DONE

/* Where a client may stop for good, killed, between two of its steps.
 * Nothing here: tests/test_ring.c compiles this file with its own
 * definition, which abandons the client there, to check that every prefix
 * of its steps leaves each token where the region says it is. */
#ifndef BATON_FP_BETWEEN_STEPS
#define BATON_FP_BETWEEN_STEPS() ((void)0)
#endif

/* How long a waiter sleeps before it looks whether the broker still
 * lives: a killed broker cannot wake it. */
#define LOOK_AT_THE_BROKER_EVERY_NS 1000000000L

typedef uint64_t ticket_t;

/* Where a client is in its operation (the model's `Phase`). */
enum phase {
    CLAIM,      /* acquire: about to claim the first unclaimed ticket */
    CHECK,      /* acquire: claimed a ticket that had no token: about to look again */
    ASLEEP,     /* acquire: in futex_wait on the ticket's slot */
    TAKE,       /* acquire: the ticket has its token: about to count it in `held` */
    ACK_TAKEN,  /* acquire: `held` counts it: about to mark the slot taken */
    HAND,       /* release: about to move one token from `held` into the intent */
    GRANT,      /* release: about to give it to the first ticket awaiting one */
    RETURN,     /* release: met the barrier: about to return it through `returned` */
    WAKE,       /* release: gave the ticket its token: about to wake its claimer */
    SETTLE,     /* release: about to clear the intent */
    ACK_GRANT,  /* release: about to acknowledge the grant in the slot */
    DONE,
};

/* Which lap a ticket's slot carries. */
enum lap { THIS, EARLIER, LATER };

static uint64_t load(_Atomic uint64_t *word) { return atomic_load(word); }

static int cas(_Atomic uint64_t *word, uint64_t old, uint64_t new) {
    return atomic_compare_exchange_strong(word, &old, new);
}

static _Atomic uint64_t *slot_word(const struct baton_ring *r, ticket_t t) {
    return &r->words[RING + t % r->capacity];
}

static _Atomic uint64_t *seat_word(const struct baton_ring *r, unsigned seat, size_t field) {
    return &r->words[RING + r->capacity + (size_t)seat * LINE + field];
}

static unsigned party_of(unsigned seat) { return seat + 1; }

static int is_granted(const struct baton_fp_slot *s) { return s->grant == BATON_FP_GIVEN; }

/* Whether a slot's ticket needs it no more: both halves done, and the
 * giver's acknowledgement in (the broker's grants need none). */
static int finished(const struct baton_fp_slot *s) {
    int claim_done = s->claim == BATON_FP_TAKEN || s->claim == BATON_FP_CANCELLED;
    int grant_done = s->grant == BATON_FP_GIVEN  ? s->acked
                     : s->grant == BATON_FP_OPEN ? s->claim == BATON_FP_CANCELLED
                                                 : 0;
    return claim_done && grant_done;
}

/* Whether the next grant lands on this slot. The barrier stays where it
 * stands even if its ticket's claimer gives up: only the broker moves it. */
static int awaits_grant(const struct baton_fp_slot *s) {
    switch (s->grant) {
    case BATON_FP_STOP: return 1;
    case BATON_FP_OPEN: return s->claim != BATON_FP_CANCELLED;
    default: return 0;
    }
}

static const struct baton_fp_slot EMPTY = {.claim = BATON_FP_UNCLAIMED, .grant = BATON_FP_OPEN};

/* `slot` as ticket t's fresh word: nobody sleeps on it yet. */
static uint64_t fresh(ticket_t t, struct baton_fp_slot slot) {
    slot.gen = (uint32_t)t;
    slot.sleeping = 0;
    return baton__fp_slot_pack(&slot);
}

/* A 32-bit difference read as signed, without the implementation-defined
 * conversion. */
static int64_t signed32(uint32_t d) { return d < 0x80000000u ? (int64_t)d : (int64_t)d - 0x100000000ll; }

/* Ticket t's slot: its word as read, decoded, and which lap it carries. */
static enum baton_fp_outcome lap(const struct baton_ring *r, ticket_t t, uint64_t *raw, struct baton_fp_slot *word,
                                 enum lap *which) {
    *raw = load(slot_word(r, t));
    if (baton__fp_slot_unpack(*raw, word) != BATON_FP_WORD_OK) return BATON_FP_CORRUPT;
    int64_t ahead = signed32(word->gen - (uint32_t)t);
    if (ahead == 0)
        *which = THIS;
    else if (ahead == -(int64_t)r->capacity)
        *which = EARLIER;
    else if (ahead > 0)
        *which = LATER;
    else
        return BATON_FP_CORRUPT;
    return OK;
}

/* Moves a hint from t to t + 1, unless somebody already moved it. */
static void pass(const struct baton_ring *r, size_t hint, ticket_t t) { cas(&r->words[hint], t, t + 1); }

static ticket_t hint(const struct baton_ring *r, size_t which) { return load(&r->words[which]); }

/* Changes ticket t's slot with `change` (given its current slot; 0 leaves
 * it alone) in one compare-and-swap, retried while others change the word
 * under it. `*changed` says whether it stored. */
static enum baton_fp_outcome update_slot(const struct baton_ring *r, ticket_t t,
                                         int (*change)(struct baton_fp_slot *, unsigned), unsigned me, int *changed) {
    for (;;) {
        uint64_t raw;
        struct baton_fp_slot word;
        enum lap which;
        enum baton_fp_outcome rc = lap(r, t, &raw, &word, &which);
        if (rc != OK) return rc;
        if (which != THIS) return BATON_FP_CORRUPT;
        struct baton_fp_slot next = word;
        if (!change(&next, me)) {
            *changed = 0;
            return OK;
        }
        if (cas(slot_word(r, t), raw, baton__fp_slot_pack(&next))) {
            *changed = 1;
            return OK;
        }
    }
}

/* Changes `seat`'s record with `change`, moving its change count on; one
 * compare-and-swap, retried if the broker collected `returned` meanwhile.
 * A plain store would lose what the broker did in between. */
static enum baton_fp_outcome update_record(const struct baton_ring *r, unsigned seat,
                                           void (*change)(struct baton_fp_record *, void *), void *arg) {
    _Atomic uint64_t *word = seat_word(r, seat, RECORD);
    for (;;) {
        uint64_t raw = load(word);
        struct baton_fp_record record;
        if (baton__fp_record_unpack(raw, &record) != BATON_FP_WORD_OK) return BATON_FP_CORRUPT;
        struct baton_fp_record next = record;
        change(&next, arg);
        next.changes = (uint16_t)((record.changes + 1) & ((1u << 14) - 1));
        if (cas(word, raw, baton__fp_record_pack(&next))) return OK;
    }
}

static int revoked(const struct baton_ring *r, unsigned seat) { return load(seat_word(r, seat, REVOKED)) != 0; }

/* --- The host: the world outside the region. Each keeps errno as it was,
 * so that a call that succeeds leaves it alone. */

/* The low 32 bits of a slot's word, on which its claimer sleeps (futex(2)
 * waits on 32 bits; every grant changes these). */
static uint32_t *low_half(_Atomic uint64_t *word) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)(void *)word + 1;
#else
    return (uint32_t *)(void *)word;
#endif
}

struct timespec baton__fp_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t;
}

int baton__fp_before(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

/* Sleeps while the low half of `word` is `expected`: until a wake, a
 * signal, the deadline, a second at most (to look at the broker's
 * liveness), or for no reason (the caller looks again). Not
 * FUTEX_PRIVATE_FLAG: the word is shared between processes. */
void baton__fp_wait(_Atomic uint64_t *word, uint32_t expected, const struct timespec *deadline) {
    int e = errno;
    struct timespec start = baton__fp_now(), until = start;
    until.tv_nsec += LOOK_AT_THE_BROKER_EVERY_NS % 1000000000L;
    until.tv_sec += LOOK_AT_THE_BROKER_EVERY_NS / 1000000000L + until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    if (deadline && baton__fp_before(deadline, &until)) until = *deadline;
    struct timespec left = {0, 0};
    if (baton__fp_before(&start, &until)) {
        left.tv_sec = until.tv_sec - start.tv_sec;
        left.tv_nsec = until.tv_nsec - start.tv_nsec;
        if (left.tv_nsec < 0) {
            left.tv_sec--;
            left.tv_nsec += 1000000000L;
        }
    }
    syscall(SYS_futex, low_half(word), FUTEX_WAIT, expected, &left, NULL, 0);
    errno = e;
}

/* Wakes one client that waits on `word` (a slot's: its claimer); whether
 * there was one. */
int baton__fp_wake_one(_Atomic uint64_t *word) {
    int e = errno;
    long woken = syscall(SYS_futex, low_half(word), FUTEX_WAKE, 1, NULL, NULL, 0);
    errno = e;
    return woken > 0;
}

static void host_wake(_Atomic uint64_t *word) { baton__fp_wake_one(word); }

/* Tells the broker to look at the region: a claim behind its barrier, or
 * a token returned through the record. Either notice asks the same, so
 * both are NUDGE. A failure is not ours to report: a broker that is gone
 * is found at the next operation. */
static void host_tell(const struct baton_ring *r) { baton__fp_nudge(r->socket); }

void baton__fp_nudge(int socket) {
    int e = errno;
    static const char nudge[] = "NUDGE\n";
    size_t sent = 0;
    while (sent < sizeof nudge - 1) {
        ssize_t n = send(socket, nudge + sent, sizeof nudge - 1 - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        sent += (size_t)n;
    }
    errno = e;
}

int baton__ring_broker_alive(const struct baton_ring *r) {
    uint32_t word = (uint32_t)load(&r->words[LIVENESS]);
    return (word & FUTEX_TID_MASK) != 0 && (word & FUTEX_OWNER_DIED) == 0;
}

/* --- The searches. */

/* Claims the first unclaimed ticket for `me`, if it has its token or
 * `only_granted` is 0: the ticket and the slot as it left it in `*t` and
 * `*claimed`; `*found` 0 if the first unclaimed one had no token and a
 * token was wanted. */
static enum baton_fp_outcome claim_first(const struct baton_ring *r, unsigned me, int only_granted, ticket_t *t,
                                         struct baton_fp_slot *claimed, int *found) {
    for (;;) {
        ticket_t at = hint(r, TAIL);
        uint64_t raw;
        struct baton_fp_slot word, slot;
        enum lap which;
        enum baton_fp_outcome rc = lap(r, at, &raw, &word, &which);
        if (rc != OK) return rc;
        if (which == LATER || (which == THIS && word.claim != BATON_FP_UNCLAIMED)) {
            pass(r, TAIL, at);
            continue;
        }
        if (which == THIS)
            slot = word;
        else if (finished(&word))
            slot = EMPTY;
        else
            return BATON_FP_FULL;
        if (only_granted && !is_granted(&slot)) {
            *found = 0;
            return OK;
        }
        slot.claim = BATON_FP_CLAIMED;
        slot.claimer = me;
        if (cas(slot_word(r, at), raw, fresh(at, slot))) {
            pass(r, TAIL, at);
            *t = at;
            *claimed = slot;
            *found = 1;
            return OK;
        }
    }
}

/* The release's grant: the token in flight goes to the first ticket
 * awaiting one (`*t`, `*stopped` 0), or back to the broker if that ticket
 * is its barrier (`*stopped` 1). A full ring refuses, nothing changed. */
static enum baton_fp_outcome give(const struct baton_ring *r, unsigned me, ticket_t *t, int *stopped) {
    ticket_t at = hint(r, SERVE);
    for (;;) {
        uint64_t raw;
        struct baton_fp_slot word;
        enum lap which;
        enum baton_fp_outcome rc = lap(r, at, &raw, &word, &which);
        if (rc != OK) return rc;
        int awaits = 0;
        if (which == THIS && awaits_grant(&word)) {
            awaits = 1;
        } else if (which == EARLIER) {
            if (!finished(&word)) return BATON_FP_FULL;
            word = EMPTY; /* an untouched ticket: its fresh slot */
            word.gen = (uint32_t)at;
            awaits = 1;
        }
        if (!awaits) {
            pass(r, SERVE, at);
            at++;
            continue;
        }
        if (word.grant == BATON_FP_STOP) {
            *stopped = 1;
            return OK;
        }
        struct baton_fp_slot next = word;
        next.grant = BATON_FP_GIVEN;
        next.giver = me;
        next.acked = 0;
        if (cas(slot_word(r, at), raw, baton__fp_slot_pack(&next))) {
            *t = at;
            *stopped = 0;
            return OK;
        }
    }
}

/* --- The changes the steps make, for update_slot and update_record. */

static int mark_taken(struct baton_fp_slot *s, unsigned me) {
    s->claim = BATON_FP_TAKEN;
    s->claimer = me;
    s->sleeping = 0;
    return 1;
}

static int ack_grant(struct baton_fp_slot *s, unsigned me) {
    s->grant = BATON_FP_GIVEN;
    s->giver = me;
    s->acked = 1;
    return 1;
}

static int cancel_if_open(struct baton_fp_slot *s, unsigned me) {
    if (is_granted(s)) return 0;
    s->claim = BATON_FP_CANCELLED;
    s->claimer = me;
    s->sleeping = 0;
    return 1;
}

static int mark_sleeping(struct baton_fp_slot *s, unsigned me) {
    (void)me;
    if (is_granted(s) || s->sleeping) return 0;
    s->sleeping = 1;
    return 1;
}

static void count_taken(struct baton_fp_record *r, void *t) {
    r->held++;
    r->intent = BATON_FP_TAKING;
    r->ticket = (uint32_t)*(ticket_t *)t;
}

static void hand_over(struct baton_fp_record *r, void *unused) {
    (void)unused;
    r->held--;
    r->intent = BATON_FP_RELEASING;
    r->ticket = 0;
}

static void settle(struct baton_fp_record *r, void *unused) {
    (void)unused;
    r->intent = BATON_FP_IDLE;
    r->ticket = 0;
}

/* Returns the token in flight through `returned`, unless 255 wait there
 * already (`*full`): the broker has not collected them yet. */
static void return_one(struct baton_fp_record *r, void *full) {
    *(int *)full = r->returned == UINT8_MAX;
    if (!*(int *)full) {
        r->returned++;
        r->intent = BATON_FP_IDLE;
        r->ticket = 0;
    }
}

/* --- The steps. */

/* One step of `seat`'s client in `*phase` (on ticket `*t`), as the
 * model's Region::step: moves them on. ASLEEP is the caller's. `*stopped`
 * is set when a release met the barrier. */
static enum baton_fp_outcome step(const struct baton_ring *r, unsigned seat, enum phase *phase, ticket_t *t,
                                  int *stopped) {
    unsigned me = party_of(seat);
    enum baton_fp_outcome rc = OK;
    uint64_t raw;
    struct baton_fp_slot word;
    enum lap which;
    int changed;
    BATON_FP_BETWEEN_STEPS();
    switch (*phase) {
    case CLAIM: {
        int found;
        if ((rc = claim_first(r, me, 0, t, &word, &found)) != OK) return rc;
        if (is_granted(&word)) {
            *phase = TAKE;
        } else {
            if (word.grant == BATON_FP_STOP) host_tell(r);
            *phase = CHECK;
        }
        return OK;
    }
    case CHECK:
        if ((rc = lap(r, *t, &raw, &word, &which)) != OK) return rc;
        if (which != THIS) return BATON_FP_CORRUPT;
        *phase = is_granted(&word) ? TAKE : ASLEEP;
        return OK;
    case TAKE:
        if ((rc = update_record(r, seat, count_taken, t)) != OK) return rc;
        *phase = ACK_TAKEN;
        return OK;
    case ACK_TAKEN:
        if ((rc = update_slot(r, *t, mark_taken, me, &changed)) != OK) return rc;
        *phase = DONE;
        return OK;
    case HAND: {
        struct baton_fp_record record;
        if (baton__fp_record_unpack(load(seat_word(r, seat, RECORD)), &record) != BATON_FP_WORD_OK)
            return BATON_FP_CORRUPT;
        if (record.held == 0) return BATON_FP_NOTHING_HELD;
        if ((rc = update_record(r, seat, hand_over, NULL)) != OK) return rc;
        *phase = GRANT;
        return OK;
    }
    case GRANT:
        if ((rc = give(r, me, t, stopped)) != OK) return rc;
        *phase = *stopped ? RETURN : WAKE;
        return OK;
    case RETURN: {
        int full = 0;
        if ((rc = update_record(r, seat, return_one, &full)) != OK) return rc;
        host_tell(r);
        if (full) { /* ask again, and try once more */
            sched_yield();
            return OK;
        }
        *phase = DONE;
        return OK;
    }
    case WAKE:
        if ((rc = lap(r, *t, &raw, &word, &which)) != OK) return rc;
        if (which == THIS && word.sleeping) host_wake(slot_word(r, *t));
        *phase = SETTLE;
        return OK;
    case SETTLE:
        if ((rc = update_record(r, seat, settle, NULL)) != OK) return rc;
        *phase = ACK_GRANT;
        return OK;
    case ACK_GRANT:
        if ((rc = update_slot(r, *t, ack_grant, me, &changed)) != OK) return rc;
        *phase = DONE;
        return OK;
    default: /* ASLEEP and DONE have no step */
        return BATON_FP_CORRUPT;
    }
}

/* `seat`'s wait on ticket t ends without a token, unless one came first:
 * then the client takes it (`*phase` TAKE). The compare-and-swap expects
 * the grant half not given, so a grant and the withdrawal settle their
 * race on one word. */
static enum baton_fp_outcome time_out(const struct baton_ring *r, unsigned seat, ticket_t t, enum phase *phase) {
    int cancelled;
    BATON_FP_BETWEEN_STEPS();
    enum baton_fp_outcome rc = update_slot(r, t, cancel_if_open, party_of(seat), &cancelled);
    if (rc != OK) return rc;
    *phase = cancelled ? DONE : TAKE;
    return OK;
}

/* ASLEEP on ticket t: marks the slot sleeping and waits on its low half
 * until a grant changes it (`*phase` TAKE). Past the deadline it
 * withdraws the wait (TIMED_OUT), unless a token came first. */
static enum baton_fp_outcome sleep_on(const struct baton_ring *r, unsigned seat, ticket_t t,
                                      const struct timespec *deadline, enum phase *phase) {
    for (;;) {
        if (revoked(r, seat)) return BATON_FP_REVOKED;
        if (!baton__ring_broker_alive(r)) return BATON_FP_GONE;
        struct timespec at = baton__fp_now();
        if (deadline && !baton__fp_before(&at, deadline)) {
            enum baton_fp_outcome rc = time_out(r, seat, t, phase);
            if (rc != OK) return rc;
            return *phase == DONE ? BATON_FP_TIMED_OUT : OK;
        }
        int changed;
        enum baton_fp_outcome rc = update_slot(r, t, mark_sleeping, party_of(seat), &changed);
        if (rc != OK) return rc;
        uint64_t raw;
        struct baton_fp_slot word;
        enum lap which;
        if ((rc = lap(r, t, &raw, &word, &which)) != OK) return rc;
        if (which != THIS) return BATON_FP_CORRUPT;
        if (is_granted(&word)) {
            *phase = TAKE;
            return OK;
        }
        baton__fp_wait(slot_word(r, t), (uint32_t)raw, deadline);
    }
}

/* Runs `seat`'s steps from `phase` to the end of its acquire. */
static enum baton_fp_outcome run(const struct baton_ring *r, unsigned seat, enum phase phase, ticket_t t,
                                 const struct timespec *deadline) {
    int stopped = 0;
    for (;;) {
        enum baton_fp_outcome rc;
        if (phase == DONE) return BATON_FP_DONE;
        if (phase == ASLEEP)
            rc = sleep_on(r, seat, t, deadline, &phase);
        else
            rc = step(r, seat, &phase, &t, &stopped);
        if (rc != OK) return rc;
    }
}

static enum baton_fp_outcome usable(const struct baton_ring *r, unsigned seat) {
    return seat >= r->seats || revoked(r, seat) ? BATON_FP_REVOKED : OK;
}

enum baton_fp_outcome baton__ring_acquire(const struct baton_ring *r, unsigned seat, const struct timespec *deadline) {
    enum baton_fp_outcome rc = usable(r, seat);
    return rc != OK ? rc : run(r, seat, CLAIM, 0, deadline);
}

enum baton_fp_outcome baton__ring_try_acquire(const struct baton_ring *r, unsigned seat) {
    enum baton_fp_outcome rc = usable(r, seat);
    if (rc != OK) return rc;
    ticket_t t;
    struct baton_fp_slot claimed;
    int found;
    if ((rc = claim_first(r, party_of(seat), 1, &t, &claimed, &found)) != OK) return rc;
    if (!found) return BATON_FP_BUSY;
    return run(r, seat, TAKE, t, NULL);
}

enum baton_fp_outcome baton__ring_release(const struct baton_ring *r, unsigned seat) {
    enum baton_fp_outcome rc = usable(r, seat);
    if (rc != OK) return rc;
    enum phase phase = HAND;
    ticket_t t = 0;
    int stopped = 0, returned = 0;
    while (phase != DONE) {
        enum phase was = phase;
        rc = step(r, seat, &phase, &t, &stopped);
        if (rc == BATON_FP_FULL && was == GRANT) { /* returned to the broker, as at the barrier */
            phase = RETURN;
            stopped = 1;
        } else if (rc != OK) {
            return rc;
        }
        if (stopped) returned = 1;
        stopped = 0;
    }
    return returned ? BATON_FP_RETURNED : BATON_FP_DONE;
}

int baton__ring_attach(struct baton_ring *r, _Atomic uint64_t *words, size_t nwords) {
    uint64_t magic = nwords > 0 ? load(&words[0]) : 0;
    if (magic != BATON_FP_MAGIC || nwords < RING) {
        errno = EPROTO;
        baton__say("the broker's region is not a baton fast-path region of layout 1 (magic %#018llx)",
                   (unsigned long long)magic);
        return -1;
    }
    uint64_t capacity = load(&words[CAPACITY]), seats = load(&words[SEATS]);
    if (capacity < 1 || capacity > BATON_FP_MAX_CAPACITY || seats < 1 || seats > BATON_FP_MAX_SEATS) {
        errno = EPROTO;
        baton__say("the broker's region: a ring of %llu slots for %llu seats is out of range",
                   (unsigned long long)capacity, (unsigned long long)seats);
        return -1;
    }
    size_t needed = RING + (size_t)capacity + (size_t)seats * LINE;
    if (nwords < needed) {
        errno = EPROTO;
        baton__say("the broker's region: its header asks for %zu words, and it has %zu", needed, nwords);
        return -1;
    }
    *r = (struct baton_ring){.words = words, .capacity = (size_t)capacity, .seats = (size_t)seats, .socket = -1};
    return 0;
}
