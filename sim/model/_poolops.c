/* The GPU block pool's per-block loops, compiled (optional).
 *
 * sim/model/gpu_fast.py keeps the pool's state in plain Python lists, a
 * bytearray per flag and one dict per group; these functions run the four
 * loops that visit one block at a time (hand out, free, commit, and the test
 * of a free-queue piece for stale entries) over exactly
 * that state, in the same order and with the same rule per block as the
 * Python loops they replace. gpu_fast.py falls back to its own Python loops
 * when this module is not built (KVSIM_PURE_POOL=1 forces the fallback), and
 * tests/model/test_gpu_fast.py runs both on the same calls.
 *
 * Nothing here allocates a data structure of its own: every object read or
 * written is one the Python pool owns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *ONE;  /* the int 1 */
static PyObject *ZERO; /* the int 0 */

/* 0 when ``i`` indexes ``list``, else -1 with IndexError set */
static inline int
check_index(PyObject *list, Py_ssize_t i)
{
    if (i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "block id %zd out of range", i);
        return -1;
    }
    return 0;
}

static inline void
list_set(PyObject *list, Py_ssize_t i, PyObject *value)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    Py_INCREF(value);
    PyList_SET_ITEM(list, i, value);
    Py_DECREF(old);
}

/* take(ids, ref, bhash, incache, bgrp, isdup, caches, dups, uncache) -> evicted
 *
 * The blocks ``ids`` leave the free queue: ref count 1, and a block that still
 * carries a hash loses it (counted as evicted); if it is its hash's cache entry
 * and no duplicate waits, the entry is deleted here, otherwise ``uncache(b, h)``
 * (the pool's Python method) promotes or removes the duplicate.
 */
static PyObject *
poolops_take(PyObject *self, PyObject *args)
{
    PyObject *ids, *ref, *bhash, *incache, *bgrp, *isdup, *caches, *dups, *uncache;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O:take", &PyList_Type, &ids, &PyList_Type, &ref,
                          &PyList_Type, &bhash, &PyByteArray_Type, &incache, &PyList_Type, &bgrp,
                          &PyByteArray_Type, &isdup, &PyList_Type, &caches, &PyList_Type, &dups,
                          &uncache))
        return NULL;
    char *inc = PyByteArray_AS_STRING(incache);
    char *dup = PyByteArray_AS_STRING(isdup);
    Py_ssize_t nblocks = PyList_GET_SIZE(ref);
    if (PyList_GET_SIZE(bhash) != nblocks || PyList_GET_SIZE(bgrp) != nblocks ||
        PyByteArray_GET_SIZE(incache) != nblocks || PyByteArray_GET_SIZE(isdup) != nblocks) {
        PyErr_SetString(PyExc_ValueError, "pool arrays of different lengths");
        return NULL;
    }
    Py_ssize_t evicted = 0;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *bo = PyList_GET_ITEM(ids, k);
        Py_ssize_t b = PyLong_AsSsize_t(bo);
        if (b == -1 && PyErr_Occurred())
            return NULL;
        if (check_index(ref, b) < 0)
            return NULL;
        list_set(ref, b, ONE);
        PyObject *h = PyList_GET_ITEM(bhash, b);
        if (h == Py_None)
            continue;
        evicted++;
        Py_INCREF(h);
        int slow = 0;
        if (inc[b]) {
            Py_ssize_t g = PyLong_AsSsize_t(PyList_GET_ITEM(bgrp, b));
            if ((g == -1 && PyErr_Occurred()) || check_index(dups, g) < 0 || check_index(caches, g) < 0) {
                Py_DECREF(h);
                return NULL;
            }
            PyObject *dg = PyList_GET_ITEM(dups, g);
            int has = PyDict_GET_SIZE(dg) ? PyDict_Contains(dg, h) : 0;
            if (has < 0) {
                Py_DECREF(h);
                return NULL;
            }
            if (has) {
                slow = 1;
            } else {
                inc[b] = 0;
                if (PyDict_DelItem(PyList_GET_ITEM(caches, g), h) < 0) {
                    Py_DECREF(h);
                    return NULL;
                }
            }
        } else if (dup[b]) {
            slow = 1;
        }
        if (slow) {
            PyObject *r = PyObject_CallFunctionObjArgs(uncache, bo, h, NULL);
            if (r == NULL) {
                Py_DECREF(h);
                return NULL;
            }
            Py_DECREF(r);
            /* the callback resizes nothing; re-read the buffers all the same */
            inc = PyByteArray_AS_STRING(incache);
            dup = PyByteArray_AS_STRING(isdup);
        }
        Py_DECREF(h);
        list_set(bhash, b, Py_None);
    }
    return PyLong_FromSsize_t(evicted);
}

/* release(ids, ref, bhash, head, tail) -> -1, or the id of a block freed twice
 *
 * Drops one reference of each block of ``ids`` (any iterable, in its order);
 * a block reaching 0 is appended to ``head`` when it has no hash, else to
 * ``tail``. The null block (id 0, pinned at 1) is skipped. On a double free it
 * stops and returns that block's id; the blocks before it stay released.
 */
static PyObject *
poolops_release(PyObject *self, PyObject *args)
{
    PyObject *ids, *ref, *bhash, *head, *tail;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!:release", &ids, &PyList_Type, &ref, &PyList_Type, &bhash,
                          &PyList_Type, &head, &PyList_Type, &tail))
        return NULL;
    if (PyList_GET_SIZE(bhash) != PyList_GET_SIZE(ref)) {
        PyErr_SetString(PyExc_ValueError, "pool arrays of different lengths");
        return NULL;
    }
    PyObject *it = PyObject_GetIter(ids);
    if (it == NULL)
        return NULL;
    PyObject *bo;
    Py_ssize_t bad = -1;
    while ((bo = PyIter_Next(it)) != NULL) {
        Py_ssize_t b = PyLong_AsSsize_t(bo);
        if ((b == -1 && PyErr_Occurred()) || check_index(ref, b) < 0) {
            Py_DECREF(bo);
            Py_DECREF(it);
            return NULL;
        }
        PyObject *co = PyList_GET_ITEM(ref, b);
        long c = PyLong_AsLong(co);
        if (c == -1 && PyErr_Occurred()) {
            Py_DECREF(bo);
            Py_DECREF(it);
            return NULL;
        }
        if (c == 1 && b != 0) {
            list_set(ref, b, ZERO);
            PyObject *dest = PyList_GET_ITEM(bhash, b) == Py_None ? head : tail;
            if (PyList_Append(dest, bo) < 0) {
                Py_DECREF(bo);
                Py_DECREF(it);
                return NULL;
            }
        } else if (c > 1) {
            PyObject *nc = PyLong_FromLong(c - 1);
            if (nc == NULL) {
                Py_DECREF(bo);
                Py_DECREF(it);
                return NULL;
            }
            list_set(ref, b, nc);
            Py_DECREF(nc);
        } else if (c != 1) {
            bad = b;
            Py_DECREF(bo);
            break;
        }
        Py_DECREF(bo);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(bad);
}

/* commit(ids, hashes, bhash, bgrp, incache, cache, g, add_dup) -> None
 *
 * Gives each unhashed, non-null block of ``ids`` the hash at the same position
 * of ``hashes`` and the group ``g``; the first block under a hash becomes the
 * entry of ``cache`` (hash -> id), a later one is handed to ``add_dup(g, h, b)``.
 * ``cache`` None: prefix caching off, the hash is only recorded. Like
 * ``zip(..., strict=True)``, unequal lengths raise ValueError after the shorter.
 */
static PyObject *
poolops_commit(PyObject *self, PyObject *args)
{
    PyObject *ids, *hashes, *bhash, *bgrp, *incache, *cache, *go, *add_dup;
    if (!PyArg_ParseTuple(args, "OOO!O!O!OOO:commit", &ids, &hashes, &PyList_Type, &bhash, &PyList_Type,
                          &bgrp, &PyByteArray_Type, &incache, &cache, &go, &add_dup))
        return NULL;
    if (cache != Py_None && !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "cache must be a dict or None");
        return NULL;
    }
    if (PyList_GET_SIZE(bgrp) != PyList_GET_SIZE(bhash) ||
        PyByteArray_GET_SIZE(incache) != PyList_GET_SIZE(bhash)) {
        PyErr_SetString(PyExc_ValueError, "pool arrays of different lengths");
        return NULL;
    }
    PyObject *fi = PySequence_Fast(ids, "ids must be a sequence");
    if (fi == NULL)
        return NULL;
    PyObject *fh = PySequence_Fast(hashes, "hashes must be a sequence");
    if (fh == NULL) {
        Py_DECREF(fi);
        return NULL;
    }
    Py_ssize_t ni = PySequence_Fast_GET_SIZE(fi), nh = PySequence_Fast_GET_SIZE(fh);
    Py_ssize_t n = ni < nh ? ni : nh;
    PyObject **iv = PySequence_Fast_ITEMS(fi), **hv = PySequence_Fast_ITEMS(fh);
    PyObject *result = Py_None;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *bo = iv[k], *h = hv[k];
        Py_ssize_t b = PyLong_AsSsize_t(bo);
        if ((b == -1 && PyErr_Occurred()) || check_index(bhash, b) < 0) {
            result = NULL;
            break;
        }
        if (PyList_GET_ITEM(bhash, b) != Py_None || b == 0)
            continue;
        list_set(bhash, b, h);
        list_set(bgrp, b, go);
        if (cache == Py_None)
            continue;
        PyObject *entry = PyDict_SetDefault(cache, h, bo); /* borrowed */
        if (entry == NULL) {
            result = NULL;
            break;
        }
        int same = entry == bo ? 1 : PyObject_RichCompareBool(entry, bo, Py_EQ);
        if (same < 0) {
            result = NULL;
            break;
        }
        if (same) {
            PyByteArray_AS_STRING(incache)[b] = 1;
        } else {
            PyObject *r = PyObject_CallFunctionObjArgs(add_dup, go, h, bo, NULL);
            if (r == NULL) {
                result = NULL;
                break;
            }
            Py_DECREF(r);
        }
    }
    if (result != NULL && ni != nh) {
        PyErr_Format(PyExc_ValueError, "commit: %zd block ids and %zd hashes", ni, nh);
        result = NULL;
    }
    Py_DECREF(fi);
    Py_DECREF(fh);
    if (result == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* flagged(ids, flags) -> bool
 *
 * Whether some block of ``ids`` has its byte in ``flags`` set: the pool's test of
 * whether a piece of its free queue holds a stale entry, one byte read per block.
 */
static PyObject *
poolops_flagged(PyObject *self, PyObject *args)
{
    PyObject *ids, *flags;
    if (!PyArg_ParseTuple(args, "O!O!:flagged", &PyList_Type, &ids, &PyByteArray_Type, &flags))
        return NULL;
    const char *f = PyByteArray_AS_STRING(flags);
    Py_ssize_t nflags = PyByteArray_GET_SIZE(flags);
    Py_ssize_t n = PyList_GET_SIZE(ids);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = PyLong_AsSsize_t(PyList_GET_ITEM(ids, i));
        if (b == -1 && PyErr_Occurred())
            return NULL;
        if (b < 0 || b >= nflags) {
            PyErr_Format(PyExc_IndexError, "block id %zd out of range", b);
            return NULL;
        }
        if (f[b])
            Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static PyMethodDef poolops_methods[] = {
    {"take", poolops_take, METH_VARARGS, "Hand out blocks: ref 1, hashes dropped (see the C source)."},
    {"release", poolops_release, METH_VARARGS, "Drop one reference per block (see the C source)."},
    {"commit", poolops_commit, METH_VARARGS, "Give blocks their hashes (see the C source)."},
    {"flagged", poolops_flagged, METH_VARARGS, "Whether some block's flag byte is set (see the C source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef poolops_module = {
    PyModuleDef_HEAD_INIT, "_poolops", "The GPU block pool's per-block loops, compiled.", -1,
    poolops_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__poolops(void)
{
    ONE = PyLong_FromLong(1);
    ZERO = PyLong_FromLong(0);
    if (ONE == NULL || ZERO == NULL)
        return NULL;
    return PyModule_Create(&poolops_module);
}
