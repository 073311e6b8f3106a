/* kvd._pool: the block pool's per-block loops in C, every uncommon block left to kvd/core/pool.py.

Theory of operation
-------------------
At batch 256 a request's cost is the pool's per-block bookkeeping: for each block a few stores
into the pool's tables (state bytes, the ref-count and hash lists, the owner's {block: pins}
dict, the hash index), each one a bytecode dispatch or a method call in Python. These functions
run those loops over the very same tables, which kvd/core/pool.py passes in on each call (so a table
the pool replaces, as `restore` does, needs nothing here), for the blocks that make up the
traffic:

    own(block_ids, held, state, refs) -> bool                  allocate's marking
    prefix(index, keys) -> list | None                         lookup's walk of the index
    pin_run(...)       -> (stop, num_uncached)                 _pin_sealed's common blocks
    unpin_run(...)     -> (stop, num_last_pins)                _unpin's common blocks
    first_unsealable(block_ids, keys, held, state) -> int      seal's validation
    seal_run(...)      -> stop                                 seal's publishing
    evict_run(...)     -> (key,) | None                        allocate's evictions of leaves
    journal_rows(...)  -> list | None                          what a seal tells the journal
    alloc_one / seal_one / release_one / lookup_one(tables, ..., owner)   one block's request

The first eight are parts of a method; the last four are whole methods for the traffic of a
worker at batch 1 (see their section below), where the Python around a C loop was most of the
request.

A `*_run` function processes blocks from `start` in order and stops *before* the first block it
does not handle -- a policy event other than a hit, a block to free, an orphan's last pin,
anything of an unexpected type -- returning that position (len(block_ids) when it did them all);
kvd/core/pool.py then does that one block itself, exactly as its pure-Python loop would, and calls
again. A block is either done completely here or not touched, so the two interleave into the
pure loop's result event for event; the Python loop is the specification, and with
KVD_PURE_PYTHON=1 (or where this is not built) it is all that runs. tests/test_pool_c.py runs
random operation sequences on a pool with this module and one without and compares every table
and every policy event.

Safety: the tables are the pool's private objects, but the ids come from clients, so every id is
checked to be an exact int inside the tables, and every table's type and length is checked on
each call; anything off stops the run (`own`: returns False, `prefix`: None) and the Python path
raises the error it names. Keys are only hashed here when they are exact bytes (no Python
__hash__ or __eq__ can run in the middle of a loop); other keys stop the run. The one loop that
calls Python is evict_run's (the policy's victim(), the journal's evicted()), neither of which
touches the pool's tables; its tables are the pool's own, so a misfit there is a kvd bug and
raises TypeError before any victim is asked for.
*/
#include "policies/_s3fifo_keys.h"  /* (Python.h, check_nargs, start_of; one-key events) */
#include <string.h>

/* kvd/core/pool.py's block states, and its empty link in the prefix tree. */
enum { FREE = 0, OWNED = 1, SEALED = 2, CACHED = 3 };
#define NO_BLOCK (-1)

/* The id `item` names if it is an exact int in [0, num_blocks), else -1. */
static Py_ssize_t block_index(PyObject *item, Py_ssize_t num_blocks)
{
    if (!PyLong_CheckExact(item))
        return -1;
    Py_ssize_t block_id = PyLong_AsSsize_t(item);
    if (block_id == -1 && PyErr_Occurred()) {
        PyErr_Clear();  /* too large for a Py_ssize_t: out of range */
        return -1;
    }
    return block_id < num_blocks ? block_id : -1;
}

/* The pool's per-block tables: `num_blocks` comes from `state`, the others must be as long. */
static int tables_fit(PyObject *state, PyObject *const *lists, int num_lists,
                      PyObject *const *bytearrays, int num_bytearrays)
{
    if (!PyByteArray_CheckExact(state))
        return 0;
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(state);
    for (int i = 0; i < num_lists; i++)
        if (!PyList_CheckExact(lists[i]) || PyList_GET_SIZE(lists[i]) != num_blocks)
            return 0;
    for (int i = 0; i < num_bytearrays; i++)
        if (!PyByteArray_CheckExact(bytearrays[i])
                || PyByteArray_GET_SIZE(bytearrays[i]) != num_blocks)
            return 0;
    return 1;
}

/* held[block] = pins + change (deleted at 0); the item is known to hold an int. */
static int add_pins(PyObject *held, PyObject *block, long pins, long change)
{
    pins += change;
    if (pins == 0)
        return PyDict_DelItem(held, block);
    PyObject *value = PyLong_FromLong(pins);
    if (value == NULL)
        return -1;
    int status = PyDict_SetItem(held, block, value);
    Py_DECREF(value);
    return status;
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

/* refs[block] as a C long; -1 if it is not a non-negative int that fits. */
static long ref_count(PyObject *refs, Py_ssize_t block_id)
{
    PyObject *value = PyList_GET_ITEM(refs, block_id);
    if (!PyLong_CheckExact(value))
        return -1;
    long count = PyLong_AsLong(value);
    if (count == -1 && PyErr_Occurred())
        PyErr_Clear();
    return count < 0 ? -1 : count;
}

static int set_ref_count(PyObject *refs, Py_ssize_t block_id, long count)
{
    PyObject *value = PyLong_FromLong(count);
    if (value == NULL)
        return -1;
    return PyList_SetItem(refs, block_id, value);  /* steals value, drops the old int */
}

/* own(block_ids, held, state, refs): every FREE block OWNED with one pin in `held`. */
static PyObject *pool_own(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("own", nargs, 4) < 0)
        return NULL;
    PyObject *block_ids = args[0], *held = args[1], *state = args[2], *refs = args[3];
    if (!PyList_CheckExact(block_ids) || !PyDict_CheckExact(held)
            || !tables_fit(state, &refs, 1, NULL, 0))
        Py_RETURN_FALSE;
    Py_ssize_t count = PyList_GET_SIZE(block_ids), num_blocks = PyByteArray_GET_SIZE(state);
    char *states = PyByteArray_AS_STRING(state);
    for (Py_ssize_t i = 0; i < count; i++) {  /* check all before changing any */
        Py_ssize_t block_id = block_index(PyList_GET_ITEM(block_ids, i), num_blocks);
        if (block_id < 0 || states[block_id] != FREE)
            Py_RETURN_FALSE;
    }
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(block_ids, i);
        Py_ssize_t block_id = PyLong_AsSsize_t(item);
        states[block_id] = OWNED;
        Py_INCREF(one);
        PyList_SetItem(refs, block_id, one);
        if (PyDict_SetItem(held, item, one) < 0) {
            Py_DECREF(one);
            return NULL;
        }
    }
    Py_DECREF(one);
    Py_RETURN_TRUE;
}

/* prefix(index, keys): the blocks of the longest prefix of `keys` in `index`; None unless
   `keys` is a list of bytes (up to the first miss) and `index` a dict. */
static PyObject *pool_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("prefix", nargs, 2) < 0)
        return NULL;
    PyObject *index = args[0], *keys = args[1];
    if (!PyDict_CheckExact(index) || !PyList_CheckExact(keys))
        Py_RETURN_NONE;
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key)) {
            Py_DECREF(found);
            Py_RETURN_NONE;
        }
        PyObject *block_id = PyDict_GetItemWithError(index, key);  /* borrowed */
        if (block_id == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(found);
                return NULL;
            }
            break;
        }
        if (PyList_Append(found, block_id) < 0) {
            Py_DECREF(found);
            return NULL;
        }
    }
    return found;
}

/* pin_run(block_ids, start, held, state, refs, hashes, next_victim, count_access, hits):
   _pin_sealed's loop for the blocks that need no policy call of their own: a counted hit on a
   CACHED block other than next_victim (its key appended to `hits`, it becomes SEALED), and an
   uncounted pin of a SEALED block. One pin more for each, in refs and in held. */
static PyObject *pool_pin_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("pin_run", nargs, 9) < 0)
        return NULL;
    PyObject *block_ids = args[0], *held = args[2], *state = args[3], *refs = args[4],
             *hashes = args[5], *hits = args[8];
    PyObject *lists[] = {refs, hashes};
    if (!PyList_CheckExact(block_ids))  /* not ours to take: the Python loop goes on from start */
        return Py_BuildValue("(On)", args[1], (Py_ssize_t)0);
    Py_ssize_t count = PyList_GET_SIZE(block_ids), position = start_of(args[1], count);
    if (position < 0)
        return NULL;
    Py_ssize_t next_victim = PyLong_AsSsize_t(args[6]);
    if (next_victim == -1 && PyErr_Occurred())
        return NULL;
    int count_access = PyObject_IsTrue(args[7]);
    if (count_access < 0)
        return NULL;
    Py_ssize_t num_uncached = 0;
    if (!PyDict_CheckExact(held) || !PyList_CheckExact(hits) || !tables_fit(state, lists, 2, NULL, 0))
        return Py_BuildValue("(nn)", position, num_uncached);
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(state);
    char *states = PyByteArray_AS_STRING(state);
    for (; position < count; position++) {
        PyObject *item = PyList_GET_ITEM(block_ids, position);
        Py_ssize_t block_id = block_index(item, num_blocks);
        if (block_id < 0)
            break;
        int is_hit = states[block_id] == CACHED && block_id != next_victim && count_access;
        if (!is_hit && !(states[block_id] == SEALED && !count_access))
            break;
        long refs_now = ref_count(refs, block_id), pins = pins_of(held, item);
        if (pins == -1)
            return NULL;
        if (refs_now < 0 || pins < 0)
            break;
        if (is_hit) {
            if (PyList_Append(hits, PyList_GET_ITEM(hashes, block_id)) < 0)
                return NULL;
            states[block_id] = SEALED;
            num_uncached++;
        }
        if (set_ref_count(refs, block_id, refs_now + 1) < 0 || add_pins(held, item, pins, 1) < 0)
            return NULL;
    }
    return Py_BuildValue("(nn)", position, num_uncached);
}

/* unpin_run(block_ids, start, held, state, refs, hashes, tiers, is_orphan, is_duplicate,
             cached_keys, cached_tiers):
   _unpin's loop for SEALED blocks: one pin fewer in held and refs; a block whose last pin this
   was becomes CACHED, its key and tier appended for the policy. Stops at an OWNED block, at the
   last pin of a duplicate or an orphan (each is freed), and at anything unexpected. */
static PyObject *pool_unpin_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("unpin_run", nargs, 11) < 0)
        return NULL;
    PyObject *block_ids = args[0], *held = args[2], *state = args[3], *refs = args[4],
             *hashes = args[5], *tiers = args[6], *is_orphan = args[7], *is_duplicate = args[8],
             *cached_keys = args[9], *cached_tiers = args[10];
    PyObject *lists[] = {refs, hashes}, *bytearrays[] = {tiers, is_orphan, is_duplicate};
    if (!PyList_CheckExact(block_ids))  /* not ours to take: the Python loop goes on from start */
        return Py_BuildValue("(On)", args[1], (Py_ssize_t)0);
    Py_ssize_t count = PyList_GET_SIZE(block_ids), position = start_of(args[1], count);
    if (position < 0)
        return NULL;
    Py_ssize_t num_last_pins = 0;
    if (!PyDict_CheckExact(held) || !PyList_CheckExact(cached_keys)
            || !PyList_CheckExact(cached_tiers) || !tables_fit(state, lists, 2, bytearrays, 3))
        return Py_BuildValue("(nn)", position, num_last_pins);
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(state);
    char *states = PyByteArray_AS_STRING(state);
    const unsigned char *tier = (const unsigned char *)PyByteArray_AS_STRING(tiers);
    const char *orphan = PyByteArray_AS_STRING(is_orphan);
    const char *duplicate = PyByteArray_AS_STRING(is_duplicate);
    for (; position < count; position++) {
        PyObject *item = PyList_GET_ITEM(block_ids, position);
        Py_ssize_t block_id = block_index(item, num_blocks);
        if (block_id < 0 || states[block_id] != SEALED)
            break;
        long refs_now = ref_count(refs, block_id), pins = pins_of(held, item);
        if (pins == -1)
            return NULL;
        if (refs_now < 1 || pins < 1 || (refs_now == 1 && (duplicate[block_id] || orphan[block_id])))
            break;
        if (add_pins(held, item, pins, -1) < 0 || set_ref_count(refs, block_id, refs_now - 1) < 0)
            return NULL;
        if (refs_now > 1)
            continue;
        PyObject *block_tier = PyLong_FromLong(tier[block_id]);
        if (block_tier == NULL)
            return NULL;
        int status = PyList_Append(cached_tiers, block_tier);
        Py_DECREF(block_tier);
        if (status < 0 || PyList_Append(cached_keys, PyList_GET_ITEM(hashes, block_id)) < 0)
            return NULL;
        states[block_id] = CACHED;
        num_last_pins++;
    }
    return Py_BuildValue("(nn)", position, num_last_pins);
}

/* first_unsealable(block_ids, keys, held, state): the position of the first block seal's
   validation must look at itself -- not an exact int in the pool, not in held, not OWNED, a key
   that is not bytes, or one of more ids than keys -- or len(block_ids) when there is none. */
static PyObject *pool_first_unsealable(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("first_unsealable", nargs, 4) < 0)
        return NULL;
    PyObject *block_ids = args[0], *keys = args[1], *held = args[2], *state = args[3];
    Py_ssize_t position = 0;
    if (!PyList_CheckExact(block_ids) || !PyList_CheckExact(keys) || !PyDict_CheckExact(held)
            || !tables_fit(state, NULL, 0, NULL, 0))
        return PyLong_FromSsize_t(position);
    Py_ssize_t count = PyList_GET_SIZE(block_ids), num_blocks = PyByteArray_GET_SIZE(state);
    const char *states = PyByteArray_AS_STRING(state);
    for (; position < count; position++) {
        PyObject *item = PyList_GET_ITEM(block_ids, position);
        Py_ssize_t block_id = block_index(item, num_blocks);
        if (block_id < 0 || states[block_id] != OWNED || position >= PyList_GET_SIZE(keys)
                || !PyBytes_CheckExact(PyList_GET_ITEM(keys, position)))
            break;
        int is_held = PyDict_Contains(held, item);
        if (is_held < 0)
            return NULL;
        if (!is_held)
            break;
    }
    return PyLong_FromSsize_t(position);
}

/* The prefix tree's four int32 link arrays (kvd/core/pool.py's _parent, _first_child, _next_sibling,
   _prev_sibling), held as buffers for one call. */
typedef struct {
    Py_buffer views[4];
    int num_open;
} Tree;

enum { PARENT, FIRST_CHILD, NEXT_SIBLING, PREV_SIBLING };

static void tree_close(Tree *tree)
{
    while (tree->num_open > 0)
        PyBuffer_Release(&tree->views[--tree->num_open]);
}

/* 1 with every array open, 0 if `links` is not four int32 arrays of num_blocks (nothing open). */
static int tree_open(Tree *tree, PyObject *links, Py_ssize_t num_blocks)
{
    tree->num_open = 0;
    if (!PyTuple_CheckExact(links) || PyTuple_GET_SIZE(links) != 4)
        return 0;
    for (int i = 0; i < 4; i++) {
        Py_buffer *view = &tree->views[i];
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(links, i), view,
                               PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            tree_close(tree);
            return 0;
        }
        tree->num_open++;
        if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "i") != 0
                || view->len != num_blocks * 4) {
            tree_close(tree);
            return 0;
        }
    }
    return 1;
}

static int *tree_links(Tree *tree, int which)
{
    return (int *)tree->views[which].buf;
}

/* seal_run(block_ids, keys, start, tiers, parents, state, hashes, tier_of, is_duplicate,
            is_orphan, index, links, indexed):
   seal's publishing loop over validated blocks: each becomes SEALED under its key (and its tier
   when `tiers` is a list), indexed if the key is new -- linked under the block holding its parent
   key, or an orphan when none does or that block is one (kvd/core/pool.py's _adopt) -- else marked a
   duplicate; True or False appended to `indexed`. `links` is the tree's four int32 arrays;
   without them (or with a parent key that is not bytes) it stops before a new key with a parent. */
static PyObject *pool_seal_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("seal_run", nargs, 13) < 0)
        return NULL;
    PyObject *block_ids = args[0], *keys = args[1], *tiers = args[3], *parents = args[4],
             *state = args[5], *hashes = args[6], *tier_of = args[7], *is_duplicate = args[8],
             *is_orphan = args[9], *index = args[10], *indexed = args[12];
    PyObject *bytearrays[] = {tier_of, is_duplicate, is_orphan};
    if (!PyList_CheckExact(block_ids))  /* not ours to take: the Python loop goes on from start */
        return Py_NewRef(args[2]);
    Py_ssize_t count = PyList_GET_SIZE(block_ids), position = start_of(args[2], count);
    if (position < 0)
        return NULL;
    if (!PyList_CheckExact(keys) || PyList_GET_SIZE(keys) != count
            || (tiers != Py_None && (!PyList_CheckExact(tiers) || PyList_GET_SIZE(tiers) != count))
            || (parents != Py_None
                && (!PyList_CheckExact(parents) || PyList_GET_SIZE(parents) != count))
            || !PyDict_CheckExact(index) || !PyList_CheckExact(indexed)
            || !tables_fit(state, &hashes, 1, bytearrays, 3))
        return PyLong_FromSsize_t(position);
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(state);
    char *states = PyByteArray_AS_STRING(state), *tier_bytes = PyByteArray_AS_STRING(tier_of);
    char *duplicate = PyByteArray_AS_STRING(is_duplicate), *orphan = PyByteArray_AS_STRING(is_orphan);
    Tree tree;
    int has_tree = parents != Py_None && tree_open(&tree, args[11], num_blocks);
    PyObject *result = NULL;
    for (; position < count; position++) {
        PyObject *item = PyList_GET_ITEM(block_ids, position), *key = PyList_GET_ITEM(keys, position);
        Py_ssize_t block_id = block_index(item, num_blocks);
        if (block_id < 0 || !PyBytes_CheckExact(key))
            break;
        long tier = 0;
        if (tiers != Py_None) {
            PyObject *value = PyList_GET_ITEM(tiers, position);
            tier = PyLong_CheckExact(value) ? PyLong_AsLong(value) : -1;
            if (tier < 0 || tier > 255) {
                PyErr_Clear();
                break;
            }
        }
        int is_new = !PyDict_Contains(index, key);  /* (bytes: cannot fail) */
        PyObject *parent_key = is_new && parents != Py_None ? PyList_GET_ITEM(parents, position)
                                                            : Py_None;
        Py_ssize_t parent = -1;  /* the block to link under; -1: none (an orphan) */
        if (parent_key != Py_None) {
            if (!has_tree || !PyBytes_CheckExact(parent_key))
                break;
            PyObject *parent_id = PyDict_GetItemWithError(index, parent_key);  /* borrowed */
            if (parent_id != NULL && (parent = block_index(parent_id, num_blocks)) < 0)
                break;  /* (an index value the pool did not write) */
        }
        states[block_id] = SEALED;
        Py_INCREF(key);
        PyList_SetItem(hashes, block_id, key);
        if (tiers != Py_None)
            tier_bytes[block_id] = (char)tier;
        if (parent_key != Py_None) {
            if (parent < 0) {
                orphan[block_id] = 1;
            } else {
                int *first_child = tree_links(&tree, FIRST_CHILD);
                int first = first_child[parent];
                tree_links(&tree, PARENT)[block_id] = (int)parent;
                tree_links(&tree, NEXT_SIBLING)[block_id] = first;
                if (first != NO_BLOCK)
                    tree_links(&tree, PREV_SIBLING)[first] = (int)block_id;
                first_child[parent] = (int)block_id;
                orphan[block_id] = orphan[parent];
            }
        }
        if (is_new) {
            if (PyDict_SetItem(index, key, item) < 0)
                goto done;
        } else {
            duplicate[block_id] = 1;
        }
        if (PyList_Append(indexed, is_new ? Py_True : Py_False) < 0)
            goto done;
    }
    result = PyLong_FromSsize_t(position);
done:
    if (has_tree)
        tree_close(&tree);
    return result;
}

/* evict_run(num_needed, victim, evicted, freed, index, state, hashes, tiers, is_orphan,
             is_duplicate, refs, generations, links) -> key | None:
   allocate's eviction loop for leaves: asks `victim()` for keys until `num_needed` blocks are
   freed, and for each key that names a CACHED block without children in the prefix tree does
   kvd/core/pool.py's _evict -- unlink it from its parent, unindex it, tell `evicted(block_id)` (the
   journal; None: no observer), free it (state, marks, ref count, generation bump) -- appending
   its id to `freed` (the caller pushes them on the free list, in order, even if this raises).
   Returns None when done, or (key,) for the first key it did not evict (the policy has let it go
   already): a victim with children, or one that is not a cached block (None included), for the
   caller to evict or to report as the policy's bug. */
static PyObject *pool_evict_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("evict_run", nargs, 13) < 0)
        return NULL;
    Py_ssize_t num_needed = PyLong_AsSsize_t(args[0]);
    if (num_needed == -1 && PyErr_Occurred())
        return NULL;
    PyObject *victim = args[1], *evicted = args[2], *freed = args[3], *index = args[4],
             *state = args[5], *hashes = args[6], *tiers = args[7], *is_orphan = args[8],
             *is_duplicate = args[9], *refs = args[10], *generations = args[11];
    PyObject *lists[] = {hashes, refs}, *bytearrays[] = {tiers, is_orphan, is_duplicate};
    if (!PyList_CheckExact(freed) || !PyDict_CheckExact(index)
            || !tables_fit(state, lists, 2, bytearrays, 3)) {
        PyErr_SetString(PyExc_TypeError, "evict_run: the pool's tables do not fit");
        return NULL;
    }
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(state);
    Py_buffer counters;
    if (PyObject_GetBuffer(generations, &counters,
                           PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Tree tree;
    if (counters.itemsize != 8 || counters.format == NULL || strcmp(counters.format, "Q") != 0
            || counters.len != num_blocks * 8 || !tree_open(&tree, args[12], num_blocks)) {
        PyBuffer_Release(&counters);
        PyErr_SetString(PyExc_TypeError, "evict_run: generations or links do not fit");
        return NULL;
    }
    unsigned long long *generation = counters.buf;
    int *parents = tree_links(&tree, PARENT), *first_child = tree_links(&tree, FIRST_CHILD);
    int *next_sibling = tree_links(&tree, NEXT_SIBLING);
    int *prev_sibling = tree_links(&tree, PREV_SIBLING);
    char *states = PyByteArray_AS_STRING(state), *tier = PyByteArray_AS_STRING(tiers);
    char *orphan = PyByteArray_AS_STRING(is_orphan), *duplicate = PyByteArray_AS_STRING(is_duplicate);
    PyObject *result = NULL, *zero = PyLong_FromLong(0);
    if (zero == NULL)
        goto done;
    for (Py_ssize_t num_freed = 0; num_freed < num_needed; num_freed++) {
        PyObject *key = PyObject_CallNoArgs(victim);
        if (key == NULL)
            goto done;
        PyObject *item = PyBytes_CheckExact(key) ? PyDict_GetItemWithError(index, key) : NULL;
        Py_ssize_t block_id = item == NULL ? -1 : block_index(item, num_blocks);
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            goto done;
        }
        if (block_id < 0 || states[block_id] != CACHED || first_child[block_id] != NO_BLOCK) {
            result = PyTuple_Pack(1, key);
            Py_DECREF(key);
            goto done;
        }
        Py_INCREF(item);  /* the index's reference goes with its entry */
        int parent = parents[block_id];
        if (parent != NO_BLOCK) {  /* _unlink */
            int before = prev_sibling[block_id], after = next_sibling[block_id];
            if (before == NO_BLOCK)
                first_child[parent] = after;
            else
                next_sibling[before] = after;
            if (after != NO_BLOCK)
                prev_sibling[after] = before;
            parents[block_id] = prev_sibling[block_id] = next_sibling[block_id] = NO_BLOCK;
        }
        int status = PyDict_DelItem(index, key);
        Py_DECREF(key);
        if (status < 0) {
            Py_DECREF(item);
            goto done;
        }
        Py_INCREF(Py_None);
        PyList_SetItem(hashes, block_id, Py_None);
        if (evicted != Py_None) {
            PyObject *answer = PyObject_CallOneArg(evicted, item);
            if (answer == NULL) {
                Py_DECREF(item);
                goto done;
            }
            Py_DECREF(answer);
        }
        states[block_id] = FREE;  /* _to_free */
        tier[block_id] = orphan[block_id] = duplicate[block_id] = 0;
        Py_INCREF(zero);
        PyList_SetItem(refs, block_id, zero);
        generation[block_id]++;
        status = PyList_Append(freed, item);
        Py_DECREF(item);
        if (status < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(zero);
    tree_close(&tree);
    PyBuffer_Release(&counters);
    return result;
}

/* journal_rows(block_ids, is_orphan, hashes, tiers, generations, links) -> list | None:
   kvd/core/pool.py's journal_rows of `block_ids` (a list of ids in the pool): per block the tuple
   (block_id, key, generation, parent, parent_generation, tier), parent ORPHAN (-2) for an
   orphan; None if anything is off (the Python then makes the rows, or names the problem). */
static PyObject *pool_journal_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("journal_rows", nargs, 6) < 0)
        return NULL;
    PyObject *block_ids = args[0], *is_orphan = args[1], *hashes = args[2], *tiers = args[3];
    if (!PyList_CheckExact(block_ids) || !PyByteArray_CheckExact(is_orphan))
        Py_RETURN_NONE;
    Py_ssize_t num_blocks = PyByteArray_GET_SIZE(is_orphan);
    PyObject *bytearrays[] = {tiers};
    if (!tables_fit(is_orphan, &hashes, 1, bytearrays, 1))
        Py_RETURN_NONE;
    Py_buffer counters;
    if (PyObject_GetBuffer(args[4], &counters, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Tree tree;
    if (counters.itemsize != 8 || counters.format == NULL || strcmp(counters.format, "Q") != 0
            || counters.len != num_blocks * 8 || !tree_open(&tree, args[5], num_blocks)) {
        PyBuffer_Release(&counters);
        Py_RETURN_NONE;
    }
    const unsigned long long *generation = counters.buf;
    const int *parents = tree_links(&tree, PARENT);
    const char *orphan = PyByteArray_AS_STRING(is_orphan);
    const unsigned char *tier = (const unsigned char *)PyByteArray_AS_STRING(tiers);
    Py_ssize_t count = PyList_GET_SIZE(block_ids);
    PyObject *rows = PyList_New(count);
    for (Py_ssize_t i = 0; rows != NULL && i < count; i++) {
        PyObject *item = PyList_GET_ITEM(block_ids, i);
        Py_ssize_t block_id = block_index(item, num_blocks);
        int parent = block_id < 0 ? NO_BLOCK : orphan[block_id] ? -2 : parents[block_id];
        if (block_id < 0 || parent >= num_blocks) {
            Py_CLEAR(rows);
            rows = Py_NewRef(Py_None);
            break;
        }
        PyObject *row = Py_BuildValue("(OOKiKi)", item, PyList_GET_ITEM(hashes, block_id),
                                      generation[block_id], parent,
                                      parent >= 0 ? generation[parent] : 0ULL, tier[block_id]);
        if (row == NULL)
            Py_CLEAR(rows);
        else
            PyList_SET_ITEM(rows, i, row);
    }
    tree_close(&tree);
    PyBuffer_Release(&counters);
    return rows;
}

/* ---- one-block requests, whole: the Service's common alloc, seal, release and lookup --------

BlockPool.hot_ops binds each of these to a tuple of the pool's tables, made once (only `restore`
replaces a table, and it refuses to run after hot_ops), with the Python method it stands in for:
a call with anything but the one common block runs that method instead, unchanged, so the C
answers a request only where it does exactly what the Python would, in the same order. The pool's
counts (`_num_owned`, `_num_sealed`) are attributes of the pool and its counters a dict, changed
here by name. A policy that offers its queues (`c_events`, kvd/core/policies/s3fifo.py) has its event
done by kvd/core/policies/_s3fifo_keys.h where that can (else, and for every other policy, its method
runs). */

static PyObject *name_num_owned, *name_num_sealed, *name_next_victim, *name_pop, *name_allocations,
    *name_lookups, *name_lookup_blocks, *name_hit_blocks, *name_seals, *name_observer, *name_sealed,
    *name_journal_rows;

/* target.name += change (an attribute, or a dict's item when `is_item`), as Python's += does. */
static int add_to(PyObject *target, PyObject *name, long change, int is_item)
{
    PyObject *value = is_item ? PyDict_GetItemWithError(target, name)
                              : PyObject_GetAttr(target, name);
    if (value == NULL) {
        if (is_item && !PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, name);
        return -1;
    }
    if (is_item)
        Py_INCREF(value);
    PyObject *step = PyLong_FromLong(change);
    PyObject *sum = step == NULL ? NULL : PyNumber_Add(value, step);
    Py_DECREF(value);
    Py_XDECREF(step);
    if (sum == NULL)
        return -1;
    int status = is_item ? PyDict_SetItem(target, name, sum) : PyObject_SetAttr(target, name, sum);
    Py_DECREF(sum);
    return status;
}

/* The tables a one-block request was bound to, unpacked: NULL (no error) if they do not fit. */
static PyObject *const *bound_tables(PyObject *tables, Py_ssize_t expected)
{
    if (!PyTuple_CheckExact(tables) || PyTuple_GET_SIZE(tables) != expected)
        return NULL;
    return &PyTuple_GET_ITEM(tables, 0);
}

/* The policy's event through its queues when it offers them (`events`, else None), else its
   method `method(key[, tier])`. is_insert: inserted(key, tier), else hit_evictable(key). */
static int policy_event(PyObject *events, PyObject *method, PyObject *key, int is_insert,
                        long tier)
{
    int done = 0;
    if (PyTuple_CheckExact(events) && PyTuple_GET_SIZE(events) == 7) {
        PyObject *const *queue = &PyTuple_GET_ITEM(events, 0);
        long in_main = small_int(queue[4]), max_frequency = small_int(queue[5]);
        if (in_main > 0 && max_frequency >= 0 && PyBool_Check(queue[6])
                && queues_fit(queue[0], queue[1], queue[2], is_insert ? queue[3] : NULL))
            done = is_insert ? insert_key(key, queue[0], queue[1], queue[2], queue[3], in_main)
                             : hit_key(key, queue[1], queue[2], queue[0], in_main, max_frequency,
                                       queue[6] == Py_True);
    }
    if (done != 0)
        return done < 0 ? -1 : 0;
    PyObject *result;
    if (is_insert) {
        PyObject *tier_value = PyLong_FromLong(tier);
        if (tier_value == NULL)
            return -1;
        result = PyObject_CallFunctionObjArgs(method, key, tier_value, NULL);
        Py_DECREF(tier_value);
    } else {
        result = PyObject_CallOneArg(method, key);
    }
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* owner's {block: pins}, made if it has none (held_all.setdefault(owner, {})); borrowed. */
static PyObject *holdings_of(PyObject *held_all, PyObject *owner)
{
    PyObject *held = PyDict_GetItemWithError(held_all, owner);
    if (held != NULL || PyErr_Occurred())
        return held;
    PyObject *fresh = PyDict_New();
    if (fresh == NULL)
        return NULL;
    held = PyDict_SetDefault(held_all, owner, fresh);
    Py_DECREF(fresh);
    return held;
}

/* alloc_one((pool, allocate, free, held_all, state, refs, counters), num_blocks, owner):
   BlockPool.allocate(1, owner) when a block is free (no eviction); allocate(num_blocks, owner)
   for anything else. */
static PyObject *pool_alloc_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("alloc_one", nargs, 3) < 0)
        return NULL;
    PyObject *const *t = bound_tables(args[0], 7);
    if (t == NULL)
        return PyErr_Format(PyExc_TypeError, "alloc_one: the bound tables do not fit");
    PyObject *pool = t[0], *free = t[2], *held_all = t[3], *state = t[4], *refs = t[5],
             *counters = t[6], *num_blocks = args[1], *owner = args[2];
    if (!PyLong_CheckExact(num_blocks) || PyLong_AsLong(num_blocks) != 1
            || !PyDict_CheckExact(held_all) || !PyDict_CheckExact(counters)
            || !tables_fit(state, &refs, 1, NULL, 0) || PyObject_Length(free) < 1) {
        PyErr_Clear();
        return PyObject_Vectorcall(t[1], &args[1], 2, NULL);
    }
    PyObject *held = holdings_of(held_all, owner);
    if (held == NULL)
        return NULL;
    PyObject *block = PyObject_CallMethodNoArgs(free, name_pop);
    if (block == NULL)
        return NULL;
    Py_ssize_t block_id = block_index(block, PyByteArray_GET_SIZE(state));
    if (block_id < 0 || !PyDict_CheckExact(held)) {
        Py_DECREF(block);
        return PyErr_Format(PyExc_TypeError, "alloc_one: the free list held a bad block id");
    }
    PyObject *one = PyLong_FromLong(1), *block_ids = PyList_New(1);
    int status = one == NULL || block_ids == NULL ? -1 : PyDict_SetItem(held, block, one);
    if (status == 0) {
        PyByteArray_AS_STRING(state)[block_id] = OWNED;
        status = set_ref_count(refs, block_id, 1);
    }
    if (status == 0)
        status = add_to(pool, name_num_owned, 1, 0);
    if (status == 0)
        status = add_to(counters, name_allocations, 1, 1);
    Py_XDECREF(one);
    if (status < 0 || block_ids == NULL) {
        Py_DECREF(block);
        Py_XDECREF(block_ids);
        return NULL;
    }
    PyList_SET_ITEM(block_ids, 0, block);
    return block_ids;
}

/* release_one((pool, release, held_all, state, refs, hashes, tier, is_orphan, is_duplicate,
   events, inserted), block_ids, owner): BlockPool.release of the last pin on one indexed block,
   which becomes CACHED; release(block_ids, owner) for anything else. */
static PyObject *pool_release_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("release_one", nargs, 3) < 0)
        return NULL;
    PyObject *const *t = bound_tables(args[0], 11);
    if (t == NULL)
        return PyErr_Format(PyExc_TypeError, "release_one: the bound tables do not fit");
    PyObject *pool = t[0], *held_all = t[2], *state = t[3], *refs = t[4], *hashes = t[5],
             *tier = t[6], *is_orphan = t[7], *is_duplicate = t[8], *block_ids = args[1],
             *owner = args[2];
    PyObject *lists[] = {refs, hashes}, *bytearrays[] = {tier, is_orphan, is_duplicate};
    if (!PyList_CheckExact(block_ids) || PyList_GET_SIZE(block_ids) != 1
            || !PyDict_CheckExact(held_all) || !tables_fit(state, lists, 2, bytearrays, 3))
        return PyObject_Vectorcall(t[1], &args[1], 2, NULL);
    PyObject *block = PyList_GET_ITEM(block_ids, 0);
    Py_ssize_t block_id = block_index(block, PyByteArray_GET_SIZE(state));
    PyObject *held = block_id < 0 ? NULL : PyDict_GetItemWithError(held_all, owner);
    if (held == NULL && PyErr_Occurred())
        return NULL;
    if (held == NULL || !PyDict_CheckExact(held) || PyByteArray_AS_STRING(state)[block_id] != SEALED
            || ref_count(refs, block_id) != 1 || pins_of(held, block) != 1
            || PyByteArray_AS_STRING(is_duplicate)[block_id]
            || PyByteArray_AS_STRING(is_orphan)[block_id]) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(t[1], &args[1], 2, NULL);  /* (not held: it raises) */
    }
    PyObject *key = Py_NewRef(PyList_GET_ITEM(hashes, block_id));
    Py_INCREF(held);
    int status = PyDict_DelItem(held, block);
    if (status == 0)
        status = set_ref_count(refs, block_id, 0);
    if (status == 0) {
        PyByteArray_AS_STRING(state)[block_id] = CACHED;
        status = add_to(pool, name_num_sealed, -1, 0);
    }
    if (status == 0)
        status = policy_event(t[9], t[10], key, 1,
                              (unsigned char)PyByteArray_AS_STRING(tier)[block_id]);
    if (status == 0 && PyDict_GET_SIZE(held) == 0)
        status = PyDict_DelItem(held_all, owner) < 0 ? -1 : 0;
    Py_DECREF(held);
    Py_DECREF(key);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* lookup_one((pool, lookup, index, state, refs, hashes, held_all, counters, events,
   hit_evictable), keys, owner): BlockPool.lookup of one key that misses or hits a CACHED block
   (not the chosen victim), pinned for owner; lookup(keys, owner) for anything else. */
static PyObject *pool_lookup_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("lookup_one", nargs, 3) < 0)
        return NULL;
    PyObject *const *t = bound_tables(args[0], 10);
    if (t == NULL)
        return PyErr_Format(PyExc_TypeError, "lookup_one: the bound tables do not fit");
    PyObject *pool = t[0], *index = t[2], *state = t[3], *refs = t[4], *hashes = t[5],
             *held_all = t[6], *counters = t[7], *keys = args[1], *owner = args[2];
    PyObject *lists[] = {refs, hashes};
    if (!PyList_CheckExact(keys) || PyList_GET_SIZE(keys) != 1
            || !PyBytes_CheckExact(PyList_GET_ITEM(keys, 0)) || !PyDict_CheckExact(index)
            || !PyDict_CheckExact(held_all) || !PyDict_CheckExact(counters)
            || !tables_fit(state, lists, 2, NULL, 0))
        return PyObject_Vectorcall(t[1], &args[1], 2, NULL);
    PyObject *key = PyList_GET_ITEM(keys, 0);
    PyObject *block = PyDict_GetItemWithError(index, key);  /* borrowed */
    if (block == NULL && PyErr_Occurred())
        return NULL;
    Py_ssize_t block_id = -1;
    if (block != NULL) {  /* a hit: on a CACHED block other than the chosen victim, or Python's */
        block_id = block_index(block, PyByteArray_GET_SIZE(state));
        PyObject *next_victim = block_id < 0 ? NULL : PyObject_GetAttr(pool, name_next_victim);
        int is_chosen = next_victim == NULL ? -1
                                            : PyObject_RichCompareBool(next_victim, block, Py_EQ);
        Py_XDECREF(next_victim);
        if (is_chosen < 0 && PyErr_Occurred())
            return NULL;
        if (is_chosen != 0 || PyByteArray_AS_STRING(state)[block_id] != CACHED
                || ref_count(refs, block_id) != 0)
            return PyObject_Vectorcall(t[1], &args[1], 2, NULL);
    }
    PyObject *block_ids = PyList_New(0);
    if (block_ids == NULL)
        return NULL;
    int status = 0;
    if (block != NULL) {
        Py_INCREF(block);
        PyObject *held = NULL, *one = NULL;
        PyObject *key = Py_NewRef(PyList_GET_ITEM(hashes, block_id));
        status = policy_event(t[8], t[9], key, 0, 0);
        Py_DECREF(key);
        if (status == 0) {
            PyByteArray_AS_STRING(state)[block_id] = SEALED;
            status = add_to(pool, name_num_sealed, 1, 0);
        }
        if (status == 0)
            status = set_ref_count(refs, block_id, 1);
        if (status == 0)
            status = (held = holdings_of(held_all, owner)) == NULL ? -1 : 0;
        if (status == 0)
            status = (one = PyLong_FromLong(1)) == NULL ? -1 : PyObject_SetItem(held, block, one);
        Py_XDECREF(one);
        if (status == 0)
            status = PyList_Append(block_ids, block);
        Py_DECREF(block);
    }
    if (status == 0)
        status = add_to(counters, name_lookups, 1, 1);
    if (status == 0)
        status = add_to(counters, name_lookup_blocks, 1, 1);
    if (status == 0)
        status = add_to(counters, name_hit_blocks, block != NULL, 1);
    if (status < 0) {
        Py_DECREF(block_ids);
        return NULL;
    }
    return block_ids;
}

/* Whether `hints` is None or a list of one item that `fits`: for seal's parents and tiers. */
static int one_hint(PyObject *hints, int (*fits)(PyObject *))
{
    return hints == Py_None || (PyList_CheckExact(hints) && PyList_GET_SIZE(hints) == 1
                                && fits(PyList_GET_ITEM(hints, 0)));
}

static int is_parent_key(PyObject *item) { return item == Py_None || PyBytes_CheckExact(item); }

static int is_tier(PyObject *item)  /* (TIER_PREFILL or TIER_DECODE, kvd/core/policies/base.py) */
{
    return PyLong_CheckExact(item) && (PyLong_AsLong(item) == 0 || PyLong_AsLong(item) == 1);
}

/* seal_one((pool, seal, held_all, state, hashes, tier, is_duplicate, is_orphan, index, links,
   generations, counters), block_ids, keys, parents, tiers, owner): BlockPool.seal of one OWNED
   block of owner's under an exact-bytes key (its parent key exact bytes or None, its tier 0 or 1),
   the pool's observer told as the Python tells it; seal(block_ids, keys, parents, tiers, owner)
   for anything else. The checks and the publishing are first_unsealable's and seal_run's. */
static PyObject *pool_seal_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("seal_one", nargs, 6) < 0)
        return NULL;
    PyObject *const *t = bound_tables(args[0], 12);
    if (t == NULL)
        return PyErr_Format(PyExc_TypeError, "seal_one: the bound tables do not fit");
    PyObject *pool = t[0], *held_all = t[2], *state = t[3], *hashes = t[4], *tier = t[5],
             *is_orphan = t[7], *links = t[9], *counters = t[11], *block_ids = args[1],
             *keys = args[2], *parents = args[3], *tiers = args[4], *owner = args[5];
    PyObject *held = NULL;
    if (PyList_CheckExact(block_ids) && PyList_GET_SIZE(block_ids) == 1 && PyList_CheckExact(keys)
            && PyList_GET_SIZE(keys) == 1 && one_hint(parents, is_parent_key)
            && one_hint(tiers, is_tier) && PyDict_CheckExact(held_all)
            && PyDict_CheckExact(counters))
        held = PyDict_GetItemWithError(held_all, owner);
    if (held == NULL && PyErr_Occurred())
        return NULL;
    PyObject *vouched = NULL;
    if (held != NULL) {
        PyObject *check[] = {block_ids, keys, held, state};
        vouched = pool_first_unsealable(module, check, 4);
        if (vouched == NULL)
            return NULL;
    }
    PyObject *indexed = NULL, *stop = NULL, *zero = NULL;
    if (vouched != NULL && PyLong_AsLong(vouched) == 1 && (indexed = PyList_New(0)) != NULL
            && (zero = PyLong_FromLong(0)) != NULL) {
        PyObject *run[] = {block_ids, keys, zero, tiers, parents, state, hashes, tier, t[6],
                           is_orphan, t[8], links, indexed};
        stop = pool_seal_run(module, run, 13);
    }
    Py_XDECREF(vouched);
    Py_XDECREF(zero);
    if (stop == NULL && PyErr_Occurred()) {
        Py_XDECREF(indexed);
        return NULL;
    }
    if (stop == NULL || PyLong_AsLong(stop) != 1) {  /* (nothing changed) the method's to do */
        Py_XDECREF(stop);
        Py_XDECREF(indexed);
        return PyObject_Vectorcall(t[1], &args[1], 5, NULL);
    }
    Py_DECREF(stop);
    /* The journal hears of the newly indexed blocks (none for a duplicate), as in the Python. */
    PyObject *observer = PyObject_GetAttr(pool, name_observer), *rows = NULL, *told = NULL;
    int status = observer == NULL ? -1 : 0;
    if (status == 0 && observer != Py_None) {
        PyObject *new_ids = PyList_GET_ITEM(indexed, 0) == Py_True ? Py_NewRef(block_ids)
                                                                    : PyList_New(0);
        if (new_ids != NULL) {
            PyObject *rows_args[] = {new_ids, is_orphan, hashes, tier, t[10], links};
            rows = pool_journal_rows(module, rows_args, 6);
            if (rows == Py_None) {  /* (C declined: the method makes them) */
                Py_DECREF(rows);
                rows = PyObject_CallMethodOneArg(pool, name_journal_rows, new_ids);
            }
            Py_DECREF(new_ids);
        }
        told = rows == NULL ? NULL : PyObject_CallMethodOneArg(observer, name_sealed, rows);
        status = told == NULL ? -1 : 0;
    }
    Py_XDECREF(observer);
    Py_XDECREF(rows);
    Py_XDECREF(told);
    if (status == 0)
        status = add_to(pool, name_num_owned, -1, 0);
    if (status == 0)
        status = add_to(pool, name_num_sealed, 1, 0);
    if (status == 0)
        status = add_to(counters, name_seals, 1, 1);
    if (status < 0) {
        Py_DECREF(indexed);
        return NULL;
    }
    return indexed;
}

static PyMethodDef pool_methods[] = {
    {"own", (PyCFunction)(void (*)(void))pool_own, METH_FASTCALL,
     "own(block_ids, held, state, refs) -> bool: each FREE block OWNED, one pin in held and refs;"
     " False, with nothing changed, unless every id is an int naming a FREE block"},
    {"prefix", (PyCFunction)(void (*)(void))pool_prefix, METH_FASTCALL,
     "prefix(index, keys) -> list | None: index[key] for the longest prefix of keys in index; "
     "None unless keys is a list of bytes"},
    {"pin_run", (PyCFunction)(void (*)(void))pool_pin_run, METH_FASTCALL,
     "pin_run(block_ids, start, held, state, refs, hashes, next_victim, count_access, hits) -> "
     "(stop, num_uncached): BlockPool._pin_sealed's common blocks"},
    {"unpin_run", (PyCFunction)(void (*)(void))pool_unpin_run, METH_FASTCALL,
     "unpin_run(block_ids, start, held, state, refs, hashes, tiers, is_orphan, is_duplicate, "
     "cached_keys, cached_tiers) -> (stop, num_last_pins): BlockPool._unpin's common blocks"},
    {"first_unsealable", (PyCFunction)(void (*)(void))pool_first_unsealable, METH_FASTCALL,
     "first_unsealable(block_ids, keys, held, state) -> int: the first block seal must check "
     "itself"},
    {"seal_run", (PyCFunction)(void (*)(void))pool_seal_run, METH_FASTCALL,
     "seal_run(block_ids, keys, start, tiers, parents, state, hashes, tier_of, is_duplicate, "
     "is_orphan, index, links, indexed) -> stop: BlockPool.seal's publishing, parents linked"},
    {"evict_run", (PyCFunction)(void (*)(void))pool_evict_run, METH_FASTCALL,
     "evict_run(num_needed, victim, evicted, freed, index, state, hashes, tiers, is_orphan, "
     "is_duplicate, refs, generations, links) -> (key,) | None: allocate's eviction of leaf "
     "victims"},
    {"alloc_one", (PyCFunction)(void (*)(void))pool_alloc_one, METH_FASTCALL,
     "alloc_one(tables, num_blocks, owner) -> list: allocate of one free block, whole"},
    {"release_one", (PyCFunction)(void (*)(void))pool_release_one, METH_FASTCALL,
     "release_one(tables, block_ids, owner) -> None: release of one block's last pin, whole"},
    {"seal_one", (PyCFunction)(void (*)(void))pool_seal_one, METH_FASTCALL,
     "seal_one(tables, block_ids, keys, parents, tiers, owner) -> list: seal of one owned "
     "block, whole"},
    {"lookup_one", (PyCFunction)(void (*)(void))pool_lookup_one, METH_FASTCALL,
     "lookup_one(tables, keys, owner) -> list: lookup of one key, a miss or a cached hit, whole"},
    {"journal_rows", (PyCFunction)(void (*)(void))pool_journal_rows, METH_FASTCALL,
     "journal_rows(block_ids, is_orphan, hashes, tiers, generations, links) -> list | None: "
     "BlockPool.journal_rows of a list of block ids"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pool_module = {
    PyModuleDef_HEAD_INIT, "kvd.core._pool",
    "The block pool's per-block loops in C; see kvd/core/_pool.c and kvd/core/pool.py.", -1, pool_methods,
};

PyMODINIT_FUNC PyInit__pool(void)
{
    PyObject **names[] = {&name_num_owned, &name_num_sealed, &name_next_victim, &name_pop,
                          &name_allocations, &name_lookups, &name_lookup_blocks, &name_hit_blocks,
                          &name_seals, &name_observer, &name_sealed, &name_journal_rows};
    const char *texts[] = {"_num_owned", "_num_sealed", "_next_victim", "pop", "allocations",
                           "lookups", "lookup_blocks", "hit_blocks", "seals", "observer",
                           "sealed", "journal_rows"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    return PyModule_Create(&pool_module);
}
