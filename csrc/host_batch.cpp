// sangam._host: the model runner's per-iteration host work in C++ (DESIGN.md §1, csrc/).
//
//   build(states, pages, page_size, arena) -> (fits, num_tokens, num_rows, width)
//       Plans every request's next step (DecodeState.plan) and packs the batch's arrays
//       (PackedBatch.from_plans) into the arena's preallocated arrays.
//   apply(states, tokens, conf, cand_positions, cu_rows, num_forced) -> list[bool]
//       Commits each request's scored rows (DecodeState.commit + select_commits), in place.
//
// The Python code named above (sangam/decoding/state.py, rules.py, noise.py and
// sangam/engine/host_batch.py) is the specification; this file mirrors it step for step, and
// tests/test_host_batch.py checks that the two agree array for array and state for state.
//
// Only the plain CPython C API is used (no pybind11, numpy or torch headers), so the extension
// builds with nothing but a compiler. Arrays are reached through the buffer protocol; Python
// owns every output array and this code only fills them, which keeps allocation out of C++.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "noise.h"
#include "rules.h"

namespace {

// Attribute names and values, interned once at import so lookups hit the string cache.
struct Names {
  PyObject *tokens, *params, *mask_token_id, *stop_ids, *shift, *seed, *prompt_len, *block,
      *step, *num_forwards, *finished, *finish_reason, *block_length, *cache, *temperature,
      *unmasking, *threshold, *factor, *tokens_per_step, *stop, *length, *confidence,
      *max_tokens, *refresh_interval, *prompt_refresh_interval, *force_refresh,
      *refresh_confidence, *min_threshold, *block_causal, *block_origin, *canvas_end,
      *prefilled, *chunk_end, *num_chunks;
};
Names names;

bool intern_names() {
  const struct {
    PyObject** slot;
    const char* text;
  } table[] = {
      {&names.tokens, "tokens"},
      {&names.params, "params"},
      {&names.mask_token_id, "mask_token_id"},
      {&names.stop_ids, "stop_ids"},
      {&names.shift, "shift"},
      {&names.seed, "seed"},
      {&names.prompt_len, "prompt_len"},
      {&names.block, "block"},
      {&names.step, "step"},
      {&names.num_forwards, "num_forwards"},
      {&names.finished, "finished"},
      {&names.finish_reason, "finish_reason"},
      {&names.block_length, "block_length"},
      {&names.cache, "cache"},
      {&names.temperature, "temperature"},
      {&names.unmasking, "unmasking"},
      {&names.threshold, "threshold"},
      {&names.factor, "factor"},
      {&names.tokens_per_step, "tokens_per_step"},
      {&names.stop, "stop"},
      {&names.length, "length"},
      {&names.confidence, "confidence"},
      {&names.max_tokens, "max_tokens"},
      {&names.refresh_interval, "refresh_interval"},
      {&names.prompt_refresh_interval, "prompt_refresh_interval"},
      {&names.force_refresh, "force_refresh"},
      {&names.refresh_confidence, "refresh_confidence"},
      {&names.min_threshold, "min_threshold"},
      {&names.block_causal, "block_causal"},
      {&names.block_origin, "block_origin"},
      {&names.canvas_end, "canvas_end"},
      {&names.prefilled, "prefilled"},
      {&names.chunk_end, "chunk_end"},
      {&names.num_chunks, "num_chunks"},
  };
  for (const auto& entry : table) {
    *entry.slot = PyUnicode_InternFromString(entry.text);
    if (*entry.slot == nullptr) return false;
  }
  return true;
}

// An owned reference, released on scope exit so every error path can simply return.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  void reset(PyObject* p) {
    Py_XDECREF(p_);
    p_ = p;
  }
  PyObject* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

// Whether a buffer format string names a native scalar of the wanted kind and size: numpy
// spells int64 'l' on Linux and 'q' on Windows, so any signed integer code of the right size
// is accepted for integers.
bool format_matches(const char* fmt, Py_ssize_t itemsize, bool integer, Py_ssize_t size) {
  if (fmt == nullptr) fmt = "B";
  if (*fmt == '@' || *fmt == '=') ++fmt;
  if (fmt[0] == '\0' || fmt[1] != '\0' || itemsize != size) return false;
  return integer ? std::strchr("bhilq", fmt[0]) != nullptr : fmt[0] == 'd';
}

template <typename T>
struct Element;
template <>
struct Element<int64_t> {
  static constexpr bool integer = true;
  static constexpr const char* name = "int64";
};
template <>
struct Element<int32_t> {
  static constexpr bool integer = true;
  static constexpr const char* name = "int32";
};
template <>
struct Element<double> {
  static constexpr bool integer = false;
  static constexpr const char* name = "float64";
};

// A C-contiguous 1-D view of a Python buffer of T, released on scope exit. Never copied or
// moved: some exporters point the buffer's shape into the Py_buffer struct itself.
template <typename T>
class Array {
 public:
  Array() = default;
  ~Array() {
    if (held_) PyBuffer_Release(&view_);
  }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;

  bool acquire(PyObject* obj, const char* what, bool writable) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) < 0) return false;
    held_ = true;
    if (!format_matches(view_.format, view_.itemsize, Element<T>::integer, sizeof(T))) {
      PyErr_Format(PyExc_TypeError, "%s: expected a contiguous %s array, got buffer format '%s'",
                   what, Element<T>::name, view_.format ? view_.format : "B");
      return false;
    }
    return true;
  }
  T* data() const { return static_cast<T*>(view_.buf); }
  int64_t size() const { return static_cast<int64_t>(view_.len / view_.itemsize); }
  T& operator[](int64_t i) const { return data()[i]; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// Attribute readers: false with a Python error set on failure. Integers go through
// PyLong_AsLongLong, which also takes numpy integers (via __index__).
bool attr_i64(PyObject* obj, PyObject* name, int64_t* out) {
  Ref v(PyObject_GetAttr(obj, name));
  if (!v) return false;
  const long long x = PyLong_AsLongLong(v.get());
  if (x == -1 && PyErr_Occurred()) return false;
  *out = x;
  return true;
}

bool attr_f64(PyObject* obj, PyObject* name, double* out) {
  Ref v(PyObject_GetAttr(obj, name));
  if (!v) return false;
  const double x = PyFloat_AsDouble(v.get());
  if (x == -1.0 && PyErr_Occurred()) return false;
  *out = x;
  return true;
}

bool attr_truth(PyObject* obj, PyObject* name, bool* out) {
  Ref v(PyObject_GetAttr(obj, name));
  if (!v) return false;
  const int t = PyObject_IsTrue(v.get());
  if (t < 0) return false;
  *out = t != 0;
  return true;
}

// `value == text` for a str attribute value (anything else compares unequal, as in Python).
bool str_equals(PyObject* value, const char* text) {
  return PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, text) == 0;
}

bool set_attr_i64(PyObject* obj, PyObject* name, int64_t value) {
  Ref v(PyLong_FromLongLong(value));
  return v && PyObject_SetAttr(obj, name, v.get()) == 0;
}

// ---------------------------------------------------------------------------------------------
// build

// One request's step plan (DecodeState.plan), plus what packing it needs.
struct Plan {
  Array<int64_t> tokens;       // the canvas: prompt + response, MASK where not yet committed
  Ref pages;                   // the request's page list, as a PySequence_Fast
  int64_t total_len = 0;       // T
  int64_t mask = 0;            // the mask token id
  int64_t shift = 0;           // Dream: position p is predicted by hidden row p - 1
  int64_t s = 0, e = 0;        // the current block [s, e)
  int64_t start = 0, end = 0;  // the span fed to the model
  int64_t kv_len = 0;          // keys attended: T (block-causal: the span's end)
  bool chunk = false;          // a block-causal prefill chunk: it stores K/V, scores no row
  int64_t num_forced = 0;      // Dream's refresh commits position s regardless of the rule
  int64_t num_rows = 0;        // forced rows + rule candidates
  double temperature = 0.0;
  uint32_t key = 0;            // the step's noise key (only drawn when temperature > 0)
};

// DecodeState.span() of a block-causal request: its prompt's K/V (what is left of it, or a
// chunk of it) with block 0's first step, a later block's first step over [s - B, e), and
// the block's other steps over [s, e); keys up to the span's end.
bool block_causal_span(PyObject* st, Plan* p, int64_t block, int64_t step, int64_t block_length,
                       bool force_refresh) {
  if (step > 0) {
    p->start = p->s, p->end = p->e;
  } else if (block == 0 || force_refresh) {
    int64_t prefilled = 0;
    if (!force_refresh && !attr_i64(st, names.prefilled, &prefilled)) return false;
    Ref chunk_end(PyObject_GetAttr(st, names.chunk_end));
    if (!chunk_end) return false;
    p->start = prefilled, p->end = p->e;
    if (chunk_end.get() != Py_None) {
      const long long end = PyLong_AsLongLong(chunk_end.get());
      if (end == -1 && PyErr_Occurred()) return false;
      p->end = end;
    }
    p->chunk = p->end <= p->s;
  } else {
    p->start = p->s - block_length, p->end = p->e;
  }
  if (p->start < 0 || p->end <= p->start || p->end > p->total_len) {
    PyErr_Format(PyExc_ValueError, "DecodeState: span [%lld, %lld) outside its canvas of %lld",
                 static_cast<long long>(p->start), static_cast<long long>(p->end),
                 static_cast<long long>(p->total_len));
    return false;
  }
  p->kv_len = p->end;
  return true;
}

bool read_plan(PyObject* st, PyObject* page_list, Plan* p) {
  Ref tokens(PyObject_GetAttr(st, names.tokens));
  if (!tokens || !p->tokens.acquire(tokens.get(), "DecodeState.tokens", false)) return false;
  Ref params(PyObject_GetAttr(st, names.params));
  if (!params) return false;
  Ref cache(PyObject_GetAttr(params.get(), names.cache));
  if (!cache) return false;
  const bool cache_none = str_equals(cache.get(), "none");
  const bool cache_dual = str_equals(cache.get(), "dual");
  int64_t block_length, prompt_len, block, step, refresh_interval, prompt_refresh_interval,
      origin;
  bool shift, force_refresh, block_causal;
  if (!attr_i64(params.get(), names.block_length, &block_length) ||
      !attr_truth(st, names.block_causal, &block_causal) ||
      !attr_i64(st, names.block_origin, &origin) ||
      !attr_f64(params.get(), names.temperature, &p->temperature) ||
      !attr_i64(params.get(), names.refresh_interval, &refresh_interval) ||
      !attr_i64(params.get(), names.prompt_refresh_interval, &prompt_refresh_interval) ||
      !attr_i64(st, names.mask_token_id, &p->mask) || !attr_truth(st, names.shift, &shift) ||
      !attr_i64(st, names.prompt_len, &prompt_len) || !attr_i64(st, names.block, &block) ||
      !attr_i64(st, names.step, &step) || !attr_truth(st, names.force_refresh, &force_refresh)) {
    return false;
  }
  const int64_t T = p->tokens.size();
  p->total_len = T;
  p->shift = shift ? 1 : 0;
  p->s = origin + block * block_length;  // block_bounds
  p->e = p->s + block_length;
  if (p->s < 0 || p->e <= p->s || p->e > T || refresh_interval < 1 ||
      prompt_refresh_interval < 1) {
    PyErr_Format(PyExc_ValueError,
                 "DecodeState: block [%lld, %lld) lies outside its canvas of %lld, or a refresh "
                 "interval is below 1",
                 static_cast<long long>(p->s), static_cast<long long>(p->e),
                 static_cast<long long>(T));
    return false;
  }
  // span(): a block's first step follows the refresh cadence (SamplingParams.block_refresh,
  // both intervals at most 2**31 - 1, so their product fits), or refreshes fully when the
  // cache was lost.
  const bool first = step == 0 || cache_none;
  p->kv_len = T;
  if (block_causal) {  // the cache is exact: nothing after a block ever attends to it
    if (!block_causal_span(st, p, block, step, block_length, force_refresh)) return false;
  } else if (cache_none ||
      (step == 0 && (force_refresh || block % (refresh_interval * prompt_refresh_interval) == 0))) {
    p->start = 0, p->end = T;  // a full refresh
  } else if (step == 0 && block % refresh_interval == 0) {
    p->start = prompt_len, p->end = T;  // a response-only refresh
  } else {  // a cached step; the block's first reaches back to s - 1 with shifted logits
    p->start = p->s - (step == 0 ? p->shift : 0), p->end = cache_dual ? p->e : T;
  }
  // Candidates: masked positions of the block. No row predicts s in a shifted model's later
  // cached steps, so there s is dropped; a block's first step commits it outright if masked.
  const int64_t* tok = p->tokens.data();
  p->num_forced = (shift && first && tok[p->s] == p->mask) ? 1 : 0;
  int64_t masked = 0;
  for (int64_t i = p->s + p->shift; i < p->e && !p->chunk; ++i) masked += tok[i] == p->mask;
  p->num_rows = p->num_forced + masked;
  if (p->temperature > 0) {  // greedy steps draw no noise
    Ref seed(PyObject_GetAttr(st, names.seed));
    if (!seed) return false;
    const unsigned long long sd = PyLong_AsUnsignedLongLongMask(seed.get());
    if (sd == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
    p->key = sangam::noise_key(sd, static_cast<uint64_t>(block), static_cast<uint64_t>(step));
  }
  p->pages.reset(PySequence_Fast(page_list, "pages: each request's pages must be a sequence"));
  return static_cast<bool>(p->pages);
}

// The arena's arrays, in the order build() takes them (sangam/engine/host_batch.py: _FIELDS).
struct Arena {
  Array<int64_t> input_ids, positions, slot_mapping;  // [num_tokens]
  Array<int32_t> block_tables;                        // [n * width]
  Array<int32_t> cu_seqlens_q;                        // [n + 1]
  Array<int32_t> kv_lens;                             // [n]
  Array<int64_t> logits_indices;                      // [num_rows]
  Array<int64_t> cu_rows;                             // [n + 1]
  Array<int64_t> row_keys;                            // [num_rows]
  Array<double> temperatures;                         // [num_rows]
  Array<int64_t> cand_positions;                      // [num_rows]
  Array<int64_t> num_forced;                          // [n]
  static constexpr Py_ssize_t kCount = 12;

  bool acquire(PyObject* arrays) {
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) != kCount) {
      PyErr_SetString(PyExc_TypeError, "arena: expected a tuple of 12 arrays");
      return false;
    }
    PyObject* const* a = &PyTuple_GET_ITEM(arrays, 0);
    return input_ids.acquire(a[0], "input_ids", true) &&
           positions.acquire(a[1], "positions", true) &&
           slot_mapping.acquire(a[2], "slot_mapping", true) &&
           block_tables.acquire(a[3], "block_tables", true) &&
           cu_seqlens_q.acquire(a[4], "cu_seqlens_q", true) &&
           kv_lens.acquire(a[5], "kv_lens", true) &&
           logits_indices.acquire(a[6], "logits_indices", true) &&
           cu_rows.acquire(a[7], "cu_rows", true) && row_keys.acquire(a[8], "row_keys", true) &&
           temperatures.acquire(a[9], "temperatures", true) &&
           cand_positions.acquire(a[10], "cand_positions", true) &&
           num_forced.acquire(a[11], "num_forced", true);
  }

  bool fits(int64_t n, int64_t num_tokens, int64_t num_rows, int64_t width) const {
    return input_ids.size() >= num_tokens && positions.size() >= num_tokens &&
           slot_mapping.size() >= num_tokens && block_tables.size() >= n * width &&
           cu_seqlens_q.size() >= n + 1 && kv_lens.size() >= n &&
           logits_indices.size() >= num_rows && cu_rows.size() >= n + 1 &&
           row_keys.size() >= num_rows && temperatures.size() >= num_rows &&
           cand_positions.size() >= num_rows && num_forced.size() >= n;
  }
};

// Packs request r: its block-table row (zero-padded to `width`), its span's tokens, positions
// and K/V slots at `tok_off`, and its logits rows at `row_off`.
bool pack_one(const Plan& p, int64_t r, int64_t width, int64_t page_size, int64_t tok_off,
              int64_t row_off, const Arena& out) {
  const Py_ssize_t num_pages = PySequence_Fast_GET_SIZE(p.pages.get());
  PyObject** items = PySequence_Fast_ITEMS(p.pages.get());
  int32_t* table = out.block_tables.data() + r * width;
  for (Py_ssize_t j = 0; j < num_pages; ++j) {
    const long long page = PyLong_AsLongLong(items[j]);
    if (page == -1 && PyErr_Occurred()) return false;
    if (page < INT32_MIN || page > INT32_MAX) {
      PyErr_Format(PyExc_OverflowError, "page id %lld does not fit block_tables (int32)", page);
      return false;
    }
    table[j] = static_cast<int32_t>(page);
  }
  for (int64_t j = num_pages; j < width; ++j) table[j] = 0;

  const int64_t* tok = p.tokens.data();
  // (page_index, offset) = divmod(pos, page_size), stepped along the span: a 64-bit division
  // per token was the loop's main cost.
  int64_t page_index = p.start / page_size, offset = p.start % page_size;
  for (int64_t pos = p.start; pos < p.end; ++pos) {
    const int64_t i = tok_off + pos - p.start;
    if (page_index >= num_pages) {
      PyErr_Format(PyExc_IndexError, "position %lld needs page %lld, but the request holds %zd",
                   static_cast<long long>(pos), static_cast<long long>(page_index), num_pages);
      return false;
    }
    out.positions[i] = pos;
    out.input_ids[i] = tok[pos];
    out.slot_mapping[i] = static_cast<int64_t>(table[page_index]) * page_size + offset;
    if (++offset == page_size) {
      offset = 0;
      ++page_index;
    }
  }
  out.cu_seqlens_q[r + 1] = static_cast<int32_t>(tok_off + p.end - p.start);
  out.kv_lens[r] = static_cast<int32_t>(p.kv_len);

  // Rows: the forced position first, then the rule's candidates in position order.
  int64_t i = row_off;
  const auto add_row = [&](int64_t pos) {
    out.cand_positions[i] = pos;
    out.logits_indices[i] = tok_off + pos - p.start - p.shift;
    out.row_keys[i] = p.temperature > 0 ? sangam::row_key(p.key, pos - p.s) : 0;
    out.temperatures[i] = p.temperature;
    ++i;
  };
  if (p.num_forced) add_row(p.s);
  for (int64_t pos = p.s + p.shift; pos < p.e && !p.chunk; ++pos) {
    if (tok[pos] == p.mask) add_row(pos);
  }
  out.cu_rows[r + 1] = i;
  out.num_forced[r] = p.num_forced;
  return true;
}

PyObject* build(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "build(states, pages, page_size, arena)");
    return nullptr;
  }
  Ref states(PySequence_Fast(args[0], "states must be a sequence"));
  Ref pages(states ? PySequence_Fast(args[1], "pages must be a sequence") : nullptr);
  if (!pages) return nullptr;
  const long long page_size = PyLong_AsLongLong(args[2]);
  if (page_size == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(states.get());
  if (n == 0 || PySequence_Fast_GET_SIZE(pages.get()) != n || page_size < 1) {
    PyErr_SetString(PyExc_ValueError,
                    "build: needs at least one request, one page list per request, and "
                    "page_size >= 1");
    return nullptr;
  }
  Arena out;
  if (!out.acquire(args[3])) return nullptr;

  // Pass 1: plan every request and size the batch.
  std::vector<Plan> plans(static_cast<size_t>(n));
  int64_t num_tokens = 0, num_rows = 0, width = 0;
  for (Py_ssize_t r = 0; r < n; ++r) {
    Plan& p = plans[static_cast<size_t>(r)];
    if (!read_plan(PySequence_Fast_GET_ITEM(states.get(), r),
                   PySequence_Fast_GET_ITEM(pages.get(), r), &p)) {
      return nullptr;
    }
    num_tokens += p.end - p.start;
    num_rows += p.num_rows;
    width = std::max<int64_t>(width, PySequence_Fast_GET_SIZE(p.pages.get()));
  }
  if (num_tokens > INT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "build: the batch has more tokens than int32 holds");
    return nullptr;
  }
  // Pass 2: pack, unless the arena is too small; the caller then grows it and calls again.
  const bool fits = out.fits(n, num_tokens, num_rows, width);
  if (fits) {
    out.cu_seqlens_q[0] = 0;
    out.cu_rows[0] = 0;
    for (Py_ssize_t r = 0; r < n; ++r) {
      if (!pack_one(plans[static_cast<size_t>(r)], r, width, page_size, out.cu_seqlens_q[r],
                    out.cu_rows[r], out)) {
        return nullptr;
      }
    }
  }
  return Py_BuildValue("(OLLL)", fits ? Py_True : Py_False, static_cast<long long>(num_tokens),
                       static_cast<long long>(num_rows), static_cast<long long>(width));
}

// ---------------------------------------------------------------------------------------------
// apply

// Whether tokens[from, to) holds any of the request's stop ids (np.isin(...).any()).
bool holds_stop_id(PyObject* st, const int64_t* tokens, int64_t from, int64_t to, bool* out) {
  Ref stop_ids(PyObject_GetAttr(st, names.stop_ids));
  Ref it(stop_ids ? PyObject_GetIter(stop_ids.get()) : nullptr);
  if (!it) return false;
  std::vector<int64_t> ids;
  while (PyObject* item = PyIter_Next(it.get())) {
    int overflow = 0;
    const long long id = PyLong_AsLongLongAndOverflow(item, &overflow);
    Py_DECREF(item);
    if (id == -1 && PyErr_Occurred()) return false;
    if (!overflow) ids.push_back(id);  // an id beyond int64 matches no token
  }
  if (PyErr_Occurred()) return false;
  *out = false;
  for (int64_t i = from; i < to && !*out; ++i) {
    for (const int64_t id : ids) {
      if (tokens[i] == id) *out = true;
    }
  }
  return true;
}

// One request's commit (DecodeState.commit): writes the forced rows and the rule's choice among
// the rest into the canvas, advances step / block, and sets *block_done.
// DecodeState.threshold: the request's own, read from its params, unless it is load-adaptive
// (min_threshold set): then the current block's, through the property (per block, set_load).
bool block_threshold(PyObject* st, PyObject* params, double* out) {
  Ref floor(PyObject_GetAttr(params, names.min_threshold));
  if (!floor) return false;
  return attr_f64(floor.get() == Py_None ? params : st, names.threshold, out);
}

bool commit_one(PyObject* st, const int64_t* cand, const int64_t* tok, const double* conf,
                int64_t num_rows, int64_t num_forced, std::vector<int64_t>& order,
                std::vector<uint8_t>& chosen, bool* block_done) {
  *block_done = false;
  Ref chunk_end(PyObject_GetAttr(st, names.chunk_end));
  if (!chunk_end) return false;
  if (chunk_end.get() != Py_None) {  // the forward was a block-causal prefill chunk (no rows)
    int64_t chunks, forwards;
    return attr_i64(st, names.num_chunks, &chunks) &&
           attr_i64(st, names.num_forwards, &forwards) &&
           PyObject_SetAttr(st, names.prefilled, chunk_end.get()) == 0 &&
           PyObject_SetAttr(st, names.chunk_end, Py_None) == 0 &&
           set_attr_i64(st, names.num_chunks, chunks + 1) &&
           set_attr_i64(st, names.num_forwards, forwards + 1);
  }
  Ref tokens(PyObject_GetAttr(st, names.tokens));
  Array<int64_t> canvas;
  if (!tokens || !canvas.acquire(tokens.get(), "DecodeState.tokens", true)) return false;
  Ref params(PyObject_GetAttr(st, names.params));
  if (!params) return false;
  Ref unmasking(PyObject_GetAttr(params.get(), names.unmasking));
  if (!unmasking) return false;
  const sangam::Rule rule = str_equals(unmasking.get(), "threshold") ? sangam::Rule::kThreshold
                            : str_equals(unmasking.get(), "factor")  ? sangam::Rule::kFactor
                            : str_equals(unmasking.get(), "topk")    ? sangam::Rule::kTopk
                                                                     : sangam::Rule::kUnknown;
  int64_t mask, prompt_len, block, step, num_forwards, block_length, tokens_per_step, origin,
      canvas_end;
  double threshold = 0.0, factor = 0.0;
  if (!attr_i64(params.get(), names.block_length, &block_length) ||
      !attr_i64(st, names.block_origin, &origin) ||
      !attr_i64(st, names.canvas_end, &canvas_end) ||
      !block_threshold(st, params.get(), &threshold) ||
      !attr_f64(params.get(), names.factor, &factor) ||
      !attr_i64(params.get(), names.tokens_per_step, &tokens_per_step) ||
      !attr_i64(st, names.mask_token_id, &mask) || !attr_i64(st, names.prompt_len, &prompt_len) ||
      !attr_i64(st, names.block, &block) || !attr_i64(st, names.step, &step) ||
      !attr_i64(st, names.num_forwards, &num_forwards)) {
    return false;
  }
  if (block_length < 1) {  // SamplingParams forbids it; checked so the division below is safe
    PyErr_SetString(PyExc_ValueError, "SamplingParams: block_length must be >= 1");
    return false;
  }
  const int64_t num_cands = num_rows - num_forced;
  if (rule == sangam::Rule::kUnknown && num_cands > 0) {  // select_commits raises only then
    PyErr_Format(PyExc_ValueError, "unknown unmasking rule %R", unmasking.get());
    return false;
  }
  chosen.resize(static_cast<size_t>(num_rows));
  std::fill(chosen.begin(), chosen.begin() + num_forced, uint8_t{1});
  sangam::select_commits(conf + num_forced, num_cands, rule, threshold, factor, tokens_per_step,
                         order, chosen.data() + num_forced);
  const int64_t T = canvas.size();
  Ref confidence(PyObject_GetAttr(st, names.confidence));
  Array<double> committed_conf;  // each position's confidence when it was committed
  if (!confidence ||
      !committed_conf.acquire(confidence.get(), "DecodeState.confidence", true)) {
    return false;
  }
  if (committed_conf.size() != T) {
    PyErr_SetString(PyExc_ValueError, "DecodeState.confidence must be as long as its tokens");
    return false;
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    if (!chosen[static_cast<size_t>(i)]) continue;
    if (cand[i] < 0 || cand[i] >= T) {
      PyErr_Format(PyExc_IndexError, "candidate position %lld is outside a canvas of %lld",
                   static_cast<long long>(cand[i]), static_cast<long long>(T));
      return false;
    }
    canvas[cand[i]] = tok[i];
    committed_conf[cand[i]] = conf[i];
  }
  if (!set_attr_i64(st, names.step, step + 1) ||
      !set_attr_i64(st, names.num_forwards, num_forwards + 1) ||
      PyObject_SetAttr(st, names.force_refresh, Py_False) != 0) {
    return false;
  }
  // block_bounds, clamped to the canvas as Python's slice tokens[s:e] would be.
  const int64_t s = std::clamp<int64_t>(origin + block * block_length, 0, T);
  const int64_t e = std::clamp<int64_t>(s + block_length, 0, T);
  *block_done = true;
  for (int64_t i = s; i < e && *block_done; ++i) *block_done = canvas[i] != mask;
  if (!*block_done) return true;
  bool stopped = false;
  int64_t max_tokens;
  if (!attr_i64(params.get(), names.max_tokens, &max_tokens)) return false;
  // stop_ids already reflects stop_at_eos (and holds the request's stop_token_ids). A stop id
  // beyond max_tokens (the last block's padding) is no stop.
  const int64_t from = std::clamp<int64_t>(prompt_len, 0, e);
  const int64_t to = std::clamp<int64_t>(prompt_len + max_tokens, from, e);
  if (!holds_stop_id(st, canvas.data(), from, to, &stopped)) return false;
  // DecodeState.num_blocks: from block 0's start to the canvas's end (a suffix may follow).
  const bool last = block + 1 == (canvas_end - origin) / block_length;
  if (stopped || last) {
    return PyObject_SetAttr(st, names.finished, Py_True) == 0 &&
           PyObject_SetAttr(st, names.finish_reason, stopped ? names.stop : names.length) == 0;
  }
  if (!set_attr_i64(st, names.block, block + 1) || !set_attr_i64(st, names.step, 0)) return false;
  // Adaptive refresh (DecodeState.commit): the next block refreshes fully when the cadence
  // starts it from cache and this block committed a token below refresh_confidence.
  double refresh_confidence;
  int64_t refresh_interval, prompt_refresh_interval;
  if (!attr_f64(params.get(), names.refresh_confidence, &refresh_confidence) ||
      !attr_i64(params.get(), names.refresh_interval, &refresh_interval) ||
      !attr_i64(params.get(), names.prompt_refresh_interval, &prompt_refresh_interval)) {
    return false;
  }
  bool force = false;
  if (refresh_confidence > 0 && refresh_interval >= 1 && prompt_refresh_interval >= 1 &&
      (block + 1) % (refresh_interval * prompt_refresh_interval) != 0) {
    for (int64_t i = s; i < e && !force; ++i) force = committed_conf[i] < refresh_confidence;
  }
  return PyObject_SetAttr(st, names.force_refresh, force ? Py_True : Py_False) == 0;
}

PyObject* apply(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "apply(states, tokens, conf, cand_positions, cu_rows, num_forced)");
    return nullptr;
  }
  Ref states(PySequence_Fast(args[0], "states must be a sequence"));
  if (!states) return nullptr;
  Array<int64_t> tokens, cand, cu_rows, num_forced;
  Array<double> conf;
  if (!tokens.acquire(args[1], "tokens", false) || !conf.acquire(args[2], "conf", false) ||
      !cand.acquire(args[3], "cand_positions", false) ||
      !cu_rows.acquire(args[4], "cu_rows", false) ||
      !num_forced.acquire(args[5], "num_forced", false)) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(states.get());
  if (cu_rows.size() < n + 1 || num_forced.size() < n) {
    PyErr_SetString(PyExc_ValueError, "apply: cu_rows / num_forced are shorter than the batch");
    return nullptr;
  }
  const int64_t num_rows = cu_rows[n];
  if (tokens.size() < num_rows || conf.size() < num_rows || cand.size() < num_rows) {
    PyErr_SetString(PyExc_ValueError, "apply: fewer scored rows than the batch has");
    return nullptr;
  }
  Ref done(PyList_New(n));
  if (!done) return nullptr;
  std::vector<int64_t> order;
  std::vector<uint8_t> chosen;
  for (Py_ssize_t r = 0; r < n; ++r) {
    const int64_t a = cu_rows[r], b = cu_rows[r + 1], k = num_forced[r];
    if (a < 0 || b < a || b > num_rows || k < 0 || k > b - a) {
      PyErr_SetString(PyExc_ValueError, "apply: inconsistent cu_rows / num_forced");
      return nullptr;
    }
    bool block_done = false;
    if (!commit_one(PySequence_Fast_GET_ITEM(states.get(), r), cand.data() + a,
                    tokens.data() + a, conf.data() + a, b - a, k, order, chosen, &block_done)) {
      return nullptr;
    }
    PyObject* flag = block_done ? Py_True : Py_False;
    Py_INCREF(flag);
    PyList_SET_ITEM(done.get(), r, flag);
  }
  PyObject* result = done.get();
  Py_INCREF(result);
  return result;
}

PyMethodDef methods[] = {
    {"build", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(build)), METH_FASTCALL,
     "build(states, pages, page_size, arena) -> (fits, num_tokens, num_rows, width)\n\n"
     "Plan each DecodeState's next step and pack the batch into the arena's arrays; when they\n"
     "are too small nothing is written and fits is False."},
    {"apply", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(apply)), METH_FASTCALL,
     "apply(states, tokens, conf, cand_positions, cu_rows, num_forced) -> list[bool]\n\n"
     "Commit each request's scored rows in place; returns whether each completed its block."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_host",
    "The model runner's per-iteration host work in C++ (see sangam/engine/host_batch.py).",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__host(void) {
  if (!intern_names()) return nullptr;
  return PyModule_Create(&module_def);
}
