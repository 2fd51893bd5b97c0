/* serving._ingest: the server's passes over a request's tensor bytes, each one pass at memory speed, without the GIL.

   copy_finite(dst, src, width) -> bool   copies src into dst (writable, at least as long) and says whether every
                                          value is finite; width: 0 (no check: integers), 2 (fp16), 4 (fp32), 8 (fp64)
   finite(src, width) -> bool             the check alone
   wake_at(fd, nbytes)                    a socket's SO_RCVLOWAT (serving/http/connection.py waits for a body whole);
                                          OSError when refused

Why: a 602 KB image cost numpy 22 us for isfinite(x).all() (a temporary bool array, then a second pass) and ~38 us
for the copy into the batch, on values the kernel had just written into the cache; fused, it is one read and one
write. A value is NaN or Inf exactly when its exponent bits are all ones, so the check is an AND and a compare per
value, which the compiler vectorizes (target_clones picks AVX-512 or AVX2 where the CPU has them).

wake_at is here because it is set twice a large request: through uvloop's socket object it cost 2 us a call (a
socket object made around the descriptor and let go), against a system call here.

Optional: serving/staging.py falls back to numpy when this is not built, serving/http/connection.py to the socket
object. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define PASS(T, MASK)                                                  \
  CLONES static int copy_##T(T *dst, const T *src, size_t n) {         \
    T bad = 0;                                                         \
    for (size_t i = 0; i < n; i++) {                                   \
      T v = src[i];                                                    \
      dst[i] = v;                                                      \
      bad |= (T)((v & (MASK)) == (MASK));                              \
    }                                                                  \
    return bad == 0;                                                   \
  }                                                                    \
  CLONES static int check_##T(const T *src, size_t n) {                \
    T bad = 0;                                                         \
    for (size_t i = 0; i < n; i++) bad |= (T)((src[i] & (MASK)) == (MASK)); \
    return bad == 0;                                                   \
  }

PASS(uint16_t, 0x7c00u)
PASS(uint32_t, 0x7f800000u)
PASS(uint64_t, 0x7ff0000000000000ull)

static int width_ok(int width) { return width == 0 || width == 2 || width == 4 || width == 8; }

static PyObject *copy_finite(PyObject *self, PyObject *args) {
  Py_buffer dst, src;
  int width, finite = 1;
  if (!PyArg_ParseTuple(args, "w*y*i", &dst, &src, &width)) return NULL;
  if (!width_ok(width) || dst.len < src.len || (width && src.len % width)) {
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyErr_SetString(PyExc_ValueError, "copy_finite: dst shorter than src, or a width not 0, 2, 4 or 8");
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  size_t n = width ? (size_t)src.len / width : 0;
  switch (width) {
    case 2: finite = copy_uint16_t(dst.buf, src.buf, n); break;
    case 4: finite = copy_uint32_t(dst.buf, src.buf, n); break;
    case 8: finite = copy_uint64_t(dst.buf, src.buf, n); break;
    default: memcpy(dst.buf, src.buf, (size_t)src.len);
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return PyBool_FromLong(finite);
}

static PyObject *all_finite(PyObject *self, PyObject *args) {
  Py_buffer src;
  int width, ok = 1;
  if (!PyArg_ParseTuple(args, "y*i", &src, &width)) return NULL;
  if (!width_ok(width) || (width && src.len % width)) {
    PyBuffer_Release(&src);
    PyErr_SetString(PyExc_ValueError, "finite: a width not 0, 2, 4 or 8");
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  size_t n = width ? (size_t)src.len / width : 0;
  switch (width) {
    case 2: ok = check_uint16_t(src.buf, n); break;
    case 4: ok = check_uint32_t(src.buf, n); break;
    case 8: ok = check_uint64_t(src.buf, n); break;
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&src);
  return PyBool_FromLong(ok);
}

static PyObject *wake_at(PyObject *self, PyObject *args) {
  int fd, nbytes;
  if (!PyArg_ParseTuple(args, "ii", &fd, &nbytes)) return NULL;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &nbytes, sizeof nbytes) != 0) return PyErr_SetFromErrno(PyExc_OSError);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_finite", copy_finite, METH_VARARGS, "copy_finite(dst, src, width) -> whether every value is finite"},
    {"finite", all_finite, METH_VARARGS, "finite(src, width) -> whether every value is finite"},
    {"wake_at", wake_at, METH_VARARGS, "wake_at(fd, nbytes): the socket's SO_RCVLOWAT"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ingest", "passes over tensor bytes (serving/_ingest.c)",
                                    -1, methods};

PyMODINIT_FUNC PyInit__ingest(void) { return PyModule_Create(&module); }
