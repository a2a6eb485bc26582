#include "internal.h"

unsigned baton_held(const baton_t *c) { return c->held; }

unsigned baton_limit(const baton_t *c) { return c->limit; }

const char *baton_refusal(const baton_t *c) { return c->refusal; }
