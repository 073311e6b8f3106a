/* kvd._copy: the data plane's bulk write into the pool, with streaming stores when it is large.

Theory of operation
-------------------
A worker writes a layer's K (or V) of many tokens as whole block runs: row i of a contiguous source
goes to row rows[i] of the pool (kvd/blockcopy.py's `scatter_rows`, which is NumPy's
`dst[rows] = src` when this module is not built or declines). NumPy copies each row with memcpy,
and glibc picks its stores per call: a row is a few tens of KiB, far below the size at which glibc
itself switches to non-temporal stores (since 2.38, about a quarter of the last-level cache), so a
16 MiB write ran through the caches as 512 ordinary copies, each line read for ownership before it
was written and evicting the source it was reading. The caller knows the whole write's size; when
it says so (`nontemporal`), this copies every row with SSE2 streaming stores, which write whole
lines straight to memory: a 16 MiB write took 1.20-1.34 ms instead of 1.74-2.01 in
bench/data_plane.py (1.45-1.50x, side by side). Below that size the lines the write leaves in the
cache are the ones attention reads next, and ordinary stores are faster (kvd/blockcopy.py measures
where).

The contract is one-sided, as kvd/protocol/_wire.c's: `scatter_rows` checks everything first -- buffer
shapes and contiguity, every row index in [0, len(dst) / row_nbytes), that no buffer overlaps dst
-- and returns False without writing a byte if anything is off; the caller then runs the NumPy
assignment, which is the specification (negative indices, overlapping views, its IndexError).
Large copies release the GIL; the row indices are checked and turned into offsets in memory of
this call's own first, so another thread writing to `rows` meanwhile cannot move the copy.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_BYTES 16
#endif

/* Copies at least this large release the GIL, as NumPy's own copy loops do for large arrays;
   below it the hand-over would cost more than the copy. */
#define RELEASE_GIL_NBYTES (64 * 1024)

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* An 8-byte signed integer format, as NumPy's intp and int64 arrays export ("l" or "q"). */
static int is_int64_format(const char *format)
{
    if (format == NULL)
        return 0;
    if (*format == '@' || *format == '=' || (PY_LITTLE_ENDIAN && *format == '<'))
        format++;
    return (format[0] == 'l' || format[0] == 'q') && format[1] == '\0';
}

#if defined(__SSE2__)
/* n is a multiple of STREAM_BYTES and dst is aligned to it; src need not be. */
static void stream_copy(char *dst, const char *src, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {  /* a cache line per step: four stores fill it */
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i < n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
}
#endif

/* The copy itself, touching no Python object: large ones run with the GIL released. */
static void copy_rows(char *out, const char *in, const Py_ssize_t *offset_of, Py_ssize_t num_rows,
                      Py_ssize_t row_nbytes, int nontemporal)
{
#if defined(__SSE2__)
    if (nontemporal && (uintptr_t)out % STREAM_BYTES == 0 && row_nbytes % STREAM_BYTES == 0) {
        for (Py_ssize_t i = 0; i < num_rows; i++)
            stream_copy(out + offset_of[i], in + i * row_nbytes, row_nbytes);
        _mm_sfence();  /* streaming stores are weakly ordered: done before anyone reads */
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < num_rows; i++)
        memcpy(out + offset_of[i], in + i * row_nbytes, row_nbytes);
}

static PyObject *copy_scatter_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "scatter_rows(dst, rows, src, row_nbytes, nontemporal) takes 5 arguments");
        return NULL;
    }
    Py_ssize_t row_nbytes = PyLong_AsSsize_t(args[3]);
    if (row_nbytes == -1 && PyErr_Occurred())
        return NULL;
    int nontemporal = PyObject_IsTrue(args[4]);
    if (nontemporal < 0)
        return NULL;

    Py_buffer dst = {0}, rows = {0}, src = {0};
    PyObject *result = Py_False;
    Py_ssize_t *offset_of = NULL;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(args[1], &rows, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(args[2], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();  /* not a contiguous (writable) buffer: the NumPy path decides */
        goto release;
    }
    if (rows.itemsize != sizeof(int64_t) || !is_int64_format(rows.format) || row_nbytes <= 0 ||
        dst.len % row_nbytes != 0 || overlaps(&dst, &src) || overlaps(&dst, &rows))
        goto release;
    Py_ssize_t num_rows = rows.len / (Py_ssize_t)sizeof(int64_t);
    if (num_rows > PY_SSIZE_T_MAX / row_nbytes || src.len != num_rows * row_nbytes)
        goto release;
    /* Checked and turned into byte offsets once, into memory of our own: with the GIL released
       another thread may write to `rows`, and the copy must go where the check said. */
    offset_of = PyMem_Malloc((num_rows ? num_rows : 1) * sizeof(Py_ssize_t));
    if (offset_of == NULL) {
        result = PyErr_NoMemory();
        goto release;
    }
    const int64_t *row_of = rows.buf;
    int64_t dst_rows = dst.len / row_nbytes;
    for (Py_ssize_t i = 0; i < num_rows; i++) {
        if (row_of[i] < 0 || row_of[i] >= dst_rows)
            goto release;
        offset_of[i] = (Py_ssize_t)row_of[i] * row_nbytes;
    }
    if (src.len >= RELEASE_GIL_NBYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_rows(dst.buf, src.buf, offset_of, num_rows, row_nbytes, nontemporal);
        Py_END_ALLOW_THREADS
    } else {
        copy_rows(dst.buf, src.buf, offset_of, num_rows, row_nbytes, nontemporal);
    }
    result = Py_True;
release:
    PyMem_Free(offset_of);
    if (src.obj)
        PyBuffer_Release(&src);
    if (rows.obj)
        PyBuffer_Release(&rows);
    if (dst.obj)
        PyBuffer_Release(&dst);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef copy_methods[] = {
    {"scatter_rows", (PyCFunction)(void (*)(void))copy_scatter_rows, METH_FASTCALL,
     "scatter_rows(dst, rows, src, row_nbytes, nontemporal) -> bool: copy row i of src to row "
     "rows[i] of dst (rows of row_nbytes bytes; rows an int64 array), with streaming stores if "
     "nontemporal; False, with nothing written, for anything NumPy's dst[rows] = src must do"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef copy_module = {
    PyModuleDef_HEAD_INIT, "kvd._copy",
    "The pool's bulk row scatter in C; see kvd/_copy.c and kvd/blockcopy.py.", -1, copy_methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    return PyModule_Create(&copy_module);
}
