#include "otlp_read.h"

/* Column buffers come back here when Arrow lets go of them (after the store's flush)
 * and the next batch's columns grow into them: memory the process already touched,
 * where fresh memory costs a page fault per 4 KiB (a fifth of the collector's kernel
 * time went to page faults, about an eighth of them on these buffers). Bounded: at
 * most POOL_SLOTS buffers of POOL_MIN_BYTES or more, POOL_MAX_BYTES in all; beyond
 * that they are freed as before. All callers hold the GIL. */
#define POOL_SLOTS 32
#define POOL_MIN_BYTES ((size_t)64 << 10)
#define POOL_MAX_BYTES ((size_t)64 << 20)
static struct {
    char *buf;
    size_t cap;
} pool[POOL_SLOTS];
static int pool_count;
static size_t pool_bytes;

/* Keep `buf` for reuse; 0 when it does not fit the pool (the caller frees it). */
static int pool_put(char *buf, size_t cap) {
    if (!buf || cap < POOL_MIN_BYTES || pool_count == POOL_SLOTS || pool_bytes + cap > POOL_MAX_BYTES)
        return 0;
    pool[pool_count].buf = buf;
    pool[pool_count].cap = cap;
    pool_count++;
    pool_bytes += cap;
    return 1;
}

void buf_release(char *buf, size_t cap) {
    if (!pool_put(buf, cap)) PyMem_Free(buf);
}

/* The smallest pooled buffer of `need` to 4 * `need` bytes (a small column leaves the
 * large buffers to the large ones), or NULL. */
static char *pool_take(size_t need, size_t *cap) {
    int best = -1;
    for (int i = 0; i < pool_count; i++)
        if (pool[i].cap >= need && pool[i].cap / 4 <= need && (best < 0 || pool[i].cap < pool[best].cap))
            best = i;
    if (best < 0) return NULL;
    char *buf = pool[best].buf;
    *cap = pool[best].cap;
    pool_bytes -= *cap;
    pool[best] = pool[--pool_count];
    return buf;
}

/* Room for `extra` more bytes, past the fast path of buf_reserve (otlp_read.h). */
int buf_grow(Buf *b, size_t extra) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    if (cap >= POOL_MIN_BYTES && pool_count) {
        size_t got;
        char *pooled = pool_take(cap, &got);
        if (pooled) {
            if (b->len) memcpy(pooled, b->buf, b->len);
            buf_release(b->buf, b->cap);
            b->buf = pooled;
            b->cap = got;
            return 0;
        }
    }
    char *grown = PyMem_Realloc(b->buf, cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    b->buf = grown;
    b->cap = cap;
    return 0;
}

const char HEX[] = "0123456789abcdef";

/* JSON string the way Python's json (ensure_ascii=False) writes it. Room for the worst
 * case (every byte a \u00XX escape) is reserved once; most keys and values need no
 * escape at all and are copied whole. */
int json_string(Buf *b, const uint8_t *s, size_t n) {
    if (buf_reserve(b, 6 * n + 2)) return -1;
    char *o = b->buf + b->len;
    *o++ = '"';
    size_t plain = 0;
    while (plain < n && s[plain] >= 0x20 && s[plain] != '"' && s[plain] != '\\') plain++;
    memcpy(o, s, plain);
    o += plain;
    for (size_t i = plain; i < n; i++) {
        uint8_t c = s[i];
        switch (c) {
        case '"': *o++ = '\\'; *o++ = '"'; break;
        case '\\': *o++ = '\\'; *o++ = '\\'; break;
        case '\n': *o++ = '\\'; *o++ = 'n'; break;
        case '\r': *o++ = '\\'; *o++ = 'r'; break;
        case '\t': *o++ = '\\'; *o++ = 't'; break;
        case '\b': *o++ = '\\'; *o++ = 'b'; break;
        case '\f': *o++ = '\\'; *o++ = 'f'; break;
        default:
            if (c < 0x20) {
                *o++ = '\\'; *o++ = 'u'; *o++ = '0'; *o++ = '0';
                *o++ = HEX[c >> 4]; *o++ = HEX[c & 15];
            } else {
                *o++ = (char)c;
            }
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->buf);
    return 0;
}

/* repr(d) for the doubles senders mostly have, a few decimals between 1e-4 and 1e15
 * (3.5, 0.125, 742.318): the fewest decimals j <= 7 whose k / 10**j converts back to
 * exactly d are the shortest round-tripping digits repr picks (a decimal with fewer
 * digits would have fewer decimals, and was tried first), written the way repr writes
 * numbers of that size (fixed notation, ".0" for integral values). 0 when it does not
 * apply; the caller then asks Python's own repr. */
static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7};

static int json_double_short(Buf *b, double d) {
    double a = fabs(d);
    if (!(a >= 1e-4 && a < 1e15)) return 0;
    for (int j = 0; j < 8; j++) {
        double scaled = a * POW10[j];
        if (scaled >= 1e15) return 0;
        double k = nearbyint(scaled);
        if (k / POW10[j] != a) continue;
        uint64_t digits = (uint64_t)k;
        char text[40];
        char *end = text + sizeof text, *o = end;
        if (j == 0) {
            *--o = '0';
            *--o = '.';
        }
        for (int i = 0; i < j; i++) {
            *--o = (char)('0' + digits % 10);
            digits /= 10;
        }
        if (j) *--o = '.';
        do {
            *--o = (char)('0' + digits % 10);
            digits /= 10;
        } while (digits);
        if (d < 0) *--o = '-';
        return buf_put(b, o, (size_t)(end - o)) ? -1 : 1;
    }
    return 0;
}

int json_double(Buf *b, double d) {
    if (isnan(d)) return PUT_LIT(b, "null");
    if (isinf(d)) return d > 0 ? PUT_LIT(b, "\"Infinity\"") : PUT_LIT(b, "\"-Infinity\"");
    int fast = json_double_short(b, d);
    if (fast) return fast < 0 ? -1 : 0;
    char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!text) return -1;
    int rc = buf_put(b, text, strlen(text));
    PyMem_Free(text);
    return rc;
}

/* Decimal digits by hand: snprintf's format parsing was a visible share of the profile. */
int json_int(Buf *b, int64_t v) {
    char text[24];
    char *end = text + sizeof text, *o = end;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        *--o = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *--o = '-';
    return buf_put(b, o, (size_t)(end - o));
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int json_base64(Buf *b, const uint8_t *s, size_t n) {
    if (buf_reserve(b, 4 * ((n + 2) / 3) + 2)) return -1;
    char *o = b->buf + b->len;
    *o++ = '"';
    size_t i = 0;
    for (; i + 2 < n; i += 3) {
        uint32_t v = ((uint32_t)s[i] << 16) | ((uint32_t)s[i + 1] << 8) | s[i + 2];
        *o++ = B64[v >> 18];
        *o++ = B64[(v >> 12) & 63];
        *o++ = B64[(v >> 6) & 63];
        *o++ = B64[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n) v |= (uint32_t)s[i + 1] << 8;
        *o++ = B64[v >> 18];
        *o++ = B64[(v >> 12) & 63];
        *o++ = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    *o++ = '"';
    b->len = (size_t)(o - b->buf);
    return 0;
}
