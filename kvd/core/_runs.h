/* kvd/core/_runs.h: what kvd/core/_pool.c and kvd/core/policies/_s3fifo.c share -- the argument checks of their
   run functions, which take a sequence and the position to start from. */
#ifndef KVD_RUNS_H
#define KVD_RUNS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

#endif
