#include "json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct parser {
    const char *p;
};

static void fail(struct parser *ps, const char *what) {
    fprintf(stderr, "json: %s at \"%.20s\"\n", what, ps->p);
    exit(1);
}

static void skip_space(struct parser *ps) {
    while (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t') ps->p++;
}

static void append_utf8(char *out, size_t *n, unsigned cp) {
    if (cp < 0x80) {
        out[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*n)++] = (char)(0xc0 | cp >> 6);
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    } else {
        out[(*n)++] = (char)(0xe0 | cp >> 12);
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    }
}

static char *parse_string(struct parser *ps) {
    if (*ps->p++ != '"') fail(ps, "expected a string");
    char *out = malloc(strlen(ps->p) + 1);
    size_t n = 0;
    for (;;) {
        char ch = *ps->p++;
        if (ch == '\0') fail(ps, "unterminated string");
        if (ch == '"') break;
        if (ch != '\\') {
            out[n++] = ch;
            continue;
        }
        char esc = *ps->p++;
        const char *plain = strchr("\"\\/bfnrt", esc);
        if (esc && plain) {
            out[n++] = "\"\\/\b\f\n\r\t"[plain - "\"\\/bfnrt"];
        } else if (esc == 'u') {
            unsigned cp;
            if (sscanf(ps->p, "%4x", &cp) != 1) fail(ps, "bad \\u escape");
            ps->p += 4;
            append_utf8(out, &n, cp);
        } else {
            fail(ps, "bad escape");
        }
    }
    out[n] = '\0';
    return out;
}

static void parse_value(struct parser *ps, struct json *v);

static void parse_members(struct parser *ps, struct json *v, char close) {
    ps->p++;
    skip_space(ps);
    if (*ps->p == close) {
        ps->p++;
        return;
    }
    for (;;) {
        v->items = realloc(v->items, (v->count + 1) * sizeof *v->items);
        if (v->type == JSON_OBJECT) {
            v->keys = realloc(v->keys, (v->count + 1) * sizeof *v->keys);
            skip_space(ps);
            v->keys[v->count] = parse_string(ps);
            skip_space(ps);
            if (*ps->p++ != ':') fail(ps, "expected ':'");
        }
        parse_value(ps, &v->items[v->count++]);
        skip_space(ps);
        if (*ps->p == ',') {
            ps->p++;
            continue;
        }
        if (*ps->p++ != close) fail(ps, "expected ',' or the end");
        return;
    }
}

static void parse_value(struct parser *ps, struct json *v) {
    memset(v, 0, sizeof *v);
    skip_space(ps);
    char ch = *ps->p;
    if (ch == '{' || ch == '[') {
        v->type = ch == '{' ? JSON_OBJECT : JSON_ARRAY;
        parse_members(ps, v, ch == '{' ? '}' : ']');
    } else if (ch == '"') {
        v->type = JSON_STRING;
        v->string = parse_string(ps);
    } else if (strncmp(ps->p, "true", 4) == 0 || strncmp(ps->p, "false", 5) == 0) {
        v->type = JSON_BOOL;
        v->number = ch == 't';
        ps->p += ch == 't' ? 4 : 5;
    } else if (strncmp(ps->p, "null", 4) == 0) {
        ps->p += 4;
    } else {
        char *end;
        v->type = JSON_NUMBER;
        v->number = strtod(ps->p, &end);
        if (end == ps->p) fail(ps, "unexpected character");
        ps->p = end;
    }
}

struct json *json_parse(const char *text) {
    struct parser ps = {text};
    struct json *v = malloc(sizeof *v);
    parse_value(&ps, v);
    skip_space(&ps);
    if (*ps.p) fail(&ps, "trailing text");
    return v;
}

static void free_inside(struct json *v) {
    for (size_t i = 0; i < v->count; i++) {
        free_inside(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->string);
}

void json_free(struct json *v) {
    if (!v) return;
    free_inside(v);
    free(v);
}

const struct json *json_get(const struct json *object, const char *key) {
    if (object->type != JSON_OBJECT) return NULL;
    for (size_t i = 0; i < object->count; i++)
        if (strcmp(object->keys[i], key) == 0) return &object->items[i];
    return NULL;
}

int json_matches(const struct json *expected, const struct json *actual) {
    if (!actual || expected->type != actual->type) return 0;
    switch (expected->type) {
    case JSON_OBJECT:
        for (size_t i = 0; i < expected->count; i++)
            if (!json_matches(&expected->items[i], json_get(actual, expected->keys[i]))) return 0;
        return 1;
    case JSON_ARRAY:
        if (expected->count != actual->count) return 0;
        for (size_t i = 0; i < expected->count; i++)
            if (!json_matches(&expected->items[i], &actual->items[i])) return 0;
        return 1;
    case JSON_STRING:
        return strcmp(expected->string, actual->string) == 0;
    default:
        return expected->number == actual->number;
    }
}
