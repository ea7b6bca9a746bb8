/* REST's sparse retrieval in one call: a shard's suffix-array match, or a scan of the context,
 * then the continuations' trie and its most frequent prefixes (datastore_svc/native.py).
 *
 * The same steps as datastore_svc/retrieval.py, which stays the reference (tests compare the
 * two on random corpora): between two target forwards, the numpy version's two dozen small
 * array operations cost more than the work they do.
 *
 * 1. Match: the longest suffix of the context (c_min <= c <= c_max tokens) that occurs, by a
 *    binary search over c, each c a binary search of the suffix array (shards), or a scan of
 *    the context before its last token (context retrieval).
 * 2. Sample: up to n occurrences, evenly spaced (integer rounding, as sample_range).
 * 3. Read the length tokens after each occurrence; PAD from a separator or the end on.
 * 4. Rows in lexicographic order (a suffix array's order already; the context's are sorted here,
 *    PAD last, ties in occurrence order). A trie node is a run of rows that agree on its depth's
 *    prefix; node ids go depth-major, rows in order within a depth.
 * 5. Keep the max_nodes nodes with the highest counts (ties: lower id, so shallower first: the
 *    kept nodes form a tree); their leaves, by count then id, are the candidates.
 *
 * Outputs (the caller's arrays): meta[4] = {c, occurrences, sampled, candidates}; per candidate
 * i < max_candidates: lengths[i], tokens[i * length + j], counts[i * length + j] (the count of
 * the prefix ending at j) and starts[i] (token position of the continuation's first token).
 * Returns 0, or -1 where memory ran out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAD (-1)

typedef struct {
    int64_t c_min, c_max, n, length, max_nodes, max_candidates;
} Config;

typedef struct {
    int64_t *meta;    /* [4] */
    int32_t *tokens;  /* [max_candidates, length] */
    int32_t *counts;  /* [max_candidates, length] */
    int32_t *lengths; /* [max_candidates] */
    int64_t *starts;  /* [max_candidates] */
} Output;

/* ---- suffix-array search (tokens big-endian, `width` bytes each; sa holds byte offsets) ---- */

static int compare_suffix(const uint8_t *text, int64_t text_bytes, int64_t offset, const uint8_t *pattern,
                          int64_t size) {
    int64_t avail = text_bytes - offset;
    int64_t k = avail < size ? avail : size;
    int r = memcmp(text + offset, pattern, (size_t)k);
    if (r != 0) return r;
    return avail < size ? -1 : 0; /* a suffix that ends inside the pattern sorts before it */
}

/* [lo, hi) of the suffixes that start with pattern, searched within [a, b). One search narrows
 * both ends until a probe starts with the pattern, then each end is searched on its own side. */
static void find_range(const uint8_t *text, int64_t text_bytes, const int32_t *sa, int64_t a, int64_t b,
                       const uint8_t *pattern, int64_t size, int64_t *lo, int64_t *hi) {
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        int r = compare_suffix(text, text_bytes, sa[mid], pattern, size);
        if (r < 0) {
            a = mid + 1;
        } else if (r > 0) {
            b = mid;
        } else { /* sa[mid] starts with the pattern: the range holds mid */
            int64_t x = a, y = mid; /* first suffix >= pattern, in [a, mid] */
            while (x < y) {
                int64_t m = x + (y - x) / 2;
                if (compare_suffix(text, text_bytes, sa[m], pattern, size) < 0) x = m + 1;
                else y = m;
            }
            *lo = x;
            x = mid + 1; /* first suffix > pattern, in [mid + 1, b] */
            y = b;
            while (x < y) {
                int64_t m = x + (y - x) / 2;
                if (compare_suffix(text, text_bytes, sa[m], pattern, size) <= 0) x = m + 1;
                else y = m;
            }
            *hi = x;
            return;
        }
    }
    *lo = *hi = a;
}

static int64_t token_at(const uint8_t *text, int64_t width, int64_t position) {
    const uint8_t *p = text + position * width;
    return width == 2 ? ((int64_t)p[0] << 8) | p[1]
                      : ((int64_t)p[0] << 24) | ((int64_t)p[1] << 16) | ((int64_t)p[2] << 8) | p[3];
}

/* ---- sampling and continuations ---- */

static int64_t sample_count(int64_t occurrences, int64_t n) { return occurrences <= n ? occurrences : n; }

/* the i-th of sample_count() indices of [lo, hi), evenly spaced, in order */
static int64_t sample_at(int64_t lo, int64_t hi, int64_t n, int64_t i) {
    if (hi - lo <= n) return lo + i;
    if (n == 1) return lo;
    return lo + (i * (hi - 1 - lo) + (n - 1) / 2) / (n - 1);
}

/* ---- the trie of sorted rows and its top nodes ---- */

typedef struct {
    int32_t *depth, *row, *count; /* [nodes] */
    int32_t *holder;              /* [length, rows]: node holding row i at depth d (-1: PAD) */
    int64_t nodes;
} Trie;

static void build_trie(const int32_t *mat, int64_t rows, int64_t length, Trie *t) {
    int64_t id = 0;
    for (int64_t d = 0; d < length; d++) {
        int64_t current = -1, run_start = 0;
        for (int64_t i = 0; i < rows; i++) {
            int start = i == 0;
            if (!start) { /* rows i-1 and i disagree within the first d + 1 tokens */
                for (int64_t j = 0; j <= d; j++) {
                    if (mat[i * length + j] != mat[(i - 1) * length + j]) {
                        start = 1;
                        break;
                    }
                }
            }
            if (start) {
                if (current >= 0) t->count[current] = (int32_t)(i - run_start);
                run_start = i;
                current = mat[i * length + d] != PAD ? id++ : -1;
                if (current >= 0) {
                    t->depth[current] = (int32_t)d;
                    t->row[current] = (int32_t)i;
                }
            }
            t->holder[d * rows + i] = (int32_t)current;
        }
        if (current >= 0) t->count[current] = (int32_t)(rows - run_start);
    }
    t->nodes = id;
}

static int32_t parent_of(const Trie *t, int64_t rows, int64_t node) {
    int32_t d = t->depth[node];
    return d > 0 ? t->holder[(int64_t)(d - 1) * rows + t->row[node]] : -1;
}

typedef struct {
    int32_t count, id;
} Leaf;

static int by_count_then_id(const void *a, const void *b) {
    const Leaf *x = a, *y = b;
    if (x->count != y->count) return x->count > y->count ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* keep the top nodes of the rows' trie, write their leaves as candidates */
static int top_candidates(const int32_t *mat, const int64_t *starts, int64_t rows, const Config *cfg,
                          Output *out) {
    int64_t length = cfg->length, cells = rows * length;
    int rc = -1;
    Trie t = {0};
    int32_t *histogram = NULL;
    uint8_t *kept = NULL;
    Leaf *leaves = NULL;
    t.depth = malloc(sizeof(int32_t) * (size_t)(cells + 1));
    t.row = malloc(sizeof(int32_t) * (size_t)(cells + 1));
    t.count = malloc(sizeof(int32_t) * (size_t)(cells + 1));
    t.holder = malloc(sizeof(int32_t) * (size_t)(cells + 1));
    histogram = calloc((size_t)rows + 2, sizeof(int32_t));
    kept = calloc((size_t)cells + 1, 2); /* [kept, has a kept child] per node */
    leaves = malloc(sizeof(Leaf) * (size_t)(cells + 1));
    if (!t.depth || !t.row || !t.count || !t.holder || !histogram || !kept || !leaves) goto done;
    build_trie(mat, rows, length, &t);

    /* the count threshold: every node above it, the lowest ids at it */
    int64_t k = cfg->max_nodes < t.nodes ? cfg->max_nodes : t.nodes;
    for (int64_t i = 0; i < t.nodes; i++) histogram[t.count[i]]++;
    int64_t above = 0, threshold = rows;
    while (threshold > 0 && above + histogram[threshold] < k) above += histogram[threshold--];
    int64_t at_threshold = k - above;
    for (int64_t i = 0; i < t.nodes; i++) {
        if (t.count[i] > threshold || (t.count[i] == threshold && at_threshold-- > 0)) kept[2 * i] = 1;
    }
    for (int64_t i = 0; i < t.nodes; i++) {
        int32_t p = kept[2 * i] ? parent_of(&t, rows, i) : -1;
        if (p >= 0) kept[2 * p + 1] = 1;
    }
    int64_t num_leaves = 0;
    for (int64_t i = 0; i < t.nodes; i++) {
        if (kept[2 * i] && !kept[2 * i + 1]) leaves[num_leaves++] = (Leaf){t.count[i], (int32_t)i};
    }
    qsort(leaves, (size_t)num_leaves, sizeof(Leaf), by_count_then_id);
    int64_t d_out = num_leaves < cfg->max_candidates ? num_leaves : cfg->max_candidates;
    for (int64_t c = 0; c < d_out; c++) {
        int32_t node = leaves[c].id, r = t.row[node], depth = t.depth[node];
        out->lengths[c] = depth + 1;
        out->starts[c] = starts[r];
        for (int32_t j = 0; j <= depth; j++) {
            out->tokens[c * length + j] = mat[r * length + j];
            out->counts[c * length + j] = t.count[t.holder[(int64_t)j * rows + r]];
        }
    }
    out->meta[3] = d_out;
    rc = 0;
done:
    free(t.depth);
    free(t.row);
    free(t.count);
    free(t.holder);
    free(histogram);
    free(kept);
    free(leaves);
    return rc;
}

static Config config_of(const int64_t *c) { return (Config){c[0], c[1], c[2], c[3], c[4], c[5]}; }

/* ---- a shard: suffix-array match ---- */

typedef struct {
    const uint8_t *text;
    int64_t num_tokens, width;
    const int32_t *sa;
    int64_t separator;
    const int64_t *first; /* [separator + 1] or NULL: the suffixes that start with token t are
                             [first[t], first[t + 1]) of sa (a search starts there) */
} ShardArrays;

/* One shard's candidates for the context's last tokens (at most c_max are read). */
static int shard_top(const ShardArrays *shard, const int64_t *context, int64_t context_size, const Config *cfg,
                     Output *out) {
    int64_t width = shard->width, num_tokens = shard->num_tokens, separator = shard->separator;
    out->meta[0] = out->meta[1] = out->meta[2] = out->meta[3] = 0;
    int64_t c_max = cfg->c_max < context_size ? cfg->c_max : context_size;
    const int64_t *tail = context + context_size - c_max;
    int64_t limit = width == 2 ? 65536 : 4294967296LL;
    if (separator < limit) limit = separator;
    int64_t skip = 0; /* a token this index cannot hold occurs nowhere: match only after it */
    for (int64_t i = 0; i < c_max; i++) {
        if (tail[i] < 0 || tail[i] >= limit) skip = i + 1;
    }
    tail += skip;
    c_max -= skip;
    uint8_t pattern[4 * 64];
    if (c_max > 64) return -1;
    for (int64_t i = 0; i < c_max; i++) {
        for (int64_t b = 0; b < width; b++) pattern[i * width + b] = (uint8_t)(tail[i] >> (8 * (width - 1 - b)));
    }
    int64_t text_bytes = num_tokens * width, best = 0, best_lo = 0, best_hi = 0;
    int64_t a = cfg->c_min, b = c_max;
    while (a <= b) {
        int64_t c = (a + b) / 2, lo = 0, hi = 0;
        int64_t from = 0, to = num_tokens, t = tail[c_max - c];
        if (shard->first != NULL) { /* tokens are below the separator here */
            from = shard->first[t];
            to = shard->first[t + 1];
        }
        find_range(shard->text, text_bytes, shard->sa, from, to, pattern + (c_max - c) * width, c * width, &lo, &hi);
        if (hi > lo) {
            best = c;
            best_lo = lo;
            best_hi = hi;
            a = c + 1;
        } else {
            b = c - 1;
        }
    }
    if (best == 0) return 0;
    int64_t rows = sample_count(best_hi - best_lo, cfg->n), length = cfg->length;
    int32_t *mat = malloc(sizeof(int32_t) * (size_t)(rows * length + 1));
    int64_t *row_starts = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (!mat || !row_starts) {
        free(mat);
        free(row_starts);
        return -1;
    }
    for (int64_t i = 0; i < rows; i++) {
        int64_t start = shard->sa[sample_at(best_lo, best_hi, cfg->n, i)] / width + best;
        int stopped = 0;
        row_starts[i] = start;
        for (int64_t j = 0; j < length; j++) {
            int64_t pos = start + j;
            if (!stopped && (pos >= num_tokens || token_at(shard->text, width, pos) >= separator)) stopped = 1;
            mat[i * length + j] = stopped ? PAD : (int32_t)token_at(shard->text, width, pos);
        }
    }
    out->meta[0] = best;
    out->meta[1] = best_hi - best_lo;
    out->meta[2] = rows;
    int rc = top_candidates(mat, row_starts, rows, cfg, out);
    free(mat);
    free(row_starts);
    return rc;
}

/* ---- several shards' candidates merged (retrieval.merge) ---- */

typedef struct {
    int32_t token, parent, depth, first_child, next_sibling, stamp;
    int64_t total, pending, source_shard, source_start;
} PathNode;

static _Thread_local const PathNode *tl_paths; /* what by_merged compares: qsort passes no context */

static int by_merged(const void *a, const void *b) { /* count down, then depth, then first seen */
    const PathNode *x = tl_paths + *(const int32_t *)a, *y = tl_paths + *(const int32_t *)b;
    if (x->total != y->total) return x->total > y->total ? -1 : 1;
    if (x->depth != y->depth) return x->depth < y->depth ? -1 : 1;
    return *(const int32_t *)a < *(const int32_t *)b ? -1 : 1;
}

static int compare_paths(int32_t x, int32_t y) { /* as Python compares token tuples */
    int32_t px[130], py[130];
    int nx = 0, ny = 0;
    for (int32_t v = x; v >= 0; v = tl_paths[v].parent) px[nx++] = tl_paths[v].token;
    for (int32_t v = y; v >= 0; v = tl_paths[v].parent) py[ny++] = tl_paths[v].token;
    for (int i = 1; i <= nx && i <= ny; i++) {
        if (px[nx - i] != py[ny - i]) return px[nx - i] < py[ny - i] ? -1 : 1;
    }
    return (nx > ny) - (nx < ny);
}

static int by_merged_leaf(const void *a, const void *b) { /* count down, then the path */
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (tl_paths[x].total != tl_paths[y].total) return tl_paths[x].total > tl_paths[y].total ? -1 : 1;
    return compare_paths(x, y);
}

/* Merge the best-matching shards' candidates: equal paths add their counts (one count per path and
 * shard), the max_nodes highest (ties: shallower, then first seen) are kept, their leaves (by count,
 * then path) are the candidates. out_shards[i]: the shard of candidate i's source. */
static int merge_shards(const Output *parts, const int64_t *best, int64_t num_best, const Config *cfg,
                        Output *out, int64_t *out_shards) {
    int64_t length = cfg->length, capacity = 1;
    for (int64_t s = 0; s < num_best; s++) capacity += parts[best[s]].meta[3] * length;
    PathNode *nodes = malloc(sizeof(PathNode) * (size_t)capacity);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)capacity);
    uint8_t *flags = calloc((size_t)capacity, 2); /* [kept, has a kept child] */
    int rc = -1;
    if (!nodes || !order || !flags) goto done;
    int32_t count = 0, roots = -1, roots_last = -1;
    for (int64_t s = 0; s < num_best; s++) {
        const Output *part = &parts[best[s]];
        for (int64_t c = 0; c < part->meta[3]; c++) {
            int32_t parent = -1;
            for (int32_t i = 0; i < part->lengths[c]; i++) {
                int32_t token = part->tokens[c * length + i];
                int32_t child = parent >= 0 ? nodes[parent].first_child : roots, last = -1;
                while (child >= 0 && nodes[child].token != token) {
                    last = child;
                    child = nodes[child].next_sibling;
                }
                if (child < 0) {
                    child = count++;
                    nodes[child] = (PathNode){token, parent, i, -1, -1, -1, 0, 0, best[s], part->starts[c]};
                    if (last >= 0) nodes[last].next_sibling = child;
                    else if (parent >= 0) nodes[parent].first_child = child;
                    else if (roots_last >= 0) nodes[roots_last].next_sibling = child;
                    else roots = child;
                    if (parent < 0) roots_last = child;
                }
                nodes[child].stamp = (int32_t)s;
                nodes[child].pending = part->counts[c * length + i]; /* the shard's last word */
                parent = child;
            }
        }
        for (int32_t v = 0; v < count; v++) {
            if (nodes[v].stamp == (int32_t)s) {
                nodes[v].total += nodes[v].pending;
                nodes[v].stamp = -1;
            }
        }
    }
    for (int32_t v = 0; v < count; v++) order[v] = v;
    tl_paths = nodes;
    qsort(order, (size_t)count, sizeof(int32_t), by_merged);
    int64_t k = cfg->max_nodes < count ? cfg->max_nodes : count;
    for (int64_t i = 0; i < k; i++) flags[2 * order[i]] = 1;
    for (int32_t v = 0; v < count; v++) {
        if (flags[2 * v] && nodes[v].parent >= 0) flags[2 * nodes[v].parent + 1] = 1;
    }
    int32_t num_leaves = 0;
    for (int32_t v = 0; v < count; v++) {
        if (flags[2 * v] && !flags[2 * v + 1]) order[num_leaves++] = v;
    }
    qsort(order, (size_t)num_leaves, sizeof(int32_t), by_merged_leaf);
    int64_t d_out = num_leaves < cfg->max_candidates ? num_leaves : cfg->max_candidates;
    for (int64_t c = 0; c < d_out; c++) {
        int32_t leaf = order[c], depth = nodes[leaf].depth;
        out->lengths[c] = depth + 1;
        out->starts[c] = nodes[leaf].source_start;
        out_shards[c] = nodes[leaf].source_shard;
        for (int32_t v = leaf; v >= 0; v = nodes[v].parent) {
            out->tokens[c * length + nodes[v].depth] = nodes[v].token;
            out->counts[c * length + nodes[v].depth] = (int32_t)nodes[v].total;
        }
    }
    out->meta[3] = d_out;
    rc = 0;
done:
    free(nodes);
    free(order);
    free(flags);
    return rc;
}

/* Shards searched for the context's last tokens (at most c_max are read) and merged as
 * retrieval.merge merges their answers; one shard's answer is its own. shards: [num_shards, 6]
 * (tokens address, tokens, width, suffix array address, separator, first-token table address or 0);
 * cfg: {c_min, c_max, n, length, max_nodes, max_candidates}. out_shards[i]: the position in
 * shards of candidate i's source. */
int sd_shards_candidates(int64_t num_shards, const int64_t *shards, const int64_t *context, int64_t context_size,
                         const int64_t *cfg_values, int64_t *meta, int32_t *tokens, int32_t *counts, int32_t *lengths,
                         int64_t *starts, int64_t *out_shards) {
    Config cfg = config_of(cfg_values);
    Output out = {meta, tokens, counts, lengths, starts};
    meta[0] = meta[1] = meta[2] = meta[3] = 0;
    int64_t per = cfg.max_candidates * cfg.length, rc = -1;
    Output *parts = calloc((size_t)num_shards + 1, sizeof(Output));
    int64_t *space = malloc(sizeof(int64_t) * (size_t)(num_shards * (4 + 2 * cfg.max_candidates) + 1));
    int32_t *space32 = malloc(sizeof(int32_t) * (size_t)(num_shards * (2 * per + cfg.max_candidates) + 1));
    int64_t *best = malloc(sizeof(int64_t) * (size_t)(num_shards + 1));
    if (!parts || !space || !space32 || !best) goto done;
    int64_t c = 0, num_best = 0;
    for (int64_t s = 0; s < num_shards; s++) {
        const int64_t *a = shards + 6 * s;
        ShardArrays shard = {(const uint8_t *)(intptr_t)a[0], a[1], a[2], (const int32_t *)(intptr_t)a[3], a[4],
                             (const int64_t *)(intptr_t)a[5]};
        int64_t *w = space + s * (4 + 2 * cfg.max_candidates);
        int32_t *w32 = space32 + s * (2 * per + cfg.max_candidates);
        parts[s] = (Output){w, w32, w32 + per, w32 + 2 * per, w + 4};
        if (shard_top(&shard, context, context_size, &cfg, &parts[s]) != 0) goto done;
        if (parts[s].meta[0] > c) c = parts[s].meta[0];
    }
    rc = 0;
    if (c == 0) goto done;
    int64_t occurrences = 0, sampled = 0;
    for (int64_t s = 0; s < num_shards; s++) {
        if (parts[s].meta[0] == c) {
            best[num_best++] = s;
            occurrences += parts[s].meta[1];
            sampled += parts[s].meta[2];
        }
    }
    meta[0] = c;
    meta[1] = occurrences;
    meta[2] = sampled;
    if (num_best == 1 && parts[best[0]].meta[3] <= cfg.max_candidates) { /* one shard's answer as it is */
        const Output *only = &parts[best[0]];
        meta[3] = only->meta[3];
        memcpy(tokens, only->tokens, sizeof(int32_t) * (size_t)per);
        memcpy(counts, only->counts, sizeof(int32_t) * (size_t)per);
        memcpy(lengths, only->lengths, sizeof(int32_t) * (size_t)cfg.max_candidates);
        memcpy(starts, only->starts, sizeof(int64_t) * (size_t)cfg.max_candidates);
        for (int64_t i = 0; i < meta[3]; i++) out_shards[i] = best[0];
        goto done;
    }
    rc = merge_shards(parts, best, num_best, &cfg, &out, out_shards);
done:
    free(parts);
    free(space);
    free(space32);
    free(best);
    return (int)rc;
}

/* ---- the context itself: a scan, no index ---- */

static _Thread_local const int32_t *tl_rows; /* what by_row compares: qsort passes no context */
static _Thread_local int64_t tl_length;

static int by_row(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    for (int64_t j = 0; j < tl_length; j++) {
        int64_t u = tl_rows[x * tl_length + j], v = tl_rows[y * tl_length + j];
        if (u == PAD) u = INT64_MAX; /* an ended row sorts last, as the separator does */
        if (v == PAD) v = INT64_MAX;
        if (u != v) return u < v ? -1 : 1;
    }
    return (x > y) - (x < y); /* ties keep the occurrences' order */
}

/* The longest suffix of context[-c_max:] that occurred before the last token, and what followed
 * it (context_retrieval). */
int sd_context_candidates(const int64_t *context, int64_t context_size, int64_t separator,
                          const int64_t *cfg_values, int64_t *meta, int32_t *tokens, int32_t *counts,
                          int32_t *lengths, int64_t *starts) {
    Config cfg = config_of(cfg_values);
    Output out = {meta, tokens, counts, lengths, starts};
    meta[0] = meta[1] = meta[2] = meta[3] = 0;
    int64_t body = context_size - 1;
    if (body <= 0) return 0;
    int64_t m = cfg.c_max < context_size ? cfg.c_max : context_size;
    const int64_t *pattern = context + context_size - m;
    int64_t *run = malloc(sizeof(int64_t) * (size_t)body);
    if (!run) return -1;
    int64_t c = 0;
    for (int64_t j = 0; j < body; j++) { /* run[j]: the pattern's suffix that ends at j */
        int64_t k = 0;
        while (k < m && k <= j && context[j - k] == pattern[m - 1 - k]) k++;
        run[j] = k;
        if (k > c) c = k;
    }
    int64_t c_min = cfg.c_min > 1 ? cfg.c_min : 1;
    if (c < c_min) {
        free(run);
        return 0;
    }
    int64_t occurrences = 0;
    for (int64_t j = 0; j < body; j++) {
        if (run[j] == c) run[occurrences++] = j; /* in place: the ends, in order */
    }
    int64_t rows = sample_count(occurrences, cfg.n), length = cfg.length;
    int32_t *mat = malloc(sizeof(int32_t) * (size_t)(rows * length + 1));
    int32_t *sorted = malloc(sizeof(int32_t) * (size_t)(rows * length + 1));
    int64_t *row_starts = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    int64_t *sorted_starts = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    int rc = -1;
    if (!mat || !sorted || !row_starts || !sorted_starts || !order) goto done;
    for (int64_t i = 0; i < rows; i++) {
        int64_t start = run[sample_at(0, occurrences, cfg.n, i)] + 1;
        int stopped = 0;
        row_starts[i] = start;
        order[i] = i;
        for (int64_t j = 0; j < length; j++) { /* the body, then a separator */
            int64_t pos = start + j;
            if (!stopped && (pos >= body || context[pos] >= separator)) stopped = 1;
            mat[i * length + j] = stopped ? PAD : (int32_t)context[pos];
        }
    }
    tl_rows = mat;
    tl_length = length;
    qsort(order, (size_t)rows, sizeof(int64_t), by_row);
    for (int64_t i = 0; i < rows; i++) {
        memcpy(sorted + i * length, mat + order[i] * length, sizeof(int32_t) * (size_t)length);
        sorted_starts[i] = row_starts[order[i]];
    }
    meta[0] = c;
    meta[1] = occurrences;
    meta[2] = rows;
    rc = top_candidates(sorted, sorted_starts, rows, &cfg, &out);
done:
    free(run);
    free(mat);
    free(sorted);
    free(row_starts);
    free(sorted_starts);
    free(order);
    return rc;
}
