/* kvd._wire: the protocol's hot pure functions and the journal's per-commit record work in C,
   every uncommon case left to kvd/protocol/__init__.py and kvd/server/journal.py.

Theory of operation
-------------------
A batch-1 request cost kvd's daemon and client several microseconds of Python just to turn bytes
into checked objects and back: msgpack.unpackb with ten limit arguments, parse_request's (or
parse_reply's) shape checks, the framing, the Packer, and the arg_* validators' loops. All are
pure functions of their input, so this module does them in C, for the inputs that make up the
traffic:

    request(body)  -> (request_id, op, args) | None    unpack_body + parse_request
    reply(body)    -> (request_id, result)   | None    unpack_body + parse_reply, success only
    requests(chunk), replies(chunk)                    the same for a chunk of whole frames
    frame(obj)     -> bytes | None                     FrameEncoder.frame (msgpack's Packer)
    is_int_list(...), is_bytes_list(...) -> bool       arg_int_list's, arg_bytes_list's checks
    args_of(args, schema) -> tuple | None              args_of: a hot op's checks, in one call

and, by the same rules, the journal's work per commit (kvd/server/journal.py: every seal's reply waits
for its commit):

    journal_records(...) -> (key_width, bytes) | None  _records: a commit's records, packed
    apply_records(chunk_of, records, ...) -> int | None  _LogState.settle of those records

It decodes and encodes a *subset* of msgpack -- nil, bool, every int, str, bin, array, map with str
keys -- under the same length limits as unpack_body (set once by `set_limits`) and a shallow depth
cap. Anything else (floats, ext types, bytes map keys, deep nesting, bad UTF-8, trailing or missing
bytes, an error reply, a malformed shape, a list that fails a check, a journal row that struct
would not pack as is) returns None (False for the checks), and the caller runs the Python path,
which is the specification: it handles what this module does not support, and raises the exact
error (ProtocolError with its request id, BadArgsError naming the argument, or the error a reply
carries) for what is invalid. So the contract is one-sided and easy to test: whenever this answers,
the answer is the Python path's (tests/test_wire.py checks that on generated, mutated and boundary
inputs, byte for byte for encoding and packing). It never raises for bad input, and reads no byte
outside its input.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Deeper than any request or reply kvd sends ([id, op, {arg: [items]}] is 3 levels; stats
   and hello replies 4); deeper bodies go to the Python path, which allows more. */
#define MAX_DEPTH 8

/* unpack_body's limits and parse_request's op length, from set_limits (all 0 until then:
   nothing but ints and nil decodes). */
static Py_ssize_t max_frame_nbytes = 0, max_str_nbytes = 0, max_bin_nbytes = 0, max_array_len = 0,
                  max_map_len = 0, max_op_len = 0;

typedef struct {
    const unsigned char *at, *end;
} Reader;

static int take(Reader *r, Py_ssize_t n, const unsigned char **out)
{
    if (r->end - r->at < n)
        return 0;
    *out = r->at;
    r->at += n;
    return 1;
}

static int read_be(Reader *r, int nbytes, uint64_t *value)
{
    const unsigned char *p;
    if (!take(r, nbytes, &p))
        return 0;
    uint64_t v = 0;
    for (int i = 0; i < nbytes; i++)
        v = (v << 8) | p[i];
    *value = v;
    return 1;
}

static PyObject *decode(Reader *r, int depth);

static PyObject *decode_str(Reader *r, Py_ssize_t n)
{
    const unsigned char *p;
    if (n > max_str_nbytes || !take(r, n, &p))
        return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL)
        PyErr_Clear();
    return s;
}

static PyObject *decode_bin(Reader *r, Py_ssize_t n)
{
    const unsigned char *p;
    if (n > max_bin_nbytes || !take(r, n, &p))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)p, n);
}

static PyObject *decode_array(Reader *r, Py_ssize_t n, int depth)
{
    /* Every item takes at least one byte: a length beyond the body is refused before any
       allocation, so a small body cannot make a large list. */
    if (n > max_array_len || n > r->end - r->at || depth >= MAX_DEPTH)
        return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = decode(r, depth + 1);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *decode_map(Reader *r, Py_ssize_t n, int depth)
{
    if (n > max_map_len || n > (r->end - r->at) / 2 || depth >= MAX_DEPTH)
        return NULL;
    PyObject *dict = PyDict_New();
    if (dict == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = decode(r, depth + 1);
        if (key == NULL || !PyUnicode_CheckExact(key)) { /* str keys only (bytes: Python) */
            Py_XDECREF(key);
            Py_DECREF(dict);
            return NULL;
        }
        PyObject *value = decode(r, depth + 1);
        if (value == NULL || PyDict_SetItem(dict, key, value) < 0) { /* last duplicate wins */
            Py_DECREF(key);
            Py_XDECREF(value);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return dict;
}

/* One object, new reference; NULL (no exception set) for anything unsupported or invalid. */
static PyObject *decode(Reader *r, int depth)
{
    const unsigned char *p;
    uint64_t n;
    if (!take(r, 1, &p))
        return NULL;
    unsigned char tag = *p;
    if (tag <= 0x7f)
        return PyLong_FromLong(tag);
    if (tag >= 0xe0)
        return PyLong_FromLong((long)(signed char)tag);
    if (tag >= 0xa0 && tag <= 0xbf)
        return decode_str(r, tag & 0x1f);
    if (tag >= 0x90 && tag <= 0x9f)
        return decode_array(r, tag & 0x0f, depth);
    if (tag >= 0x80 && tag <= 0x8f)
        return decode_map(r, tag & 0x0f, depth);
    switch (tag) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xcc: case 0xcd: case 0xce: case 0xcf: /* uint 8/16/32/64 */
        if (!read_be(r, 1 << (tag - 0xcc), &n))
            return NULL;
        return PyLong_FromUnsignedLongLong(n);
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: { /* int 8/16/32/64, two's complement */
        int nbytes = 1 << (tag - 0xd0);
        if (!read_be(r, nbytes, &n))
            return NULL;
        int64_t v = nbytes == 8 ? (int64_t)n
                                : (int64_t)(n ^ (1ULL << (8 * nbytes - 1))) - (1LL << (8 * nbytes - 1));
        return PyLong_FromLongLong(v);
    }
    case 0xd9: case 0xda: case 0xdb: /* str 8/16/32 */
        if (!read_be(r, 1 << (tag - 0xd9), &n))
            return NULL;
        return n > (uint64_t)PY_SSIZE_T_MAX ? NULL : decode_str(r, (Py_ssize_t)n);
    case 0xc4: case 0xc5: case 0xc6: /* bin 8/16/32 */
        if (!read_be(r, 1 << (tag - 0xc4), &n))
            return NULL;
        return n > (uint64_t)PY_SSIZE_T_MAX ? NULL : decode_bin(r, (Py_ssize_t)n);
    case 0xdc: case 0xdd: /* array 16/32 */
        if (!read_be(r, tag == 0xdc ? 2 : 4, &n))
            return NULL;
        return decode_array(r, (Py_ssize_t)n, depth);
    case 0xde: case 0xdf: /* map 16/32 */
        if (!read_be(r, tag == 0xde ? 2 : 4, &n))
            return NULL;
        return decode_map(r, (Py_ssize_t)n, depth);
    default: /* floats, ext types, the never-used 0xc1: the Python path */
        return NULL;
    }
}

/* The body as exactly one object, or NULL with no exception set. */
static PyObject *decode_body(const unsigned char *body, Py_ssize_t nbytes)
{
    Reader r = {body, body + nbytes};
    PyObject *obj = decode(&r, 0);
    if (obj == NULL)
        PyErr_Clear(); /* e.g. MemoryError: the Python path meets it again and raises it */
    else if (r.at != r.end)
        Py_CLEAR(obj); /* trailing bytes */
    return obj;
}

/* An int in [0, 2**64): what parse_request and parse_reply accept as a request id. */
static int is_request_id(PyObject *value)
{
    if (!PyLong_CheckExact(value))
        return 0;
    PyLong_AsUnsignedLongLong(value); /* OverflowError below 0 or above 2**64 - 1 */
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* A body as parse_request(unpack_body(body)) returns it: a new (request_id, op, args) tuple,
   or NULL (no exception set) for the Python path. */
static PyObject *request_of(const unsigned char *body, Py_ssize_t nbytes)
{
    PyObject *obj = decode_body(body, nbytes), *result = NULL;
    if (obj == NULL)
        return NULL;
    if (PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == 3) {
        PyObject *request_id = PyList_GET_ITEM(obj, 0), *op = PyList_GET_ITEM(obj, 1),
                 *args = PyList_GET_ITEM(obj, 2);
        /* args is a dict whose keys are str: decode_map makes no other. */
        if (is_request_id(request_id) && PyUnicode_CheckExact(op)
                && PyUnicode_GET_LENGTH(op) > 0 && PyUnicode_GET_LENGTH(op) <= max_op_len
                && PyDict_CheckExact(args))
            result = PyTuple_Pack(3, request_id, op, args);
    }
    Py_DECREF(obj);
    PyErr_Clear();
    return result;
}

/* A success reply as parse_reply(unpack_body(body)) returns it: (request_id, result), or NULL
   (no exception set) for the Python path, which raises the error an error reply carries. */
static PyObject *reply_of(const unsigned char *body, Py_ssize_t nbytes)
{
    PyObject *obj = decode_body(body, nbytes), *result = NULL;
    if (obj == NULL)
        return NULL;
    if (PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == 3
            && PyList_GET_ITEM(obj, 1) == Py_True && is_request_id(PyList_GET_ITEM(obj, 0)))
        result = PyTuple_Pack(2, PyList_GET_ITEM(obj, 0), PyList_GET_ITEM(obj, 2));
    Py_DECREF(obj);
    PyErr_Clear();
    return result;
}

typedef PyObject *(*BodyDecoder)(const unsigned char *, Py_ssize_t);

/* `decode_one` of a body (a bytes-like object), or None. */
static PyObject *decode_buffer(PyObject *body, BodyDecoder decode_one)
{
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = decode_one(view.buf, view.len);
    PyBuffer_Release(&view);
    if (result == NULL)
        Py_RETURN_NONE;
    return result;
}

/* `decode_one` of every frame of a chunk that holds whole frames only (length prefix, body),
   as a list; None if the chunk holds anything else (a partial frame, a bad length prefix) or
   any body is one for the Python path: the caller then feeds the chunk to its FrameDecoder. */
static PyObject *decode_frames(PyObject *chunk, BodyDecoder decode_one)
{
    Py_buffer view;
    if (PyObject_GetBuffer(chunk, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const unsigned char *at = view.buf, *end = at + view.len;
    PyObject *results = PyList_New(0);
    while (results != NULL && at < end) {
        uint64_t nbytes = 0;
        Reader r = {at, end};
        PyObject *result = NULL;
        if (read_be(&r, 4, &nbytes) && nbytes > 0 && (Py_ssize_t)nbytes <= max_frame_nbytes
                && (Py_ssize_t)nbytes <= end - r.at)
            result = decode_one(r.at, (Py_ssize_t)nbytes);
        if (result == NULL || PyList_Append(results, result) < 0)
            Py_CLEAR(results);
        Py_XDECREF(result);
        at = r.at + nbytes;
    }
    PyBuffer_Release(&view);
    if (results == NULL || PyList_GET_SIZE(results) == 0) {
        PyErr_Clear();
        Py_XDECREF(results);
        Py_RETURN_NONE;
    }
    return results;
}

static PyObject *wire_request(PyObject *module, PyObject *body)
{
    return decode_buffer(body, request_of);
}

static PyObject *wire_reply(PyObject *module, PyObject *body)
{
    return decode_buffer(body, reply_of);
}

static PyObject *wire_requests(PyObject *module, PyObject *chunk)
{
    return decode_frames(chunk, request_of);
}

static PyObject *wire_replies(PyObject *module, PyObject *chunk)
{
    return decode_frames(chunk, reply_of);
}

/* ---- encoding: FrameEncoder.frame for the common objects ------------------------------------ */

typedef struct {
    unsigned char *data;
    Py_ssize_t size, capacity;
    unsigned char inline_data[512]; /* a batch-1 frame never leaves it */
} Writer;

static int reserve(Writer *w, Py_ssize_t n)
{
    if (w->capacity - w->size >= n)
        return 1;
    if (w->size + n > max_frame_nbytes + 4)
        return 0; /* too large: the Python path raises TooLargeError */
    Py_ssize_t capacity = w->capacity * 2 > w->size + n ? w->capacity * 2 : w->size + n;
    unsigned char *data = w->data == w->inline_data ? PyMem_Malloc(capacity)
                                                    : PyMem_Realloc(w->data, capacity);
    if (data == NULL)
        return 0;
    if (w->data == w->inline_data)
        memcpy(data, w->inline_data, w->size);
    w->data = data;
    w->capacity = capacity;
    return 1;
}

/* A tag byte followed by `nbytes` big-endian bytes of `value` (nbytes 0, 1, 2, 4 or 8). */
static int put(Writer *w, unsigned char tag, int nbytes, uint64_t value)
{
    if (!reserve(w, 1 + nbytes))
        return 0;
    unsigned char *p = w->data + w->size;
    *p++ = tag;
    for (int i = nbytes - 1; i >= 0; i--)
        *p++ = (unsigned char)(value >> (8 * i));
    w->size += 1 + nbytes;
    return 1;
}

/* The smallest of msgpack's length forms, as msgpack's Packer chooses it. `fix` is the tag of
   the short form holding lengths below `fix_limit` (0: none), `tag8` that of the 8-bit form
   (0: none; bin has no fix form, arrays and maps no 8-bit form), then the 16- and 32-bit ones. */
static int put_length(Writer *w, Py_ssize_t n, unsigned char fix, Py_ssize_t fix_limit,
                      unsigned char tag8, unsigned char tag16)
{
    if (n < fix_limit)
        return put(w, fix | (unsigned char)n, 0, 0);
    if (tag8 && n <= 0xff)
        return put(w, tag8, 1, (uint64_t)n);
    if (n <= 0xffff)
        return put(w, tag16, 2, (uint64_t)n);
    if ((uint64_t)n <= 0xffffffffULL)
        return put(w, tag16 + 1, 4, (uint64_t)n);
    return 0;
}

static int put_bytes(Writer *w, const char *bytes, Py_ssize_t n)
{
    if (!reserve(w, n))
        return 0;
    memcpy(w->data + w->size, bytes, n);
    w->size += n;
    return 1;
}

static int encode(Writer *w, PyObject *obj, int depth);

static int encode_int(Writer *w, PyObject *obj)
{
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow > 0) { /* above 2**63 - 1: uint 64, or too large for msgpack */
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return put(w, 0xcf, 8, u);
    }
    if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (v >= 0) {
        if (v <= 0x7f)
            return put(w, (unsigned char)v, 0, 0);
        if (v <= 0xff)
            return put(w, 0xcc, 1, (uint64_t)v);
        if (v <= 0xffff)
            return put(w, 0xcd, 2, (uint64_t)v);
        if (v <= 0xffffffffLL)
            return put(w, 0xce, 4, (uint64_t)v);
        return put(w, 0xcf, 8, (uint64_t)v);
    }
    if (v >= -32)
        return put(w, (unsigned char)(signed char)v, 0, 0);
    if (v >= -0x80)
        return put(w, 0xd0, 1, (uint64_t)v);
    if (v >= -0x8000)
        return put(w, 0xd1, 2, (uint64_t)v);
    if (v >= -0x80000000LL)
        return put(w, 0xd2, 4, (uint64_t)v);
    return put(w, 0xd3, 8, (uint64_t)v);
}

static int encode_str(Writer *w, PyObject *obj)
{
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(obj, &n);
    if (utf8 == NULL) { /* lone surrogates: msgpack's Packer raises for them too */
        PyErr_Clear();
        return 0;
    }
    return put_length(w, n, 0xa0, 32, 0xd9, 0xda) && put_bytes(w, utf8, n);
}

static int encode(Writer *w, PyObject *obj, int depth)
{
    if (obj == Py_None)
        return put(w, 0xc0, 0, 0);
    if (obj == Py_False)
        return put(w, 0xc2, 0, 0);
    if (obj == Py_True)
        return put(w, 0xc3, 0, 0);
    if (PyLong_CheckExact(obj))
        return encode_int(w, obj);
    if (PyUnicode_CheckExact(obj))
        return encode_str(w, obj);
    if (PyBytes_CheckExact(obj)) {
        Py_ssize_t n = PyBytes_GET_SIZE(obj);
        return put_length(w, n, 0, 0, 0xc4, 0xc5) && put_bytes(w, PyBytes_AS_STRING(obj), n);
    }
    if (depth >= MAX_DEPTH)
        return 0;
    if (PyList_CheckExact(obj)) {
        Py_ssize_t n = PyList_GET_SIZE(obj);
        if (!put_length(w, n, 0x90, 16, 0, 0xdc))
            return 0;
        /* (an item's encoding runs no Python code, so the list cannot change under us) */
        for (Py_ssize_t i = 0; i < n; i++)
            if (!encode(w, PyList_GET_ITEM(obj, i), depth + 1))
                return 0;
        return 1;
    }
    if (PyDict_CheckExact(obj)) {
        Py_ssize_t position = 0;
        PyObject *key, *value;
        if (!put_length(w, PyDict_GET_SIZE(obj), 0x80, 16, 0, 0xde))
            return 0;
        while (PyDict_Next(obj, &position, &key, &value))
            if (!PyUnicode_CheckExact(key) || !encode_str(w, key) || !encode(w, value, depth + 1))
                return 0;
        return 1;
    }
    return 0; /* floats, tuples, NumPy scalars, subclasses...: the Python path */
}

static PyObject *wire_frame(PyObject *module, PyObject *obj)
{
    Writer w;
    w.data = w.inline_data;
    w.size = 4; /* the length prefix, filled in below */
    w.capacity = sizeof w.inline_data;
    PyObject *frame = NULL;
    if (encode(&w, obj, 0)) {
        uint32_t nbytes = (uint32_t)(w.size - 4);
        w.data[0] = (unsigned char)(nbytes >> 24);
        w.data[1] = (unsigned char)(nbytes >> 16);
        w.data[2] = (unsigned char)(nbytes >> 8);
        w.data[3] = (unsigned char)nbytes;
        if ((Py_ssize_t)nbytes <= max_frame_nbytes)
            frame = PyBytes_FromStringAndSize((const char *)w.data, w.size);
    }
    if (w.data != w.inline_data)
        PyMem_Free(w.data);
    if (frame == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return frame;
}

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
static PyObject *wire_is_int_list(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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
static PyObject *wire_is_bytes_list(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_args(args, nargs, 4))
        return NULL;
    Py_ssize_t max_len, max_item_nbytes;
    int allow_nil = PyObject_IsTrue(args[3]); /* (an int: no Python code runs) */
    return PyBool_FromLong(ssize_of(args[1], &max_len) && ssize_of(args[2], &max_item_nbytes)
                           && is_bytes_list_within(args[0], max_len, max_item_nbytes, allow_nil));
}

/* kvd/protocol/__init__.py's argument fields: (name, kind, is_required, a, b, allow_nil). */
enum { ARG_INT = 0, ARG_INT_LIST = 1, ARG_BYTES_LIST = 2 };

/* Whether `value` passes `field`'s check (see args_of in kvd/protocol/__init__.py). */
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

/* args_of(args, schema): kvd.protocol.args_of's values as a tuple, or None for anything its
   validators must look at. */
static PyObject *wire_args_of(PyObject *module, PyObject *const *argv, Py_ssize_t nargs)
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

/* kvd.protocol.args_of, which call_hot runs for what hot_values declines (set_validators). */
static PyObject *validators = NULL;

static PyObject *wire_set_validators(PyObject *module, PyObject *callable)
{
    Py_INCREF(callable);
    Py_XSETREF(validators, callable);
    Py_RETURN_NONE;
}

/* call_hot(handler, args, schema, owner): handler(*args_of(args, schema), owner), the values on
   the C stack: no tuple, and no frame of Python between the Service and the handler. What
   hot_values declines goes to the validators, which raise the error (or, where they accept what
   C could not tell, return the values). */
static PyObject *wire_call_hot(PyObject *module, PyObject *const *argv, Py_ssize_t nargs)
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

/* ---- the journal's records: kvd/server/journal.py's _records and _LogState.settle, per commit ----- */

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
static PyObject *wire_journal_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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
static PyObject *wire_apply_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

static PyObject *wire_set_limits(PyObject *module, PyObject *args)
{
    if (!PyArg_ParseTuple(args, "nnnnnn", &max_frame_nbytes, &max_str_nbytes, &max_bin_nbytes,
                          &max_array_len, &max_map_len, &max_op_len))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef wire_methods[] = {
    {"request", wire_request, METH_O,
     "request(body) -> (request_id, op, args) or None: unpack_body + parse_request, or None "
     "for the Python path"},
    {"reply", wire_reply, METH_O,
     "reply(body) -> (request_id, result) or None: a success reply, or None for the Python path"},
    {"requests", wire_requests, METH_O,
     "requests(chunk) -> [request(body) of every frame] or None: for a chunk of whole frames "
     "whose bodies all decode here; None for the FrameDecoder and the Python path"},
    {"replies", wire_replies, METH_O,
     "replies(chunk) -> [reply(body) of every frame] or None: as requests(), for replies"},
    {"frame", wire_frame, METH_O,
     "frame(obj) -> bytes or None: FrameEncoder.frame's bytes for None, bool, int, str, bytes, "
     "list and str-keyed dict, or None for the Python path"},
    {"is_int_list", (PyCFunction)(void (*)(void))wire_is_int_list, METH_FASTCALL,
     "is_int_list(value, max_len, limit) -> bool: a list of at most max_len ints in [0, limit] "
     "(False: arg_int_list raises the error)"},
    {"args_of", (PyCFunction)(void (*)(void))wire_args_of, METH_FASTCALL,
     "args_of(args, schema) -> tuple | None: kvd.protocol.args_of's values, or None for anything "
     "its validators must look at"},
    {"call_hot", (PyCFunction)(void (*)(void))wire_call_hot, METH_FASTCALL,
     "call_hot(handler, args, schema, owner) -> handler(*args_of(args, schema), owner), its "
     "checks in C where they pass (the validators set_validators names otherwise)"},
    {"set_validators", wire_set_validators, METH_O,
     "set_validators(args_of): what call_hot runs for the arguments its C checks decline"},
    {"is_bytes_list", (PyCFunction)(void (*)(void))wire_is_bytes_list, METH_FASTCALL,
     "is_bytes_list(value, max_len, max_item_nbytes, allow_nil) -> bool: a list of at most "
     "max_len binary strings of 1 to max_item_nbytes bytes (False: arg_bytes_list raises)"},
    {"journal_records", (PyCFunction)(void (*)(void))wire_journal_records, METH_FASTCALL,
     "journal_records(evictions, seals, first_seal_seq, default_key_width) -> (key_width, "
     "records) or None: kvd/server/journal.py's _records, or None for the Python path"},
    {"apply_records", (PyCFunction)(void (*)(void))wire_apply_records, METH_FASTCALL,
     "apply_records(chunk_of, records, key_width, first_chunk_id, max_chunk_records) -> int or "
     "None: _LogState.settle of one commit's chunks, the change in live blocks"},
    {"set_limits", wire_set_limits, METH_VARARGS,
     "set_limits(max_frame_nbytes, max_str_nbytes, max_bin_nbytes, max_array_len, max_map_len, "
     "max_op_len): the frame cap, unpack_body's limits and parse_request's op length"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "kvd.protocol._wire",
    "The common frame bodies and journal records in C; see kvd/protocol/_wire.c and kvd/protocol/__init__.py.", -1,
    wire_methods,
};

PyMODINIT_FUNC PyInit__wire(void)
{
    return PyModule_Create(&wire_module);
}
