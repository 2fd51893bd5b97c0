/* serving._ingest: the server's passes over a request's tensor bytes, each one pass at memory speed, without the GIL.

   copy_finite(dst, src, width) -> bool   copies src into dst (writable, at least as long) and says whether every
                                          value is finite; width: 0 (no check: integers), 2 (fp16), 4 (fp32), 8 (fp64)
   finite(src, width) -> bool             the check alone
   wake_at(fd, nbytes)                    a socket's SO_RCVLOWAT (serving/http/connection.py waits for a body whole);
                                          OSError when refused
   Lock(memory, create)                   a mutex in the first LOCK_BYTES of `memory` (writable,
                                          e.g. a mapping of a memfd several processes share):
                                          process-shared and robust; `create` initializes it (once,
                                          by the process that made the memory). A context manager;
                                          waits without the GIL. A holder that died holding it
                                          leaves it to the next taker, which counts it in
                                          `recovered` (serving/placements.py orders its writes so
                                          that what a dead holder left half done is never seen)

Why: a 602 KB image cost numpy 22 us for isfinite(x).all() (a temporary bool array, then a second pass) and ~38 us
for the copy into the batch, on values the kernel had just written into the cache; fused, it is one read and one
write. A value is NaN or Inf exactly when its exponent bits are all ones, so the check is an AND and a compare per
value, which the compiler vectorizes (target_clones picks AVX-512 or AVX2 where the CPU has them).

wake_at is here because it is set twice a large request: through uvloop's socket object it cost 2 us a call (a
socket object made around the descriptor and let go), against a system call here.

Optional: serving/staging.py falls back to numpy when this is not built, serving/http/connection.py to the socket
object, serving/placements.py to a threading.Lock (one process only: front-end processes,
serving/front_ends.py, are refused where this is not built). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <pthread.h>
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


/* ---- Lock: a pthread mutex in shared memory, process-shared and robust ---- */

#define LOCK_BYTES 64

typedef struct {
  PyObject_HEAD
  Py_buffer memory; /* held: the mapping stays while the lock lives */
  pthread_mutex_t *mutex;
  long recovered;
} LockObject;

static int lock_init(LockObject *self, PyObject *args, PyObject *kwds) {
  static char *names[] = {"memory", "create", NULL};
  int create = 0;
  if (self->mutex) {
    PyErr_SetString(PyExc_RuntimeError, "Lock: already initialized");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*|p", names, &self->memory, &create)) return -1;
  if (self->memory.len < LOCK_BYTES || sizeof(pthread_mutex_t) > LOCK_BYTES ||
      ((uintptr_t)self->memory.buf) % 16) {
    PyBuffer_Release(&self->memory);
    PyErr_SetString(PyExc_ValueError,
                    "Lock: memory must be at least LOCK_BYTES long and 16-byte aligned");
    return -1;
  }
  self->mutex = (pthread_mutex_t *)self->memory.buf;
  if (create) {
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutex_init(self->mutex, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc) {
      self->mutex = NULL;
      PyBuffer_Release(&self->memory);
      errno = rc;
      PyErr_SetFromErrno(PyExc_OSError);
      return -1;
    }
  }
  return 0;
}

static void lock_dealloc(LockObject *self) {
  if (self->mutex) PyBuffer_Release(&self->memory);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int taken(LockObject *self, int rc) {
  if (rc == EOWNERDEAD) {
    /* its holder died holding it: ours now, made usable again */
    pthread_mutex_consistent(self->mutex);
    self->recovered++;
    return 1;
  }
  if (rc) {
    errno = rc;
    PyErr_SetFromErrno(PyExc_OSError);
    return 0;
  }
  return 1;
}

static PyObject *lock_acquire(LockObject *self, PyObject *unused) {
  if (!self->mutex) {
    PyErr_SetString(PyExc_RuntimeError, "Lock: not initialized");
    return NULL;
  }
  int rc = pthread_mutex_trylock(self->mutex);
  if (rc == EBUSY) {
    /* another thread of this process may hold it and need the GIL to let go */
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_mutex_lock(self->mutex);
    Py_END_ALLOW_THREADS
  }
  if (!taken(self, rc)) return NULL;
  Py_RETURN_TRUE;
}

static PyObject *lock_release(LockObject *self, PyObject *unused) {
  int rc = pthread_mutex_unlock(self->mutex);
  if (rc) {
    errno = rc;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  Py_RETURN_NONE;
}

static PyObject *lock_exit(LockObject *self, PyObject *args) { return lock_release(self, NULL); }

static PyObject *lock_recovered(LockObject *self, void *closure) {
  return PyLong_FromLong(self->recovered);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)lock_acquire, METH_NOARGS,
     "acquire(): waits for the lock (without the GIL)"},
    {"release", (PyCFunction)lock_release, METH_NOARGS, "release()"},
    {"__enter__", (PyCFunction)lock_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)lock_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef lock_getset[] = {
    {"recovered", (getter)lock_recovered, NULL,
     "times this process took it from a holder that had died", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "serving._ingest.Lock",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lock(memory, create=False): a process-shared, robust mutex in memory[:LOCK_BYTES]",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lock_init,
    .tp_dealloc = (destructor)lock_dealloc,
    .tp_methods = lock_methods,
    .tp_getset = lock_getset,
};

static PyMethodDef methods[] = {
    {"copy_finite", copy_finite, METH_VARARGS, "copy_finite(dst, src, width) -> whether every value is finite"},
    {"finite", all_finite, METH_VARARGS, "finite(src, width) -> whether every value is finite"},
    {"wake_at", wake_at, METH_VARARGS, "wake_at(fd, nbytes): the socket's SO_RCVLOWAT"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ingest", "passes over tensor bytes (serving/_ingest.c)",
                                    -1, methods};

PyMODINIT_FUNC PyInit__ingest(void) {
  if (PyType_Ready(&LockType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
  Py_INCREF(&LockType);
  if (PyModule_AddObject(m, "Lock", (PyObject *)&LockType) < 0 ||
      PyModule_AddIntConstant(m, "LOCK_BYTES", LOCK_BYTES) < 0) {
    Py_DECREF(&LockType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
