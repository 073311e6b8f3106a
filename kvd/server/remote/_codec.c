/* kvd.server.remote._codec: the remote tier's per-block work, off the GIL.

Theory of operation
-------------------
The write-behind thread turns a batch of sealed blocks into one Redis command, `MSET key value
key value ...`, packed as the bytes that go on the wire (RESP). In Python (kvd/server/remote/
codec.py's `BlockCodec.pack_mset`, the specification and this module's twin) each block costs
about 15 us of interpreted code holding the GIL that the daemon's loop thread needs; here a batch
costs one call: the Python objects (the rows, their hashes) are read first, with the GIL, into
memory of this call's own; then, with the GIL released, each block's generation is read, its
key, header and bytes are written into the command, its CRC-32 is taken of the copy, and the
generation is read again: a block whose generation differs from its row's (evicted before or
during the copy) is dropped from the command (counted stale), exactly as the Python does.

The generations live in the shared segment and the loop thread bumps them while this runs (that
is the point of the check): each is read with an atomic acquire load, and the copy's reads are
ordered before the second reading by an acquire fence.

`crc32` is zlib's CRC-32 by carry-less multiplication (below), which the fetch thread's checks use
too, with the GIL released for all but short buffers.

The command is written after a reserved head room, and its array header (`*N`, whose width
depends on how many blocks were kept) right-aligned against the body: the caller sends
`memoryview(command)[start:]`, with no copy of the body. As every C path of kvd's (docs/native.md),
`pack_mset` is one-sided: for anything off (a row not (int, bytes of 1-64, int), a block id out of
range, buffers of the wrong shape) it returns None having done nothing, and the Python twin packs
the batch or raises its own error.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_HASH_NBYTES 64
#define HEADER_NBYTES 32
#define ROOM 32 /* before the body: "*N\r\n$4\r\nMSET\r\n", N < 2**63 */

typedef struct {
    int64_t block_id;
    uint64_t generation;
    Py_ssize_t hash_nbytes;
    unsigned char hash[MAX_HASH_NBYTES];
} Row;

/* CRC-32 (zlib's: reflected 0x04C11DB7) by carry-less multiplication, four 128-bit lanes folded
   64 bytes at a time, then reduced (Intel's "Fast CRC Computation for Generic Polynomials Using
   PCLMULQDQ", as Chromium's zlib does it): 4.6 us per 64 KiB against zlib's 15.3 on the 2-core
   VM, which is most of a fetch's checking and a write's packing. zlib's crc32 does the rest (the tail
   under 16 bytes, short buffers, CPUs without PCLMULQDQ); the twin tests compare the two. */
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_CLMUL_CRC 1
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_clmul(const unsigned char *buf, size_t len, uint32_t crc)
{
    /* len >= 64, a multiple of 16; crc is the bit-inverted running CRC */
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    buf += 64;
    len -= 64;
    while (len >= 64) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
        __m128i x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
        __m128i x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(buf + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 0x30)));
        buf += 64;
        len -= 64;
    }
    __m128i lanes[3] = {x2, x3, x4};
    for (int i = 0; i < 3; i++) {  /* four lanes folded into one */
        __m128i x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, lanes[i]), x5);
    }
    for (; len >= 16; buf += 16, len -= 16) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)buf)), x5);
    }
    /* 128 bits to 64, then Barrett's reduction to 32 */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, k5k0, 0x00), x2);
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static int has_clmul;

static uint32_t fast_crc32(const unsigned char *buf, size_t len)
{
    uint32_t crc = 0;
#ifdef HAVE_CLMUL_CRC
    if (has_clmul && len >= 64) {
        size_t head = len & ~(size_t)15;
        crc = ~crc32_clmul(buf, head, ~crc);
        buf += head;
        len -= head;
    }
#endif
    while (len > 0) {  /* (zlib takes uInt lengths) */
        uInt chunk = len > (1u << 30) ? (1u << 30) : (uInt)len;
        crc = (uint32_t)crc32(crc, buf, chunk);
        buf += chunk;
        len -= chunk;
    }
    return crc;
}

static Py_ssize_t put_bulk_head(char *out, Py_ssize_t nbytes)
{
    return sprintf(out, "$%zd\r\n", nbytes);
}

/* The rows into memory of this call's own; -1 (an error perhaps set) for anything the Python
   must handle. */
static int read_rows(PyObject *rows, Row *row_of, Py_ssize_t num_rows, Py_ssize_t num_blocks)
{
    for (Py_ssize_t i = 0; i < num_rows; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 3)
            return -1;
        PyObject *hash = PyTuple_GET_ITEM(row, 1);
        row_of[i].block_id = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 0));
        row_of[i].generation = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(row, 2));
        if (PyErr_Occurred())
            return -1;
        if (!PyBytes_Check(hash) || PyBytes_GET_SIZE(hash) < 1 ||
            PyBytes_GET_SIZE(hash) > MAX_HASH_NBYTES || row_of[i].block_id < 0 ||
            row_of[i].block_id >= num_blocks)
            return -1;
        row_of[i].hash_nbytes = PyBytes_GET_SIZE(hash);
        memcpy(row_of[i].hash, PyBytes_AS_STRING(hash), row_of[i].hash_nbytes);
    }
    return 0;
}

/* One block's "$klen key $vlen value" at out (the GIL released); its length, or 0 if stale. */
static Py_ssize_t put_block(char *out, const Row *row, const char *prefix, Py_ssize_t prefix_nbytes,
                            const unsigned char *head, const char *blocks, Py_ssize_t block_nbytes,
                            const uint64_t *generations)
{
    static const char hex[] = "0123456789abcdef";
    const uint64_t *generation = generations + row->block_id;
    if (__atomic_load_n(generation, __ATOMIC_ACQUIRE) != row->generation)
        return 0;
    char *p = out;
    p += put_bulk_head(p, prefix_nbytes + 2 * row->hash_nbytes);
    memcpy(p, prefix, prefix_nbytes);
    p += prefix_nbytes;
    for (Py_ssize_t i = 0; i < row->hash_nbytes; i++) {
        *p++ = hex[row->hash[i] >> 4];
        *p++ = hex[row->hash[i] & 15];
    }
    *p++ = '\r';
    *p++ = '\n';
    p += put_bulk_head(p, HEADER_NBYTES + row->hash_nbytes + block_nbytes);
    unsigned char *header = (unsigned char *)p;
    memcpy(header, head, HEADER_NBYTES);
    header[6] = (unsigned char)row->hash_nbytes;
    p += HEADER_NBYTES;
    memcpy(p, row->hash, row->hash_nbytes);
    p += row->hash_nbytes;
    memcpy(p, blocks + row->block_id * block_nbytes, block_nbytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(generation, __ATOMIC_ACQUIRE) != row->generation)
        return 0;
    uint32_t crc = fast_crc32((const unsigned char *)p, (size_t)block_nbytes);
    for (int i = 0; i < 4; i++)
        header[24 + i] = (unsigned char)(crc >> (8 * i));
    p += block_nbytes;
    *p++ = '\r';
    *p++ = '\n';
    return p - out;
}

static PyObject *codec_pack_mset(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "pack_mset(blocks, generations, rows, prefix, head) takes 5 arguments");
        return NULL;
    }
    PyObject *rows = args[2], *prefix_obj = args[3], *head_obj = args[4];
    if (!PyList_Check(rows) || !PyBytes_Check(prefix_obj) || !PyBytes_Check(head_obj) ||
        PyBytes_GET_SIZE(head_obj) != HEADER_NBYTES)
        Py_RETURN_NONE;
    Py_buffer blocks = {0}, generations = {0};
    PyObject *command = NULL, *result = NULL;
    Row *row_of = NULL;
    if (PyObject_GetBuffer(args[0], &blocks, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0 ||
        PyObject_GetBuffer(args[1], &generations, PyBUF_C_CONTIGUOUS) < 0)
        goto decline;
    if (blocks.ndim != 2 || blocks.itemsize != 1 || generations.itemsize != 8 ||
        generations.len / 8 != blocks.shape[0] || blocks.shape[1] <= 0 ||
        (uintptr_t)generations.buf % 8 != 0)
        goto decline;
    Py_ssize_t num_blocks = blocks.shape[0], block_nbytes = blocks.shape[1];
    Py_ssize_t num_rows = PyList_GET_SIZE(rows), prefix_nbytes = PyBytes_GET_SIZE(prefix_obj);
    row_of = PyMem_Malloc((num_rows ? num_rows : 1) * sizeof(Row));
    if (row_of == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    if (read_rows(rows, row_of, num_rows, num_blocks) < 0)
        goto decline;
    /* every block kept, each with its two bulk heads ("$N\r\n", N < 2**63) and two CRLFs */
    Py_ssize_t most = prefix_nbytes + 2 * MAX_HASH_NBYTES + HEADER_NBYTES + MAX_HASH_NBYTES +
                      block_nbytes + 2 * 24;
    command = PyBytes_FromStringAndSize(NULL, ROOM + num_rows * most);
    if (command == NULL)
        goto release;
    char *out = PyBytes_AS_STRING(command), *p = out + ROOM;
    memset(out, 0, ROOM);
    const char *prefix = PyBytes_AS_STRING(prefix_obj);
    const unsigned char *head = (const unsigned char *)PyBytes_AS_STRING(head_obj);
    Py_ssize_t num_values = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < num_rows; i++) {
        Py_ssize_t nbytes = put_block(p, &row_of[i], prefix, prefix_nbytes, head, blocks.buf,
                                      block_nbytes, generations.buf);
        p += nbytes;
        num_values += nbytes > 0;
    }
    Py_END_ALLOW_THREADS
    char array_head[ROOM];
    int head_nbytes = snprintf(array_head, ROOM, "*%zd\r\n$4\r\nMSET\r\n", 1 + 2 * num_values);
    Py_ssize_t start = ROOM - head_nbytes;
    memcpy(out + start, array_head, head_nbytes);
    if (_PyBytes_Resize(&command, p - out) < 0)
        goto release;
    result = Py_BuildValue("(Onn)", command, start, num_values);
    goto release;
decline:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
release:
    Py_XDECREF(command);
    PyMem_Free(row_of);
    if (generations.obj)
        PyBuffer_Release(&generations);
    if (blocks.obj)
        PyBuffer_Release(&blocks);
    return result;
}

/* Buffers this large are checksummed with the GIL released. */
#define RELEASE_GIL_NBYTES 4096

static PyObject *codec_crc32(PyObject *module, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint32_t crc;
    if (view.len >= RELEASE_GIL_NBYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = fast_crc32(view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = fast_crc32(view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef codec_methods[] = {
    {"crc32", (PyCFunction)codec_crc32, METH_O,
     "crc32(data) -> int: zlib.crc32(data), by carry-less multiplication where the CPU has it"},
    {"pack_mset", (PyCFunction)(void (*)(void))codec_pack_mset, METH_FASTCALL,
     "pack_mset(blocks, generations, rows, prefix, head) -> (command, start, num_values): the "
     "RESP bytes of MSET of the rows' (block_id, hash, generation) blocks still of their "
     "generation, from command[start:]; see kvd/server/remote/codec.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef codec_module = {
    PyModuleDef_HEAD_INIT, "kvd.server.remote._codec",
    "The remote tier's MSET packing in C; see kvd/server/remote/_codec.c.", -1, codec_methods,
};

PyMODINIT_FUNC PyInit__codec(void)
{
#ifdef HAVE_CLMUL_CRC
    __builtin_cpu_init();
    has_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    return PyModule_Create(&codec_module);
}
