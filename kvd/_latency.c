/* kvd._latency: the daemon's per-request latency histogram in C (kvd/metrics.py's OpStats).

Theory of operation
-------------------
Every request the daemon answers lands in one bucket of its op's latency histogram. In Python
that was a perf_counter call, a dict lookup, a bisect, a list increment and a float sum: about
0.6 us of a batch-1 request that the server handles in under 10 (bench/request_path.py measures
the request path). Here it is one call:

    Histogram(bounds)          bucket upper bounds in seconds, increasing (Prometheus' "le")
    add(op)                    give `op` a row; only ops with a row are recorded, so a client
                               cannot grow the metric labels by sending made-up op names
    since(op, started)         record time.perf_counter() - started, read from the same clock
                               (CLOCK_MONOTONIC, as perf_counter reads it on Linux)
    record(op, seconds)        record `seconds`
    rows() -> {op: (counts, sum_s)}   the ops recorded at least once: counts has one entry
                               per bound and a last one for +Inf

kvd/metrics.py's Histogram is the same in Python, the specification: the two must agree on every
input (tests/test_metrics.py feeds both the same values, bounds and non-ops included). A value
goes in the first bucket whose bound is >= it (bisect_left); an op that is not a str with a row
is ignored, never an error: the request path calls this for whatever a client sent.

Each row is a bytearray in a dict, op -> row, so that rows() can take the dict's items in one
call (PyDict_Items retries if an allocation lets another thread add a row) and then read rows that
the items list keeps alive: the metrics thread scrapes while the loop thread records. A scrape may
see one request half-counted (its bucket but not yet its sum), never freed memory.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#define MAX_BOUNDS 64

typedef struct {
    PyObject_HEAD
    PyObject *rows;  /* op -> bytearray: uint64_t counts[num_bounds + 1], then double sum_s */
    Py_ssize_t num_bounds;
    double bounds[MAX_BOUNDS];
} Histogram;

static Py_ssize_t row_nbytes(const Histogram *h)
{
    return (h->num_bounds + 1) * (Py_ssize_t)sizeof(uint64_t) + (Py_ssize_t)sizeof(double);
}

static PyObject *histogram_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *bounds;
    if (!PyArg_ParseTuple(args, "O!:Histogram", &PyTuple_Type, &bounds))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_BOUNDS)
        return PyErr_Format(PyExc_ValueError, "at most %d bounds", MAX_BOUNDS);
    Histogram *self = (Histogram *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        double bound = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (bound == -1.0 && PyErr_Occurred())
            goto fail;
        if (i > 0 && !(bound > self->bounds[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "bounds must increase");
            goto fail;
        }
        self->bounds[i] = bound;
    }
    self->num_bounds = n;
    self->rows = PyDict_New();
    if (self->rows != NULL)
        return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void histogram_dealloc(Histogram *self)
{
    Py_XDECREF(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *histogram_add(Histogram *self, PyObject *op)
{
    if (!PyUnicode_Check(op)) {
        PyErr_SetString(PyExc_TypeError, "an op is a str");
        return NULL;
    }
    PyObject *row = PyDict_GetItemWithError(self->rows, op);
    if (row == NULL) {
        if (PyErr_Occurred())
            return NULL;
        row = PyByteArray_FromStringAndSize(NULL, row_nbytes(self));
        if (row == NULL)
            return NULL;
        memset(PyByteArray_AS_STRING(row), 0, (size_t)row_nbytes(self));
        int failed = PyDict_SetItem(self->rows, op, row);
        Py_DECREF(row);
        if (failed)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* Count `seconds` in op's row, if op has one. Never raises: the request path calls it. */
static void record(Histogram *self, PyObject *op, double seconds)
{
    if (!PyUnicode_CheckExact(op))
        return;
    PyObject *row = PyDict_GetItemWithError(self->rows, op);  /* a str: hashing cannot fail */
    if (row == NULL) {
        PyErr_Clear();
        return;
    }
    Py_ssize_t bucket = 0;
    while (bucket < self->num_bounds && seconds > self->bounds[bucket])
        bucket++;
    char *at = PyByteArray_AS_STRING(row);
    uint64_t count;
    double sum_s;
    memcpy(&count, at + bucket * sizeof(uint64_t), sizeof count);
    count++;
    memcpy(at + bucket * sizeof(uint64_t), &count, sizeof count);
    char *sum_at = at + (self->num_bounds + 1) * sizeof(uint64_t);
    memcpy(&sum_s, sum_at, sizeof sum_s);
    sum_s += seconds;
    memcpy(sum_at, &sum_s, sizeof sum_s);
}

static int check_nargs(const char *name, Py_ssize_t nargs)
{
    if (nargs == 2)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes 2 arguments (%zd given)", name, nargs);
    return -1;
}

static PyObject *histogram_record(Histogram *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("record", nargs))
        return NULL;
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    record(self, args[0], seconds);
    Py_RETURN_NONE;
}

static PyObject *histogram_since(Histogram *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("since", nargs))
        return NULL;
    double started = PyFloat_AsDouble(args[1]);
    if (started == -1.0 && PyErr_Occurred())
        return NULL;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    record(self, args[0], ((double)now.tv_sec * 1e9 + (double)now.tv_nsec) / 1e9 - started);
    Py_RETURN_NONE;
}

/* (counts, sum_s) of one row, or Py_None if it has recorded nothing (NULL on an error). */
static PyObject *row_view(const Histogram *self, PyObject *row)
{
    Py_ssize_t num_counts = self->num_bounds + 1;
    uint64_t counts[MAX_BOUNDS + 1];
    double sum_s;
    /* A copy first: the allocations below may let the loop thread record into this row. */
    memcpy(counts, PyByteArray_AS_STRING(row), (size_t)num_counts * sizeof(uint64_t));
    memcpy(&sum_s, PyByteArray_AS_STRING(row) + num_counts * sizeof(uint64_t), sizeof sum_s);
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < num_counts; i++)
        total += counts[i];
    if (total == 0)
        Py_RETURN_NONE;
    PyObject *list = PyList_New(num_counts);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < num_counts; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(counts[i]);
        if (count == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, count);
    }
    PyObject *sum = PyFloat_FromDouble(sum_s);
    if (sum == NULL) {
        Py_DECREF(list);
        return NULL;
    }
    PyObject *view = PyTuple_Pack(2, list, sum);
    Py_DECREF(list);
    Py_DECREF(sum);
    return view;
}

static PyObject *histogram_rows(Histogram *self, PyObject *unused)
{
    PyObject *items = PyDict_Items(self->rows), *result = PyDict_New();
    if (items == NULL || result == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *view = row_view(self, PyTuple_GET_ITEM(item, 1));
        if (view == NULL)
            goto fail;
        int failed = view != Py_None && PyDict_SetItem(result, PyTuple_GET_ITEM(item, 0), view);
        Py_DECREF(view);
        if (failed)
            goto fail;
    }
    Py_DECREF(items);
    return result;
fail:
    Py_XDECREF(items);
    Py_XDECREF(result);
    return NULL;
}

static PyMethodDef histogram_methods[] = {
    {"add", (PyCFunction)histogram_add, METH_O, "add(op): give op a row (ops without are ignored)"},
    {"since", (PyCFunction)(void (*)(void))histogram_since, METH_FASTCALL,
     "since(op, started): record time.perf_counter() - started for op"},
    {"record", (PyCFunction)(void (*)(void))histogram_record, METH_FASTCALL,
     "record(op, seconds): record seconds for op"},
    {"rows", (PyCFunction)histogram_rows, METH_NOARGS,
     "rows() -> {op: (counts, sum_s)} of the ops recorded at least once"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject histogram_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvd._latency.Histogram",
    .tp_doc = "Histogram(bounds): per-op latency buckets; see kvd/_latency.c",
    .tp_basicsize = sizeof(Histogram),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = histogram_new,
    .tp_dealloc = (destructor)histogram_dealloc,
    .tp_methods = histogram_methods,
};

static struct PyModuleDef latency_module = {
    PyModuleDef_HEAD_INIT, "kvd._latency",
    "The daemon's per-request latency histogram in C; see kvd/_latency.c and kvd/metrics.py.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__latency(void)
{
    if (PyType_Ready(&histogram_type) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&latency_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Histogram", (PyObject *)&histogram_type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
