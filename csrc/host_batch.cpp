// sangam._host: the model runner's per-iteration host work in C++ (docs/design.md §1, csrc/).
//
//   configure(layout) -> None
//       Learns where each field lives in a request's records (the field lists are defined once,
//       in Python: BlockCursor's CURSOR_FIELDS, DecodeState's DECODE_FIELDS, ...). Called once,
//       at import, by sangam/engine/host_batch.py.
//   build(requests, pages, page_size, arena) -> (fits, num_tokens, num_rows, width)
//       Plans every request's next step (MaskedDiffusion.plan, BlockCursor.span: every family
//       Sangam serves plans so) and packs the batch's arrays (PackedBatch.from_plans) into the
//       arena's preallocated arrays.
//   apply(requests, tokens, conf, cand_positions, cu_rows, num_forced, num_editable)
//       -> (list[bool], dict[int, Exception])
//       Commits each request's scored rows (MaskedDiffusion.commit with the Unmasking selector
//       and Editing, sangam/decoding/family.py), in place, moving its cursor; leaves the
//       requests whose family it does not mirror (host_commits 0) to Python. Returns whether
//       each one's block ended, and the error of each one whose commit failed (the others
//       commit all the same).
//
// A request is its DecodeState.host_buffers: a tuple of buffers (its cursor's record, the
// decoder's integer and float records, its tokens, confidences, block thresholds and stop ids),
// in HOST_BUFFERS order. No attribute is read by name: the records' layouts come from
// configure(). The Python code named above is the specification; this file mirrors it step for
// step, and tests/test_host_batch.py checks that the two agree array for array and state for
// state.
//
// Only the plain CPython C API is used (no pybind11, numpy or torch headers), so the extension
// builds with nothing but a compiler. Python owns every array and this code only fills them.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "noise.h"
#include "rules.h"

namespace {

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

// ---------------------------------------------------------------------------------------------
// The records' layout, from configure().

struct CursorLayout {
  int64_t prompt_len, total_len, block_length, block_origin, num_blocks, canvas_end, cache,
      refresh_interval, prompt_refresh_interval, shift, block_causal, block, step,
      force_refresh, prefilled, chunk_end;
};
struct DecodeLayout {
  int64_t mask_token_id, seed, rule, tokens_per_step, max_tokens, max_post_steps, host_commits,
      num_forwards, num_chunks, finished, finish_reason, post_steps;
};
struct FloatLayout {
  int64_t temperature, factor, refresh_confidence, edit_threshold;
};
struct Buffers {  // positions in DecodeState.host_buffers
  int64_t cursor, record, floats, tokens, confidence, thresholds, stop_ids, count;
};
struct Codes {  // values of enumerated fields
  int64_t cache_dual, cache_prefix, cache_none, rule_threshold, rule_factor, rule_topk,
      finish_stop, finish_length;
};
struct Layout {
  CursorLayout c;
  DecodeLayout d;
  FloatLayout f;
  Buffers b;
  Codes code;
  int64_t cursor_len = 0, record_len = 0, floats_len = 0;  // the records' field counts
  bool configured = false;
};
Layout layout;

// The index of `name` in the sequence `names`; false with an error if it is not there.
bool index_of(PyObject* names, const char* name, int64_t* out) {
  Ref seq(PySequence_Fast(names, "configure: field lists must be sequences"));
  if (!seq) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.get(), i);
    if (PyUnicode_Check(item) && PyUnicode_CompareWithASCIIString(item, name) == 0) {
      *out = i;
      return true;
    }
  }
  PyErr_Format(PyExc_KeyError, "configure: no field %s", name);
  return false;
}

// configure(layout): layout is a dict of field lists: "cursor", "decode", "floats",
// "buffers", "cache_modes", "rules" and "finish_reasons" (each a sequence of names; a rule's
// code is its position in "rules").
PyObject* configure(PyObject*, PyObject* arg) {
  if (!PyDict_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "configure(layout): layout must be a dict");
    return nullptr;
  }
  const auto list = [&](const char* key) -> PyObject* {
    PyObject* v = PyDict_GetItemString(arg, key);  // borrowed
    if (v == nullptr) PyErr_Format(PyExc_KeyError, "configure: layout has no %s", key);
    return v;
  };
  PyObject *cursor = list("cursor"), *decode = list("decode"), *floats = list("floats"),
           *buffers = list("buffers"), *cache = list("cache_modes"), *rules = list("rules"),
           *reasons = list("finish_reasons");
  if (!cursor || !decode || !floats || !buffers || !cache || !rules || !reasons) return nullptr;
  Layout l;
  CursorLayout& c = l.c;
  DecodeLayout& d = l.d;
  const bool ok =
      index_of(cursor, "prompt_len", &c.prompt_len) &&
      index_of(cursor, "total_len", &c.total_len) &&
      index_of(cursor, "block_length", &c.block_length) &&
      index_of(cursor, "block_origin", &c.block_origin) &&
      index_of(cursor, "num_blocks", &c.num_blocks) &&
      index_of(cursor, "canvas_end", &c.canvas_end) && index_of(cursor, "cache", &c.cache) &&
      index_of(cursor, "refresh_interval", &c.refresh_interval) &&
      index_of(cursor, "prompt_refresh_interval", &c.prompt_refresh_interval) &&
      index_of(cursor, "shift", &c.shift) && index_of(cursor, "block_causal", &c.block_causal) &&
      index_of(cursor, "block", &c.block) && index_of(cursor, "step", &c.step) &&
      index_of(cursor, "force_refresh", &c.force_refresh) &&
      index_of(cursor, "prefilled", &c.prefilled) &&
      index_of(cursor, "chunk_end", &c.chunk_end) &&
      index_of(decode, "mask_token_id", &d.mask_token_id) && index_of(decode, "seed", &d.seed) &&
      index_of(decode, "rule", &d.rule) &&
      index_of(decode, "tokens_per_step", &d.tokens_per_step) &&
      index_of(decode, "max_tokens", &d.max_tokens) &&
      index_of(decode, "max_post_steps", &d.max_post_steps) &&
      index_of(decode, "post_steps", &d.post_steps) &&
      index_of(decode, "host_commits", &d.host_commits) &&
      index_of(decode, "num_forwards", &d.num_forwards) &&
      index_of(decode, "num_chunks", &d.num_chunks) &&
      index_of(decode, "finished", &d.finished) &&
      index_of(decode, "finish_reason", &d.finish_reason) &&
      index_of(floats, "temperature", &l.f.temperature) &&
      index_of(floats, "factor", &l.f.factor) &&
      index_of(floats, "refresh_confidence", &l.f.refresh_confidence) &&
      index_of(floats, "edit_threshold", &l.f.edit_threshold) &&
      index_of(buffers, "cursor", &l.b.cursor) && index_of(buffers, "record", &l.b.record) &&
      index_of(buffers, "floats", &l.b.floats) && index_of(buffers, "tokens", &l.b.tokens) &&
      index_of(buffers, "confidence", &l.b.confidence) &&
      index_of(buffers, "block_thresholds", &l.b.thresholds) &&
      index_of(buffers, "stop_ids", &l.b.stop_ids) &&
      index_of(cache, "dual", &l.code.cache_dual) &&
      index_of(cache, "prefix", &l.code.cache_prefix) &&
      index_of(cache, "none", &l.code.cache_none) &&
      index_of(rules, "threshold", &l.code.rule_threshold) &&
      index_of(rules, "factor", &l.code.rule_factor) &&
      index_of(rules, "topk", &l.code.rule_topk) &&
      index_of(reasons, "stop", &l.code.finish_stop) &&
      index_of(reasons, "length", &l.code.finish_length);
  if (!ok) return nullptr;
  l.b.count = PySequence_Size(buffers);
  l.cursor_len = PySequence_Size(cursor);
  l.record_len = PySequence_Size(decode);
  l.floats_len = PySequence_Size(floats);
  if (l.b.count < 0 || l.cursor_len < 0 || l.record_len < 0 || l.floats_len < 0) return nullptr;
  l.configured = true;
  layout = l;
  Py_RETURN_NONE;
}

// One request's buffers (DecodeState.host_buffers), acquired for the duration of a call.
struct Request {
  Array<int64_t> cursor, record, tokens, stop_ids;
  Array<double> floats, confidence, thresholds;

  // `writable`: apply() writes the cursor, the counters, the tokens and the confidences.
  bool acquire(PyObject* buffers, bool writable) {
    if (!layout.configured) {
      PyErr_SetString(PyExc_RuntimeError, "sangam._host: configure() was not called");
      return false;
    }
    if (!PyTuple_Check(buffers) || PyTuple_GET_SIZE(buffers) != layout.b.count) {
      PyErr_SetString(PyExc_TypeError, "a request is its DecodeState.host_buffers tuple");
      return false;
    }
    PyObject* const* a = &PyTuple_GET_ITEM(buffers, 0);
    const Buffers& b = layout.b;
    if (!cursor.acquire(a[b.cursor], "cursor record", writable) ||
        !record.acquire(a[b.record], "decode record", writable) ||
        !floats.acquire(a[b.floats], "decode floats", false) ||
        !tokens.acquire(a[b.tokens], "DecodeState.tokens", writable)) {
      return false;
    }
    if (writable && (!confidence.acquire(a[b.confidence], "DecodeState.confidence", true) ||
                     !thresholds.acquire(a[b.thresholds], "block_thresholds", false) ||
                     !stop_ids.acquire(a[b.stop_ids], "stop ids", false))) {
      return false;
    }
    if (cursor.size() != layout.cursor_len || record.size() != layout.record_len ||
        floats.size() != layout.floats_len) {
      PyErr_SetString(PyExc_ValueError, "a request's records do not match their layout");
      return false;
    }
    return true;
  }
  int64_t& at(int64_t field) const { return cursor[field]; }
};

// ---------------------------------------------------------------------------------------------
// build

// One request's step plan (DecodeState.plan), plus what packing it needs.
struct Plan {
  Request req;
  Ref pages;                   // the request's page list, as a PySequence_Fast
  int64_t total_len = 0;       // T
  int64_t mask = 0;            // the mask token id
  int64_t shift = 0;           // Dream: position p is predicted by hidden row p - 1
  int64_t s = 0, e = 0;        // the current block [s, e)
  int64_t start = 0, end = 0;  // the span fed to the model
  int64_t kv_len = 0;          // keys attended: T (block-causal: the span's end)
  bool chunk = false;          // a block-causal prefill chunk: it stores K/V, scores no row
  int64_t num_forced = 0;      // Dream's refresh commits position s regardless of the rule
  int64_t num_editable = 0;    // token editing: the block's filled response positions
  int64_t num_rows = 0;        // forced rows + rule candidates + editable positions
  double temperature = 0.0;
  uint32_t key = 0;            // the step's noise key (only drawn when temperature > 0)
};

// BlockCursor.span(): the next forward's span [start, end) and the keys it attends.
bool cursor_span(const Request& q, Plan* p) {
  const CursorLayout& c = layout.c;
  const Codes& code = layout.code;
  const int64_t block = q.at(c.block), step = q.at(c.step), b = q.at(c.block_length);
  const bool force = q.at(c.force_refresh) != 0;
  p->s = q.at(c.block_origin) + block * b;
  p->e = p->s + b;
  const int64_t T = q.at(c.total_len);
  p->kv_len = T;
  if (q.at(c.block_causal)) {  // the cache is exact: nothing after a block ever attends to it
    if (step > 0) {
      p->start = p->s, p->end = p->e;
    } else if (block == 0 || force) {  // the prompt's K/V (what is left of it) and the block
      const int64_t chunk_end = q.at(c.chunk_end);
      p->start = q.at(c.prefilled), p->end = chunk_end < 0 ? p->e : chunk_end;
    } else {
      p->start = p->s - b, p->end = p->e;
    }
    p->chunk = p->end <= p->s;
    p->kv_len = p->end;
  } else if (q.at(c.cache) == code.cache_none) {
    p->start = 0, p->end = T;
  } else {
    int64_t s = p->s;
    if (step == 0) {  // the block's first step, as the cadence says (both intervals >= 1)
      const int64_t every = q.at(c.refresh_interval), prompt_every = q.at(c.prompt_refresh_interval);
      if (every < 1 || prompt_every < 1) {
        PyErr_SetString(PyExc_ValueError, "BlockCursor: a refresh interval is below 1");
        return false;
      }
      if (force || block % (every * prompt_every) == 0) {
        p->start = 0, p->end = T;  // a full refresh
        return true;
      }
      if (block % every == 0) {
        p->start = q.at(c.prompt_len), p->end = T;  // a response-only refresh
        return true;
      }
      s -= q.at(c.shift);  // a cached first step: with shifted logits, row s - 1 predicts s
    }
    p->start = s, p->end = q.at(c.cache) == code.cache_dual ? p->e : T;
  }
  return true;
}

bool read_plan(PyObject* buffers, PyObject* page_list, Plan* p) {
  Request& q = p->req;
  if (!q.acquire(buffers, false)) return false;
  const CursorLayout& c = layout.c;
  const int64_t T = q.tokens.size();
  p->total_len = T;
  p->shift = q.at(c.shift) ? 1 : 0;
  p->mask = q.record[layout.d.mask_token_id];
  p->temperature = q.floats[layout.f.temperature];
  if (q.at(c.total_len) != T) {
    PyErr_SetString(PyExc_ValueError, "BlockCursor: total_len differs from the tokens' length");
    return false;
  }
  if (!cursor_span(q, p)) return false;
  if (p->s < 0 || p->e <= p->s || p->e > T || p->start < 0 || p->end <= p->start ||
      p->end > T) {
    PyErr_Format(PyExc_ValueError,
                 "BlockCursor: block [%lld, %lld) or span [%lld, %lld) outside its canvas of %lld",
                 static_cast<long long>(p->s), static_cast<long long>(p->e),
                 static_cast<long long>(p->start), static_cast<long long>(p->end),
                 static_cast<long long>(T));
    return false;
  }
  // Candidates: masked positions of the block. No row predicts s in a shifted model's later
  // cached steps, so there s is dropped; a block's first step commits it outright if masked.
  const bool first = q.at(c.step) == 0 || q.at(c.cache) == layout.code.cache_none;
  const int64_t* tok = q.tokens.data();
  p->num_forced = (p->shift && first && tok[p->s] == p->mask) ? 1 : 0;
  int64_t masked = 0;
  for (int64_t i = p->s + p->shift; i < p->e && !p->chunk; ++i) masked += tok[i] == p->mask;
  if (std::isfinite(q.floats[layout.f.edit_threshold]) && !p->chunk) {  // token editing
    for (int64_t i = std::max(p->s, q.at(c.prompt_len)); i < p->e; ++i) {
      p->num_editable += tok[i] != p->mask;
    }
  }
  p->num_rows = p->chunk ? 0 : p->num_forced + masked + p->num_editable;
  if (p->temperature > 0) {  // greedy steps draw no noise
    const uint64_t seed = static_cast<uint64_t>(q.record[layout.d.seed]);
    p->key = sangam::noise_key(seed, static_cast<uint64_t>(q.at(c.block)),
                               static_cast<uint64_t>(q.at(c.step)));
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
  Array<int64_t> num_editable;                        // [n]
  static constexpr Py_ssize_t kCount = 13;

  bool acquire(PyObject* arrays) {
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) != kCount) {
      PyErr_SetString(PyExc_TypeError, "arena: expected a tuple of 13 arrays");
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
           num_forced.acquire(a[11], "num_forced", true) &&
           num_editable.acquire(a[12], "num_editable", true);
  }

  bool fits(int64_t n, int64_t num_tokens, int64_t num_rows, int64_t width) const {
    return input_ids.size() >= num_tokens && positions.size() >= num_tokens &&
           slot_mapping.size() >= num_tokens && block_tables.size() >= n * width &&
           cu_seqlens_q.size() >= n + 1 && kv_lens.size() >= n &&
           logits_indices.size() >= num_rows && cu_rows.size() >= n + 1 &&
           row_keys.size() >= num_rows && temperatures.size() >= num_rows &&
           cand_positions.size() >= num_rows && num_forced.size() >= n &&
           num_editable.size() >= n;
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

  const int64_t* tok = p.req.tokens.data();
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

  // Rows: the forced position first, then the rule's candidates in position order, then the
  // editable positions in position order.
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
  if (p.num_editable) {
    for (int64_t pos = std::max(p.s, p.req.at(layout.c.prompt_len)); pos < p.e; ++pos) {
      if (tok[pos] != p.mask) add_row(pos);
    }
  }
  out.cu_rows[r + 1] = i;
  out.num_forced[r] = p.num_forced;
  out.num_editable[r] = p.num_editable;
  return true;
}

PyObject* build(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "build(requests, pages, page_size, arena)");
    return nullptr;
  }
  Ref requests(PySequence_Fast(args[0], "requests must be a sequence"));
  Ref pages(requests ? PySequence_Fast(args[1], "pages must be a sequence") : nullptr);
  if (!pages) return nullptr;
  const long long page_size = PyLong_AsLongLong(args[2]);
  if (page_size == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(requests.get());
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
    if (!read_plan(PySequence_Fast_GET_ITEM(requests.get(), r),
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

// One request's commit (DecodeState.commit): writes the forced rows and the rule's choice among
// the rest into the canvas, moves the cursor (BlockCursor.advance / store_chunk), and sets
// *block_done.
bool commit_one(PyObject* buffers, const int64_t* cand, const int64_t* tok, const double* conf,
                int64_t num_rows, int64_t num_forced, int64_t num_editable,
                std::vector<int64_t>& order, std::vector<uint8_t>& chosen, bool* block_done) {
  *block_done = false;
  Request q;
  if (!q.acquire(buffers, true)) return false;
  const CursorLayout& c = layout.c;
  const DecodeLayout& d = layout.d;
  const Codes& code = layout.code;
  // The decoding families this path mirrors commit here (host_commits 1: the masked family with
  // an unmasking rule); the others (structured output's frontier, which reads its rows'
  // logits) commit in Python (sangam/decoding/family.py): this request is left as it is.
  if (!q.record[d.host_commits]) return true;
  q.record[d.num_forwards] += 1;
  if (q.at(c.chunk_end) >= 0) {  // the forward was a block-causal prefill chunk (no rows)
    q.at(c.prefilled) = q.at(c.chunk_end);
    q.at(c.chunk_end) = -1;
    q.record[d.num_chunks] += 1;
    return true;
  }
  const int64_t rule_id = q.record[d.rule];
  const sangam::Rule rule = rule_id == code.rule_threshold ? sangam::Rule::kThreshold
                            : rule_id == code.rule_factor  ? sangam::Rule::kFactor
                            : rule_id == code.rule_topk    ? sangam::Rule::kTopk
                                                           : sangam::Rule::kUnknown;
  const int64_t block_length = q.at(c.block_length), block = q.at(c.block);
  if (block_length < 1 || block < 0 || block >= q.thresholds.size()) {
    PyErr_SetString(PyExc_ValueError, "BlockCursor: block outside the request's blocks");
    return false;
  }
  const int64_t num_cands = num_rows - num_forced - num_editable;
  if (rule == sangam::Rule::kUnknown && num_cands > 0) {  // select_commits raises only then
    PyErr_Format(PyExc_ValueError, "unknown unmasking rule %lld",
                 static_cast<long long>(rule_id));
    return false;
  }
  chosen.resize(static_cast<size_t>(num_rows));
  std::fill(chosen.begin(), chosen.begin() + num_forced, uint8_t{1});
  // DecodeState.threshold: the current block's (load-adaptive requests set theirs per block).
  sangam::select_commits(conf + num_forced, num_cands, rule, q.thresholds[block],
                         q.floats[layout.f.factor], q.record[d.tokens_per_step], order,
                         chosen.data() + num_forced);
  const int64_t T = q.tokens.size();
  if (q.confidence.size() != T) {
    PyErr_SetString(PyExc_ValueError, "DecodeState.confidence must be as long as its tokens");
    return false;
  }
  // Token editing: a filled position takes its row's token when that differs from it and is
  // sure beyond edit_threshold (strictly, as LLaDA2.1 edits).
  const double edit_threshold = q.floats[layout.f.edit_threshold];
  bool edited = false;
  for (int64_t i = num_rows - num_editable; i < num_rows; ++i) {
    if (cand[i] < 0 || cand[i] >= T) {
      PyErr_Format(PyExc_IndexError, "candidate position %lld is outside a canvas of %lld",
                   static_cast<long long>(cand[i]), static_cast<long long>(T));
      return false;
    }
    const bool edit = conf[i] > edit_threshold && tok[i] != q.tokens[cand[i]];
    chosen[static_cast<size_t>(i)] = edit;
    edited = edited || edit;
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    if (!chosen[static_cast<size_t>(i)]) continue;
    if (cand[i] < 0 || cand[i] >= T) {
      PyErr_Format(PyExc_IndexError, "candidate position %lld is outside a canvas of %lld",
                   static_cast<long long>(cand[i]), static_cast<long long>(T));
      return false;
    }
    q.tokens[cand[i]] = tok[i];
    q.confidence[cand[i]] = conf[i];
  }
  // block_bounds, clamped to the canvas as Python's slice tokens[s:e] would be.
  const int64_t mask = q.record[d.mask_token_id];
  const int64_t s = std::clamp<int64_t>(q.at(c.block_origin) + block * block_length, 0, T);
  const int64_t e = std::clamp<int64_t>(s + block_length, 0, T);
  bool done = true;
  for (int64_t i = s; i < e && done; ++i) done = q.tokens[i] != mask;
  if (done && std::isfinite(edit_threshold)) {  // DecodeState._edits_go_on
    int64_t& post = q.record[d.post_steps];
    const bool had_masks = num_rows > num_editable;
    if (!had_masks) ++post;
    done = !((had_masks || edited) && post < q.record[d.max_post_steps]);
  }
  q.at(c.step) += 1;  // BlockCursor.advance
  q.at(c.force_refresh) = 0;
  if (!done) return true;
  q.record[d.post_steps] = 0;
  *block_done = true;
  // A stop id beyond max_tokens (the last block's padding) is no stop; stop_ids already
  // reflects stop_at_eos (and holds the request's stop_token_ids).
  const int64_t prompt_len = q.at(c.prompt_len);
  const int64_t from = std::clamp<int64_t>(prompt_len, 0, e);
  const int64_t to = std::clamp<int64_t>(prompt_len + q.record[d.max_tokens], from, e);
  bool stopped = false;
  for (int64_t i = from; i < to && !stopped; ++i) {
    for (int64_t j = 0; j < q.stop_ids.size() && !stopped; ++j) stopped = q.tokens[i] == q.stop_ids[j];
  }
  if (stopped || block + 1 == q.at(c.num_blocks)) {
    q.record[d.finished] = 1;
    q.record[d.finish_reason] = stopped ? code.finish_stop : code.finish_length;
    return true;
  }
  // Adaptive refresh: the next block refreshes fully when the cadence starts it from cache
  // and this block committed a token below refresh_confidence.
  const double refresh_confidence = q.floats[layout.f.refresh_confidence];
  const int64_t every = q.at(c.refresh_interval), prompt_every = q.at(c.prompt_refresh_interval);
  // BlockCursor.block_refresh(block + 1) != FULL_REFRESH: a block-causal request's later
  // blocks never refresh; a bidirectional one's by the cadence.
  const bool from_cache = q.at(c.block_causal) ||
                          (every >= 1 && prompt_every >= 1 && (block + 1) % (every * prompt_every) != 0);
  bool force = false;
  if (refresh_confidence > 0 && from_cache) {
    for (int64_t i = s; i < e && !force; ++i) force = q.confidence[i] < refresh_confidence;
  }
  q.at(c.block) = block + 1;
  q.at(c.step) = 0;
  q.at(c.force_refresh) = force ? 1 : 0;
  return true;
}

PyObject* apply(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "apply(requests, tokens, conf, cand_positions, cu_rows, "
                                     "num_forced, num_editable)");
    return nullptr;
  }
  Ref requests(PySequence_Fast(args[0], "requests must be a sequence"));
  if (!requests) return nullptr;
  Array<int64_t> tokens, cand, cu_rows, num_forced, num_editable;
  Array<double> conf;
  if (!tokens.acquire(args[1], "tokens", false) || !conf.acquire(args[2], "conf", false) ||
      !cand.acquire(args[3], "cand_positions", false) ||
      !cu_rows.acquire(args[4], "cu_rows", false) ||
      !num_forced.acquire(args[5], "num_forced", false) ||
      !num_editable.acquire(args[6], "num_editable", false)) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(requests.get());
  if (cu_rows.size() < n + 1 || num_forced.size() < n || num_editable.size() < n) {
    PyErr_SetString(PyExc_ValueError,
                    "apply: cu_rows / num_forced / num_editable are shorter than the batch");
    return nullptr;
  }
  const int64_t num_rows = cu_rows[n];
  if (tokens.size() < num_rows || conf.size() < num_rows || cand.size() < num_rows) {
    PyErr_SetString(PyExc_ValueError, "apply: fewer scored rows than the batch has");
    return nullptr;
  }
  Ref done(PyList_New(n));
  Ref errors(PyDict_New());
  if (!done || !errors) return nullptr;
  std::vector<int64_t> order;
  std::vector<uint8_t> chosen;
  for (Py_ssize_t r = 0; r < n; ++r) {
    const int64_t a = cu_rows[r], b = cu_rows[r + 1], k = num_forced[r], ed = num_editable[r];
    if (a < 0 || b < a || b > num_rows || k < 0 || ed < 0 || k + ed > b - a) {
      PyErr_SetString(PyExc_ValueError, "apply: inconsistent cu_rows / num_forced / num_editable");
      return nullptr;
    }
    bool block_done = false;
    if (!commit_one(PySequence_Fast_GET_ITEM(requests.get(), r), cand.data() + a,
                    tokens.data() + a, conf.data() + a, b - a, k, ed, order, chosen,
                    &block_done)) {
      // A request's failure is its own: its error is returned, and the others commit.
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      PyErr_NormalizeException(&type, &value, &trace);
      if (trace != nullptr) PyException_SetTraceback(value, trace);
      Ref error(value), index(PyLong_FromSsize_t(r));
      Py_XDECREF(type);
      Py_XDECREF(trace);
      if (!index || PyDict_SetItem(errors.get(), index.get(), error.get()) < 0) return nullptr;
      block_done = false;
    }
    PyObject* flag = block_done ? Py_True : Py_False;
    Py_INCREF(flag);
    PyList_SET_ITEM(done.get(), r, flag);
  }
  return PyTuple_Pack(2, done.get(), errors.get());
}

PyMethodDef methods[] = {
    {"configure", configure, METH_O,
     "configure(layout) -> None\n\nLearn the records' field layout (see host_batch.py)."},
    {"build", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(build)), METH_FASTCALL,
     "build(requests, pages, page_size, arena) -> (fits, num_tokens, num_rows, width)\n\n"
     "Plan each request's next step and pack the batch into the arena's arrays; when they\n"
     "are too small nothing is written and fits is False."},
    {"apply", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(apply)), METH_FASTCALL,
     "apply(requests, tokens, conf, cand_positions, cu_rows, num_forced, num_editable)\n"
     "-> (list[bool], dict[int, Exception])\n\n"
     "Commit each request's scored rows in place; returns whether each completed its block,\n"
     "and the errors of those whose commit failed."},
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

PyMODINIT_FUNC PyInit__host(void) { return PyModule_Create(&module_def); }
