/* The steady-state residency check of nimblejax's XLA call path, in C.

   residency.py states the rules and holds the pure-Python version of the same two
   functions; tests/test_residency_ext.py runs both on the same cases. Here a call
   costs one pass over the leaves with no Python frame per leaf:

   steady(leaves, record) -> the record's results, or None
       Decides each leaf's source; when the sources are the record's, calls
       record.fn with the PASSED leaves, stores leaves and results in the record and
       returns the results. None: the sources changed (the caller decides again).
   decide(leaves, record) -> (sources, passed leaves), or None
       Where each leaf's data comes from: HELD, PASSED or j >= 0 (the previous
       call's result j); None when a leaf that is not held changed its signature.

   A leaf is HELD when it is the very object of the previous call, a jax.Array of the
   concrete type (Py_TYPE compared with the ArrayImpl type given to init) and not
   deleted. is_deleted is a C++ method of jaxlib's array: it is called (vectorcall,
   no attribute lookup) only for leaves that would be held or fed back; no cheaper
   public way to see a deletion exists. A leaf that is not held keeps its signature:
   the array's aval is compared by identity with the last one that matched at that
   position (results of one jitted function share their avals), else field by
   field; any other leaf goes to the Python check given to init. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STACK_LEAVES 256

static PyObject *array_type;     /* jax's concrete jax.Array type (ArrayImpl) */
static PyObject *is_deleted_fn;  /* ArrayImpl.is_deleted, called with the array */
static PyObject *same_signature; /* same_signature(x, sig) for any other leaf */
static long PASSED = -1, HELD = -2;
static PyObject *s_leaves, *s_outs, *s_sources, *s_sigs, *s_holdable, *s_out_feedable,
    *s_avals, *s_fn, *s_aval, *s_shape, *s_dtype, *s_weak_type, *s_is_deleted;

/* The record's fields a decision reads (new references). */
typedef struct {
  PyObject *last, *outs, *sigs, *holdable, *out_feedable, *avals;
} Record;

static void record_clear(Record *r) {
  Py_CLEAR(r->last); Py_CLEAR(r->outs); Py_CLEAR(r->sigs);
  Py_CLEAR(r->holdable); Py_CLEAR(r->out_feedable); Py_CLEAR(r->avals);
}

static PyObject *fast_attr(PyObject *obj, PyObject *name) {
  PyObject *value = PyObject_GetAttr(obj, name);
  if (value == NULL) return NULL;
  PyObject *seq = PySequence_Fast(value, "nimblejax residency: a record field is not a sequence");
  Py_DECREF(value);
  return seq;
}

static int record_read(PyObject *rec, Record *r) {
  r->last = fast_attr(rec, s_leaves);
  r->outs = r->last ? fast_attr(rec, s_outs) : NULL;
  r->sigs = r->outs ? fast_attr(rec, s_sigs) : NULL;
  r->holdable = r->sigs ? PyObject_GetAttr(rec, s_holdable) : NULL;
  r->out_feedable = r->holdable ? PyObject_GetAttr(rec, s_out_feedable) : NULL;
  r->avals = r->out_feedable ? PyObject_GetAttr(rec, s_avals) : NULL;
  if (r->avals == NULL) return -1;
  if (!PyBytes_Check(r->holdable) || !PyBytes_Check(r->out_feedable) || !PyList_Check(r->avals)) {
    PyErr_SetString(PyExc_TypeError, "nimblejax residency: holdable/out_feedable must be bytes, avals a list");
    return -1;
  }
  return 0;
}

/* 1: deleted, 0: not, -1: error. */
static int deleted(PyObject *x) {
  PyObject *r = Py_TYPE(x) == (PyTypeObject *)array_type
      ? PyObject_Vectorcall(is_deleted_fn, &x, 1, NULL)
      : PyObject_CallMethodNoArgs(x, s_is_deleted);
  if (r == NULL) return -1;
  int truth = PyObject_IsTrue(r);
  Py_DECREF(r);
  return truth;
}

/* The previous call's feedable results by identity: open addressing, the last index
   of an object that appears twice wins (as a dict built in order would). */
typedef struct {
  PyObject **keys;
  Py_ssize_t *values;
  size_t mask;
} Table;

static size_t slot_of(PyObject *p, size_t mask) {
  return (size_t)(((uintptr_t)p >> 4) * (uintptr_t)0x9E3779B97F4A7C15ull) & mask;
}

static int table_build(Table *t, PyObject *outs, PyObject *feedable) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(outs), nf = PyBytes_GET_SIZE(feedable);
  const char *fed = PyBytes_AS_STRING(feedable);
  size_t size = 8;
  while (size < 2 * (size_t)n) size <<= 1;
  t->keys = calloc(size, sizeof(PyObject *));
  t->values = malloc(size * sizeof(Py_ssize_t));
  if (t->keys == NULL || t->values == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  t->mask = size - 1;
  PyObject **items = PySequence_Fast_ITEMS(outs);
  for (Py_ssize_t j = 0; j < n && j < nf; j++) {
    if (!fed[j]) continue;
    size_t s = slot_of(items[j], t->mask);
    while (t->keys[s] != NULL && t->keys[s] != items[j]) s = (s + 1) & t->mask;
    t->keys[s] = items[j];
    t->values[s] = j;
  }
  return 0;
}

static Py_ssize_t table_find(const Table *t, PyObject *x) {
  size_t s = slot_of(x, t->mask);
  for (; t->keys[s] != NULL; s = (s + 1) & t->mask)
    if (t->keys[s] == x) return t->values[s];
  return -1;
}

/* Whether array x (of the concrete type) keeps signature sig; 1, 0 or -1 (error). */
static int same_array_signature(PyObject *x, PyObject *sig, PyObject *avals, Py_ssize_t i) {
  PyObject *aval = PyObject_GetAttr(x, s_aval);
  if (aval == NULL) return -1;
  if (aval == PyList_GET_ITEM(avals, i)) {
    Py_DECREF(aval);
    return 1;
  }
  static PyObject *const *names[3] = {&s_shape, &s_dtype, &s_weak_type};
  int same = PyTuple_Check(sig) && PyTuple_GET_SIZE(sig) == 3;
  for (int k = 0; same == 1 && k < 3; k++) {
    PyObject *field = PyObject_GetAttr(aval, *names[k]);
    same = field == NULL ? -1 : PyObject_RichCompareBool(field, PyTuple_GET_ITEM(sig, k), Py_EQ);
    Py_XDECREF(field);
  }
  if (same == 1) PyList_SetItem(avals, i, aval); /* steals aval: the next look is one compare */
  else Py_DECREF(aval);
  return same;
}

static int same_leaf_signature(PyObject *x, PyObject *sig, PyObject *avals, Py_ssize_t i) {
  if (Py_TYPE(x) == (PyTypeObject *)array_type) return same_array_signature(x, sig, avals, i);
  PyObject *args[2] = {x, sig};
  PyObject *r = PyObject_Vectorcall(same_signature, args, 2, NULL);
  if (r == NULL) return -1;
  int truth = PyObject_IsTrue(r);
  Py_DECREF(r);
  return truth;
}

/* The source of leaf i that is not held: PASSED or the index of a previous result. */
static int fed_source(PyObject *x, const Record *r, Table *table, long *src) {
  *src = PASSED;
  if (table->keys == NULL && table_build(table, r->outs, r->out_feedable) < 0) return -1;
  Py_ssize_t j = table_find(table, x);
  if (j < 0) return 0;
  int d = deleted(x);
  if (d < 0) return -1;
  if (!d) *src = (long)j;
  return 0;
}

/* Fills src[0..n) for `leaves` against the record: 1 done, 0 a signature changed (or
   the record does not fit the leaves), -1 error. */
static int decide_sources(PyObject *leaves, const Record *r, long *src) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves);
  if (PySequence_Fast_GET_SIZE(r->last) != n || PySequence_Fast_GET_SIZE(r->sigs) != n ||
      PyBytes_GET_SIZE(r->holdable) != n || PyList_GET_SIZE(r->avals) != n)
    return 0;
  PyObject **xs = PySequence_Fast_ITEMS(leaves), **last = PySequence_Fast_ITEMS(r->last);
  PyObject **sigs = PySequence_Fast_ITEMS(r->sigs);
  const char *holdable = PyBytes_AS_STRING(r->holdable), *fed = PyBytes_AS_STRING(r->out_feedable);
  int any_feedable = memchr(fed, 1, PyBytes_GET_SIZE(r->out_feedable)) != NULL;
  Table table = {NULL, NULL, 0};
  int status = 1;
  for (Py_ssize_t i = 0; i < n && status == 1; i++) {
    PyObject *x = xs[i];
    src[i] = PASSED;
    if (holdable[i] && x == last[i] && Py_TYPE(x) == (PyTypeObject *)array_type) {
      int d = deleted(x);
      if (d < 0) { status = -1; break; }
      if (!d) { src[i] = HELD; continue; }
    } else if (holdable[i] && any_feedable && fed_source(x, r, &table, &src[i]) < 0) {
      status = -1;
      break;
    }
    status = same_leaf_signature(x, sigs[i], r->avals, i);
  }
  free(table.keys);
  free(table.values);
  return status;
}

/* Runs decide_sources into a buffer; returns the buffer (src_stack or malloc'd), NULL
   with *status set otherwise. */
static long *sources_of(PyObject *leaves, const Record *r, long *src_stack, int *status) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves);
  long *src = n <= STACK_LEAVES ? src_stack : malloc(n * sizeof(long));
  if (src == NULL) {
    PyErr_NoMemory();
    *status = -1;
    return NULL;
  }
  *status = decide_sources(leaves, r, src);
  if (*status != 1 && src != src_stack) free(src);
  return *status == 1 ? src : NULL;
}

/* 1 when src equals the record's sources list, 0 when not, -1 on error. */
static int same_sources(PyObject *rec, const long *src, Py_ssize_t n) {
  PyObject *sources = fast_attr(rec, s_sources);
  if (sources == NULL) return -1;
  int same = PySequence_Fast_GET_SIZE(sources) == n;
  PyObject **items = PySequence_Fast_ITEMS(sources);
  for (Py_ssize_t i = 0; same == 1 && i < n; i++) {
    long s = PyLong_AsLong(items[i]);
    same = s == -1 && PyErr_Occurred() ? -1 : s == src[i];
  }
  Py_DECREF(sources);
  return same;
}

static PyObject *passed_leaves(PyObject *leaves, const long *src) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves), count = 0;
  for (Py_ssize_t i = 0; i < n; i++) count += src[i] == PASSED;
  PyObject *out = PyList_New(count), **xs = PySequence_Fast_ITEMS(leaves);
  for (Py_ssize_t i = 0, k = 0; out != NULL && i < n; i++)
    if (src[i] == PASSED) PyList_SET_ITEM(out, k++, Py_NewRef(xs[i]));
  return out;
}

static PyObject *call_passed(PyObject *rec, PyObject *leaves, const long *src) {
  PyObject *fn = PyObject_GetAttr(rec, s_fn);
  if (fn == NULL) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves), count = 0;
  PyObject **xs = PySequence_Fast_ITEMS(leaves), *stack[STACK_LEAVES];
  PyObject **args = n <= STACK_LEAVES ? stack : malloc(n * sizeof(PyObject *));
  PyObject *outs = NULL;
  if (args == NULL) PyErr_NoMemory();
  else {
    for (Py_ssize_t i = 0; i < n; i++)
      if (src[i] == PASSED) args[count++] = xs[i];
    outs = PyObject_Vectorcall(fn, args, count, NULL);
  }
  if (args != stack) free(args);
  Py_DECREF(fn);
  return outs;
}

/* steady() on a sequence of leaves (`given`, stored in the record as it is). */
static PyObject *steady_core(PyObject *given, PyObject *rec) {
  PyObject *leaves = PySequence_Fast(given, "leaves must be a sequence"), *outs = NULL;
  Record r = {0};
  long stack[STACK_LEAVES], *src = NULL;
  int status = -1;
  if (leaves != NULL && record_read(rec, &r) == 0)
    src = sources_of(leaves, &r, stack, &status);
  if (src != NULL) status = same_sources(rec, src, PySequence_Fast_GET_SIZE(leaves));
  if (status == 1) outs = call_passed(rec, leaves, src);
  if (outs != NULL &&
      (PyObject_SetAttr(rec, s_leaves, given) < 0 || PyObject_SetAttr(rec, s_outs, outs) < 0))
    Py_CLEAR(outs);
  if (src != stack) free(src);
  record_clear(&r);
  Py_XDECREF(leaves);
  if (outs != NULL || status < 0 || PyErr_Occurred()) return outs;
  Py_RETURN_NONE;
}

static PyObject *py_steady(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "steady(leaves, record)");
    return NULL;
  }
  return steady_core(args[0], args[1]);
}

/* ---- the call's arguments flattened here -------------------------------------------
   A call's (args, kwargs) is walked down builtin containers (exact tuple, list and dict,
   and None, which holds nothing) to leaves of the concrete array type, float, int and
   bool, in jax.tree_util's order (a dict's values by sorted key). Its structure is a
   tuple of codes, one per container or leaf in that order: TUPLE + 4 n, LIST + 4 n,
   NONE, LEAF, and for a dict the tuple of its sorted keys. Any other type (a registered
   pytree node, a numpy array, ...) ends the walk: jax flattens that call. */
enum { TUPLE = 0, LIST = 1, NONE = 2, LEAF = 3 };

typedef struct {
  PyObject *codes; /* building: a list to append to; NULL when comparing */
  PyObject *const *want; /* comparing: the record's codes */
  Py_ssize_t nwant, pos;
  PyObject *leaves; /* a list the leaves are appended to */
} Walk;

/* 1: this code is the next one (appended, or equal to the record's), 0: not, -1: error. */
static int code(Walk *w, Py_ssize_t value) {
  if (w->codes != NULL) {
    PyObject *v = PyLong_FromSsize_t(value);
    int r = v == NULL ? -1 : PyList_Append(w->codes, v);
    Py_XDECREF(v);
    return r < 0 ? -1 : 1;
  }
  if (w->pos >= w->nwant || !PyLong_CheckExact(w->want[w->pos])) return 0;
  Py_ssize_t have = PyLong_AsSsize_t(w->want[w->pos++]);
  return have == -1 && PyErr_Occurred() ? -1 : have == value;
}

static int walk(Walk *w, PyObject *x);

static int walk_items(Walk *w, PyObject *const *items, Py_ssize_t n) {
  int r = 1;
  for (Py_ssize_t i = 0; r == 1 && i < n; i++) r = walk(w, items[i]);
  return r;
}

static int walk_dict(Walk *w, PyObject *d) {
  PyObject *keys;
  if (w->codes != NULL) {
    PyObject *list = PyDict_Keys(d);
    if (list == NULL) return -1;
    if (PyList_Sort(list) < 0) { /* unorderable keys: jax's order is not ours to guess */
      Py_DECREF(list);
      PyErr_Clear();
      return 0;
    }
    keys = PyList_AsTuple(list);
    Py_DECREF(list);
    if (keys == NULL || PyList_Append(w->codes, keys) < 0) {
      Py_XDECREF(keys);
      return -1;
    }
  } else {
    if (w->pos >= w->nwant || !PyTuple_CheckExact(w->want[w->pos])) return 0;
    keys = Py_NewRef(w->want[w->pos++]);
    if (PyTuple_GET_SIZE(keys) != PyDict_GET_SIZE(d)) {
      Py_DECREF(keys);
      return 0;
    }
  }
  int r = 1;
  for (Py_ssize_t i = 0; r == 1 && i < PyTuple_GET_SIZE(keys); i++) {
    PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(keys, i)); /* borrowed */
    r = v != NULL ? walk(w, v) : PyErr_Occurred() ? -1 : 0;
  }
  Py_DECREF(keys);
  return r;
}

static int walk(Walk *w, PyObject *x) {
  int r;
  if (PyTuple_CheckExact(x)) {
    r = code(w, TUPLE + 4 * PyTuple_GET_SIZE(x));
    return r == 1 ? walk_items(w, PySequence_Fast_ITEMS(x), PyTuple_GET_SIZE(x)) : r;
  }
  if (PyList_CheckExact(x)) {
    r = code(w, LIST + 4 * PyList_GET_SIZE(x));
    return r == 1 ? walk_items(w, PySequence_Fast_ITEMS(x), PyList_GET_SIZE(x)) : r;
  }
  if (PyDict_CheckExact(x)) return walk_dict(w, x);
  if (x == Py_None) return code(w, NONE);
  if (Py_TYPE(x) == (PyTypeObject *)array_type || PyFloat_CheckExact(x) || PyLong_CheckExact(x) ||
      PyBool_Check(x)) {
    r = code(w, LEAF);
    return r == 1 ? (PyList_Append(w->leaves, x) < 0 ? -1 : 1) : r;
  }
  return 0;
}

/* Walks args then kwargs: 1 done, 0 not this structure or another type, -1 error. */
static int walk_call(Walk *w, PyObject *args, PyObject *kwargs) {
  int r = walk(w, args);
  if (r == 1) r = kwargs == Py_None ? code(w, NONE) : PyDict_Check(kwargs) ? walk_dict(w, kwargs) : 0;
  if (r == 1 && w->codes == NULL && w->pos != w->nwant) r = 0;
  return r;
}

static PyObject *py_structure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "structure(args, kwargs)");
    return NULL;
  }
  Walk w = {PyList_New(0), NULL, 0, 0, PyList_New(0)};
  PyObject *result = NULL;
  int r = w.codes && w.leaves ? walk_call(&w, args[0], args[1]) : -1;
  if (r == 1) {
    PyObject *codes = PyList_AsTuple(w.codes);
    if (codes != NULL) result = PyTuple_Pack(2, codes, w.leaves);
    Py_XDECREF(codes);
  } else if (r == 0) result = Py_NewRef(Py_None);
  Py_XDECREF(w.codes);
  Py_XDECREF(w.leaves);
  return result;
}

static PyObject *py_steady_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "steady_call(args, kwargs, structure, record)");
    return NULL;
  }
  Walk w = {NULL, PySequence_Fast_ITEMS(args[2]), PyTuple_GET_SIZE(args[2]), 0, PyList_New(0)};
  if (w.leaves == NULL) return NULL;
  int r = walk_call(&w, args[0], args[1]);
  PyObject *outs = r == 1 ? steady_core(w.leaves, args[3]) : r == 0 ? Py_NewRef(Py_None) : NULL;
  Py_DECREF(w.leaves);
  return outs;
}

static PyObject *sources_list(PyObject *rec, const long *src, Py_ssize_t n) {
  int same = same_sources(rec, src, n);
  if (same < 0) return NULL;
  if (same) return PyObject_GetAttr(rec, s_sources);
  PyObject *out = PyList_New(n);
  for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
    PyObject *v = PyLong_FromLong(src[i]);
    if (v == NULL) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, v);
  }
  return out;
}

static PyObject *py_decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "decide(leaves, record)");
    return NULL;
  }
  PyObject *leaves = PySequence_Fast(args[0], "leaves must be a sequence"), *result = NULL;
  Record r = {0};
  long stack[STACK_LEAVES], *src = NULL;
  int status = -1;
  if (leaves != NULL && record_read(args[1], &r) == 0)
    src = sources_of(leaves, &r, stack, &status);
  if (src != NULL) {
    PyObject *sources = sources_list(args[1], src, PySequence_Fast_GET_SIZE(leaves));
    PyObject *passed = sources ? passed_leaves(leaves, src) : NULL;
    if (passed != NULL) result = PyTuple_Pack(2, sources, passed);
    Py_XDECREF(sources);
    Py_XDECREF(passed);
  }
  if (src != stack) free(src);
  record_clear(&r);
  Py_XDECREF(leaves);
  if (result != NULL || status < 0 || PyErr_Occurred()) return result;
  Py_RETURN_NONE;
}

static PyObject *intern(const char *name) { return PyUnicode_InternFromString(name); }

static PyObject *py_init(PyObject *self, PyObject *args) {
  PyObject *type, *is_deleted, *same;
  if (!PyArg_ParseTuple(args, "O!OOll", &PyType_Type, &type, &is_deleted, &same, &PASSED, &HELD))
    return NULL;
  PyObject *old[3] = {array_type, is_deleted_fn, same_signature};
  array_type = Py_NewRef(type);
  is_deleted_fn = Py_NewRef(is_deleted);
  same_signature = Py_NewRef(same);
  for (int k = 0; k < 3; k++) Py_XDECREF(old[k]);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS,
     "init(array_type, is_deleted, same_signature, PASSED, HELD): the concrete jax.Array "
     "type, its is_deleted, the Python signature check of other leaves, the source codes."},
    {"steady", (PyCFunction)(void (*)(void))py_steady, METH_FASTCALL,
     "steady(leaves, record): the results of record.fn when the sources are the record's, else None."},
    {"decide", (PyCFunction)(void (*)(void))py_decide, METH_FASTCALL,
     "decide(leaves, record): (sources, passed leaves), or None when a signature changed."},
    {"structure", (PyCFunction)(void (*)(void))py_structure, METH_FASTCALL,
     "structure(args, kwargs): (its structure's codes, its leaves), or None where a type "
     "other than tuple, list, dict, None, the array type, float, int or bool is met."},
    {"steady_call", (PyCFunction)(void (*)(void))py_steady_call, METH_FASTCALL,
     "steady_call(args, kwargs, structure, record): steady() on the call's leaves when "
     "it has that structure, else None."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nimble_residency",
                                    "nimblejax's residency check in C (see residency.py).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nimble_residency(void) {
  PyObject **names[] = {&s_leaves, &s_outs, &s_sources, &s_sigs, &s_holdable, &s_out_feedable,
                        &s_avals, &s_fn, &s_aval, &s_shape, &s_dtype, &s_weak_type, &s_is_deleted};
  const char *texts[] = {"leaves", "outs", "sources", "sigs", "holdable", "out_feedable",
                         "avals", "fn", "aval", "shape", "dtype", "weak_type", "is_deleted"};
  for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
    if ((*names[k] = intern(texts[k])) == NULL) return NULL;
  return PyModule_Create(&module);
}
