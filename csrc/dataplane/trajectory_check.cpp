// check_core: the value checks of a trajectory's core arrays in one pass.
//
// The arrays come in through the buffer protocol (no numpy headers), so the trainer's receiver
// checks a message straight on the ZMQ frames.
// Semantics are those of the numpy path in areal_mega/dataplane/trajectory.py
// (Trajectory.validate); tests/test_dataplane_trajectory.py checks both agree on every rule.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dataplane_native.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Bits of the result, one per rule; Python raises the first failing one in its own order.
constexpr long kNegativeId = 1;       // input_ids >= 0
constexpr long kMaskNotBinary = 2;    // loss_mask in {0, 1}
constexpr long kVersionBelow = 4;     // versions >= -1
constexpr long kMaskOnPrompt = 8;     // loss_mask == 0 on the first prompt_len tokens
constexpr long kBadLogprob = 16;      // logprobs finite and <= 0 where loss_mask != 0

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Runtime dispatch to AVX-512 / AVX2 builds of the loops (numpy does the same for its
// reductions); the baseline build has no packed 32-bit min.
#define AREAL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AREAL_CLONES
#endif

// Frames received by ZMQ may start at any byte offset: load through memcpy (one mov on x86).
template <typename T>
inline T load(const unsigned char* p, Py_ssize_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<Py_ssize_t>(sizeof(T)), sizeof(T));
  return v;
}

AREAL_CLONES
long check(const unsigned char* ids, const unsigned char* mask, const unsigned char* logprobs,
           const unsigned char* versions, Py_ssize_t n, Py_ssize_t prompt_len) {
  // Branch-free reductions the compiler vectorises; one pass over each array.
  int32_t min_id = 0, min_version = -1;
  for (Py_ssize_t i = 0; i < n; ++i) min_id = std::min(min_id, load<int32_t>(ids, i));
  for (Py_ssize_t i = 0; i < n; ++i) min_version = std::min(min_version, load<int32_t>(versions, i));
  unsigned char max_mask = 0, prompt_mask = 0;
  for (Py_ssize_t i = 0; i < prompt_len; ++i) prompt_mask |= mask[i];
  for (Py_ssize_t i = 0; i < n; ++i) max_mask = std::max(max_mask, mask[i]);
  // A float32 is finite and <= 0 iff its bits are +0 or the sign is set with an exponent below
  // all-ones; in integers so NaN needs no special case and the loop vectorises.
  uint32_t bad_logprob = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const uint32_t x = load<uint32_t>(logprobs, i);
    const uint32_t ok = (x == 0u) | ((x >> 31) & ((x & 0x7F800000u) != 0x7F800000u));
    bad_logprob |= static_cast<uint32_t>(mask[i] != 0) & (ok ^ 1u);
  }
  long bits = 0;
  if (min_id < 0) bits |= kNegativeId;
  if (max_mask > 1) bits |= kMaskNotBinary;
  if (min_version < -1) bits |= kVersionBelow;
  if (prompt_mask) bits |= kMaskOnPrompt;
  if (bad_logprob) bits |= kBadLogprob;
  return bits;
}

class Buffer {
 public:
  Buffer() { view_.obj = nullptr; }
  ~Buffer() {
    if (view_.obj) PyBuffer_Release(&view_);
  }
  bool get(PyObject* obj, const char* name) {
    if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Format(PyExc_TypeError, "%s: not a C-contiguous buffer", name);
      return false;
    }
    return true;
  }
  const unsigned char* data() const { return static_cast<const unsigned char*>(view_.buf); }
  Py_ssize_t len() const { return view_.len; }

 private:
  Py_buffer view_;
};

}  // namespace

PyObject* check_core(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "check_core(input_ids, loss_mask, logprobs, versions, prompt_len)");
    return nullptr;
  }
  Buffer ids, mask, lp, ver;
  if (!ids.get(args[0], "input_ids") || !mask.get(args[1], "loss_mask") ||
      !lp.get(args[2], "logprobs") || !ver.get(args[3], "versions"))
    return nullptr;
  const Py_ssize_t prompt_len = PyLong_AsSsize_t(args[4]);
  if (prompt_len == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t n = mask.len();
  if (ids.len() != 4 * n || lp.len() != 4 * n || ver.len() != 4 * n || prompt_len < 0 ||
      prompt_len > n) {
    PyErr_Format(PyExc_ValueError,
                 "check_core: byte lengths ids %zd mask %zd logprobs %zd versions %zd, "
                 "prompt_len %zd do not describe one trajectory",
                 ids.len(), mask.len(), lp.len(), ver.len(), prompt_len);
    return nullptr;
  }
  long bits;
  if (n < (1 << 16)) {  // a few microseconds: not worth a GIL round trip
    bits = check(ids.data(), mask.data(), lp.data(), ver.data(), n, prompt_len);
  } else {
    Py_BEGIN_ALLOW_THREADS
    bits = check(ids.data(), mask.data(), lp.data(), ver.data(), n, prompt_len);
    Py_END_ALLOW_THREADS
  }
  return PyLong_FromLong(bits);
}

