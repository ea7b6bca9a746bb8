/* REST's sparse retrieval in one call: a shard's suffix-array match, or a scan of the context,
 * then the continuations' trie and its most frequent prefixes (datastore_svc/native.py). At the
 * end of the file, DReSD's dense retrieval in one call: every shard's inverted lists searched and
 * the drafts after the hits read and merged (sd_dense_candidates).
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
#include <stdatomic.h>
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

/* ---- dense retrieval (DReSD): an IVF search of half-precision keys, then the drafts ---- */

/* The same steps as datastore_svc/dense.py's dense_retrieve, drafts_from_hits and merge_dense
 * over FAISS's own arrays (an IndexIVFScalarQuantizer of fp16 keys, inner product): the nprobe
 * lists whose centroids score highest, every key in them scored (the centroid's score added when
 * the keys are residuals), the top_k kept (ties: the lower key row), then the hits whose next
 * token is the verified one read as drafts. */

typedef struct {
    int64_t nlist, dims, by_residual, nprobe;
    const float *centroids;   /* [nlist, dims] */
    const int64_t *sizes;     /* [nlist] keys per list */
    const int64_t *codes;     /* [nlist] addresses of uint16 [size, dims]: IEEE half keys */
    const int64_t *ids;       /* [nlist] addresses of int64 [size]: each key's row */
    const uint8_t *positions; /* [keys] int32 or int64 (position_width bytes): a key's token position */
    int64_t position_width, num_keys;
    const uint8_t *text; /* the shard's tokens, big-endian, as ShardArrays */
    int64_t num_tokens, width, separator;
} DenseShard;

#define DENSE_ROW 15

static DenseShard dense_shard_of(const int64_t *a) {
    return (DenseShard){a[0], a[1], a[2], a[3],
                        (const float *)(intptr_t)a[4], (const int64_t *)(intptr_t)a[5],
                        (const int64_t *)(intptr_t)a[6], (const int64_t *)(intptr_t)a[7],
                        (const uint8_t *)(intptr_t)a[8], a[9], a[10],
                        (const uint8_t *)(intptr_t)a[11], a[12], a[13], a[14]};
}

static float half_to_float(uint16_t h) {
    /* the exponent rebased by a multiply: exact for normal and subnormal halves alike */
    uint32_t bits = (uint32_t)(h & 0x7fff) << 13, sign = (uint32_t)(h & 0x8000) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    f *= 0x1p112f;
    memcpy(&bits, &f, sizeof f);
    bits |= sign;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float dot_half(const float *q, const uint16_t *key, int64_t dims) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* eight partial sums: the compiler vectorises them */
    int64_t j = 0;
    for (; j + 8 <= dims; j += 8)
        for (int u = 0; u < 8; u++) acc[u] += q[j + u] * half_to_float(key[j + u]);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < dims; j++) s += q[j] * half_to_float(key[j]);
    return s;
}

static float dot_float(const float *q, const float *x, int64_t dims) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= dims; j += 8)
        for (int u = 0; u < 8; u++) acc[u] += q[j + u] * x[j + u];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < dims; j++) s += q[j] * x[j];
    return s;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86_DISPATCH 1

/* AVX2, FMA and F16C, and an OS that saves the AVX registers (F16C by CPUID: older compilers'
 * __builtin_cpu_supports does not know it) */
static int has_avx2_f16c(void) {
    unsigned a, b, c, d;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c >> 29) & 1u;
}

__attribute__((target("avx2,fma,f16c"))) static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c"))) static float dot_half_avx2(const float *q, const uint16_t *key,
                                                                    int64_t dims) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= dims; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(key + j))), acc);
    float s = hsum256(acc);
    for (; j < dims; j++) s += q[j] * half_to_float(key[j]);
    return s;
}

__attribute__((target("avx2,fma,f16c"))) static float dot_float_avx2(const float *q, const float *x, int64_t dims) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= dims; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(x + j), acc);
    float s = hsum256(acc);
    for (; j < dims; j++) s += q[j] * x[j];
    return s;
}
#endif

typedef float (*DotHalf)(const float *, const uint16_t *, int64_t);
typedef float (*DotFloat)(const float *, const float *, int64_t);

static _Atomic int simd_allowed = 1;

/* Whether the dense search uses vector instructions: mode 0 forbids them (tests of the plain C
 * path), 1 allows them, -1 only asks. Returns whether they are used now. */
int sd_dense_simd(int mode) {
    if (mode >= 0) simd_allowed = mode;
#ifdef HAVE_X86_DISPATCH
    return simd_allowed && has_avx2_f16c();
#else
    return 0;
#endif
}

/* The dot products this CPU runs fastest: AVX2 with FMA and F16C where it has them. */
static void pick_dots(DotHalf *half, DotFloat *full) {
    *half = dot_half;
    *full = dot_float;
#ifdef HAVE_X86_DISPATCH
    if (simd_allowed && has_avx2_f16c()) {
        *half = dot_half_avx2;
        *full = dot_float_avx2;
    }
#endif
}

/* The k best (score, id) seen: a heap whose root is the worst kept (lower score, or equal score
 * and higher id). */
typedef struct {
    float *score;
    int64_t *id;
    int64_t size, k;
} Best;

static int worse(float s, int64_t i, float t, int64_t j) { return s < t || (s == t && i > j); }

static void best_offer(Best *b, float s, int64_t id) {
    int64_t at;
    if (b->size < b->k) {
        at = b->size++;
        while (at > 0) { /* up */
            int64_t up = (at - 1) / 2;
            if (!worse(s, id, b->score[up], b->id[up])) break;
            b->score[at] = b->score[up];
            b->id[at] = b->id[up];
            at = up;
        }
    } else {
        if (b->k == 0 || !worse(b->score[0], b->id[0], s, id)) return;
        at = 0;
        for (;;) { /* down */
            int64_t l = 2 * at + 1, r = l + 1, w = at;
            float ws = s;
            int64_t wi = id;
            if (l < b->size && worse(b->score[l], b->id[l], ws, wi)) w = l, ws = b->score[l], wi = b->id[l];
            if (r < b->size && worse(b->score[r], b->id[r], ws, wi)) w = r;
            if (w == at) break;
            b->score[at] = b->score[w];
            b->id[at] = b->id[w];
            at = w;
        }
    }
    b->score[at] = s;
    b->id[at] = id;
}

static _Thread_local const Best *tl_best;

static int by_best(const void *a, const void *b) { /* score down, then id up */
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    const Best *h = tl_best;
    if (h->score[x] != h->score[y]) return h->score[x] > h->score[y] ? -1 : 1;
    return (h->id[x] > h->id[y]) - (h->id[x] < h->id[y]);
}

typedef struct {
    int64_t max_candidates, length, next_token, top_k;
} DenseConfig;

/* Drafts kept so far: tokens [capacity, length], and per draft its length, score, count, start
 * position and shard (position in the table). */
typedef struct {
    int32_t *tokens, *lengths, *counts;
    float *score;
    int64_t *starts, *shards;
    int64_t size, capacity, length;
} Drafts;

static Drafts drafts_alloc(int64_t capacity, int64_t length) {
    size_t n = (size_t)capacity + 1;
    return (Drafts){malloc(sizeof(int32_t) * n * (size_t)length), malloc(sizeof(int32_t) * n),
                    malloc(sizeof(int32_t) * n), malloc(sizeof(float) * n), malloc(sizeof(int64_t) * n),
                    malloc(sizeof(int64_t) * n), 0, capacity, length};
}

static int drafts_ok(const Drafts *d) {
    return d->tokens && d->lengths && d->counts && d->score && d->starts && d->shards;
}

static void drafts_free(Drafts *d) {
    free(d->tokens);
    free(d->lengths);
    free(d->counts);
    free(d->score);
    free(d->starts);
    free(d->shards);
}

static int64_t find_draft(const Drafts *d, const int32_t *draft, int64_t n) {
    for (int64_t i = 0; i < d->size; i++) {
        if (d->lengths[i] == n && memcmp(d->tokens + i * d->length, draft, sizeof(int32_t) * (size_t)n) == 0)
            return i;
    }
    return -1;
}

static void add_draft(Drafts *d, const int32_t *draft, int64_t n, float score, int32_t count, int64_t start,
                      int64_t shard) {
    int64_t i = d->size++;
    memcpy(d->tokens + i * d->length, draft, sizeof(int32_t) * (size_t)n);
    d->lengths[i] = (int32_t)n;
    d->score[i] = score;
    d->counts[i] = count;
    d->starts[i] = start;
    d->shards[i] = shard;
}

static int64_t key_position(const DenseShard *s, int64_t row) {
    const uint8_t *p = s->positions + row * s->position_width;
    if (s->position_width == 4) {
        int32_t v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One shard: search, then its drafts (the first max_candidates distinct ones by score, each with
 * the count of every hit that drafted it) appended to out. searched/matched as drafts_from_hits. */
static int dense_shard(const DenseShard *s, int64_t shard, const float *query, const DenseConfig *cfg,
                       Drafts *out, int64_t *searched, int64_t *matched) {
    int64_t probes = s->nprobe < s->nlist ? s->nprobe : s->nlist;
    Best lists = {malloc(sizeof(float) * (size_t)(probes + 1)), malloc(sizeof(int64_t) * (size_t)(probes + 1)), 0,
                  probes};
    Best keys = {malloc(sizeof(float) * (size_t)(cfg->top_k + 1)),
                 malloc(sizeof(int64_t) * (size_t)(cfg->top_k + 1)), 0, cfg->top_k};
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(cfg->top_k + 1));
    int32_t *draft = malloc(sizeof(int32_t) * (size_t)(cfg->length + 1));
    int rc = -1;
    if (!lists.score || !lists.id || !keys.score || !keys.id || !order || !draft) goto done;
    DotHalf dot_key;
    DotFloat dot_centroid;
    pick_dots(&dot_key, &dot_centroid);
    for (int64_t l = 0; l < s->nlist; l++) best_offer(&lists, dot_centroid(query, s->centroids + l * s->dims, s->dims), l);
    for (int64_t p = 0; p < lists.size; p++) {
        int64_t l = lists.id[p];
        float base = s->by_residual ? lists.score[p] : 0.0f;
        const uint16_t *code = (const uint16_t *)(intptr_t)s->codes[l];
        const int64_t *ids = (const int64_t *)(intptr_t)s->ids[l];
        for (int64_t i = 0; i < s->sizes[l]; i++) best_offer(&keys, base + dot_key(query, code + i * s->dims, s->dims), ids[i]);
    }
    for (int64_t i = 0; i < keys.size; i++) order[i] = i;
    tl_best = &keys;
    qsort(order, (size_t)keys.size, sizeof(int64_t), by_best);
    int64_t first = out->size; /* this shard's drafts start here */
    for (int64_t h = 0; h < keys.size; h++) {
        int64_t row = keys.id[order[h]];
        if (row < 0 || row >= s->num_keys) continue; /* no key of this index: nothing to read */
        int64_t p = key_position(s, row);
        if (p < 0) continue;
        (*searched)++;
        if (p + 1 >= s->num_tokens || token_at(s->text, s->width, p + 1) != cfg->next_token) continue;
        (*matched)++;
        int64_t n = 0;
        while (n < cfg->length && p + 2 + n < s->num_tokens) {
            int64_t t = token_at(s->text, s->width, p + 2 + n);
            if (t >= s->separator) break;
            draft[n++] = (int32_t)t;
        }
        if (n == 0) continue;
        Drafts mine = *out; /* this shard's part only: another shard's equal draft is merged later */
        mine.tokens += first * out->length;
        mine.lengths += first;
        mine.size = out->size - first;
        int64_t seen = find_draft(&mine, draft, n);
        if (seen >= 0) out->counts[first + seen]++;
        else if (out->size - first < cfg->max_candidates)
            add_draft(out, draft, n, keys.score[order[h]], 1, p + 2, shard);
    }
    rc = 0;
done:
    free(lists.score);
    free(lists.id);
    free(keys.score);
    free(keys.id);
    free(order);
    free(draft);
    return rc;
}

static _Thread_local const float *tl_scores;

static int by_score_stable(const void *a, const void *b) { /* score down, then first seen */
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    if (tl_scores[x] != tl_scores[y]) return tl_scores[x] > tl_scores[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* Every shard of shards [num_shards, DENSE_ROW] searched for query [dims] and merged as
 * merge_dense merges their answers. cfg: {max_candidates, length, next_token, top_k}. Outputs:
 * meta[3] = {searched, matched, candidates}; per candidate i: lengths[i], tokens[i * length + j],
 * counts[i], scores[i], starts[i], out_shards[i] (its shard's position in shards). */
int sd_dense_candidates(int64_t num_shards, const int64_t *shards, const float *query, const int64_t *cfg_values,
                        int64_t *meta, int32_t *tokens, int32_t *counts, int32_t *lengths, float *scores,
                        int64_t *starts, int64_t *out_shards) {
    DenseConfig cfg = {cfg_values[0], cfg_values[1], cfg_values[2], cfg_values[3]};
    if (cfg.max_candidates < 0 || cfg.length < 0 || cfg.top_k < 0) return -1;
    int64_t capacity = num_shards * cfg.max_candidates, searched = 0, matched = 0;
    meta[0] = meta[1] = meta[2] = 0;
    Drafts all = drafts_alloc(capacity, cfg.length), merged = drafts_alloc(capacity, cfg.length);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(capacity + 1));
    int rc = -1;
    if (!drafts_ok(&all) || !drafts_ok(&merged) || !order) goto done;
    for (int64_t s = 0; s < num_shards; s++) {
        DenseShard shard = dense_shard_of(shards + DENSE_ROW * s);
        if (dense_shard(&shard, s, query, &cfg, &all, &searched, &matched) != 0) goto done;
    }
    for (int64_t i = 0; i < all.size; i++) { /* equal drafts merge: the best score's source, counts add */
        const int32_t *draft = all.tokens + i * cfg.length;
        int64_t seen = find_draft(&merged, draft, all.lengths[i]);
        if (seen < 0) {
            add_draft(&merged, draft, all.lengths[i], all.score[i], all.counts[i], all.starts[i], all.shards[i]);
            continue;
        }
        merged.counts[seen] += all.counts[i];
        if (all.score[i] > merged.score[seen]) {
            merged.score[seen] = all.score[i];
            merged.starts[seen] = all.starts[i];
            merged.shards[seen] = all.shards[i];
        }
    }
    for (int64_t i = 0; i < merged.size; i++) order[i] = i;
    tl_scores = merged.score;
    qsort(order, (size_t)merged.size, sizeof(int64_t), by_score_stable);
    int64_t found = merged.size < cfg.max_candidates ? merged.size : cfg.max_candidates;
    for (int64_t i = 0; i < found; i++) {
        int64_t k = order[i];
        memcpy(tokens + i * cfg.length, merged.tokens + k * cfg.length, sizeof(int32_t) * (size_t)merged.lengths[k]);
        lengths[i] = merged.lengths[k];
        counts[i] = merged.counts[k];
        scores[i] = merged.score[k];
        starts[i] = merged.starts[k];
        out_shards[i] = merged.shards[k];
    }
    meta[0] = searched;
    meta[1] = matched;
    meta[2] = found;
    rc = 0;
done:
    drafts_free(&all);
    drafts_free(&merged);
    free(order);
    return rc;
}
