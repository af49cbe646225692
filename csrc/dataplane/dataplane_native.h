// areal_mega._dataplane_native: the per-message hot path of the trajectory data plane.
// A plain CPython extension (no torch; numpy's C API in wire_fields.cpp only); each function has a pure-Python twin
// with the same semantics in areal_mega/dataplane/ that tests compare it against.
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

// trajectory_check.cpp: check_core(input_ids, loss_mask, logprobs, versions, prompt_len) -> int
PyObject* check_core(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// wire_fields.cpp: field_frames(fields) -> int | (reason, detail)
PyObject* field_frames(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// wire_fields.cpp: decode_fields(fields, views, dtypes, required, sample_id)
//   -> (arrays: dict, n_required: int) | (reason, detail)
PyObject* decode_fields(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// wire_fields.cpp: pack_fields(arrays: dict, wire_str: dict, threshold)
//   -> (fields, pack: bytes, own: list) | None (an array the Python twin must handle)
PyObject* pack_fields(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

// wire_fields.cpp: imports the numpy C API; 0 on success, -1 with an exception set.
int wire_fields_init();
