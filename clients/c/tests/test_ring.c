/* The fast path's words and steps, in this process: the library's pack
 * and unpack against literal words computed from docs/fastpath.md's
 * layout (the vectors of words.rs's `the_layout_is_the_one_the_design_gives`
 * and `garbage_is_told_from_a_word` among them), and the ring's client
 * steps on a region laid out here as the broker's Ring::init lays it out,
 * in the cases a served broker meets only by chance: a ring that wraps, a
 * full one, the barrier, a corrupt word, a revoked seat, a dead broker, and
 * a client killed between any two of its steps.
 * tests/test_fastpath.c runs the same code against the real broker. */
#include <baton.h>

#include <errno.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"

/* The ring's source, compiled here with a place to stop its client
 * between two steps, as a kill would: after `steps_left` more steps, it
 * jumps back to the test, abandoning the operation (-1: never). */
static jmp_buf killed;
static int steps_left = -1;
#define BATON_FP_BETWEEN_STEPS()                                                                       \
    do {                                                                                               \
        if (steps_left == 0) longjmp(killed, 1);                                                       \
        if (steps_left > 0) steps_left--;                                                              \
    } while (0)
#include "fastpath_ring.c"

#define CHECK_EQ(a, b)                                                                                 \
    do {                                                                                               \
        unsigned long long a_ = (a), b_ = (b);                                                         \
        if (a_ != b_) {                                                                                \
            fprintf(stderr, "%s:%d: %s is %#llx, not %#llx\n", __FILE__, __LINE__, #a, a_, b_);         \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

static struct baton_fp_slot slot_of(uint64_t word) {
    struct baton_fp_slot s;
    CHECK(baton__fp_slot_unpack(word, &s) == BATON_FP_WORD_OK);
    return s;
}

static struct baton_fp_record record_of(uint64_t word) {
    struct baton_fp_record r;
    CHECK(baton__fp_record_unpack(word, &r) == BATON_FP_WORD_OK);
    return r;
}

static void the_layout_is_the_one_the_design_gives(void) {
    /* gen 7, taken by seat 2, given by the broker and acknowledged,
     * sleeping (words.rs's vector). */
    struct baton_fp_slot s = {.gen = 7, .claim = BATON_FP_TAKEN, .claimer = 2 + 1, .grant = BATON_FP_GIVEN,
                              .giver = BATON_FP_BROKER, .acked = 1, .sleeping = 1};
    uint64_t word = 7ull << 32 | 2ull << 30 | 3ull << 19 | 2ull << 17 | 1ull << 5 | 1ull << 4;
    CHECK_EQ(baton__fp_slot_pack(&s), word);
    struct baton_fp_slot back = slot_of(word);
    CHECK(back.gen == 7 && back.claim == BATON_FP_TAKEN && back.claimer == 3 && back.grant == BATON_FP_GIVEN &&
          back.giver == 0 && back.acked && back.sleeping);

    /* The largest ticket, claimed by the broker, no token yet. */
    s = (struct baton_fp_slot){.gen = UINT32_MAX, .claim = BATON_FP_CLAIMED, .claimer = BATON_FP_BROKER};
    CHECK_EQ(baton__fp_slot_pack(&s), 0xffffffffull << 32 | 1ull << 30);
    /* Cancelled by the last seat (2046: party 2047, all 11 bits), given
     * by seat 0 (party 1), not acknowledged. */
    s = (struct baton_fp_slot){.gen = 1, .claim = BATON_FP_CANCELLED, .claimer = 2047, .grant = BATON_FP_GIVEN,
                               .giver = 1};
    word = 1ull << 32 | 3ull << 30 | 0x7ffull << 19 | 2ull << 17 | 1ull << 6;
    CHECK_EQ(baton__fp_slot_pack(&s), word);
    CHECK(slot_of(word).claimer == 2047 && slot_of(word).giver == 1 && !slot_of(word).acked);
    /* The barrier on an unclaimed ticket; fields its states lack are left
     * out of the word. */
    s = (struct baton_fp_slot){.gen = 9, .claim = BATON_FP_UNCLAIMED, .claimer = 5, .grant = BATON_FP_STOP,
                               .giver = 4, .acked = 1};
    CHECK_EQ(baton__fp_slot_pack(&s), 9ull << 32 | 1ull << 17);

    /* held 3, returned 1, Taking(5), changes 9 (words.rs's vector). */
    struct baton_fp_record r = {.held = 3, .returned = 1, .intent = BATON_FP_TAKING, .ticket = 5, .changes = 9};
    word = 3ull << 48 | 1ull << 40 | 1ull << 38 | 5ull << 14 | 9;
    CHECK_EQ(baton__fp_record_pack(&r), word);
    struct baton_fp_record rback = record_of(word);
    CHECK(rback.held == 3 && rback.returned == 1 && rback.intent == BATON_FP_TAKING && rback.ticket == 5 &&
          rback.changes == 9);
    /* Every field full; a Taking ticket keeps its low 24 bits only. */
    r = (struct baton_fp_record){.held = UINT16_MAX, .returned = UINT8_MAX, .intent = BATON_FP_RELEASING,
                                 .changes = (1u << 14) - 1};
    CHECK_EQ(baton__fp_record_pack(&r), 0xffffull << 48 | 0xffull << 40 | 2ull << 38 | 0x3fff);
    r = (struct baton_fp_record){.intent = BATON_FP_TAKING, .ticket = 0x1234567};
    CHECK_EQ(baton__fp_record_pack(&r), 1ull << 38 | 0x234567ull << 14);
}

static void garbage_is_told_from_a_word(void) {
    struct baton_fp_slot s;
    struct baton_fp_record r;
    CHECK(baton__fp_slot_unpack(3ull << 17, &s) == BATON_FP_BAD_STATE);               /* grant state 3 */
    CHECK(baton__fp_slot_unpack(1, &s) == BATON_FP_BAD_STRAY);                        /* a low bit */
    CHECK(baton__fp_slot_unpack(5ull << 19, &s) == BATON_FP_BAD_STRAY);               /* an unclaimed slot's claimer */
    CHECK(baton__fp_slot_unpack(1ull << 5, &s) == BATON_FP_BAD_STRAY);                /* an open slot acked */
    CHECK(baton__fp_slot_unpack(1ull << 17 | 1ull << 6, &s) == BATON_FP_BAD_STRAY);   /* the barrier with a giver */
    CHECK(baton__fp_record_unpack(3ull << 38, &r) == BATON_FP_BAD_STATE);             /* intent 3 */
    CHECK(baton__fp_record_unpack(2ull << 38 | 1ull << 14, &r) == BATON_FP_BAD_STRAY); /* releasing with a ticket */
    CHECK(baton__fp_record_unpack(1ull << 14, &r) == BATON_FP_BAD_STRAY);             /* idle with a ticket */
}

static uint64_t seed = 0x9e3779b97f4a7c15ull;

static uint64_t next_random(void) {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
}

/* words.rs's properties, over a million random words: a word decodes only
 * to what packs back to it; and every grant changes the half a claimer
 * sleeps on. */
static void a_word_decodes_only_to_what_packs_back_to_it(void) {
    for (int i = 0; i < 1000000; i++) {
        /* Random bits, and random bits with the low four (always garbage)
         * cleared, so that both halves of the space are met often. */
        uint64_t word = next_random() & (i % 2 ? ~0xfull : ~0ull);
        struct baton_fp_slot s;
        struct baton_fp_record r;
        if (baton__fp_slot_unpack(word, &s) == BATON_FP_WORD_OK) CHECK_EQ(baton__fp_slot_pack(&s), word);
        if (baton__fp_record_unpack(word, &r) == BATON_FP_WORD_OK) CHECK_EQ(baton__fp_record_pack(&r), word);

        uint64_t bits = next_random();
        struct baton_fp_slot waiting = {.gen = (uint32_t)bits, .claim = BATON_FP_CLAIMED,
                                        .claimer = (unsigned)(bits >> 32) & 0x7ff, .grant = BATON_FP_OPEN,
                                        .sleeping = 1};
        struct baton_fp_slot granted = waiting;
        granted.grant = BATON_FP_GIVEN;
        granted.giver = (unsigned)(bits >> 43) & 0x7ff;
        CHECK((uint32_t)baton__fp_slot_pack(&waiting) != (uint32_t)baton__fp_slot_pack(&granted));
    }
}

/* A region in this process, laid out as Ring::init does: `lent` tokens
 * given by the broker to the first tickets, the broker alive. Lines are
 * 64 bytes apart, as in the mapped region. */
#define SLOTS 4
#define SEATS_HERE 2
#define RING_AT 32
#define WORDS (RING_AT + SLOTS + SEATS_HERE * 8)
static _Alignas(64) _Atomic uint64_t region[WORDS];

static struct baton_ring lay_out(unsigned lent) {
    for (size_t i = 0; i < WORDS; i++) atomic_store(&region[i], 0);
    for (unsigned t = 0; t < SLOTS; t++) {
        struct baton_fp_slot s = {.gen = t, .grant = t < lent ? BATON_FP_GIVEN : BATON_FP_OPEN, .acked = t < lent};
        atomic_store(&region[RING_AT + t], baton__fp_slot_pack(&s));
    }
    atomic_store(&region[24], lent); /* serve */
    atomic_store(&region[1], SLOTS);
    atomic_store(&region[2], SEATS_HERE);
    atomic_store(&region[3], lent);
    atomic_store(&region[8], (uint64_t)getpid()); /* a live owner's tid */
    atomic_store(&region[0], BATON_FP_MAGIC);
    struct baton_ring r;
    CHECK(baton__ring_attach(&r, region, WORDS) == 0);
    CHECK(r.capacity == SLOTS && r.seats == SEATS_HERE);
    return r; /* its socket is -1: a NUDGE goes nowhere */
}

static _Atomic uint64_t *slot(uint64_t t) { return &region[RING_AT + t % SLOTS]; }

static struct baton_fp_record record(unsigned seat) { return record_of(region[RING_AT + SLOTS + seat * 8]); }

/* An acquire that would wait: a few seconds at most, so that a broken
 * step fails the test rather than hangs it (nobody here gives tokens but
 * the test). */
static enum baton_fp_outcome acquire(const struct baton_ring *r, unsigned seat) {
    struct timespec guard = baton_deadline(5000);
    return baton__ring_acquire(r, seat, &guard);
}

static void a_ring_goes_round_many_laps(void) {
    struct baton_ring r = lay_out(1);
    for (int i = 0; i < 50; i++) {
        unsigned seat = (unsigned)i % SEATS_HERE;
        CHECK(acquire(&r, seat) == BATON_FP_DONE);
        CHECK(record(seat).held == 1 && record(seat).intent == BATON_FP_TAKING);
        CHECK(baton__ring_release(&r, seat) == BATON_FP_DONE);
        CHECK(record(seat).held == 0 && record(seat).intent == BATON_FP_IDLE);
    }
    /* 50 claims, and each release gave the token to the next ticket: the
     * slots went round 12 times, and carry the last lap. */
    CHECK_EQ(atomic_load(&region[16]), 50); /* tail */
    struct baton_fp_slot last = slot_of(*slot(50));
    CHECK(last.gen == 50 && last.claim == BATON_FP_UNCLAIMED && last.grant == BATON_FP_GIVEN && last.acked);
    CHECK(baton__ring_release(&r, 0) == BATON_FP_NOTHING_HELD);
}

static void a_wait_past_its_deadline_is_withdrawn_and_passed_by(void) {
    struct baton_ring r = lay_out(1);
    CHECK(acquire(&r, 0) == BATON_FP_DONE);
    CHECK(baton__ring_try_acquire(&r, 1) == BATON_FP_BUSY);
    struct timespec deadline = baton_deadline(30), after;
    CHECK(baton__ring_acquire(&r, 1, &deadline) == BATON_FP_TIMED_OUT);
    clock_gettime(CLOCK_MONOTONIC, &after);
    CHECK(after.tv_sec > deadline.tv_sec || (after.tv_sec == deadline.tv_sec && after.tv_nsec >= deadline.tv_nsec));
    struct baton_fp_slot cancelled = slot_of(*slot(1));
    CHECK(cancelled.claim == BATON_FP_CANCELLED && cancelled.claimer == 2 && cancelled.grant == BATON_FP_OPEN &&
          !cancelled.sleeping);
    CHECK(record(1).held == 0);
    /* The release passes the withdrawn ticket by: the token is free for
     * the next claim. */
    CHECK(baton__ring_release(&r, 0) == BATON_FP_DONE);
    CHECK(slot_of(*slot(1)).grant == BATON_FP_OPEN);
    CHECK(baton__ring_try_acquire(&r, 1) == BATON_FP_DONE);
    CHECK(record(1).held == 1);
}

static void a_release_that_meets_the_barrier_returns_its_token(void) {
    struct baton_ring r = lay_out(1);
    CHECK(acquire(&r, 0) == BATON_FP_DONE);
    /* The broker's barrier on the first ticket that awaits a token. */
    struct baton_fp_slot stop = {.gen = 1, .grant = BATON_FP_STOP};
    atomic_store(slot(1), baton__fp_slot_pack(&stop));
    CHECK(baton__ring_release(&r, 0) == BATON_FP_RETURNED);
    struct baton_fp_record after = record(0);
    CHECK(after.held == 0 && after.returned == 1 && after.intent == BATON_FP_IDLE);
    CHECK_EQ(*slot(1), baton__fp_slot_pack(&stop));
}

static void a_full_ring_refuses_a_claim_and_changes_nothing(void) {
    struct baton_ring r = lay_out(0);
    /* Ticket 0's claimer stopped between its claim and its take: its slot
     * is not finished, and tickets 1..3 are. The next claim, ticket 4,
     * would need slot 0. */
    struct baton_fp_slot stuck = {.gen = 0, .claim = BATON_FP_CLAIMED, .claimer = 1, .grant = BATON_FP_GIVEN,
                                  .acked = 1};
    atomic_store(slot(0), baton__fp_slot_pack(&stuck));
    for (uint32_t t = 1; t < 4; t++) {
        struct baton_fp_slot done = {.gen = t, .claim = BATON_FP_TAKEN, .claimer = 1, .grant = BATON_FP_GIVEN,
                                     .acked = 1};
        atomic_store(slot(t), baton__fp_slot_pack(&done));
    }
    atomic_store(&region[16], 4);
    atomic_store(&region[24], 4);
    struct baton_fp_record holds = {.held = 1};
    atomic_store(&region[RING_AT + SLOTS + 8], baton__fp_record_pack(&holds));
    uint64_t before[WORDS];
    for (size_t i = 0; i < WORDS; i++) before[i] = region[i];
    CHECK(acquire(&r, 1) == BATON_FP_FULL);
    CHECK(baton__ring_try_acquire(&r, 1) == BATON_FP_FULL);
    for (size_t i = 0; i < WORDS; i++) CHECK_EQ(region[i], before[i]);
    /* A release cannot give its token to ticket 4 either: it returns it. */
    CHECK(baton__ring_release(&r, 1) == BATON_FP_RETURNED);
    CHECK(record(1).held == 0 && record(1).returned == 1 && record(1).intent == BATON_FP_IDLE);
    CHECK_EQ(*slot(0), baton__fp_slot_pack(&stuck));
}

static void a_corrupt_word_a_revoked_seat_and_a_dead_broker_are_refused(void) {
    struct baton_ring r = lay_out(0);
    atomic_store(slot(0), 3ull << 17);
    CHECK(acquire(&r, 0) == BATON_FP_CORRUPT);
    r = lay_out(0);
    atomic_store(&region[RING_AT + SLOTS + 8 + 1], 1); /* seat 1 revoked */
    CHECK(acquire(&r, 1) == BATON_FP_REVOKED);
    CHECK(baton__ring_release(&r, 1) == BATON_FP_REVOKED);
    CHECK(acquire(&r, SEATS_HERE) == BATON_FP_REVOKED); /* a seat the region lacks */
    /* No token, and the broker's thread died (the kernel's owner-died
     * bit): a waiter gives up instead of sleeping forever. */
    r = lay_out(0);
    CHECK(baton__ring_broker_alive(&r));
    atomic_store(&region[8], (uint64_t)getpid() | 0x40000000u);
    CHECK(!baton__ring_broker_alive(&r));
    CHECK(acquire(&r, 0) == BATON_FP_GONE);
    atomic_store(&region[8], 0); /* unlocked: no broker either */
    CHECK(!baton__ring_broker_alive(&r));
}

/* Where every token is, from the region's words alone, by the design's
 * rules (docs/fastpath.md, "When a client dies: the repair"): in a record
 * (`held`, `returned`), in flight (a record `Releasing` that no
 * unacknowledged slot names as giver), free (given to a ticket nobody
 * claimed), or given to a claimer whose record does not count it yet (its
 * intent is not `Taking` that ticket). Each token is counted exactly once
 * after any prefix of a client's steps, or a dead client's tokens could
 * not be found (or would be found twice). */
static unsigned tokens_counted(void) {
    unsigned tokens = 0;
    struct baton_fp_record records[SEATS_HERE];
    for (unsigned seat = 0; seat < SEATS_HERE; seat++) {
        records[seat] = record(seat);
        tokens += records[seat].held + records[seat].returned;
    }
    int named_as_giver[SEATS_HERE] = {0};
    for (unsigned i = 0; i < SLOTS; i++) {
        struct baton_fp_slot s = slot_of(region[RING_AT + i]);
        if (s.grant != BATON_FP_GIVEN) continue;
        if (!s.acked && s.giver > 0) named_as_giver[s.giver - 1] = 1;
        if (s.claim == BATON_FP_UNCLAIMED) {
            tokens++;
        } else if (s.claim == BATON_FP_CLAIMED && s.claimer > 0) {
            struct baton_fp_record *r = &records[s.claimer - 1];
            if (!(r->intent == BATON_FP_TAKING && r->ticket == (s.gen & 0xffffffu))) tokens++;
        }
    }
    for (unsigned seat = 0; seat < SEATS_HERE; seat++)
        if (records[seat].intent == BATON_FP_RELEASING && !named_as_giver[seat]) tokens++;
    return tokens;
}

/* One token, two clients: an uncontended acquire; a wait whose deadline
 * has passed (withdrawn); a release that passes the withdrawn ticket by; a
 * TRY; a release that meets the barrier. Stopped (longjmp) where
 * steps_left says. */
static void one_token_two_clients(const struct baton_ring *r) {
    struct timespec past = baton_deadline(0);
    CHECK(baton__ring_acquire(r, 0, NULL) == BATON_FP_DONE);
    CHECK(baton__ring_acquire(r, 1, &past) == BATON_FP_TIMED_OUT);
    CHECK(baton__ring_release(r, 0) == BATON_FP_DONE);
    CHECK(baton__ring_try_acquire(r, 1) == BATON_FP_DONE);
    uint64_t t = atomic_load(&region[16]); /* the first ticket nobody claimed: the broker's barrier goes there */
    struct baton_fp_slot stop = {.gen = (uint32_t)t, .grant = BATON_FP_STOP};
    atomic_store(slot(t), baton__fp_slot_pack(&stop));
    CHECK(baton__ring_release(r, 1) == BATON_FP_RETURNED);
}

static void every_prefix_of_a_client_s_steps_leaves_each_token_counted_once(void) {
    struct baton_ring r = lay_out(1);
    steps_left = 1000000;
    one_token_two_clients(&r);
    int steps = 1000000 - steps_left;
    CHECK(steps >= 15 && tokens_counted() == 1);
    for (int stop = 0; stop <= steps; stop++) {
        r = lay_out(1);
        steps_left = stop;
        if (setjmp(killed) == 0) one_token_two_clients(&r);
        unsigned counted = tokens_counted();
        if (counted != 1) {
            fprintf(stderr, "killed before step %d of %d: %u tokens counted, 1 lent\n", stop, steps, counted);
            exit(1);
        }
    }
    steps_left = -1;
}

int main(void) {
    struct {
        const char *name;
        void (*run)(void);
    } tests[] = {
        {"the_layout_is_the_one_the_design_gives", the_layout_is_the_one_the_design_gives},
        {"garbage_is_told_from_a_word", garbage_is_told_from_a_word},
        {"a_word_decodes_only_to_what_packs_back_to_it", a_word_decodes_only_to_what_packs_back_to_it},
        {"a_ring_goes_round_many_laps", a_ring_goes_round_many_laps},
        {"a_wait_past_its_deadline_is_withdrawn_and_passed_by", a_wait_past_its_deadline_is_withdrawn_and_passed_by},
        {"a_release_that_meets_the_barrier_returns_its_token", a_release_that_meets_the_barrier_returns_its_token},
        {"a_full_ring_refuses_a_claim_and_changes_nothing", a_full_ring_refuses_a_claim_and_changes_nothing},
        {"a_corrupt_word_a_revoked_seat_and_a_dead_broker_are_refused",
         a_corrupt_word_a_revoked_seat_and_a_dead_broker_are_refused},
        {"every_prefix_of_a_client_s_steps_leaves_each_token_counted_once",
         every_prefix_of_a_client_s_steps_leaves_each_token_counted_once},
    };
    size_t n = sizeof tests / sizeof *tests;
    for (size_t i = 0; i < n; i++) {
        tests[i].run();
        printf("test %s ... ok\n", tests[i].name);
    }
    printf("clients: %zu passed, 0 failed, 0 skipped (C fast path: words and steps)\n", n);
    return 0;
}
