/* kvd.core.policies._s3fifo: the batch events and the victim of S3-FIFO and kvd's policy in C,
every uncommon key left to kvd/core/policies/s3fifo.py and adaptive.py.

Theory of operation
-------------------
Once the pool's operations were in C (kvd/core/_pool.c), a batch-256 release was mostly
S3-FIFO's `inserted_many` and a lookup its `hit_evictable_many`: per key a dict pop and an
OrderedDict store, each a method call in Python. The policy keeps its queues in one
`S3FIFOQueues` object (kvd/core/policies/s3fifo.py; its docstring is the contract);
`bind(queues)` reads its fields once, checks their types and that its IN_MAIN and MAX_FREQUENCY
are this file's (a renamed or retyped field raises TypeError there), and returns a `Queues`
object whose methods do the same operations on those queues:

    insert(key) -> bool, insert_run(keys, start) -> stop
        a key coming back from `pinned` to its queue (S, or M when its packed value has IN_MAIN
        set) with its counter, and a new key that no ghost holds to S unhit;
    hit(key) -> bool, hit_run(keys, start) -> stop
        an evictable key leaving S or M for `pinned`, packed with its counter (plus one, up to
        MAX_FREQUENCY; in M only if count_main_hits) and IN_MAIN when it came from M;
    victim(small_target, num_small_evictions) -> (key | None, num_small_evictions)
        the whole of victim(), which has no uncommon case: with a main ghost (kvd's policy) S's
        victims are remembered with their eviction number and M's in the main ghost.

A one-key event returns False for, and a run stops *before*, a key it does not handle -- a ghost
hit (its admission and adaptation rules are the policy's), a key in neither queue (the Python
raises KeyError), a key that is not exact bytes (hashing it could run Python code), a value that
is not a small int -- and a run returns that position; the policy's Python does that key (and
calls again), so the two interleave into the pure loop's result key for key
(tests/native/test_s3fifo_c.py compares twin policies). OrderedDicts are read with the dict
API and changed only through the abstract object API (PyObject_SetItem, PyObject_DelItem,
popitem), which keeps their order; assigning to a key an OrderedDict holds keeps its position,
as in Python.

What it buys: the policy's events at batch 16 and 256 (`python -m bench.pool_ab --base python`
turns it off with the pool's C); and a one-block release or lookup, whose one event reaches the
policy's `inserted` or `hit_evictable`, each the C's `insert` or `hit` where it runs.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define IN_MAIN 0x4
#define MAX_FREQUENCY 3

typedef struct {
    PyObject_HEAD
    PyObject *small, *main, *pinned, *ghost, *main_ghost;  /* main_ghost: NULL for S3-FIFO */
    Py_ssize_t ghost_limit;
    int count_main_hits;
} Queues;

static PyObject *ordered_dict_type, *name_popitem;

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* The start position `arg` gives in a sequence of `length` items; -1 with an exception. */
static Py_ssize_t start_of(PyObject *arg, Py_ssize_t length)
{
    Py_ssize_t start = PyLong_AsSsize_t(arg);
    if (start == -1 && PyErr_Occurred())
        return -1;
    if (start < 0 || start > length) {
        PyErr_SetString(PyExc_ValueError, "start is outside the sequence");
        return -1;
    }
    return start;
}

/* ---- binding ----------------------------------------------------------------------------- */

/* queues.name, a new reference, if it is exactly of `type` (NULL: an OrderedDict); else NULL
   with a TypeError. */
static PyObject *bind_field(PyObject *queues, const char *name, PyTypeObject *type)
{
    PyObject *field = PyObject_GetAttrString(queues, name);
    if (type == NULL)
        type = (PyTypeObject *)ordered_dict_type;
    if (field != NULL && !Py_IS_TYPE(field, type)) {
        PyErr_Format(PyExc_TypeError, "bind: queues.%s must be a %s, not %s", name,
                     type->tp_name, Py_TYPE(field)->tp_name);
        Py_CLEAR(field);
    }
    return field;
}

/* queues.name as a C long, which must be `expected` unless that is negative. */
static long bind_long(PyObject *queues, const char *name, long expected)
{
    PyObject *field = PyObject_GetAttrString(queues, name);
    if (field == NULL)
        return -1;
    long value = PyLong_Check(field) ? PyLong_AsLong(field) : -1;
    Py_DECREF(field);
    if (value < 0 || (expected >= 0 && value != expected)) {
        PyErr_Clear();
        if (expected >= 0)
            PyErr_Format(PyExc_TypeError, "bind: queues.%s must be %ld, as in kvd/core/policies/"
                         "_s3fifo.c", name, expected);
        else
            PyErr_Format(PyExc_TypeError, "bind: queues.%s must be a non-negative int", name);
        return -1;
    }
    return value;
}

static PyTypeObject QueuesType;

static PyObject *s3fifo_bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("bind", nargs, 1) < 0)
        return NULL;
    PyObject *queues = args[0];
    Queues *self = PyObject_GC_New(Queues, &QueuesType);
    if (self == NULL)
        return NULL;
    self->small = self->main = self->pinned = self->ghost = self->main_ghost = NULL;
    PyObject_GC_Track(self);
    if ((self->small = bind_field(queues, "small", NULL)) == NULL
            || (self->main = bind_field(queues, "main", NULL)) == NULL
            || (self->pinned = bind_field(queues, "pinned", &PyDict_Type)) == NULL
            || (self->ghost = bind_field(queues, "ghost", NULL)) == NULL
            || bind_long(queues, "IN_MAIN", IN_MAIN) < 0
            || bind_long(queues, "MAX_FREQUENCY", MAX_FREQUENCY) < 0
            || (self->ghost_limit = bind_long(queues, "ghost_limit", -1)) < 0)
        goto fail;
    PyObject *main_ghost = PyObject_GetAttrString(queues, "main_ghost");
    if (main_ghost == NULL)
        goto fail;
    if (main_ghost == Py_None)
        Py_DECREF(main_ghost);
    else if ((self->main_ghost = bind_field(queues, "main_ghost", NULL)) == NULL)
        goto fail;
    else
        Py_DECREF(main_ghost);
    PyObject *count_main_hits = PyObject_GetAttrString(queues, "count_main_hits");
    if (count_main_hits == NULL)
        goto fail;
    self->count_main_hits = PyObject_IsTrue(count_main_hits);
    Py_DECREF(count_main_hits);
    if (self->count_main_hits < 0)
        goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int queues_traverse(Queues *self, visitproc visit, void *arg)
{
    Py_VISIT(self->small);
    Py_VISIT(self->main);
    Py_VISIT(self->pinned);
    Py_VISIT(self->ghost);
    Py_VISIT(self->main_ghost);
    return 0;
}

static int queues_clear(Queues *self)
{
    Py_CLEAR(self->small);
    Py_CLEAR(self->main);
    Py_CLEAR(self->pinned);
    Py_CLEAR(self->ghost);
    Py_CLEAR(self->main_ghost);
    return 0;
}

static void queues_dealloc(Queues *self)
{
    PyObject_GC_UnTrack(self);
    queues_clear(self);
    PyObject_GC_Del(self);
}

/* ---- one key's events --------------------------------------------------------------------
   Each returns 1 when it did the key, 0 when it leaves the key to the policy's Python (nothing
   changed), and -1 with an exception. */

/* A queue value or packed pin: a small non-negative exact int, else -1. */
static long small_int(PyObject *value)
{
    if (!PyLong_CheckExact(value))
        return -1;
    long number = PyLong_AsLong(value);
    if (number == -1 && PyErr_Occurred())
        PyErr_Clear();
    return number;
}

/* queue[key] = number (an OrderedDict: its order kept). */
static int store(PyObject *queue, PyObject *key, long number)
{
    PyObject *value = PyLong_FromLong(number);
    if (value == NULL)
        return -1;
    int status = PyObject_SetItem(queue, key, value);
    Py_DECREF(value);
    return status;
}

/* inserted(key): a key pinned while cached back to its queue with its counter; a new key that
   no ghost holds to S unhit. */
static int insert_key(Queues *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    PyObject *packed_value = PyDict_GetItemWithError(self->pinned, key);  /* borrowed */
    if (packed_value == NULL) {
        if (PyErr_Occurred())
            return -1;
        PyObject *ghosts[] = {self->ghost, self->main_ghost};
        for (int i = 0; i < 2 && ghosts[i] != NULL; i++) {
            int is_ghost = PyDict_Contains(ghosts[i], key);
            if (is_ghost != 0)
                return is_ghost < 0 ? -1 : 0;  /* a ghost hit: the policy's own code */
        }
        return store(self->small, key, 0) < 0 ? -1 : 1;
    }
    long packed = small_int(packed_value);
    if (packed < 0)
        return 0;
    if (PyDict_DelItem(self->pinned, key) < 0)
        return -1;
    int status = packed & IN_MAIN ? store(self->main, key, packed ^ IN_MAIN)
                                  : store(self->small, key, packed);
    return status < 0 ? -1 : 1;
}

/* hit_evictable(key): an evictable key leaves S or M for `pinned`. */
static int hit_key(Queues *self, PyObject *key)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    PyObject *queue = self->small, *value = PyDict_GetItemWithError(queue, key);  /* borrowed */
    if (value == NULL) {
        if (PyErr_Occurred())
            return -1;
        queue = self->main;
        value = PyDict_GetItemWithError(queue, key);
        if (value == NULL)
            return PyErr_Occurred() ? -1 : 0;  /* in neither queue: a bug the Python names */
    }
    long counter = small_int(value);
    if (counter < 0)
        return 0;
    long packed = counter;
    if (queue == self->small || self->count_main_hits)
        packed = counter < MAX_FREQUENCY ? counter + 1 : counter;
    if (queue == self->main)
        packed |= IN_MAIN;
    if (PyObject_DelItem(queue, key) < 0)
        return -1;
    return store(self->pinned, key, packed) < 0 ? -1 : 1;
}

/* The keys of `keys` (a list) from args[1] on, each done by `event` up to the first it leaves
   to the Python; the position of that key (len(keys) when none). */
static PyObject *run(Queues *self, PyObject *const *args, Py_ssize_t nargs, const char *name,
                     int (*event)(Queues *, PyObject *))
{
    if (check_nargs(name, nargs, 2) < 0)
        return NULL;
    PyObject *keys = args[0];
    if (!PyList_CheckExact(keys))  /* not ours to take: the Python loop goes on from start */
        return Py_NewRef(args[1]);
    Py_ssize_t count = PyList_GET_SIZE(keys), position = start_of(args[1], count);
    if (position < 0)
        return NULL;
    for (; position < count; position++) {
        int done = event(self, PyList_GET_ITEM(keys, position));
        if (done < 0)
            return NULL;
        if (!done)
            break;
    }
    return PyLong_FromSsize_t(position);
}

/* One key's event, True when done, False when it leaves the key to the Python. */
static PyObject *one(int done)
{
    if (done < 0)
        return NULL;
    return Py_NewRef(done ? Py_True : Py_False);
}

static PyObject *queues_insert(Queues *self, PyObject *key)
{
    return one(insert_key(self, key));
}

static PyObject *queues_hit(Queues *self, PyObject *key)
{
    return one(hit_key(self, key));
}

static PyObject *queues_insert_run(Queues *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run(self, args, nargs, "insert_run", insert_key);
}

static PyObject *queues_hit_run(Queues *self, PyObject *const *args, Py_ssize_t nargs)
{
    return run(self, args, nargs, "hit_run", hit_key);
}

/* ---- victim ------------------------------------------------------------------------------ */

/* (key, value) = queue.popitem(last=False): the oldest entry; NULL with an exception. */
static PyObject *pop_oldest(PyObject *queue)
{
    PyObject *item = PyObject_CallMethodOneArg(queue, name_popitem, Py_False);
    if (item != NULL && (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)) {
        Py_DECREF(item);
        PyErr_SetString(PyExc_TypeError, "popitem() did not return a pair");
        return NULL;
    }
    return item;
}

/* ghost[key] = value, then the oldest ghost dropped while there are more than ghost_limit. */
static int remember(Queues *self, PyObject *ghost, PyObject *key, PyObject *value)
{
    if (PyObject_SetItem(ghost, key, value) < 0)
        return -1;
    if (PyDict_Size(ghost) > self->ghost_limit) {
        PyObject *oldest = pop_oldest(ghost);
        if (oldest == NULL)
            return -1;
        Py_DECREF(oldest);
    }
    return 0;
}

/* victim(small_target, num_small_evictions) -> (key | None, num_small_evictions): S's oldest
   keys leave S while S is at least small_target long (or M is empty), each promoted to M
   (counter cleared) if it was hit, else evicted into the ghost; then M's oldest keys are evicted
   or, with a counter, reinserted one lower. */
static PyObject *queues_victim(Queues *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("victim", nargs, 2) < 0)
        return NULL;
    double small_target = PyFloat_AsDouble(args[0]);
    long long num_small_evictions = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *small = self->small, *main = self->main;
    while (PyDict_Size(small) > 0
           && ((double)PyDict_Size(small) >= small_target || PyDict_Size(main) == 0)) {
        PyObject *oldest = pop_oldest(small);
        if (oldest == NULL)
            return NULL;
        PyObject *key = PyTuple_GET_ITEM(oldest, 0), *count = PyTuple_GET_ITEM(oldest, 1);
        int is_hit = PyObject_IsTrue(count);
        int status = is_hit < 0 ? -1 : 0;
        if (is_hit == 0) {  /* evicted into the ghost */
            PyObject *mark = Py_None;
            if (self->main_ghost != NULL
                    && (mark = PyLong_FromLongLong(++num_small_evictions)) == NULL)
                status = -1;
            if (status == 0) {
                status = remember(self, self->ghost, key, mark);
                if (self->main_ghost != NULL)
                    Py_DECREF(mark);
            }
            PyObject *answer = status < 0 ? NULL : Py_BuildValue("(OL)", key, num_small_evictions);
            Py_DECREF(oldest);
            return answer;
        }
        if (status == 0)
            status = store(main, key, 0);
        Py_DECREF(oldest);
        if (status < 0)
            return NULL;
    }
    while (PyDict_Size(main) > 0) {
        PyObject *oldest = pop_oldest(main);
        if (oldest == NULL)
            return NULL;
        PyObject *key = PyTuple_GET_ITEM(oldest, 0);
        long count = PyLong_AsLong(PyTuple_GET_ITEM(oldest, 1));
        int status = count == -1 && PyErr_Occurred() ? -1 : 0;
        if (status == 0 && count == 0) {
            if (self->main_ghost != NULL)
                status = remember(self, self->main_ghost, key, Py_None);
            PyObject *answer = status < 0 ? NULL : Py_BuildValue("(OL)", key, num_small_evictions);
            Py_DECREF(oldest);
            return answer;
        }
        if (status == 0)
            status = store(main, key, count - 1);
        Py_DECREF(oldest);
        if (status < 0)
            return NULL;
    }
    return Py_BuildValue("(OL)", Py_None, num_small_evictions);
}

#define METHOD(name, doc) \
    {#name, (PyCFunction)(void (*)(void))queues_##name, METH_FASTCALL, doc}

static PyMethodDef queues_methods[] = {
    {"insert", (PyCFunction)queues_insert, METH_O,
     "insert(key) -> bool: inserted(key), unless it is a ghost hit (or anything unexpected)"},
    {"hit", (PyCFunction)queues_hit, METH_O,
     "hit(key) -> bool: hit_evictable(key), unless anything is unexpected"},
    METHOD(insert_run, "insert_run(keys, start) -> stop: inserted_many's keys from start up to "
                       "the first ghost hit (or anything unexpected)"),
    METHOD(hit_run, "hit_run(keys, start) -> stop: hit_evictable_many's keys from start up to "
                    "anything unexpected"),
    METHOD(victim, "victim(small_target, num_small_evictions) -> (key | None, "
                   "num_small_evictions): the policy's victim()"),
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QueuesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd.core.policies._s3fifo.Queues",
    .tp_doc = "A policy's S3-FIFO queues, bound once (kvd/core/policies/_s3fifo.c).",
    .tp_basicsize = sizeof(Queues),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)queues_dealloc,
    .tp_traverse = (traverseproc)queues_traverse,
    .tp_clear = (inquiry)queues_clear,
    .tp_methods = queues_methods,
};

static PyMethodDef s3fifo_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))s3fifo_bind, METH_FASTCALL,
     "bind(queues) -> Queues: the events over an S3FIFOQueues (kvd/core/policies/s3fifo.py); "
     "TypeError naming a field that does not fit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef s3fifo_module = {
    PyModuleDef_HEAD_INIT, "kvd.core.policies._s3fifo",
    "S3-FIFO's batch events in C; see kvd/core/policies/_s3fifo.c and "
    "kvd/core/policies/s3fifo.py.", -1, s3fifo_methods,
};

PyMODINIT_FUNC PyInit__s3fifo(void)
{
    if (PyType_Ready(&QueuesType) < 0)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    ordered_dict_type = PyObject_GetAttrString(collections, "OrderedDict");
    Py_DECREF(collections);
    if (ordered_dict_type == NULL || !PyType_Check(ordered_dict_type)
            || (name_popitem = PyUnicode_InternFromString("popitem")) == NULL)
        return NULL;
    return PyModule_Create(&s3fifo_module);
}
