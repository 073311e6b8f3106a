/* kvd.protocol._checks: the hot ops' argument checks in C (kvd/protocol/checks.py), every
   uncommon case left to the Python validators there.

Theory of operation
-------------------
A hot op's arguments (alloc, seal, release, lookup) are a few lists of ints or hashes, checked
on every request; the Python validators walk them with a call per argument and a loop per list.
These are pure functions of their input, so this module does the same checks for the arguments
that make up the traffic:

    is_int_list(value, max_len, limit) -> bool          arg_int_list's checks
    is_bytes_list(value, max_len, max_nbytes, nil) -> bool   arg_bytes_list's checks
    args_of(args, schema) -> tuple | None               args_of: a hot op's checks in one call
    call_hot(handler, args, schema, owner)              handler(*args_of(args, schema), owner)

The contract is one-sided, as for every compiled module of kvd (kvd/native.py): whatever this
accepts, the validators accept, returning the very same objects; what it declines (False or
None) goes to the validators, which raise the BadArgsError that names the argument (call_hot
calls them itself, through set_validators). tests/native/test_checks_c.py checks both halves on
generated and boundary arguments. It never raises for bad input.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ---- validation: the arg_*_list checks, for the lists that pass them -------------------------- */

/* The arguments of a check, positional (METH_FASTCALL: a batch-1 request cannot afford
   PyArg_ParseTuple's tuple): 0 when they are not as documented, with TypeError set. */
static int check_count(Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected)
        return 1;
    PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", expected, nargs);
    return 0;
}

static int check_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (!check_count(nargs, expected))
        return 0;
    for (Py_ssize_t i = 1; i < nargs; i++)
        if (!PyLong_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "the limits must be ints");
            return 0;
        }
    return 1;
}

/* Whether `value` is a list of at most `max_len` ints (not bools) in [0, limit]. */
static int is_int_list_within(PyObject *value, Py_ssize_t max_len, unsigned long long limit)
{
    if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) > max_len)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        PyObject *item = PyList_GET_ITEM(value, i);
        if (!PyLong_CheckExact(item))
            return 0;
        unsigned long long v = PyLong_AsUnsignedLongLong(item);
        if (PyErr_Occurred()) { /* negative, or above 2**64 - 1 */
            PyErr_Clear();
            return 0;
        }
        if (v > limit)
            return 0;
    }
    return 1;
}

/* Whether `value` is a list of at most `max_len` bytes of 1 to `max_item_nbytes` bytes each (or
   None items, if `allow_nil`). */
static int is_bytes_list_within(PyObject *value, Py_ssize_t max_len, Py_ssize_t max_item_nbytes,
                                int allow_nil)
{
    if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) > max_len)
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        PyObject *item = PyList_GET_ITEM(value, i);
        if (item == Py_None && allow_nil)
            continue;
        if (!PyBytes_CheckExact(item) || PyBytes_GET_SIZE(item) == 0
                || PyBytes_GET_SIZE(item) > max_item_nbytes)
            return 0;
    }
    return 1;
}

/* An int argument as a Py_ssize_t (*out), or as an unsigned 64-bit limit; 0, with no error set,
   when it does not fit: the caller then declines and Python decides. */
static int ssize_of(PyObject *obj, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int u64_limit_of(PyObject *obj, unsigned long long *out)
{
    *out = PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred()) { /* a negative limit admits no int: let Python say so */
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* Whether `value` is a list of at most `max_len` ints (not bools) in [0, limit]. */
static PyObject *checks_is_int_list(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_args(args, nargs, 3))
        return NULL;
    Py_ssize_t max_len;
    unsigned long long limit;
    return PyBool_FromLong(ssize_of(args[1], &max_len) && u64_limit_of(args[2], &limit)
                           && is_int_list_within(args[0], max_len, limit));
}

/* Whether `value` is a list of at most `max_len` bytes of 1 to `max_item_nbytes` bytes each
   (or None items, if `allow_nil`). */
static PyObject *checks_is_bytes_list(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_args(args, nargs, 4))
        return NULL;
    Py_ssize_t max_len, max_item_nbytes;
    int allow_nil = PyObject_IsTrue(args[3]); /* (an int: no Python code runs) */
    return PyBool_FromLong(ssize_of(args[1], &max_len) && ssize_of(args[2], &max_item_nbytes)
                           && is_bytes_list_within(args[0], max_len, max_item_nbytes, allow_nil));
}

/* kvd/protocol/checks.py's argument fields: (name, kind, is_required, a, b, allow_nil). */
enum { ARG_INT = 0, ARG_INT_LIST = 1, ARG_BYTES_LIST = 2 };

/* Whether `value` passes `field`'s check (see args_of in kvd/protocol/checks.py). */
static int passes(PyObject *value, PyObject *const *field)
{
    long kind = PyLong_AsLong(field[1]);
    Py_ssize_t max_len, max_item_nbytes;
    unsigned long long limit = UINT64_MAX;
    switch (kind) {
    case ARG_INT: {
        int overflow;
        if (!PyLong_CheckExact(value))
            return 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow), lo, hi;
        if (overflow || (v == -1 && PyErr_Occurred()))
            break;
        lo = PyLong_AsLongLongAndOverflow(field[3], &overflow);
        if (overflow || (lo == -1 && PyErr_Occurred()) || v < lo)
            break;
        if (field[4] == Py_None)
            return 1;
        hi = PyLong_AsLongLongAndOverflow(field[4], &overflow);
        return !overflow && !(hi == -1 && PyErr_Occurred()) && v <= hi;
    }
    case ARG_INT_LIST:
        return ssize_of(field[3], &max_len)
               && (field[4] == Py_None || u64_limit_of(field[4], &limit))
               && is_int_list_within(value, max_len, limit);
    case ARG_BYTES_LIST:
        return ssize_of(field[3], &max_len) && ssize_of(field[4], &max_item_nbytes)
               && is_bytes_list_within(value, max_len, max_item_nbytes, field[5] == Py_True);
    }
    PyErr_Clear();
    return 0;
}

/* The most fields a hot op's schema has (kvd/server/service.py's seal has four). */
#define MAX_HOT_FIELDS 8

/* The values of `args` in `schema`'s order (None for an absent optional field), as new
   references in values[0 .. return value), when every field passes and nothing else is there;
   -1 otherwise, with no error set and nothing held (the Python validators then name what is
   wrong). */
static Py_ssize_t hot_values(PyObject *args, PyObject *schema, PyObject **values)
{
    if (!PyDict_CheckExact(args) || !PyTuple_CheckExact(schema)
            || PyTuple_GET_SIZE(schema) > MAX_HOT_FIELDS)
        return -1;
    Py_ssize_t num_fields = PyTuple_GET_SIZE(schema), num_found = 0, i = 0;
    for (; i < num_fields; i++) {
        PyObject *field = PyTuple_GET_ITEM(schema, i);
        if (!PyTuple_CheckExact(field) || PyTuple_GET_SIZE(field) != 6
                || !PyUnicode_CheckExact(PyTuple_GET_ITEM(field, 0))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(field, 1)))
            break;
        PyObject *const *parts = &PyTuple_GET_ITEM(field, 0);
        PyObject *value = PyDict_GetItemWithError(args, parts[0]);
        if (value == NULL) {
            if (PyErr_Occurred() || parts[2] != Py_False)  /* required (or a key that raised) */
                break;
            value = Py_None;
        } else {
            num_found++;
            if (!passes(value, parts))
                break;
        }
        Py_INCREF(value);
        values[i] = value;
    }
    if (i == num_fields && num_found == PyDict_GET_SIZE(args))  /* none missing, none extra */
        return num_fields;
    PyErr_Clear();
    while (i > 0)
        Py_DECREF(values[--i]);
    return -1;
}

/* args_of(args, schema): kvd.protocol.checks.args_of's values as a tuple, or None for anything its
   validators must look at. */
static PyObject *checks_args_of(PyObject *module, PyObject *const *argv, Py_ssize_t nargs)
{
    if (!check_count(nargs, 2))
        return NULL;
    PyObject *values[MAX_HOT_FIELDS];
    Py_ssize_t num_values = hot_values(argv[0], argv[1], values);
    if (num_values < 0)
        Py_RETURN_NONE;
    PyObject *tuple = PyTuple_New(num_values);
    for (Py_ssize_t i = 0; i < num_values; i++) {
        if (tuple == NULL)
            Py_DECREF(values[i]);
        else
            PyTuple_SET_ITEM(tuple, i, values[i]);
    }
    return tuple;
}

/* kvd.protocol.checks.args_of, which call_hot runs for what hot_values declines (set_validators). */
static PyObject *validators = NULL;

static PyObject *checks_set_validators(PyObject *module, PyObject *callable)
{
    Py_INCREF(callable);
    Py_XSETREF(validators, callable);
    Py_RETURN_NONE;
}

/* call_hot(handler, args, schema, owner): handler(*args_of(args, schema), owner), the values on
   the C stack: no tuple, and no frame of Python between the Service and the handler. What
   hot_values declines goes to the validators, which raise the error (or, where they accept what
   C could not tell, return the values). */
static PyObject *checks_call_hot(PyObject *module, PyObject *const *argv, Py_ssize_t nargs)
{
    if (!check_count(nargs, 4))
        return NULL;
    PyObject *stack[MAX_HOT_FIELDS + 1];
    Py_ssize_t num_values = hot_values(argv[1], argv[2], stack);
    if (num_values >= 0) {
        stack[num_values] = argv[3];
        PyObject *result = PyObject_Vectorcall(argv[0], stack, num_values + 1, NULL);
        for (Py_ssize_t i = 0; i < num_values; i++)
            Py_DECREF(stack[i]);
        return result;
    }
    if (validators == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "call_hot: set_validators was never called");
        return NULL;
    }
    PyObject *values = PyObject_CallFunctionObjArgs(validators, argv[1], argv[2], NULL);
    if (values == NULL)
        return NULL;
    PyObject *result = NULL;
    if (!PyTuple_CheckExact(values) || PyTuple_GET_SIZE(values) > MAX_HOT_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "call_hot: the validators must return a tuple of fields");
    } else {
        num_values = PyTuple_GET_SIZE(values);
        for (Py_ssize_t i = 0; i < num_values; i++)
            stack[i] = PyTuple_GET_ITEM(values, i);  /* (borrowed: `values` holds them) */
        stack[num_values] = argv[3];
        result = PyObject_Vectorcall(argv[0], stack, num_values + 1, NULL);
    }
    Py_DECREF(values);
    return result;
}

static PyMethodDef checks_methods[] = {
    {"is_int_list", (PyCFunction)(void (*)(void))checks_is_int_list, METH_FASTCALL,
     "is_int_list(value, max_len, limit) -> bool: a list of at most max_len ints in [0, limit] "
     "(False: arg_int_list raises the error)"},
    {"is_bytes_list", (PyCFunction)(void (*)(void))checks_is_bytes_list, METH_FASTCALL,
     "is_bytes_list(value, max_len, max_item_nbytes, allow_nil) -> bool: a list of at most "
     "max_len binary strings of 1 to max_item_nbytes bytes (False: arg_bytes_list raises)"},
    {"args_of", (PyCFunction)(void (*)(void))checks_args_of, METH_FASTCALL,
     "args_of(args, schema) -> tuple | None: kvd.protocol.checks.args_of's values, or None for anything "
     "its validators must look at"},
    {"call_hot", (PyCFunction)(void (*)(void))checks_call_hot, METH_FASTCALL,
     "call_hot(handler, args, schema, owner) -> handler(*args_of(args, schema), owner), its "
     "checks in C where they pass (the validators set_validators names otherwise)"},
    {"set_validators", checks_set_validators, METH_O,
     "set_validators(args_of): what call_hot runs for the arguments its C checks decline"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef checks_module = {
    PyModuleDef_HEAD_INIT, "kvd.protocol._checks",
    "The hot ops' argument checks in C; see kvd/protocol/checks.py.", -1, checks_methods,
};

PyMODINIT_FUNC PyInit__checks(void)
{
    return PyModule_Create(&checks_module);
}
