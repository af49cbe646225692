// field_frames / decode_fields: the per-field checks of a trajectory message's header and the
// zero-copy arrays over its frames (wire format: areal_mega/dataplane/wire.py, schema 2).
//
// Semantics, order of checks and error texts are those of wire._field_frames_py and
// wire._decode_fields_py; tests/test_dataplane_transport.py runs every malformed message
// through both. A failed check returns (reason, detail) instead of raising, so the caller
// raises its own WireError.
#include <cstdint>
#include <cstring>
#include <vector>

#include "dataplane_native.h"

// Only this file uses the numpy C API (arrays straight over the frames, no np.frombuffer call);
// wire_fields_init() imports it when the module loads.
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

namespace {

constexpr Py_ssize_t kMaxNdim = 4;                  // wire.MAX_NDIM
constexpr long long kMaxDim = 1LL << 40;            // every dimension < 2**40
constexpr long long kCountLimit = 1LL << 59;        // elements; times an itemsize <= 8 fits

PyObject* failure(const char* reason, PyObject* detail) {  // steals detail
  if (detail == nullptr) return nullptr;
  return Py_BuildValue("(sN)", reason, detail);
}

// Owns a reference; released on scope exit.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return p_; }
  void reset(PyObject* p) {
    Py_XDECREF(p_);
    p_ = p;
  }
  PyObject* release() {
    PyObject* p = p_;
    p_ = nullptr;
    return p;
  }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

// A read-only array of `descr` with dims `dims[:ndim]` over the bytes of `buf` from `offset`,
// keeping `buf` alive as its base: what np.frombuffer(buf, descr, count, offset).reshape(shape)
// returns, without the calls. The caller checked the bytes are there.
PyObject* array_over(PyObject* buf, PyObject* descr, const npy_intp* dims, int ndim,
                     long long offset) {
  Py_buffer view;
  if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) != 0) return nullptr;
  char* data = static_cast<char*>(view.buf) + offset;
  // The memory belongs to `buf` (a zmq.Frame, bytes or a memoryview holding its own export)
  // and lives as long as it does; the array keeps `buf` as its base, as np.frombuffer does.
  PyBuffer_Release(&view);
  Py_INCREF(descr);  // stolen by PyArray_NewFromDescr
  PyObject* arr = PyArray_NewFromDescr(&PyArray_Type, reinterpret_cast<PyArray_Descr*>(descr),
                                       ndim, const_cast<npy_intp*>(dims), nullptr, data, 0,
                                       nullptr);
  if (arr == nullptr) return nullptr;
  Py_INCREF(buf);  // stolen by PyArray_SetBaseObject
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr), buf) != 0) {
    Py_DECREF(arr);
    return nullptr;
  }
  return arr;
}

}  // namespace

PyObject* field_frames(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !PyList_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "field_frames(fields: list)");
    return nullptr;
  }
  PyObject* fields = args[0];
  long n_own = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(fields); ++i) {
    PyObject* spec = PyList_GET_ITEM(fields, i);
    if (!PyList_CheckExact(spec) || PyList_GET_SIZE(spec) != 4 ||
        !PyUnicode_CheckExact(PyList_GET_ITEM(spec, 0)) || !PyBool_Check(PyList_GET_ITEM(spec, 3)))
      return failure("bad_header",
                     PyUnicode_FromFormat("fields[%zd] is not [name, dtype, shape, packed]", i));
    n_own += PyList_GET_ITEM(spec, 3) == Py_False;
  }
  return PyLong_FromLong(n_own);
}

PyObject* decode_fields(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyList_Check(args[1]) ||
      !PyDict_CheckExact(args[2]) || !PyDict_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "decode_fields(fields: list, views: list, dtypes: dict, required: dict, "
                    "sample_id)");
    return nullptr;
  }
  PyObject *fields = args[0], *views = args[1], *dtypes = args[2], *required = args[3];
  PyObject* sid = args[4];
  const Py_ssize_t n_views = PyList_GET_SIZE(views);
  if (n_views < 2) {
    PyErr_SetString(PyExc_ValueError, "decode_fields: views must hold header and pack");
    return nullptr;
  }
  PyObject* pack = PyList_GET_ITEM(views, 1);
  const Py_ssize_t pack_len = PyObject_Size(pack);
  if (pack_len < 0) return nullptr;
  Ref arrays(PyDict_New());
  if (!arrays) return nullptr;
  long long end = 0;  // bytes of the pack used so far
  Py_ssize_t k = 2;   // next field frame
  long n_required = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(fields); ++i) {
    // field_frames checked the structure: [str, ?, ?, bool]
    PyObject* spec = PyList_GET_ITEM(fields, i);
    PyObject *name = PyList_GET_ITEM(spec, 0), *dt = PyList_GET_ITEM(spec, 1);
    PyObject *shape = PyList_GET_ITEM(spec, 2);
    const bool packed = PyList_GET_ITEM(spec, 3) == Py_True;
    PyObject* entry = PyUnicode_CheckExact(dt) ? PyDict_GetItemWithError(dtypes, dt) : nullptr;
    if (entry == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      return failure("bad_dtype", PyUnicode_FromFormat("field %R: dtype %R not allowed",
                                                       name, dt));
    }
    PyObject* dtype = PyTuple_GET_ITEM(entry, 0);
    const long long itemsize = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    PyObject* want = PyDict_GetItemWithError(required, name);
    if (want == nullptr && PyErr_Occurred()) return nullptr;
    if (want != nullptr && dtype != want)
      return failure("bad_dtype",
                     PyUnicode_FromFormat("field %R: dtype %S, expected %S (sample_id=%R)",
                                          name, dtype, want, sid));
    if (!PyList_CheckExact(shape) || PyList_GET_SIZE(shape) > kMaxNdim)
      return failure("bad_shape", PyUnicode_FromFormat("field %R: shape %R", name, shape));
    const Py_ssize_t ndim = PyList_GET_SIZE(shape);
    npy_intp dims[kMaxNdim];
    long long count = 1;
    for (Py_ssize_t d = 0; d < ndim; ++d) {
      PyObject* dim = PyList_GET_ITEM(shape, d);
      int overflow = 0;
      const long long v = PyLong_CheckExact(dim) ? PyLong_AsLongLongAndOverflow(dim, &overflow)
                                                 : -1;
      if (v < 0 || overflow || v >= kMaxDim)
        return failure("bad_shape", PyUnicode_FromFormat("field %R: shape %R", name, shape));
      dims[d] = static_cast<npy_intp>(v);
      // Saturate (the exact product of 4 dims < 2**40 may need 160 bits): a saturated count
      // is larger than any buffer, so the size check below fails as the exact one would.
      if (v == 0)
        count = 0;
      else if (count > kCountLimit / v)
        count = kCountLimit;
      else
        count *= v;
    }
    const long long nbytes = count * itemsize;
    Ref arr;
    if (packed) {
      const long long start = (end + 7) & ~7LL;
      end = start + nbytes;
      if (end > pack_len)
        return failure("frame_size",
                       PyUnicode_FromFormat("frame 1 (pack) field %R: needs bytes [%lld, %lld), "
                                            "the pack has %zd", name, start, end, pack_len));
      arr.reset(array_over(pack, dtype, dims, static_cast<int>(ndim), start));
    } else {
      if (k >= n_views) {  // the caller checked the frame count; be safe anyway
        PyErr_SetString(PyExc_ValueError, "decode_fields: fewer views than field frames");
        return nullptr;
      }
      PyObject* view = PyList_GET_ITEM(views, k);
      const Py_ssize_t len = PyObject_Size(view);
      if (len < 0) return nullptr;
      if (nbytes != len)
        return failure("frame_size",
                       PyUnicode_FromFormat("frame %zd field %R: %zd bytes, shape %S of %S "
                                            "needs %lld", k, name, len, shape, dtype, nbytes));
      arr.reset(array_over(view, dtype, dims, static_cast<int>(ndim), 0));
      ++k;
    }
    if (!arr) return nullptr;
    const int dup = PyDict_Contains(arrays.get(), name);
    if (dup < 0) return nullptr;
    if (dup) return failure("bad_header", PyUnicode_FromFormat("duplicate field %R", name));
    if (PyDict_SetItem(arrays.get(), name, arr.get()) < 0) return nullptr;
    n_required += want != nullptr;
  }
  if (end != pack_len)
    return failure("frame_size", PyUnicode_FromFormat(
        "frame 1 (pack): %zd bytes, the packed fields end at %lld", pack_len, end));
  return Py_BuildValue("(Nl)", arrays.release(), n_required);
}

int wire_fields_init() {
  import_array1(-1);
  return 0;
}

PyObject* pack_fields(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "pack_fields(arrays: dict, wire_str: dict, threshold)");
    return nullptr;
  }
  PyObject *arrays = args[0], *wire_str = args[1];
  const long long threshold = PyLong_AsLongLong(args[2]);
  if (threshold == -1 && PyErr_Occurred()) return nullptr;
  Ref fields(PyList_New(0)), own(PyList_New(0));
  if (!fields || !own) return nullptr;
  struct Packed {
    PyArrayObject* arr;
    long long start, nbytes;
  };
  std::vector<Packed> packed;
  long long end = 0;
  Py_ssize_t pos = 0;
  PyObject *name, *value;
  while (PyDict_Next(arrays, &pos, &name, &value)) {
    if (!PyArray_CheckExact(value)) Py_RETURN_NONE;  // the Python twin copes
    PyArrayObject* arr = reinterpret_cast<PyArrayObject*>(value);
    if (!PyArray_IS_C_CONTIGUOUS(arr)) Py_RETURN_NONE;
    PyObject* dt =
        PyDict_GetItemWithError(wire_str, reinterpret_cast<PyObject*>(PyArray_DESCR(arr)));
    if (dt == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;  // byte-swapped or unusual dtype
    }
    const int ndim = PyArray_NDIM(arr);
    Ref shape(PyList_New(ndim));
    if (!shape) return nullptr;
    for (int d = 0; d < ndim; ++d) {
      PyObject* v = PyLong_FromSsize_t(PyArray_DIM(arr, d));
      if (v == nullptr) return nullptr;
      PyList_SET_ITEM(shape.get(), d, v);
    }
    const long long nbytes = static_cast<long long>(PyArray_NBYTES(arr));
    const bool small = nbytes < threshold;
    PyObject* spec = PyList_New(4);
    if (spec == nullptr) return nullptr;
    Py_INCREF(name);
    Py_INCREF(dt);
    PyObject* flag = small ? Py_True : Py_False;
    Py_INCREF(flag);
    PyList_SET_ITEM(spec, 0, name);
    PyList_SET_ITEM(spec, 1, dt);
    PyList_SET_ITEM(spec, 2, shape.release());
    PyList_SET_ITEM(spec, 3, flag);
    const int rc = PyList_Append(fields.get(), spec);
    Py_DECREF(spec);
    if (rc != 0) return nullptr;
    if (small) {
      const long long start = (end + 7) & ~7LL;
      packed.push_back({arr, start, nbytes});
      end = start + nbytes;
    } else if (PyList_Append(own.get(), value) != 0) {
      return nullptr;
    }
  }
  Ref pack(PyBytes_FromStringAndSize(nullptr, end));
  if (!pack) return nullptr;
  char* out = PyBytes_AS_STRING(pack.get());
  long long at = 0;
  for (const Packed& p : packed) {
    std::memset(out + at, 0, static_cast<size_t>(p.start - at));  // alignment padding
    std::memcpy(out + p.start, PyArray_DATA(p.arr), static_cast<size_t>(p.nbytes));
    at = p.start + p.nbytes;
  }
  return PyTuple_Pack(3, fields.get(), pack.get(), own.get());
}
