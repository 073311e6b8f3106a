/* kvd.core._pool: the block pool's per-block operations in C, over tables bound once.

Theory of operation
-------------------
At batch 256 a request's cost is the pool's per-block bookkeeping: for each block a few stores
into the pool's tables, each a bytecode dispatch or a method call in Python; at batch 1 it is the
Python around them. kvd/core/pool.py keeps its whole state in one `PoolTables` object (its
docstring is the contract); `bind(tables, policy, observer)` reads that object's fields once,
checks each one's type, item format and length (a renamed or retyped field raises TypeError
there, naming it), holds the fixed-size tables' buffers (so none can be resized under it) and
returns a `Loops` object whose methods are the pool's operations, each done whole:

    allocate(num_blocks, owner)        -> list | None    the top blocks of the free stack
    evict(num_needed)                  -> None | (key,)  victims and their subtrees, until free
    seal(block_ids, keys, parents, tiers, owner) -> list | None
    put(key, tier)                     -> int | None | (key,)   one key cached, evicting if need be
    lookup(keys, owner)                -> list | None
    pin(block_ids, owner)              -> bool
    release(block_ids, owner)          -> bool
    journal_rows(block_ids)            -> list | None

Each does exactly what BlockPool's Python does for that call -- the same table changes and the
same policy and observer calls in the same order -- or declines before changing anything (None
or False): for arguments it does not vouch for (not a list, an id that is not an exact int in
the pool, an id named twice, a key that is not exact bytes -- for put, nor a tuple of exact
ints -- anything that must raise a KvdError), for allocate when the free list is short, and for
put when no block is free or evictable. Then the Python does the whole call. The Python is the
specification; tests/native/test_pool_c.py runs twin pools and compares every table and every
event. evict and put return (key,) when the policy let go of a key that is not a cached block:
the pool raises InternalError naming the policy.

The policy is reached through its public interface only (kvd/core/policies/base.py), its bound
methods looked up once here; the observer's `evicted` likewise. A caller's keys are hashed here
only when they are exact bytes or (put) tuples of exact ints: no Python __hash__ or __eq__ runs
before a call is vouched for; keys the pool's tables or its policy hold are the pool's own. Ids
repeated in one call are found with a scratch bit in their state byte (SEEN), set and cleared
before anything changes.

What it buys: `python -m bench.pool_ab --base python` (the pool's ops with and without the C, at
any batch); eviction and journal_rows are measured alone by timing a full pool's allocate and
journal_rows with and without them.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* kvd/core/pool.py's block states, its empty link and no chosen victim, and the counts' slots
   (PoolTables.COUNT_NAMES, checked by bind). */
enum { FREE = 0, OWNED = 1, SEALED = 2, CACHED = 3 };
#define SEEN 0x80
#define NO_BLOCK (-1)
enum { NUM_FREE, NUM_OWNED, NUM_SEALED, NEXT_VICTIM, ALLOCATIONS, EVICTIONS, SEALS, LOOKUPS,
       LOOKUP_BLOCKS, HIT_BLOCKS, NUM_COUNTS };
static const char *const count_names[NUM_COUNTS] = {
    "free", "owned", "sealed", "next_victim", "allocations", "evictions", "seals", "lookups",
    "lookup_blocks", "hit_blocks"};

/* The fixed-size tables: field name, item format, item size, and length (0: num_blocks). */
enum { T_STATE, T_TIER, T_ORPHAN, T_DUPLICATE, T_PARENT, T_FIRST_CHILD, T_NEXT_SIBLING,
       T_PREV_SIBLING, T_REFS, T_FREE, T_GENERATIONS, T_COUNTS, NUM_BUFFERS };
static const struct { const char *name; char format; Py_ssize_t itemsize, length; } buffer_fields[] = {
    {"state", 'B', 1, 0}, {"tier", 'B', 1, 0}, {"is_orphan", 'B', 1, 0},
    {"is_duplicate", 'B', 1, 0}, {"parent", 'i', 4, 0}, {"first_child", 'i', 4, 0},
    {"next_sibling", 'i', 4, 0}, {"prev_sibling", 'i', 4, 0}, {"refs", 'q', 8, 0},
    {"free", 'q', 8, 0}, {"generations", 'Q', 8, 0}, {"counts", 'q', 8, NUM_COUNTS},
};
/* The policy's methods the pool calls (kvd/core/policies/base.py), then the observer's. */
enum { P_INSERTED, P_INSERTED_MANY, P_HIT, P_HIT_MANY, P_ACCESSED, P_REMOVED, P_DISCARD,
       P_FORGOTTEN, P_VICTIM, NUM_POLICY };
static const char *const policy_methods[NUM_POLICY] = {
    "inserted", "inserted_many", "hit_evictable", "hit_evictable_many", "accessed", "removed",
    "discard", "forgotten", "victim"};

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_blocks;
    Py_buffer views[NUM_BUFFERS];
    int num_views;
    unsigned char *state, *tier, *orphan, *duplicate;
    int32_t *parent, *first_child, *next_sibling, *prev_sibling;
    int64_t *refs, *free, *counts;
    uint64_t *generations;
    PyObject *hashes, *index, *held;  /* list, dict, dict */
    PyObject *policy[NUM_POLICY];     /* bound methods */
    PyObject *evicted;                /* the observer's, or NULL */
} Loops;

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* ---- binding ----------------------------------------------------------------------------- */

static int bind_buffer(Loops *self, PyObject *tables, int which)
{
    const char *name = buffer_fields[which].name;
    PyObject *field = PyObject_GetAttrString(tables, name);
    if (field == NULL)
        return -1;
    Py_buffer *view = &self->views[which];
    int status = PyObject_GetBuffer(field, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS);
    Py_DECREF(field);
    if (status < 0) {
        PyErr_Format(PyExc_TypeError, "bind: tables.%s is not a writable buffer", name);
        return -1;
    }
    self->num_views++;
    const char *format = view->format == NULL ? "B" : view->format;
    if (format[0] != '\0' && strchr("<=@", format[0]) != NULL)  /* (native order and size) */
        format++;
    Py_ssize_t length = buffer_fields[which].length ? buffer_fields[which].length
                                                    : self->num_blocks;
    if (format[0] != buffer_fields[which].format || format[1] != '\0'
            || view->itemsize != buffer_fields[which].itemsize
            || view->len != length * view->itemsize) {
        PyErr_Format(PyExc_TypeError, "bind: tables.%s must hold %zd items of format '%c' "
                     "(got %zd of '%s')", name, length, buffer_fields[which].format,
                     view->itemsize ? view->len / view->itemsize : 0, format);
        return -1;
    }
    return 0;
}

/* tables.name, a new reference, if it is exactly of `type`; else NULL with a TypeError. */
static PyObject *bind_object(PyObject *tables, const char *name, PyTypeObject *type)
{
    PyObject *field = PyObject_GetAttrString(tables, name);
    if (field != NULL && !Py_IS_TYPE(field, type)) {
        PyErr_Format(PyExc_TypeError, "bind: tables.%s must be a %s, not %s", name, type->tp_name,
                     Py_TYPE(field)->tp_name);
        Py_CLEAR(field);
    }
    return field;
}

static int bind_count_names(PyObject *tables)
{
    PyObject *names = PyObject_GetAttrString(tables, "COUNT_NAMES");
    if (names == NULL)
        return -1;
    int fits = PyTuple_Check(names) && PyTuple_GET_SIZE(names) == NUM_COUNTS;
    for (int i = 0; fits && i < NUM_COUNTS; i++) {
        PyObject *item = PyTuple_GET_ITEM(names, i);
        fits = PyUnicode_Check(item) && PyUnicode_CompareWithASCIIString(item, count_names[i]) == 0;
    }
    Py_DECREF(names);
    if (!fits)
        PyErr_SetString(PyExc_TypeError, "bind: tables.COUNT_NAMES differ from kvd/core/_pool.c's");
    return fits ? 0 : -1;
}

static PyTypeObject LoopsType;

static PyObject *pool_bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("bind", nargs, 3) < 0)
        return NULL;
    PyObject *tables = args[0], *policy = args[1], *observer = args[2];
    Loops *self = PyObject_GC_New(Loops, &LoopsType);
    if (self == NULL)
        return NULL;
    self->num_views = 0;
    self->hashes = self->index = self->held = self->evicted = NULL;
    for (int i = 0; i < NUM_POLICY; i++)
        self->policy[i] = NULL;
    PyObject_GC_Track(self);
    self->hashes = bind_object(tables, "hashes", &PyList_Type);
    if (self->hashes == NULL)
        goto fail;
    self->num_blocks = PyList_GET_SIZE(self->hashes);
    if (self->num_blocks <= 0 || self->num_blocks > INT32_MAX) {
        PyErr_SetString(PyExc_TypeError, "bind: tables.hashes must hold 1 to 2**31-1 blocks");
        goto fail;
    }
    if ((self->index = bind_object(tables, "index", &PyDict_Type)) == NULL
            || (self->held = bind_object(tables, "held", &PyDict_Type)) == NULL
            || bind_count_names(tables) < 0)
        goto fail;
    for (int i = 0; i < NUM_BUFFERS; i++)
        if (bind_buffer(self, tables, i) < 0)
            goto fail;
    self->state = self->views[T_STATE].buf;
    self->tier = self->views[T_TIER].buf;
    self->orphan = self->views[T_ORPHAN].buf;
    self->duplicate = self->views[T_DUPLICATE].buf;
    self->parent = self->views[T_PARENT].buf;
    self->first_child = self->views[T_FIRST_CHILD].buf;
    self->next_sibling = self->views[T_NEXT_SIBLING].buf;
    self->prev_sibling = self->views[T_PREV_SIBLING].buf;
    self->refs = self->views[T_REFS].buf;
    self->free = self->views[T_FREE].buf;
    self->generations = self->views[T_GENERATIONS].buf;
    self->counts = self->views[T_COUNTS].buf;
    for (int i = 0; i < NUM_POLICY; i++)
        if ((self->policy[i] = PyObject_GetAttrString(policy, policy_methods[i])) == NULL)
            goto fail;
    if (observer != Py_None && (self->evicted = PyObject_GetAttrString(observer, "evicted")) == NULL)
        goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int loops_traverse(Loops *self, visitproc visit, void *arg)
{
    Py_VISIT(self->hashes);
    Py_VISIT(self->index);
    Py_VISIT(self->held);
    Py_VISIT(self->evicted);
    for (int i = 0; i < NUM_POLICY; i++)
        Py_VISIT(self->policy[i]);
    return 0;
}

static int loops_clear(Loops *self)
{
    Py_CLEAR(self->hashes);
    Py_CLEAR(self->index);
    Py_CLEAR(self->held);
    Py_CLEAR(self->evicted);
    for (int i = 0; i < NUM_POLICY; i++)
        Py_CLEAR(self->policy[i]);
    return 0;
}

static void loops_dealloc(Loops *self)
{
    PyObject_GC_UnTrack(self);
    loops_clear(self);
    while (self->num_views > 0)
        PyBuffer_Release(&self->views[--self->num_views]);
    PyObject_GC_Del(self);
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* The id `item` names if it is an exact int in [0, num_blocks), else -1. */
static Py_ssize_t block_of(Loops *self, PyObject *item)
{
    if (!PyLong_CheckExact(item))
        return -1;
    Py_ssize_t block_id = PyLong_AsSsize_t(item);
    if (block_id == -1 && PyErr_Occurred()) {
        PyErr_Clear();  /* too large for a Py_ssize_t: out of range */
        return -1;
    }
    return block_id < self->num_blocks ? block_id : -1;
}

/* Whether the hashes list still has a slot per block (Python code could change its length). */
static int hashes_fit(Loops *self)
{
    if (PyList_GET_SIZE(self->hashes) == self->num_blocks)
        return 1;
    PyErr_SetString(PyExc_SystemError, "kvd/core/_pool.c: the pool's hashes changed length");
    return 0;
}

/* Each id of `block_ids` (a list) is an exact int in the pool, none repeated, and its state fits
   `wanted` (a bit per state); 0 if not. The SEEN marks are cleared again. */
static int ids_fit(Loops *self, PyObject *block_ids, int wanted)
{
    Py_ssize_t count = PyList_GET_SIZE(block_ids), checked = 0;
    int fits = 1;
    for (; fits && checked < count; checked++) {
        Py_ssize_t block_id = block_of(self, PyList_GET_ITEM(block_ids, checked));
        fits = block_id >= 0 && !(self->state[block_id] & SEEN)
               && (wanted & (1 << self->state[block_id]));
        if (fits)
            self->state[block_id] |= SEEN;
        else
            break;
    }
    for (Py_ssize_t i = 0; i < checked; i++)
        self->state[PyLong_AsSsize_t(PyList_GET_ITEM(block_ids, i))] &= ~SEEN;
    return fits;
}

/* The pins `held` has on `block` (0 when none); -1 with an exception, -2 for a non-int value. */
static long pins_of(PyObject *held, PyObject *block)
{
    PyObject *value = PyDict_GetItemWithError(held, block);  /* borrowed */
    if (value == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(value))
        return -2;
    long pins = PyLong_AsLong(value);
    if (pins == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -2;
    }
    return pins < 0 ? -2 : pins;
}

/* held[block] = pins (deleted at 0). */
static int set_pins(PyObject *held, PyObject *block, long pins)
{
    if (pins == 0)
        return PyDict_DelItem(held, block);
    PyObject *value = PyLong_FromLong(pins);
    if (value == NULL)
        return -1;
    int status = PyDict_SetItem(held, block, value);
    Py_DECREF(value);
    return status;
}

/* owner's {block: pins}, made if it has none (held.setdefault(owner, {})); borrowed. */
static PyObject *holdings_of(Loops *self, PyObject *owner)
{
    PyObject *held = PyDict_GetItemWithError(self->held, owner);
    if (held != NULL || PyErr_Occurred())
        return held;
    PyObject *fresh = PyDict_New();
    if (fresh == NULL)
        return NULL;
    held = PyDict_SetDefault(self->held, owner, fresh);
    Py_DECREF(fresh);
    return held;
}

static int call_policy(Loops *self, int which, PyObject *key)
{
    PyObject *result = PyObject_CallOneArg(self->policy[which], key);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* pool.py's _tell_hits: hit_evictable_many(keys), a single key as hit_evictable. */
static int tell_hits(Loops *self, PyObject *keys)
{
    if (PyList_GET_SIZE(keys) == 1)
        return call_policy(self, P_HIT, PyList_GET_ITEM(keys, 0));
    return call_policy(self, P_HIT_MANY, keys);
}

/* pool.py's _tell_inserted: inserted_many(keys, tiers), a single key as inserted. */
static int tell_inserted(Loops *self, PyObject *keys, PyObject *tiers)
{
    PyObject *args[2] = {keys, tiers};
    int which = P_INSERTED_MANY;
    if (PyList_GET_SIZE(keys) == 1) {
        args[0] = PyList_GET_ITEM(keys, 0);
        args[1] = PyList_GET_ITEM(tiers, 0);
        which = P_INSERTED;
    }
    PyObject *result = PyObject_Vectorcall(self->policy[which], args, 2, NULL);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* `status` after *list is replaced by a new empty list (-1 if that fails): a batch told. */
static int renew(PyObject **list, int status)
{
    Py_DECREF(*list);
    *list = PyList_New(0);
    return *list == NULL ? -1 : status;
}

/* ---- the prefix tree and freeing (pool.py's _link, _unlink, _to_free, _evict, ...) --------- */

static void unlink_block(Loops *self, Py_ssize_t child)
{
    int32_t parent = self->parent[child];
    if (parent == NO_BLOCK)
        return;
    int32_t before = self->prev_sibling[child], after = self->next_sibling[child];
    if (before == NO_BLOCK)
        self->first_child[parent] = after;
    else
        self->next_sibling[before] = after;
    if (after != NO_BLOCK)
        self->prev_sibling[after] = before;
    self->parent[child] = self->prev_sibling[child] = self->next_sibling[child] = NO_BLOCK;
}

static int to_free(Loops *self, Py_ssize_t block_id)
{
    int64_t top = self->counts[NUM_FREE];
    if (top < 0 || top >= self->num_blocks) {
        PyErr_SetString(PyExc_SystemError, "kvd/core/_pool.c: the free list is full");
        return -1;
    }
    self->state[block_id] = FREE;
    self->tier[block_id] = self->orphan[block_id] = self->duplicate[block_id] = 0;
    self->refs[block_id] = 0;
    self->generations[block_id]++;
    self->free[top] = block_id;
    self->counts[NUM_FREE] = top + 1;
    return 0;
}

/* _evict: drop an indexed block no policy tracks any more: unindex, unlink, free. */
static int evict_block(Loops *self, Py_ssize_t block_id)
{
    for (int32_t child = self->first_child[block_id]; child != NO_BLOCK;) {
        int32_t following = self->next_sibling[child];  /* only pinned orphans are left */
        unlink_block(self, child);
        child = following;
    }
    unlink_block(self, block_id);
    if (!hashes_fit(self))
        return -1;
    if (PyDict_DelItem(self->index, PyList_GET_ITEM(self->hashes, block_id)) < 0)
        return -1;
    PyList_SetItem(self->hashes, block_id, Py_NewRef(Py_None));
    if (self->evicted != NULL) {
        PyObject *item = PyLong_FromSsize_t(block_id);
        PyObject *result = item == NULL ? NULL : PyObject_CallOneArg(self->evicted, item);
        Py_XDECREF(item);
        if (result == NULL)
            return -1;
        Py_DECREF(result);
    }
    if (to_free(self, block_id) < 0)
        return -1;
    self->counts[EVICTIONS]++;
    return 0;
}

/* _evict_subtree: `root` and its cached descendants, children first; pinned ones orphaned. */
static int evict_subtree(Loops *self, Py_ssize_t root)
{
    if (self->first_child[root] == NO_BLOCK)  /* a leaf, the common victim: no walk */
        return evict_block(self, root);
    Py_ssize_t capacity = 16, length = 1;
    int32_t *visit = PyMem_Malloc(capacity * sizeof *visit);
    if (visit == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    visit[0] = (int32_t)root;
    for (Py_ssize_t i = 0; i < length; i++) {  /* every parent before its children */
        for (int32_t child = self->first_child[visit[i]]; child != NO_BLOCK;
             child = self->next_sibling[child]) {
            if (length == capacity) {
                int32_t *more = capacity > self->num_blocks ? NULL
                                : PyMem_Realloc(visit, 2 * capacity * sizeof *visit);
                if (more == NULL) {
                    PyMem_Free(visit);
                    PyErr_SetString(PyExc_SystemError, "kvd/core/_pool.c: the prefix tree loops");
                    return -1;
                }
                visit = more;
                capacity *= 2;
            }
            visit[length++] = child;
        }
    }
    int status = 0;
    for (Py_ssize_t i = length - 1; status == 0 && i >= 0; i--) {
        int32_t block_id = visit[i];
        if (block_id == root) {
            status = evict_block(self, block_id);
        } else if (self->state[block_id] == CACHED) {
            PyObject *key = Py_NewRef(PyList_GET_ITEM(self->hashes, block_id));
            status = call_policy(self, P_DISCARD, key);
            Py_DECREF(key);
            if (status == 0)
                status = evict_block(self, block_id);
        } else {
            self->orphan[block_id] = 1;
        }
    }
    PyMem_Free(visit);
    return status;
}

/* ---- the operations ----------------------------------------------------------------------- */

/* allocate(num_blocks, owner): _take_free when num_blocks is an int in [1, free blocks]. */
static PyObject *loops_allocate(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("allocate", nargs, 2) < 0)
        return NULL;
    if (!PyLong_CheckExact(args[0]))
        Py_RETURN_NONE;
    Py_ssize_t count = PyLong_AsSsize_t(args[0]);
    if (count == -1 && PyErr_Occurred())
        PyErr_Clear();
    int64_t top = self->counts[NUM_FREE];
    if (count < 1 || count > top || top > self->num_blocks)
        Py_RETURN_NONE;
    PyObject *held = holdings_of(self, args[1]);
    if (held == NULL)
        return NULL;
    PyObject *block_ids = PyList_New(count);
    if (block_ids == NULL)
        return NULL;
    self->counts[NUM_FREE] = top - count;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t block_id = (Py_ssize_t)self->free[top - 1 - i];
        PyObject *item = PyLong_FromSsize_t(block_id);
        if (item == NULL || block_id < 0 || block_id >= self->num_blocks) {
            Py_XDECREF(item);
            Py_DECREF(block_ids);
            return item == NULL ? NULL
                   : PyErr_Format(PyExc_SystemError, "kvd/core/_pool.c: a bad free block id");
        }
        PyList_SET_ITEM(block_ids, i, item);
        self->state[block_id] = OWNED;
        self->refs[block_id] = 1;
        if (set_pins(held, item, 1) < 0) {
            Py_DECREF(block_ids);
            return NULL;
        }
    }
    self->counts[NUM_OWNED] += count;
    self->counts[ALLOCATIONS] += count;
    return block_ids;
}

/* _evict_for: victims and their subtrees until `num_needed` blocks are free. A new reference to
   None, or to (key,) for a victim that is not a cached block; NULL with an exception. */
static PyObject *evict_until(Loops *self, Py_ssize_t num_needed)
{
    while (self->counts[NUM_FREE] < num_needed) {
        int64_t block_id = self->counts[NEXT_VICTIM];
        if (block_id != NO_BLOCK) {
            self->counts[NEXT_VICTIM] = NO_BLOCK;
            if (block_id < 0 || block_id >= self->num_blocks)
                return PyErr_Format(PyExc_SystemError, "kvd/core/_pool.c: a bad next victim");
        } else {
            PyObject *key = PyObject_CallNoArgs(self->policy[P_VICTIM]);
            if (key == NULL)
                return NULL;
            PyObject *item = key == Py_None ? NULL : PyDict_GetItemWithError(self->index, key);
            block_id = item == NULL ? -1 : block_of(self, item);
            if (PyErr_Occurred()) {
                Py_DECREF(key);
                return NULL;
            }
            if (block_id < 0 || self->state[block_id] != CACHED) {
                PyObject *answer = PyTuple_Pack(1, key);
                Py_DECREF(key);
                return answer;
            }
            Py_DECREF(key);
        }
        if (evict_subtree(self, (Py_ssize_t)block_id) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* evict(num_needed): _evict_for; (key,) for a victim that is not a cached block. */
static PyObject *loops_evict(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("evict", nargs, 1) < 0)
        return NULL;
    Py_ssize_t num_needed = PyLong_AsSsize_t(args[0]);
    if (num_needed == -1 && PyErr_Occurred())
        return NULL;
    return evict_until(self, num_needed);
}

/* TIER_PREFILL or TIER_DECODE (kvd/core/policies/base.py): an exact int 0 or 1; else -1. */
static long tier_of(PyObject *item)
{
    if (!PyLong_CheckExact(item))
        return -1;
    int overflow;
    long tier = PyLong_AsLongAndOverflow(item, &overflow);
    return tier == 0 || tier == 1 ? tier : -1;
}

static int is_tier(PyObject *item) { return tier_of(item) >= 0; }

/* Whether seal's `hints` is None or a list of `count` items that each `fits`. */
static int hints_fit(PyObject *hints, Py_ssize_t count, int (*fits)(PyObject *))
{
    if (hints == Py_None)
        return 1;
    if (!PyList_CheckExact(hints) || PyList_GET_SIZE(hints) != count)
        return 0;
    for (Py_ssize_t i = 0; i < count; i++)
        if (!fits(PyList_GET_ITEM(hints, i)))
            return 0;
    return 1;
}

static int is_parent_key(PyObject *item) { return item == Py_None || PyBytes_CheckExact(item); }
static int is_key(PyObject *item) { return PyBytes_CheckExact(item); }

/* seal(block_ids, keys, parents, tiers, owner): _check_seal's checks, then _publish. */
static PyObject *loops_seal(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("seal", nargs, 5) < 0)
        return NULL;
    PyObject *block_ids = args[0], *keys = args[1], *parents = args[2], *tiers = args[3];
    if (!PyList_CheckExact(block_ids) || !PyList_CheckExact(keys) || !hashes_fit(self))
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(block_ids);
    if (PyList_GET_SIZE(keys) != count || !hints_fit(keys, count, is_key)
            || !hints_fit(parents, count, is_parent_key) || !hints_fit(tiers, count, is_tier))
        Py_RETURN_NONE;
    PyObject *held = count ? PyDict_GetItemWithError(self->held, args[4]) : NULL;
    if (held == NULL && PyErr_Occurred())
        return NULL;
    if (count && (held == NULL || !PyDict_CheckExact(held) || !ids_fit(self, block_ids, 1 << OWNED)))
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < count; i++) {
        int is_held = PyDict_Contains(held, PyList_GET_ITEM(block_ids, i));
        if (is_held <= 0) {
            if (is_held < 0)
                return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *indexed = PyList_New(count);
    if (indexed == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(block_ids, i), *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t block_id = PyLong_AsSsize_t(item);
        self->state[block_id] = SEALED;
        PyList_SetItem(self->hashes, block_id, Py_NewRef(key));
        if (tiers != Py_None)
            self->tier[block_id] = (unsigned char)tier_of(PyList_GET_ITEM(tiers, i));
        int is_new = !PyDict_Contains(self->index, key);  /* (bytes: cannot fail) */
        if (is_new) {
            PyObject *parent_key = parents == Py_None ? Py_None : PyList_GET_ITEM(parents, i);
            if (parent_key != Py_None) {  /* _adopt */
                PyObject *parent_item = PyDict_GetItemWithError(self->index, parent_key);
                Py_ssize_t parent = parent_item == NULL ? -1 : block_of(self, parent_item);
                if (parent < 0) {
                    self->orphan[block_id] = 1;
                } else {
                    int32_t first = self->first_child[parent];
                    self->parent[block_id] = (int32_t)parent;
                    self->next_sibling[block_id] = first;
                    if (first != NO_BLOCK)
                        self->prev_sibling[first] = (int32_t)block_id;
                    self->first_child[parent] = (int32_t)block_id;
                    self->orphan[block_id] = self->orphan[parent];
                }
            }
            if (PyDict_SetItem(self->index, key, item) < 0) {
                Py_DECREF(indexed);
                return NULL;
            }
        } else {
            self->duplicate[block_id] = 1;
        }
        PyList_SET_ITEM(indexed, i, Py_NewRef(is_new ? Py_True : Py_False));
    }
    self->counts[NUM_OWNED] -= count;
    self->counts[NUM_SEALED] += count;
    self->counts[SEALS] += count;
    return indexed;
}

/* A key put() hashes and compares without running Python code: exact bytes, or an exact tuple
   of exact ints (the embedded cache's (layer, position)). */
static int is_put_key(PyObject *key)
{
    if (PyBytes_CheckExact(key))
        return 1;
    if (!PyTuple_CheckExact(key))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(key); i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(key, i)))
            return 0;
    return 1;
}

/* put(key, tier): _put (without the observer, which the Python tells); None for what must
   raise or find nothing free or evictable, (key,) as evict's. */
static PyObject *loops_put(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("put", nargs, 2) < 0)
        return NULL;
    PyObject *key = args[0];
    long tier = tier_of(args[1]);
    if (tier < 0 || !is_put_key(key) || !hashes_fit(self))
        Py_RETURN_NONE;
    int is_indexed = PyDict_Contains(self->index, key);
    if (is_indexed != 0)
        return is_indexed < 0 ? NULL : Py_NewRef(Py_None);
    if (self->counts[NUM_FREE] == 0) {
        if (self->counts[NUM_OWNED] + self->counts[NUM_SEALED] >= self->num_blocks)
            Py_RETURN_NONE;
        PyObject *unevictable = evict_until(self, 1);
        if (unevictable != Py_None)
            return unevictable;  /* NULL or (key,) */
        Py_DECREF(unevictable);
    }
    int64_t top = self->counts[NUM_FREE] - 1;
    Py_ssize_t block_id = top < 0 || top >= self->num_blocks ? -1 : (Py_ssize_t)self->free[top];
    if (block_id < 0 || block_id >= self->num_blocks)
        return PyErr_Format(PyExc_SystemError, "kvd/core/_pool.c: a bad free list");
    PyObject *item = PyLong_FromSsize_t(block_id);
    if (item == NULL || PyDict_SetItem(self->index, key, item) < 0) {
        Py_XDECREF(item);
        return NULL;
    }
    self->counts[NUM_FREE] = top;
    self->state[block_id] = CACHED;
    PyList_SetItem(self->hashes, block_id, Py_NewRef(key));
    self->tier[block_id] = (unsigned char)tier;
    self->counts[ALLOCATIONS]++;
    self->counts[SEALS]++;
    PyObject *result = PyObject_Vectorcall(self->policy[P_INSERTED], args, 2, NULL);
    if (result == NULL) {
        Py_DECREF(item);
        return NULL;
    }
    Py_DECREF(result);
    return item;
}

/* _pin_sealed(block_ids, owner, count_access) over ids known to be SEALED or CACHED. */
static int pin_sealed(Loops *self, PyObject *block_ids, PyObject *owner, int count_access)
{
    Py_ssize_t count = PyList_GET_SIZE(block_ids);
    if (count == 0)
        return 0;
    PyObject *held = holdings_of(self, owner);
    if (held == NULL)
        return -1;
    Py_INCREF(held);
    PyObject *hits = PyList_New(0);  /* cached blocks hit, for the policy in one call */
    int status = hits == NULL ? -1 : 0;
    Py_ssize_t num_uncached = 0;
    for (Py_ssize_t i = 0; status == 0 && i < count; i++) {
        PyObject *item = PyList_GET_ITEM(block_ids, i);
        Py_ssize_t block_id = PyLong_AsSsize_t(item);
        PyObject *key = PyList_GET_ITEM(self->hashes, block_id);
        if (self->state[block_id] == CACHED) {
            if (block_id == self->counts[NEXT_VICTIM]) {  /* a hit cancels the choice */
                self->counts[NEXT_VICTIM] = NO_BLOCK;
                if (count_access) {
                    if (PyList_GET_SIZE(hits)) {
                        status = renew(&hits, tell_hits(self, hits));
                    }
                    if (status == 0)
                        status = call_policy(self, P_ACCESSED, key);
                }
            } else if (count_access) {
                status = PyList_Append(hits, key);
            } else {
                status = call_policy(self, P_REMOVED, key);
            }
            self->state[block_id] = SEALED;
            num_uncached++;
        } else if (count_access) {
            if (PyList_GET_SIZE(hits)) {
                status = renew(&hits, tell_hits(self, hits));
            }
            if (status == 0)
                status = call_policy(self, P_ACCESSED, key);
        }
        if (status < 0)
            break;
        self->refs[block_id]++;
        long pins = pins_of(held, item);
        if (pins < 0) {
            if (pins == -2)
                PyErr_SetString(PyExc_SystemError, "kvd/core/_pool.c: a pin count is not an int");
            status = -1;
        } else {
            status = set_pins(held, item, pins + 1);
        }
    }
    if (status == 0 && PyList_GET_SIZE(hits))
        status = tell_hits(self, hits);
    if (status == 0)
        self->counts[NUM_SEALED] += num_uncached;
    Py_XDECREF(hits);
    Py_DECREF(held);
    return status;
}

/* lookup(keys, owner): the longest indexed prefix of `keys` (a list of exact bytes up to its
   first miss), pinned as _pin_sealed(count_access=True) pins it, and counted. */
static PyObject *loops_lookup(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("lookup", nargs, 2) < 0)
        return NULL;
    PyObject *keys = args[0];
    if (!PyList_CheckExact(keys) || !hashes_fit(self))
        Py_RETURN_NONE;
    PyObject *block_ids = PyList_New(0);
    if (block_ids == NULL)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key)) {
            Py_DECREF(block_ids);
            Py_RETURN_NONE;
        }
        PyObject *item = PyDict_GetItemWithError(self->index, key);  /* borrowed */
        if (item == NULL)
            break;
        Py_ssize_t block_id = block_of(self, item);
        if (block_id < 0 || (self->state[block_id] != SEALED && self->state[block_id] != CACHED)) {
            Py_DECREF(block_ids);
            Py_RETURN_NONE;  /* (an index entry the pool did not write: the Python's to see) */
        }
        if (PyList_Append(block_ids, item) < 0) {
            Py_DECREF(block_ids);
            return NULL;
        }
    }
    if (pin_sealed(self, block_ids, args[1], 1) < 0) {
        Py_DECREF(block_ids);
        return NULL;
    }
    self->counts[LOOKUPS]++;
    self->counts[LOOKUP_BLOCKS] += count;
    self->counts[HIT_BLOCKS] += PyList_GET_SIZE(block_ids);
    return block_ids;
}

/* pin(block_ids, owner): pin's checks, then _pin_sealed(count_access=False). */
static PyObject *loops_pin(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("pin", nargs, 2) < 0)
        return NULL;
    PyObject *block_ids = args[0];
    if (!PyList_CheckExact(block_ids) || !hashes_fit(self)
            || !ids_fit(self, block_ids, (1 << SEALED) | (1 << CACHED)))
        Py_RETURN_FALSE;
    if (pin_sealed(self, block_ids, args[1], 0) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* _unpin(reversed(block_ids), held), every pin known to be there. */
static int unpin(Loops *self, PyObject *block_ids, PyObject *held)
{
    PyObject *cached_keys = PyList_New(0), *cached_tiers = PyList_New(0);
    int status = cached_keys == NULL || cached_tiers == NULL ? -1 : 0;
    Py_ssize_t num_last_pins = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(block_ids) - 1; status == 0 && i >= 0; i--) {
        PyObject *item = PyList_GET_ITEM(block_ids, i);
        Py_ssize_t block_id = PyLong_AsSsize_t(item);
        long pins = pins_of(held, item);
        if (pins < 1) {
            if (pins != -1)
                PyErr_SetString(PyExc_SystemError, "kvd/core/_pool.c: a pin vanished");
            status = -1;
            break;
        }
        if ((status = set_pins(held, item, pins - 1)) < 0)
            break;
        if (self->state[block_id] == OWNED) {
            self->counts[NUM_OWNED]--;
            status = to_free(self, block_id);
            continue;
        }
        if (--self->refs[block_id] > 0)
            continue;
        num_last_pins++;
        PyObject *key = Py_NewRef(PyList_GET_ITEM(self->hashes, block_id));
        if (self->duplicate[block_id]) {  /* nobody can look it up: freed */
            PyList_SetItem(self->hashes, block_id, Py_NewRef(Py_None));
            status = to_free(self, block_id);
        } else if (self->orphan[block_id]) {  /* unreachable: freed with its subtree */
            if (PyList_GET_SIZE(cached_keys)) {
                status = tell_inserted(self, cached_keys, cached_tiers);
                status = renew(&cached_tiers, renew(&cached_keys, status));
            }
            if (status == 0)
                status = call_policy(self, P_FORGOTTEN, key);
            if (status == 0)
                status = evict_subtree(self, block_id);
        } else {
            self->state[block_id] = CACHED;
            PyObject *tier = PyLong_FromLong(self->tier[block_id]);
            status = tier == NULL || PyList_Append(cached_keys, key) < 0
                     || PyList_Append(cached_tiers, tier) < 0 ? -1 : 0;
            Py_XDECREF(tier);
        }
        Py_DECREF(key);
    }
    if (status == 0 && PyList_GET_SIZE(cached_keys))
        status = tell_inserted(self, cached_keys, cached_tiers);
    if (status == 0)
        self->counts[NUM_SEALED] -= num_last_pins;
    Py_XDECREF(cached_keys);
    Py_XDECREF(cached_tiers);
    return status;
}

/* release(block_ids, owner): when owner holds each block of the list (none named twice). */
static PyObject *loops_release(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("release", nargs, 2) < 0)
        return NULL;
    PyObject *block_ids = args[0], *owner = args[1];
    if (!PyList_CheckExact(block_ids) || !hashes_fit(self))
        Py_RETURN_FALSE;
    if (PyList_GET_SIZE(block_ids) == 0)
        Py_RETURN_TRUE;
    PyObject *held = PyDict_GetItemWithError(self->held, owner);
    if (held == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    if (!PyDict_CheckExact(held)
            || !ids_fit(self, block_ids, (1 << OWNED) | (1 << SEALED) | (1 << CACHED)))
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(block_ids); i++) {
        long pins = pins_of(held, PyList_GET_ITEM(block_ids, i));
        if (pins == -1)
            return NULL;
        if (pins < 1)
            Py_RETURN_FALSE;
    }
    Py_INCREF(held);
    int status = unpin(self, block_ids, held);
    if (status == 0 && PyDict_Size(held) == 0)
        status = PyDict_DelItem(self->held, owner);
    Py_DECREF(held);
    if (status < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* journal_rows(block_ids): per block of the list (block_id, key, generation, parent,
   parent_generation, tier), parent -2 (ORPHAN) for an orphan; None for anything else. */
static PyObject *loops_journal_rows(Loops *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("journal_rows", nargs, 1) < 0)
        return NULL;
    PyObject *block_ids = args[0];
    if (!PyList_CheckExact(block_ids) || !hashes_fit(self))
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(block_ids);
    for (Py_ssize_t i = 0; i < count; i++)
        if (block_of(self, PyList_GET_ITEM(block_ids, i)) < 0)
            Py_RETURN_NONE;
    PyObject *rows = PyList_New(count);
    for (Py_ssize_t i = 0; rows != NULL && i < count; i++) {
        PyObject *item = PyList_GET_ITEM(block_ids, i);
        Py_ssize_t block_id = PyLong_AsSsize_t(item);
        int parent = self->orphan[block_id] ? -2 : self->parent[block_id];
        PyObject *row = Py_BuildValue("(OOKiKi)", item, PyList_GET_ITEM(self->hashes, block_id),
                                      (unsigned long long)self->generations[block_id], parent,
                                      parent >= 0 ? (unsigned long long)self->generations[parent]
                                                  : 0ULL, (int)self->tier[block_id]);
        if (row == NULL)
            Py_CLEAR(rows);
        else
            PyList_SET_ITEM(rows, i, row);
    }
    return rows;
}

#define METHOD(name, doc) \
    {#name, (PyCFunction)(void (*)(void))loops_##name, METH_FASTCALL, doc}

static PyMethodDef loops_methods[] = {
    METHOD(allocate, "allocate(num_blocks, owner) -> list | None: BlockPool._take_free, when "
                     "num_blocks is an int in [1, free blocks]"),
    METHOD(evict, "evict(num_needed) -> None | (key,): BlockPool._evict_for; (key,) for a "
                  "victim that is not a cached block"),
    METHOD(seal, "seal(block_ids, keys, parents, tiers, owner) -> list | None: BlockPool.seal "
                 "without the observer"),
    METHOD(put, "put(key, tier) -> int | None | (key,): BlockPool.put without the observer, "
                "for exact-bytes keys and tuples of exact ints"),
    METHOD(lookup, "lookup(keys, owner) -> list | None: BlockPool.lookup of exact-bytes keys"),
    METHOD(pin, "pin(block_ids, owner) -> bool: BlockPool.pin"),
    METHOD(release, "release(block_ids, owner) -> bool: BlockPool.release, no block named twice"),
    METHOD(journal_rows, "journal_rows(block_ids) -> list | None: BlockPool.journal_rows"),
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd.core._pool.Loops",
    .tp_doc = "A pool's operations over its tables, bound once (kvd/core/_pool.c).",
    .tp_basicsize = sizeof(Loops),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)loops_dealloc,
    .tp_traverse = (traverseproc)loops_traverse,
    .tp_clear = (inquiry)loops_clear,
    .tp_methods = loops_methods,
};

static PyMethodDef pool_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))pool_bind, METH_FASTCALL,
     "bind(tables, policy, observer) -> Loops: the operations over a PoolTables (kvd/core/pool.py);"
     " TypeError naming a field that does not fit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pool_module = {
    PyModuleDef_HEAD_INIT, "kvd.core._pool",
    "The block pool's per-block operations in C; see kvd/core/_pool.c and kvd/core/pool.py.", -1,
    pool_methods,
};

PyMODINIT_FUNC PyInit__pool(void)
{
    if (PyType_Ready(&LoopsType) < 0)
        return NULL;
    return PyModule_Create(&pool_module);
}
