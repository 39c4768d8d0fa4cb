#include "tools/bench_cases.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <string_view>

namespace sparse_mla::tools::bench {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kSparseDecode:
      return "sparse";
    case OpKind::kDenseDecode:
      return "dense";
    case OpKind::kQuantizeStore:
      return "quantize_store";
    case OpKind::kRepack:
      return "repack";
  }
  return "unknown";
}

namespace {

// ---- FlashMLA on H200, microseconds. Source: /work/shared/targets.md (the project's performance
// bar; FlashMLA's 2026-04 Hopper release timed on an H200, CUDA 13.0, L2 flushed). ----
constexpr std::array<int64_t, 6> kProdBatches = {2, 64, 74, 128, 148, 256};

struct ProdConfig {
  const char* name;
  int64_t h_q, extra_topk, extra_page;
  bool extra_random_length;  // "E" rows: 2-token pages, per-request extra_topk_length
  std::array<double, 6> flashmla_sq2, flashmla_sq1;
};

constexpr ProdConfig kProdConfigs[] = {
    {"C1",
     64,
     512,
     64,
     false,
     {15.0, 49.7, 71.6, 92.8, 120.1, 176.5},
     {16.1, 48.0, 53.1, 51.8, 74.7, 95.2}},
    {"C2",
     128,
     1024,
     64,
     false,
     {17.3, 106.3, 134.9, 207.1, 252.7, 406.9},
     {18.3, 59.0, 81.5, 108.5, 137.7, 208.6}},
    {"C3",
     64,
     1024,
     2,
     true,
     {14.2, 75.3, 82.3, 121.5, 135.9, 217.6},
     {17.6, 47.4, 50.8, 79.2, 84.9, 124.6}},
    {"C4",
     128,
     1024,
     2,
     true,
     {15.8, 90.0, 94.5, 147.5, 169.6, 267.6},
     {17.8, 60.2, 62.0, 90.4, 100.6, 153.0}},
};

// Peak shapes (b=148, s_q=2, s_k=32768, one cache) and V32 peak (h_q=128, topk 2048, b=128).
constexpr double kPeakModel1H64 = 2049.0;
constexpr double kPeakModel1H128 = 2690.0;
constexpr double kPeakV32H128 = 367.0;

// Dense decode, bf16 pages of 64, d=576, h_q=128, h_kv=1, b=128; s_k 4096..32768.
constexpr std::array<int64_t, 4> kDenseContexts = {4096, 8192, 16384, 32768};
constexpr std::array<double, 4> kDenseSq1 = {242, 449, 868, 1707};
constexpr std::array<double, 4> kDenseSq2 = {423, 809, 1582, 3174};

// Imbalanced batch: four requests, bf16 pages of 64, causal.
constexpr std::array<int64_t, 4> kImbalancedLengths = {4641, 45118, 1730, 1696};
struct ImbRow {
  int64_t h_q, s_q;
  double flashmla_us;
};
constexpr ImbRow kImbalanced[] = {{16, 4, 53.7}, {16, 1, 50.2}, {128, 4, 104.0}};

std::string fmt(const char* f, auto... args) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

uint64_t seed_of(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: a stable seed per case name
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

bool glob_match(std::string_view pat, std::string_view s) {
  size_t p = 0, i = 0, star = std::string_view::npos, mark = 0;
  while (i < s.size()) {
    if (p < pat.size() && pat[p] == s[i]) {
      ++p, ++i;
    } else if (p < pat.size() && pat[p] == '*') {
      star = p++;
      mark = i;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      i = ++mark;
    } else {
      return false;
    }
  }
  while (p < pat.size() && pat[p] == '*') ++p;
  return p == pat.size();
}

bool term_matches(const std::string& term, const Case& c) {
  if (term == c.suite) return true;
  if (term.find('*') != std::string::npos) return glob_match(term, c.name);
  return c.name.find(term) != std::string::npos;
}

}  // namespace

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  auto add = [&](Case c) {
    c.seed = seed_of(c.name);
    cases.push_back(std::move(c));
  };

  // DeepSeek-V4 production shapes: window cache (topk 128, 256-token pages) + extra cache.
  for (int64_t s_q : {2, 1}) {
    for (const auto& pc : kProdConfigs) {
      for (size_t bi = 0; bi < kProdBatches.size(); ++bi) {
        Case c;
        c.b = kProdBatches[bi];
        c.s_q = s_q;
        c.h_q = pc.h_q;
        c.name = fmt("sparse/%s/sq%lld/b%lld", pc.name, (long long)s_q, (long long)c.b);
        c.suite = "model1";
        c.config = fmt("%s s_q=%lld", pc.name, (long long)s_q);
        c.extra_topk = pc.extra_topk;
        c.extra_page_size = pc.extra_page;
        c.extra_random_length = pc.extra_random_length;
        // E rows draw up to 1024 entries per request: a denser compressed cache (context / 16).
        c.extra_ratio = pc.extra_random_length ? 16 : 4;
        c.flashmla_us = (s_q == 2 ? pc.flashmla_sq2 : pc.flashmla_sq1)[bi];
        c.flashmla_timed_by_events = s_q == 1;
        c.quick = (c.b == 2 || c.b == 64) && (s_q == 2 || std::string_view(pc.name) == "C1");
        add(c);
      }
    }
  }

  // The same shapes with the two query tokens' indices 90% shared: a modelled MTP overlap (a
  // window cache and a top-k selection move little from one token to the next), where rows that
  // one token list reads are read again by the other. No FlashMLA times.
  for (const auto& pc : kProdConfigs) {
    for (size_t bi : {size_t{0}, size_t{3}}) {
      Case c;
      c.b = kProdBatches[bi];
      c.s_q = 2;
      c.h_q = pc.h_q;
      c.name = fmt("mtp/%s/sq2/b%lld", pc.name, (long long)c.b);
      c.suite = "model1_mtp";
      c.config = fmt("%s s_q=2, 90%% shared", pc.name);
      c.extra_topk = pc.extra_topk;
      c.extra_page_size = pc.extra_page;
      c.extra_random_length = pc.extra_random_length;
      c.extra_ratio = pc.extra_random_length ? 16 : 4;
      c.mtp_shared = 0.9;
      add(c);
    }
  }

  // Tensor-parallel head counts on the same shapes. FlashMLA runs only 64/128 heads, so an engine
  // pads to 64 and pays the h_q=64 time of the same shape: C1 for C1, C3 for C3 and C4 (C4's
  // shape at h_q=64 is C3). C2's shape at h_q=64 has no FlashMLA row.
  for (const auto& pc : kProdConfigs) {
    if (std::string_view(pc.name) == "C4") continue;
    for (int64_t h_q : {8, 16, 32}) {
      for (size_t bi : {size_t{0}, size_t{1}, size_t{3}, size_t{5}}) {
        Case c;
        c.b = kProdBatches[bi];
        c.s_q = 2;
        c.h_q = h_q;
        c.name = fmt("tp/%s/h%lld/sq2/b%lld", pc.name, (long long)h_q, (long long)c.b);
        c.suite = "tp";
        c.config = fmt("%s h_q=%lld", pc.name, (long long)h_q);
        c.extra_topk = pc.extra_topk;
        c.extra_page_size = pc.extra_page;
        c.extra_random_length = pc.extra_random_length;
        c.extra_ratio = pc.extra_random_length ? 16 : 4;
        if (pc.h_q == 64) {
          c.flashmla_us = pc.flashmla_sq2[bi];
          c.flashmla_note = "padded to h_q=64; target <= 0.5x";
        }
        c.quick = h_q == 16 && std::string_view(pc.name) == "C1" && (c.b == 2 || c.b == 64);
        add(c);
      }
    }
  }

  // Peak shapes: one cache, 64-token pages, s_k 32768, b 148, s_q 2, topk 16384.
  for (int64_t h_q : {64, 128}) {
    Case c;
    c.name = fmt("peak/model1/h%lld", (long long)h_q);
    c.suite = "model1_peak";
    c.config = "MODEL1 peak";
    c.b = 148;
    c.s_q = 2;
    c.h_q = h_q;
    c.context = 32768;
    c.context_jitter = 0;
    c.topk = 16384;
    c.page_size = 64;
    c.sink = false;
    c.flashmla_us = h_q == 64 ? kPeakModel1H64 : kPeakModel1H128;
    add(c);
  }

  // DeepSeek-V3.2: d_qk 576, topk 2048, 64-token pages, s_k 32768, one cache; h_q 32 and 16 are
  // its tensor-parallel shards of 4 and 8 GPUs.
  for (int64_t s_q : {2, 1}) {
    for (int64_t h_q : {128, 64, 32, 16}) {
      for (int64_t b : {2, 64, 128}) {
        Case c;
        c.name = fmt("v32/h%lld/sq%lld/b%lld", (long long)h_q, (long long)s_q, (long long)b);
        c.suite = "v32";
        c.config = fmt("V32 h_q=%lld s_q=%lld", (long long)h_q, (long long)s_q);
        c.format = KVFormat::kV32;
        c.b = b;
        c.s_q = s_q;
        c.h_q = h_q;
        c.context = 32768;
        c.context_jitter = 0;
        c.topk = 2048;
        c.page_size = 64;
        c.sink = false;
        if (h_q == 128 && s_q == 2 && b == 128) c.flashmla_us = kPeakV32H128;
        c.quick = h_q == 128 && s_q == 2 && b == 2;
        add(c);
      }
    }
  }

  // Dense decode, b=128, h_q=128, pages of 64: bf16 (FlashMLA rows) and FP8 pages.
  for (KVFormat f : {KVFormat::kBF16, KVFormat::kModel1, KVFormat::kV32}) {
    for (int64_t s_q : {1, 2}) {
      for (size_t ci = 0; ci < kDenseContexts.size(); ++ci) {
        Case c;
        c.op = OpKind::kDenseDecode;
        c.format = f;
        c.name = fmt("dense/%s/sq%lld/sk%lld", kv_format_name(f), (long long)s_q,
                     (long long)kDenseContexts[ci]);
        c.suite = "dense";
        c.config = fmt("%s s_q=%lld", kv_format_name(f), (long long)s_q);
        c.b = 128;
        c.s_q = s_q;
        c.h_q = 128;
        c.context = kDenseContexts[ci];
        c.context_jitter = 0;
        c.page_size = 64;
        c.causal = s_q > 1;
        if (f == KVFormat::kBF16) c.flashmla_us = (s_q == 1 ? kDenseSq1 : kDenseSq2)[ci];
        add(c);
      }
    }
  }

  // Dense decode with tensor-parallel heads, s_q=1: memory-bound, FP8 pages should take <= 0.6x
  // the bf16 time.
  for (KVFormat f : {KVFormat::kBF16, KVFormat::kModel1, KVFormat::kV32}) {
    for (int64_t h_q : {16, 32}) {
      Case c;
      c.op = OpKind::kDenseDecode;
      c.format = f;
      c.name = fmt("dense_tp/%s/h%lld/sk16384/b128", kv_format_name(f), (long long)h_q);
      c.suite = "dense_tp";
      c.config = fmt("dense TP h_q=%lld", (long long)h_q);
      c.b = 128;
      c.s_q = 1;
      c.h_q = h_q;
      c.context = 16384;
      c.context_jitter = 0;
      c.page_size = 64;
      add(c);
    }
  }

  // Imbalanced batch (4641, 45118, 1730, 1696 tokens), causal, pages of 64.
  for (KVFormat f : {KVFormat::kBF16, KVFormat::kModel1}) {
    for (const auto& row : kImbalanced) {
      Case c;
      c.op = OpKind::kDenseDecode;
      c.format = f;
      c.name = fmt("dense_imb/%s/h%lld/sq%lld", kv_format_name(f), (long long)row.h_q,
                   (long long)row.s_q);
      c.suite = "dense_imb";
      c.config = fmt("imbalanced %s", kv_format_name(f));
      c.b = 4;
      c.s_q = row.s_q;
      c.h_q = row.h_q;
      c.seqlens.assign(kImbalancedLengths.begin(), kImbalancedLengths.end());
      c.context = 0;
      c.page_size = 64;
      c.causal = true;
      if (f == KVFormat::kBF16) c.flashmla_us = row.flashmla_us;
      c.flashmla_timed_by_events = true;
      c.quick = row.h_q == 16 && row.s_q == 1;
      add(c);
    }
  }

  // Dense decode where FlashMLA has no kernel, bf16, s_q 1, s_k 16384, about 2.4 GB of cache
  // each (b 128; 64 with 2 KV heads, 16 with 8): page sizes other than 64 (the same work as
  // dense/BF16/sq1/sk16384 at h_q 128 and dense_tp/BF16/h16 at h_q 16), head counts down to 1,
  // several KV heads (h_q 128 over 2 of them: 64 query rows a KV head, the Hopper kernel).
  struct AnyShape {
    int64_t page_size, h_q, h_kv, b;
  };
  constexpr AnyShape kAnyShapes[] = {
      {16, 128, 1, 128}, {32, 128, 1, 128}, {128, 128, 1, 128}, {256, 128, 1, 128},
      {16, 16, 1, 128},  {32, 16, 1, 128},  {128, 16, 1, 128},  {256, 16, 1, 128},
      {64, 1, 1, 128},   {64, 8, 1, 128},   {64, 64, 1, 128},   {64, 16, 2, 64},
      {64, 128, 2, 64},  {64, 128, 8, 16}};
  for (const AnyShape& a : kAnyShapes) {
    Case c;
    c.op = OpKind::kDenseDecode;
    c.format = KVFormat::kBF16;
    c.name = fmt("dense_any/p%lld/h%lld/kv%lld", (long long)a.page_size, (long long)a.h_q,
                 (long long)a.h_kv);
    c.suite = "dense_any";
    c.config = fmt("dense h_q=%lld h_kv=%lld", (long long)a.h_q, (long long)a.h_kv);
    c.b = a.b;
    c.s_q = 1;
    c.h_q = a.h_q;
    c.h_kv = a.h_kv;
    c.context = 16384;
    c.context_jitter = 0;
    c.page_size = a.page_size;
    add(c);
  }

  // Small dense batches, s_q 1, pages of 64: latency-bound calls (one request of a chat, a few
  // of a lightly loaded server) where the choice between the Hopper and the portable kernel is
  // decided by start-up cost, not by throughput.
  for (KVFormat f : {KVFormat::kBF16, KVFormat::kModel1}) {
    for (int64_t b : {1, 8}) {
      for (int64_t h_q : {16, 128}) {
        for (int64_t context : {1024, 8192}) {
          Case c;
          c.op = OpKind::kDenseDecode;
          c.format = f;
          c.name = fmt("dense_small/%s/h%lld/sk%lld/b%lld", kv_format_name(f), (long long)h_q,
                       (long long)context, (long long)b);
          c.suite = "dense_small";
          c.config = fmt("dense small %s", kv_format_name(f));
          c.b = b;
          c.s_q = 1;
          c.h_q = h_q;
          c.context = context;
          c.context_jitter = 0;
          c.page_size = 64;
          add(c);
        }
      }
    }
  }

  // KV kernels: quantize-and-store one decode step (b=128 new tokens), a prefill chunk and a
  // large batch; page repack 256 -> 64 and 64 -> 256.
  for (KVFormat f : {KVFormat::kModel1, KVFormat::kV32}) {
    for (int64_t n : {128, 1 << 16, 1 << 20}) {
      Case c;
      c.op = OpKind::kQuantizeStore;
      c.format = f;
      c.name = fmt("kv/quantize_store/%s/n%lld", kv_format_name(f), (long long)n);
      c.suite = "kv";
      c.config = "quantize_store";
      c.tokens = n;
      c.b = 1;
      c.page_size = 256;
      c.quick = n == 128 || (n == 1 << 16 && f == KVFormat::kModel1);
      add(c);
    }
    Case c;  // a large prefill chunk: consecutive slots, whole pages
    c.op = OpKind::kQuantizeStore;
    c.format = f;
    c.name = fmt("kv/quantize_store/%s/n%lld_consecutive", kv_format_name(f), 1LL << 20);
    c.suite = "kv";
    c.config = "quantize_store";
    c.tokens = 1 << 20;
    c.consecutive_slots = true;
    c.b = 1;
    c.page_size = 256;
    add(c);
  }
  for (auto [from, to] : {std::pair<int64_t, int64_t>{256, 64}, {64, 256}}) {
    Case c;
    c.op = OpKind::kRepack;
    c.format = KVFormat::kModel1;
    c.name = fmt("kv/repack/MODEL1/%lldto%lld", (long long)from, (long long)to);
    c.suite = "kv";
    c.config = "repack";
    c.b = 64;
    c.context = 16384;
    c.context_jitter = 0.25;
    c.page_size = from;
    c.extra_page_size = to;
    c.quick = from == 256;
    add(c);
  }
  return cases;
}

std::vector<Case> select_cases(const std::vector<Case>& cases, const std::string& filter,
                               bool quick_only) {
  std::vector<std::string> include, exclude;
  size_t start = 0;
  while (start <= filter.size()) {
    size_t end = filter.find(',', start);
    if (end == std::string::npos) end = filter.size();
    std::string term = filter.substr(start, end - start);
    if (!term.empty() && term[0] == '-') {
      exclude.push_back(term.substr(1));
    } else if (!term.empty()) {
      include.push_back(term);
    }
    start = end + 1;
  }
  // A term that names a case exactly selects only that case ("sparse/C1/sq2/b2" is not b256).
  auto matches = [&](const std::string& t, const Case& c) {
    for (const Case& other : cases) {
      if (other.name == t) return c.name == t;
    }
    return term_matches(t, c);
  };
  std::vector<Case> out;
  for (const Case& c : cases) {
    if (quick_only && !c.quick) continue;
    bool in = include.empty();
    for (const auto& t : include) in = in || matches(t, c);
    for (const auto& t : exclude) in = in && !matches(t, c);
    if (in) out.push_back(c);
  }
  return out;
}

}  // namespace sparse_mla::tools::bench
