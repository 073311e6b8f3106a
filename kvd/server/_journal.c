/* kvd.server._journal: the journal's work per commit in C (kvd/server/journal.py), every
   uncommon case left to the Python there.

Theory of operation
-------------------
Every seal's reply waits for its commit, so what a commit does in Python is on the request path:
packing the buffered rows into records, and (later, in the upkeep) applying them to the
in-memory view of the log. Both are pure functions of their input, so this module does them for
the rows that make up the traffic:

    journal_records(evictions, seals, first_seal_seq, default_key_width)
        -> (key_width, bytes) | None          journal.py's _records: a commit's records, packed
    apply_records(chunk_of, records, key_width, first_chunk_id, max_chunk_records)
        -> int | None                         _LogState.settle of those records, at once

The contract is one-sided, as for every compiled module of kvd (kvd/native.py): whenever this
answers, the answer is the Python's (tests/native/test_journal_c.py checks it byte for byte on
generated and boundary rows); for anything else -- a row struct would not pack as is, a block
beyond chunk_of, a record of no known kind -- it returns None and the Python runs, which raises
the exact error or does the uncommon thing. It never raises for bad input, and apply_records
changes chunk_of only when it answers.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* kvd/server/journal.py's record: 35 header bytes, then the key zero-padded to the chunk's key width. */
#define RECORD_HEADER_NBYTES 35
#define RECORD_MAX_KEY_NBYTES 255
#define RECORD_SEAL 1
#define RECORD_EVICT 2

static void put_le(unsigned char *at, uint64_t value, int nbytes)
{
    for (int i = 0; i < nbytes; i++, value >>= 8)
        at[i] = (unsigned char)value;
}

/* An exact int in [lo, hi] into *value; 0 (no error set) otherwise. */
static int int_within(PyObject *obj, long long lo, long long hi, long long *value)
{
    if (!PyLong_CheckExact(obj))
        return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred()) || v < lo || v > hi) {
        PyErr_Clear();
        return 0;
    }
    *value = v;
    return 1;
}

/* An exact int in [0, 2**64 - 1] into *value; 0 (no error set) otherwise. */
static int u64_of(PyObject *obj, uint64_t *value)
{
    if (!PyLong_CheckExact(obj))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *value = v;
    return 1;
}

/* One SEAL record of `row` -- (block_id, key, generation, parent, parent_generation, tier) -- at
   `at`, which is zeroed; 0 if the row is not one the journal's struct would pack. */
static int put_seal(unsigned char *at, PyObject *row, uint64_t seal_seq)
{
    long long block_id, parent, tier;
    uint64_t generation, parent_generation;
    PyObject *key = PyTuple_GET_ITEM(row, 1);
    if (!int_within(PyTuple_GET_ITEM(row, 0), INT32_MIN, INT32_MAX, &block_id)
            || !u64_of(PyTuple_GET_ITEM(row, 2), &generation)
            || !int_within(PyTuple_GET_ITEM(row, 3), INT32_MIN, INT32_MAX, &parent)
            || !u64_of(PyTuple_GET_ITEM(row, 4), &parent_generation)
            || !int_within(PyTuple_GET_ITEM(row, 5), 0, 255, &tier))
        return 0;
    put_le(at, seal_seq, 8);
    put_le(at + 8, generation, 8);
    put_le(at + 16, parent_generation, 8);
    put_le(at + 24, (uint64_t)block_id, 4);
    put_le(at + 28, (uint64_t)parent, 4);
    at[32] = RECORD_SEAL;
    at[33] = (unsigned char)tier;
    at[34] = (unsigned char)PyBytes_GET_SIZE(key);
    memcpy(at + RECORD_HEADER_NBYTES, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    return 1;
}

/* journal_records(evictions, seals, first_seal_seq, default_key_width): kvd/server/journal.py's
   `_records` -- (key width, the records packed) -- or None for the Python path. */
static PyObject *journal_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "expected 4 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *evictions = args[0], *seals = args[1];
    uint64_t first_seal_seq;
    long long key_width;
    if (!PyList_CheckExact(evictions) || !PyDict_CheckExact(seals)
            || !u64_of(args[2], &first_seal_seq)
            || !int_within(args[3], 0, RECORD_MAX_KEY_NBYTES, &key_width))
        Py_RETURN_NONE;
    Py_ssize_t num_seals = PyDict_GET_SIZE(seals), pos = 0;
    if (num_seals && first_seal_seq > UINT64_MAX - (uint64_t)(num_seals - 1))
        Py_RETURN_NONE; /* a seal_seq past 2**64 - 1: struct raises */
    PyObject *block, *row;
    if (num_seals)
        key_width = 0;
    while (PyDict_Next(seals, &pos, &block, &row)) { /* (no Python code runs: all exact types) */
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 6
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(row, 1))
                || PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 1)) > RECORD_MAX_KEY_NBYTES)
            Py_RETURN_NONE;
        if (PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 1)) > key_width)
            key_width = PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 1));
    }
    /* Tombstones of blocks not sealed again since: validated and counted first. */
    Py_ssize_t num_tombstones = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(evictions); i++) {
        long long block_id;
        PyObject *item = PyList_GET_ITEM(evictions, i);
        if (!int_within(item, INT32_MIN, INT32_MAX, &block_id))
            Py_RETURN_NONE;
        int is_sealed = PyDict_Contains(seals, item); /* (an exact int: hashing runs no code) */
        if (is_sealed < 0) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        num_tombstones += !is_sealed;
    }
    Py_ssize_t record_nbytes = RECORD_HEADER_NBYTES + key_width;
    if (num_tombstones + num_seals > PY_SSIZE_T_MAX / record_nbytes)
        Py_RETURN_NONE;
    PyObject *blob = PyBytes_FromStringAndSize(NULL, (num_tombstones + num_seals) * record_nbytes);
    if (blob == NULL)
        return NULL;
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(blob);
    memset(at, 0, (size_t)PyBytes_GET_SIZE(blob));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(evictions); i++) {
        PyObject *item = PyList_GET_ITEM(evictions, i);
        int is_sealed = PyDict_Contains(seals, item); /* as in the first pass */
        if (is_sealed < 0) {
            PyErr_Clear();
            Py_DECREF(blob);
            Py_RETURN_NONE;
        }
        if (is_sealed)
            continue;
        put_le(at + 24, (uint64_t)PyLong_AsLongLong(item), 4);
        at[32] = RECORD_EVICT;
        at += record_nbytes;
    }
    pos = 0;
    for (uint64_t seal_seq = first_seal_seq; PyDict_Next(seals, &pos, &block, &row);
            seal_seq++, at += record_nbytes)
        if (!put_seal(at, row, seal_seq)) {
            Py_DECREF(blob);
            Py_RETURN_NONE;
        }
    return Py_BuildValue("(nN)", (Py_ssize_t)key_width, blob);
}

/* A record's block_id (offset 24, little-endian i32). */
static int32_t record_block_id(const unsigned char *at)
{
    return (int32_t)((uint32_t)at[24] | (uint32_t)at[25] << 8 | (uint32_t)at[26] << 16
                     | (uint32_t)at[27] << 24);
}

/* apply_records(chunk_of, records, key_width, first_chunk_id, max_chunk_records): _LogState.settle
   of one commit's chunks, done at once -- each record's block gets its chunk (a SEAL record's) or
   0 (a tombstone's) in chunk_of, a writable buffer of int64 -- and the change in live blocks;
   None, with chunk_of untouched, for records settle would not take as they are. */
static PyObject *apply_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "expected 5 arguments, got %zd", nargs);
        return NULL;
    }
    long long key_width, first_chunk_id, max_chunk_records;
    if (!PyBytes_CheckExact(args[1])
            || !int_within(args[2], 0, RECORD_MAX_KEY_NBYTES, &key_width)
            || !int_within(args[3], 0, INT64_MAX, &first_chunk_id)
            || !int_within(args[4], 1, INT32_MAX, &max_chunk_records))
        Py_RETURN_NONE;
    Py_buffer view;
    int flags = PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(args[0], &view, flags) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = Py_None;
    const unsigned char *records = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t record_nbytes = RECORD_HEADER_NBYTES + key_width;
    Py_ssize_t num_records = PyBytes_GET_SIZE(args[1]) / record_nbytes;
    Py_ssize_t num_slots = view.len / 8;
    int64_t *chunk_of = (int64_t *)view.buf;
    if (view.itemsize != 8 || view.format == NULL || strcmp(view.format, "q") != 0
            || PyBytes_GET_SIZE(args[1]) % record_nbytes != 0
            || (num_records - 1) / max_chunk_records > INT64_MAX - first_chunk_id)
        goto done;
    /* Every record checked before any slot changes: all applied, or none. */
    for (Py_ssize_t i = 0; i < num_records; i++) {
        const unsigned char *at = records + i * record_nbytes;
        int32_t block_id = record_block_id(at);
        if (block_id < 0 || block_id >= num_slots
                || (at[32] != RECORD_SEAL && at[32] != RECORD_EVICT))
            goto done;
    }
    long long num_live = 0;
    for (Py_ssize_t i = 0; i < num_records; i++) {
        const unsigned char *at = records + i * record_nbytes;
        int32_t block_id = record_block_id(at);
        int64_t chunk = at[32] == RECORD_SEAL ? first_chunk_id + i / max_chunk_records : 0;
        num_live += (chunk != 0) - (chunk_of[block_id] != 0);
        chunk_of[block_id] = chunk;
    }
    result = PyLong_FromLongLong(num_live);
done:
    PyBuffer_Release(&view);
    if (result == Py_None)
        Py_INCREF(result);
    return result;
}

static PyMethodDef journal_methods[] = {
    {"journal_records", (PyCFunction)(void (*)(void))journal_records, METH_FASTCALL,
     "journal_records(evictions, seals, first_seal_seq, default_key_width) -> (key_width, "
     "records) or None: kvd/server/journal.py's _records, or None for the Python path"},
    {"apply_records", (PyCFunction)(void (*)(void))apply_records, METH_FASTCALL,
     "apply_records(chunk_of, records, key_width, first_chunk_id, max_chunk_records) -> int or "
     "None: _LogState.settle of one commit's chunks, the change in live blocks"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef journal_module = {
    PyModuleDef_HEAD_INIT, "kvd.server._journal",
    "The journal's records packed and applied in C; see kvd/server/journal.py.", -1,
    journal_methods,
};

PyMODINIT_FUNC PyInit__journal(void)
{
    return PyModule_Create(&journal_module);
}
