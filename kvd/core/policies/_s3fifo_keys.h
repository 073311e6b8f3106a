/* kvd/core/policies/_s3fifo_keys.h: one key's S3-FIFO events on the policy's own queues, shared by
   kvd/core/policies/_s3fifo.c's batch runs and kvd/core/_pool.c's one-block requests (which change a
   policy's queues directly when it offers them: S3FIFOPolicy.c_events, kvd/core/policies/s3fifo.py).

   Each event returns 1 when it did the key, 0 when it leaves the key to the policy's Python
   (nothing changed: a ghost hit, whose admission and adaptation rules are the policy's; a key in
   neither queue, for which the Python raises; a key that is not exact bytes, whose hashing could
   run Python code; a value that is not a small int), and -1 with an exception. OrderedDicts are
   changed only through PyODict_SetItem and PyODict_DelItem, which keep their order lists. */
#ifndef KVD_S3FIFO_KEYS_H
#define KVD_S3FIFO_KEYS_H

#include "../_runs.h"

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
    int status = PyODict_SetItem(queue, key, value);
    Py_DECREF(value);
    return status;
}

/* Whether the queues are what the events below may change: pinned a dict, small and main
   OrderedDicts, ghosts (NULL for hit_key, which has none) a tuple of dicts. */
static int queues_fit(PyObject *pinned, PyObject *small, PyObject *main, PyObject *ghosts)
{
    if (!PyDict_CheckExact(pinned) || !PyODict_CheckExact(small) || !PyODict_CheckExact(main))
        return 0;
    if (ghosts == NULL)
        return 1;
    if (!PyTuple_CheckExact(ghosts))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ghosts); i++)
        if (!PyDict_Check(PyTuple_GET_ITEM(ghosts, i)))
            return 0;
    return 1;
}

/* inserted(key): a key pinned while cached back to its queue (S, or M when its packed value has
   in_main set) with its counter; a new key that no ghost holds to S unhit. */
static int insert_key(PyObject *key, PyObject *pinned, PyObject *small, PyObject *main,
                      PyObject *ghosts, long in_main)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    PyObject *packed_value = PyDict_GetItemWithError(pinned, key);  /* borrowed */
    if (packed_value == NULL) {
        if (PyErr_Occurred())
            return -1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ghosts); i++) {
            int is_ghost = PyDict_Contains(PyTuple_GET_ITEM(ghosts, i), key);
            if (is_ghost != 0)
                return is_ghost < 0 ? -1 : 0;  /* a ghost hit: the policy's own code */
        }
        return store(small, key, 0) < 0 ? -1 : 1;
    }
    long packed = small_int(packed_value);
    if (packed < 0)
        return 0;
    if (PyDict_DelItem(pinned, key) < 0)
        return -1;
    int status = packed & in_main ? store(main, key, packed ^ in_main) : store(small, key, packed);
    return status < 0 ? -1 : 1;
}

/* hit_evictable(key): an evictable key leaves S or M for `pinned`, packed with its counter (plus
   one, up to max_frequency; in M only if count_main_hits) and in_main when it came from M. */
static int hit_key(PyObject *key, PyObject *small, PyObject *main, PyObject *pinned,
                   long in_main, long max_frequency, int count_main_hits)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    PyObject *queue = small, *value = PyDict_GetItemWithError(small, key);  /* borrowed */
    if (value == NULL) {
        if (PyErr_Occurred())
            return -1;
        queue = main;
        value = PyDict_GetItemWithError(main, key);
        if (value == NULL)
            return PyErr_Occurred() ? -1 : 0;  /* in neither queue: a bug the Python names */
    }
    long counter = small_int(value);
    if (counter < 0)
        return 0;
    long packed = counter;
    if (queue == small || count_main_hits)
        packed = counter < max_frequency ? counter + 1 : counter;
    if (queue == main)
        packed |= in_main;
    if (PyODict_DelItem(queue, key) < 0)
        return -1;
    PyObject *packed_value = PyLong_FromLong(packed);
    if (packed_value == NULL)
        return -1;
    int status = PyDict_SetItem(pinned, key, packed_value);
    Py_DECREF(packed_value);
    return status < 0 ? -1 : 1;
}

#endif
