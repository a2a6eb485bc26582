/* Just enough JSON for the tests: the vectors file and the broker's status
 * document. Malformed input ends the test. */
#ifndef BATON_TEST_JSON_H
#define BATON_TEST_JSON_H

#include <stddef.h>

enum json_type { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT };

struct json {
    enum json_type type;
    double number;       /* JSON_NUMBER, JSON_BOOL */
    char *string;        /* JSON_STRING, NUL-terminated */
    size_t count;        /* JSON_ARRAY, JSON_OBJECT */
    struct json *items;  /* the elements, or the members' values */
    char **keys;         /* JSON_OBJECT: the members' names */
};

struct json *json_parse(const char *text);
void json_free(struct json *v);

/* The member `key` of an object, or NULL. */
const struct json *json_get(const struct json *object, const char *key);

/* Every key `expected` gives matches in `actual`, recursively; arrays must
 * have exactly the elements given, each matched the same way. */
int json_matches(const struct json *expected, const struct json *actual);

#endif
