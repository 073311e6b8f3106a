/* kvd.core.policies._s3fifo: the batch events of S3-FIFO and kvd's policy in C, every uncommon key left
to kvd/core/policies/s3fifo.py and adaptive.py.

Theory of operation
-------------------
Once the pool's loops were in C (kvd/core/_pool.c), a batch-256 release was mostly S3-FIFO's
`inserted_many` and a lookup its `hit_evictable_many`: per key a dict pop and an OrderedDict
store, each a method call in Python. These functions do the same operations on the policy's own
queues, which the policy passes in on each call, for the keys that make up the traffic:

    insert_run(keys, start, pinned, small, main, ghosts, in_main) -> stop
        a key coming back from `pinned` to its queue (S, or M when its packed value has in_main
        set) with its counter, and a new key that no ghost holds to S unhit;
    hit_run(keys, start, small, main, pinned, in_main, max_frequency, count_main_hits) -> stop
        an evictable key leaving S or M for `pinned`, packed with its counter (plus one, up to
        max_frequency; in M only if count_main_hits) and in_main when it came from M.

Each stops *before* the first key it does not handle -- a ghost hit (its admission and
adaptation rules are the policy's), a key in neither queue (the Python raises KeyError), a key
that is not exact bytes (hashing it could run Python code), a value that is not a small int --
and returns that position; the policy's Python loop does that key and calls again, so the two
interleave into the pure loop's result key for key (tests/policies/test_s3fifo_c.py compares
twin policies). OrderedDicts are changed only through PyODict_SetItem, PyODict_DelItem and their
own popitem, which keep their order lists; assigning to a key an OrderedDict holds keeps its
position, as in Python.

    victim(small, main, ghost, main_ghost, ...) -> (key | None, num_small_evictions)
        the whole of victim(), which has no uncommon case: kvd's policy passes its main ghost
        and its count of S's evictions, which numbers its S ghosts.
*/
#include "_s3fifo_keys.h"  /* (Python.h, check_nargs, start_of; the one-key events) */

static PyObject *s3fifo_insert_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("insert_run", nargs, 7) < 0)
        return NULL;
    PyObject *keys = args[0], *pinned = args[2], *small = args[3], *main = args[4],
             *ghosts = args[5];
    if (!PyList_CheckExact(keys))  /* not ours to take: the Python loop goes on from start */
        return Py_NewRef(args[1]);
    Py_ssize_t count = PyList_GET_SIZE(keys), position = start_of(args[1], count);
    if (position < 0)
        return NULL;
    long in_main = PyLong_AsLong(args[6]);
    if (in_main == -1 && PyErr_Occurred())
        return NULL;
    if (!queues_fit(pinned, small, main, ghosts))
        return PyLong_FromSsize_t(position);
    for (; position < count; position++) {
        int done = insert_key(PyList_GET_ITEM(keys, position), pinned, small, main, ghosts,
                              in_main);
        if (done < 0)
            return NULL;
        if (!done)
            break;
    }
    return PyLong_FromSsize_t(position);
}

static PyObject *s3fifo_hit_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("hit_run", nargs, 8) < 0)
        return NULL;
    PyObject *keys = args[0], *small = args[2], *main = args[3], *pinned = args[4];
    if (!PyList_CheckExact(keys))  /* not ours to take: the Python loop goes on from start */
        return Py_NewRef(args[1]);
    Py_ssize_t count = PyList_GET_SIZE(keys), position = start_of(args[1], count);
    if (position < 0)
        return NULL;
    long in_main = PyLong_AsLong(args[5]), max_frequency = PyLong_AsLong(args[6]);
    int count_main_hits = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred() || count_main_hits < 0)
        return NULL;
    if (!queues_fit(pinned, small, main, NULL))
        return PyLong_FromSsize_t(position);
    for (; position < count; position++) {
        int done = hit_key(PyList_GET_ITEM(keys, position), small, main, pinned, in_main,
                           max_frequency, count_main_hits);
        if (done < 0)
            return NULL;
        if (!done)
            break;
    }
    return PyLong_FromSsize_t(position);
}

/* (key, value) = queue.popitem(last=False): the oldest entry; NULL with an exception. */
static PyObject *pop_oldest(PyObject *queue)
{
    static PyObject *name = NULL;
    if (name == NULL && (name = PyUnicode_InternFromString("popitem")) == NULL)
        return NULL;
    PyObject *item = PyObject_CallMethodOneArg(queue, name, Py_False);
    if (item != NULL && (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)) {
        Py_DECREF(item);
        PyErr_SetString(PyExc_TypeError, "popitem() did not return a pair");
        return NULL;
    }
    return item;
}

/* ghost[key] = value, then the oldest ghost dropped while there are more than `limit`. */
static int remember(PyObject *ghost, PyObject *key, PyObject *value, Py_ssize_t limit)
{
    if (PyODict_SetItem(ghost, key, value) < 0)
        return -1;
    if (PyDict_GET_SIZE(ghost) > limit) {
        PyObject *oldest = pop_oldest(ghost);
        if (oldest == NULL)
            return -1;
        Py_DECREF(oldest);
    }
    return 0;
}

/* victim(small, main, ghost, main_ghost, small_target, ghost_limit, num_small_evictions)
   -> (key | None, num_small_evictions):
   S3-FIFO's victim() with its ghost: S's oldest keys leave S while S is at least small_target
   long (or M is empty), each promoted to M (counter cleared) if it was hit, else evicted into
   the ghost; then M's oldest keys are evicted or, with a counter, reinserted one lower. With
   `main_ghost` (kvd's policy), S's victims are remembered with their eviction number and M's
   in main_ghost (at most ghost_limit each); without it (None), S's with None and M's nowhere. */
static PyObject *s3fifo_victim(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("victim", nargs, 7) < 0)
        return NULL;
    PyObject *small = args[0], *main = args[1], *ghost = args[2], *main_ghost = args[3];
    double small_target = PyFloat_AsDouble(args[4]);
    Py_ssize_t ghost_limit = PyLong_AsSsize_t(args[5]);
    long long num_small_evictions = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyODict_CheckExact(small) || !PyODict_CheckExact(main) || !PyODict_CheckExact(ghost)
            || (main_ghost != Py_None && !PyODict_CheckExact(main_ghost))) {
        PyErr_SetString(PyExc_TypeError, "victim: the queues must be OrderedDicts");
        return NULL;
    }
    while (PyDict_GET_SIZE(small) > 0
           && ((double)PyDict_GET_SIZE(small) >= small_target || PyDict_GET_SIZE(main) == 0)) {
        PyObject *oldest = pop_oldest(small);
        if (oldest == NULL)
            return NULL;
        PyObject *key = PyTuple_GET_ITEM(oldest, 0), *count = PyTuple_GET_ITEM(oldest, 1);
        int is_hit = PyObject_IsTrue(count);
        int status = is_hit < 0 ? -1 : 0;
        if (is_hit == 0) {  /* evicted into the ghost */
            PyObject *mark = Py_None;
            if (main_ghost != Py_None && (mark = PyLong_FromLongLong(++num_small_evictions)) == NULL)
                status = -1;
            if (status == 0) {
                status = remember(ghost, key, mark, ghost_limit);
                if (main_ghost != Py_None)
                    Py_DECREF(mark);
            }
            PyObject *answer = status < 0 ? NULL : Py_BuildValue("(OL)", key, num_small_evictions);
            Py_DECREF(oldest);
            return answer;
        }
        if (status == 0) {
            PyObject *zero = PyLong_FromLong(0);
            status = zero == NULL ? -1 : PyODict_SetItem(main, key, zero);
            Py_XDECREF(zero);
        }
        Py_DECREF(oldest);
        if (status < 0)
            return NULL;
    }
    while (PyDict_GET_SIZE(main) > 0) {
        PyObject *oldest = pop_oldest(main);
        if (oldest == NULL)
            return NULL;
        PyObject *key = PyTuple_GET_ITEM(oldest, 0);
        long count = PyLong_AsLong(PyTuple_GET_ITEM(oldest, 1));
        int status = count == -1 && PyErr_Occurred() ? -1 : 0;
        if (status == 0 && count == 0) {
            if (main_ghost != Py_None)
                status = remember(main_ghost, key, Py_None, ghost_limit);
            PyObject *answer = status < 0 ? NULL : Py_BuildValue("(OL)", key, num_small_evictions);
            Py_DECREF(oldest);
            return answer;
        }
        if (status == 0) {
            PyObject *lower = PyLong_FromLong(count - 1);
            status = lower == NULL ? -1 : PyODict_SetItem(main, key, lower);
            Py_XDECREF(lower);
        }
        Py_DECREF(oldest);
        if (status < 0)
            return NULL;
    }
    return Py_BuildValue("(OL)", Py_None, num_small_evictions);
}

static PyMethodDef s3fifo_methods[] = {
    {"insert_run", (PyCFunction)(void (*)(void))s3fifo_insert_run, METH_FASTCALL,
     "insert_run(keys, start, pinned, small, main, ghosts, in_main) -> stop: inserted_many's "
     "keys from start up to the first ghost hit (or anything unexpected)"},
    {"hit_run", (PyCFunction)(void (*)(void))s3fifo_hit_run, METH_FASTCALL,
     "hit_run(keys, start, small, main, pinned, in_main, max_frequency, count_main_hits) -> "
     "stop: hit_evictable_many's keys from start up to anything unexpected"},
    {"victim", (PyCFunction)(void (*)(void))s3fifo_victim, METH_FASTCALL,
     "victim(small, main, ghost, main_ghost, small_target, ghost_limit, num_small_evictions) -> "
     "(key | None, num_small_evictions): S3-FIFO's victim() (kvd's policy's with main_ghost)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef s3fifo_module = {
    PyModuleDef_HEAD_INIT, "kvd.core.policies._s3fifo",
    "S3-FIFO's batch events in C; see kvd/core/policies/_s3fifo.c and kvd/core/policies/s3fifo.py.", -1,
    s3fifo_methods,
};

PyMODINIT_FUNC PyInit__s3fifo(void)
{
    return PyModule_Create(&s3fifo_module);
}
