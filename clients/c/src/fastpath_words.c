/* The region's words, packed and unpacked bit for bit as docs/fastpath.md
 * ("The region") lays them out, and as crates/baton-core/src/fastpath/
 * words.rs does: what counts as garbage is the same here. */
#include "fastpath.h"

/* A slot: gen 63..32, claim 31..30, claimer 29..19, grant 18..17, giver
 * 16..6, acked 5, sleeping 4; bits 3..0 unused. */
#define CLAIM_SHIFT 30
#define CLAIMER_SHIFT 19
#define GRANT_SHIFT 17
#define GIVER_SHIFT 6
#define ACKED (1ull << 5)
#define SLEEPING (1ull << 4)
#define PARTY_MASK ((1ull << BATON_FP_PARTY_BITS) - 1)
#define LOW_BITS_UNUSED ((1ull << 4) - 1)

uint64_t baton__fp_slot_pack(const struct baton_fp_slot *s) {
    uint64_t claimer = s->claim == BATON_FP_UNCLAIMED ? 0 : s->claimer & PARTY_MASK;
    int given = s->grant == BATON_FP_GIVEN;
    uint64_t giver = given ? s->giver & PARTY_MASK : 0;
    return (uint64_t)s->gen << 32 | (uint64_t)s->claim << CLAIM_SHIFT | claimer << CLAIMER_SHIFT |
           (uint64_t)s->grant << GRANT_SHIFT | giver << GIVER_SHIFT | (given && s->acked ? ACKED : 0) |
           (s->sleeping ? SLEEPING : 0);
}

enum baton_fp_word baton__fp_slot_unpack(uint64_t word, struct baton_fp_slot *s) {
    if (word & LOW_BITS_UNUSED) return BATON_FP_BAD_STRAY;
    unsigned claim = (unsigned)(word >> CLAIM_SHIFT) & 3;
    unsigned claimer = (unsigned)((word >> CLAIMER_SHIFT) & PARTY_MASK);
    if (claim == BATON_FP_UNCLAIMED && claimer != 0) return BATON_FP_BAD_STRAY;
    unsigned grant = (unsigned)(word >> GRANT_SHIFT) & 3;
    unsigned giver = (unsigned)((word >> GIVER_SHIFT) & PARTY_MASK);
    int acked = (word & ACKED) != 0;
    /* Every 11-bit party names a seat a region may have; whether this
     * region has it is the ring's business (it knows its seats). */
    if (grant == 3) return BATON_FP_BAD_STATE;
    if (grant != BATON_FP_GIVEN && (giver != 0 || acked)) return BATON_FP_BAD_STRAY;
    *s = (struct baton_fp_slot){
        .gen = (uint32_t)(word >> 32),
        .claim = (enum baton_fp_claim)claim,
        .claimer = claimer,
        .grant = (enum baton_fp_grant)grant,
        .giver = giver,
        .acked = acked,
        .sleeping = (word & SLEEPING) != 0,
    };
    return BATON_FP_WORD_OK;
}

/* A record: held 63..48, returned 47..40, intent 39..38, ticket 37..14
 * (TAKING only), changes 13..0. */
#define HELD_SHIFT 48
#define RETURNED_SHIFT 40
#define INTENT_SHIFT 38
#define TICKET_SHIFT 14
#define TICKET_MASK ((1ull << 24) - 1)
#define CHANGES_MASK ((1ull << 14) - 1)

uint64_t baton__fp_record_pack(const struct baton_fp_record *r) {
    uint64_t ticket = r->intent == BATON_FP_TAKING ? r->ticket & TICKET_MASK : 0;
    return (uint64_t)r->held << HELD_SHIFT | (uint64_t)r->returned << RETURNED_SHIFT |
           (uint64_t)r->intent << INTENT_SHIFT | ticket << TICKET_SHIFT | (r->changes & CHANGES_MASK);
}

enum baton_fp_word baton__fp_record_unpack(uint64_t word, struct baton_fp_record *r) {
    uint32_t ticket = (uint32_t)((word >> TICKET_SHIFT) & TICKET_MASK);
    unsigned intent = (unsigned)(word >> INTENT_SHIFT) & 3;
    if (intent == 3) return BATON_FP_BAD_STATE;
    if (intent != BATON_FP_TAKING && ticket != 0) return BATON_FP_BAD_STRAY;
    *r = (struct baton_fp_record){
        .held = (uint16_t)(word >> HELD_SHIFT),
        .returned = (uint8_t)(word >> RETURNED_SHIFT),
        .intent = (enum baton_fp_intent)intent,
        .ticket = ticket,
        .changes = (uint16_t)(word & CHANGES_MASK),
    };
    return BATON_FP_WORD_OK;
}
