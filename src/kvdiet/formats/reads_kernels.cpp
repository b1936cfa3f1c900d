// ModuleReads.holds' checks (kvdiet/model/module_reads.py) in C loops, in the translation unit fp4_kernels.cpp
// opens. A decode step checks every layer's binding once (StepBindings): on v4.1-mini some 4,700 dict reads,
// 840 settings, 520 classes and 960 hook dicts, cold after the last step's weights went through the caches. The
// Python form (all(map(...)) passes) took about 1.2 ms of a 19 ms 4K step there; these loops read the same
// objects, with the objects a few checks ahead read early (several misses in flight instead of one).
//
// Every result is the Python form's: dict.get(d, k) is PyDict_GetItemWithError (dict.get reads a dict subclass's
// storage as this does, never its __getitem__ or __missing__), == is PyObject_RichCompare then truth (no identity
// shortcut: a NaN setting never equals itself there either), a hook dict's truth is PyObject_IsTrue.

// The object at index i of list `items` (borrowed)
inline PyObject* item_at(PyObject* items, Py_ssize_t i) { return PyList_GET_ITEM(items, i); }

// d.get(key) as dict.get reads it (borrowed; Py_None where absent); throws where d is not a dict or the
// lookup raised (a key whose __eq__ raises)
inline PyObject* dict_get(PyObject* d, PyObject* key) {
  if (!PyDict_Check(d)) throw py::type_error("module reads: a recorded owner is not a dict");
  PyObject* got = PyDict_GetItemWithError(d, key);
  if (got == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return Py_None;
  }
  return got;
}

constexpr Py_ssize_t kAhead = 16;  // objects whose first line is read ahead of the one checked
constexpr Py_ssize_t kKeysAhead = 8;  // dicts whose key table (and values, when split) is read ahead

// The first line of object i + kAhead of `items` started
inline void prefetch_ahead(PyObject* items, Py_ssize_t n, Py_ssize_t i) {
  if (i + kAhead < n) __builtin_prefetch(item_at(items, i + kAhead));
}

// Where dict i + kKeysAhead of `dicts` (its header read ahead by prefetch_ahead) keeps its keys and values: their
// first lines started (a small dict's whole table: the index bytes and the entries beside them)
inline void prefetch_table_ahead(PyObject* dicts, Py_ssize_t n, Py_ssize_t i) {
  if (i + kKeysAhead >= n) return;
  PyObject* d = item_at(dicts, i + kKeysAhead);
  if (!PyDict_Check(d)) return;  // dict_get raises when it gets there
  const auto* dict = reinterpret_cast<const PyDictObject*>(d);
  const char* table = reinterpret_cast<const char*>(dict->ma_keys);
  __builtin_prefetch(table);
  __builtin_prefetch(table + 64);
  __builtin_prefetch(table + 128);
  if (dict->ma_values != nullptr) __builtin_prefetch(dict->ma_values);
}

// The lists' common length; throws unless every one is a list of that length
inline Py_ssize_t columns_length(std::initializer_list<PyObject*> columns) {
  Py_ssize_t n = -1;
  for (PyObject* c : columns) {
    if (!PyList_Check(c)) throw py::type_error("module reads: the columns must be lists");
    if (n >= 0 && PyList_GET_SIZE(c) != n) throw py::value_error("module reads: columns of different lengths");
    n = PyList_GET_SIZE(c);
  }
  return n;
}

// Whether no hook dict of `hooks` holds a hook, every object of `modules` is exactly of the class beside it in
// `classes`, every dicts[i].get(keys[i]) is objects[i] and every eq_dicts[i].get(eq_keys[i]) == eq_values[i]:
// ModuleReads.holds past its `overridden` and global-hook checks. Lists of equal length in each group.
// Raises: TypeError / ValueError for columns of another shape; what a key's comparison raises.
bool reads_hold(py::handle hooks, py::handle modules, py::handle classes, py::handle dicts, py::handle keys,
                py::handle objects, py::handle eq_dicts, py::handle eq_keys, py::handle eq_values) {
  PyObject *hk = hooks.ptr(), *mods = modules.ptr(), *cls = classes.ptr();
  PyObject *ds = dicts.ptr(), *ks = keys.ptr(), *os = objects.ptr();
  PyObject *eds = eq_dicts.ptr(), *eks = eq_keys.ptr(), *evs = eq_values.ptr();
  const Py_ssize_t nh = columns_length({hk}), nm = columns_length({mods, cls});
  const Py_ssize_t ns = columns_length({ds, ks, os});
  columns_length({eds, eks, evs});
  for (Py_ssize_t i = 0; i < nh; ++i) {
    prefetch_ahead(hk, nh, i);
    const int set = PyObject_IsTrue(item_at(hk, i));
    if (set < 0) throw py::error_already_set();
    if (set) return false;
  }
  for (Py_ssize_t i = 0; i < nm; ++i) {
    prefetch_ahead(mods, nm, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(item_at(mods, i))) != item_at(cls, i)) return false;
  }
  for (Py_ssize_t i = 0; i < ns; ++i) {
    prefetch_ahead(ds, ns, i);
    prefetch_table_ahead(ds, ns, i);
    if (dict_get(item_at(ds, i), item_at(ks, i)) != item_at(os, i)) return false;
  }
  // a setting's __eq__ runs Python code: both sides held while it runs, the lengths read again each time (a column
  // it shrank ends the loop)
  for (Py_ssize_t i = 0; i < std::min({PyList_GET_SIZE(eds), PyList_GET_SIZE(eks), PyList_GET_SIZE(evs)}); ++i) {
    prefetch_ahead(eds, PyList_GET_SIZE(eds), i);
    prefetch_table_ahead(eds, PyList_GET_SIZE(eds), i);
    const py::object got = py::reinterpret_borrow<py::object>(dict_get(item_at(eds, i), item_at(eks, i)));
    const py::object want = py::reinterpret_borrow<py::object>(item_at(evs, i));
    PyObject* same = PyObject_RichCompare(got.ptr(), want.ptr(), Py_EQ);
    if (same == nullptr) throw py::error_already_set();
    const int truth = PyObject_IsTrue(same);
    Py_DECREF(same);
    if (truth < 0) throw py::error_already_set();
    if (!truth) return false;
  }
  return true;
}

// Whether tensor i of `tensors` still has version counter stamps[2i] and data pointer stamps[2i + 1] (as
// Tensor._version and Tensor.data_ptr read them): StepBindings.holds' parameter check.
// Raises: TypeError where `tensors` is not a list of tensors or `stamps` not a list of twice its length of ints.
bool stamps_hold(py::handle tensors, py::handle stamps) {
  PyObject *ts = tensors.ptr(), *ss = stamps.ptr();
  if (!PyList_Check(ts) || !PyList_Check(ss) || PyList_GET_SIZE(ss) != 2 * PyList_GET_SIZE(ts)) {
    throw py::type_error("stamps: a list of tensors and a list of two ints for each");
  }
  const Py_ssize_t n = PyList_GET_SIZE(ts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_ahead(ts, n, i);
    PyObject* t = item_at(ts, i);
    if (!THPVariable_Check(t)) throw py::type_error("stamps: not a tensor");
    const at::Tensor& tensor = THPVariable_Unpack(t);
    const int64_t version = PyLong_AsLongLong(item_at(ss, 2 * i));
    const int64_t ptr = PyLong_AsLongLong(item_at(ss, 2 * i + 1));
    if (PyErr_Occurred()) throw py::error_already_set();
    if (tensor._version() != version || reinterpret_cast<int64_t>(tensor.data_ptr()) != ptr) return false;
  }
  return true;
}
