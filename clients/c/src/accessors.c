#include "internal.h"

/* The socket's tokens and the region's: the connection's either way. */
unsigned baton_held(const baton_t *c) { return c->held + c->fast.held; }

unsigned baton_limit(const baton_t *c) { return c->limit; }

const char *baton_refusal(const baton_t *c) { return c->refusal; }
