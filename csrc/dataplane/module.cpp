// Module table of areal_mega._dataplane_native (see dataplane_native.h).
#include "dataplane_native.h"

namespace {

PyCFunction fastcall(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f));
}

PyMethodDef kMethods[] = {
    {"check_core", fastcall(check_core), METH_FASTCALL,
     "check_core(input_ids, loss_mask, logprobs, versions, prompt_len) -> int\n\n"
     "Bit mask of the failed value rules of a trajectory's core arrays (buffers of int32, "
     "uint8, float32, int32 of one length, native byte order): 1 negative id, 2 mask not 0/1, "
     "4 version < -1, 8 mask on a prompt token, 16 logprob not finite or > 0 where masked in. "
     "Twin: trajectory.failed_value_rules_numpy."},
    {"field_frames", fastcall(field_frames), METH_FASTCALL,
     "field_frames(fields) -> int | (reason, detail)\n\n"
     "Frames of their own the header's field list declares, after checking every entry is "
     "[str, dtype, shape, bool]. Twin: wire._field_frames_py."},
    {"decode_fields", fastcall(decode_fields), METH_FASTCALL,
     "decode_fields(fields, views, dtypes, required, sample_id)\n"
     "    -> (arrays, n_required) | (reason, detail)\n\n"
     "Zero-copy arrays of every field after the dtype / shape / size / layout checks. "
     "Twin: wire._decode_fields_py."},
    {"pack_fields", fastcall(pack_fields), METH_FASTCALL,
     "pack_fields(arrays, wire_str, threshold) -> (fields, pack, own) | None\n\n"
     "Field specs, the pack (every array under `threshold` bytes, 8-byte aligned, zero padded) "
     "and the arrays sent in frames of their own; None when an array is not a C-contiguous "
     "ndarray of a dtype in `wire_str`. Twin: wire._pack_fields_py."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_dataplane_native",
                       "The data plane's per-message hot path (csrc/dataplane).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__dataplane_native(void) {
  if (wire_fields_init() != 0) return nullptr;
  return PyModule_Create(&kModule);
}
