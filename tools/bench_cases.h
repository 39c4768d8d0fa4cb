// The shapes of `sparse-mla bench`: DeepSeek-V4 (MODEL1) production and peak shapes, small
// tensor-parallel head counts, V3.2 (V32) shapes, dense decode and the KV-cache kernels; plus the
// FLOP/byte counts of targets.md and FlashMLA's times quoted from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparse_mla/kv_cache.h"

namespace sparse_mla::tools::bench {

enum class OpKind { kSparseDecode, kDenseDecode, kQuantizeStore, kRepack };
const char* op_name(OpKind op);  // "sparse", "dense", "quantize_store", "repack"

struct Case {
  std::string name;    // unique, e.g. "sparse/C1/sq2/b128"
  std::string suite;   // group for selection: model1, model1_mtp, model1_peak, tp, v32, dense,
                       // dense_tp, dense_imb, dense_any, dense_small, kv
  std::string config;  // series label for plots, e.g. "C1", "C1 h16", "bf16 s_q=1"
  OpKind op = OpKind::kSparseDecode;
  KVFormat format = KVFormat::kModel1;
  int64_t b = 1, s_q = 1, h_q = 64;
  uint64_t seed = 1;

  // Sparse decode. Request i owns context_i ~ context * U[1 - jitter, 1 + jitter] tokens of the
  // main cache; its indices are distinct random slots among them (each query token drawn anew,
  // but for the share that mtp_shared keeps).
  int64_t context = 16384;
  double context_jitter = 0.25;
  int64_t topk = 128;
  int64_t page_size = 256;
  int64_t extra_topk = 0;  // 0: no extra cache
  int64_t extra_page_size = 64;
  int64_t extra_ratio = 4;  // extra entries per request = max(context_i / extra_ratio, extra_topk)
  bool extra_random_length = false;  // extra_topk_length[i] ~ U[1, extra_topk], stratified
  // Query tokens s >= 1 of a request keep this fraction of token 0's indices (in each cache) in
  // their places, as overlapping MTP windows would, and give the other places, chosen at random,
  // slots token 0 did not take (where there are enough of them): every prefix of the lists, so
  // the part that extra_topk_length leaves attended too, shares that fraction.
  double mtp_shared = 0;
  bool sink = true;

  // Dense decode: explicit per-request lengths, or `context` for all.
  std::vector<int64_t> seqlens;
  int64_t h_kv = 1;
  bool causal = false;

  // KV kernels: quantize-store of `tokens` rows; repack of b requests of `context` tokens from
  // page_size pages to extra_page_size pages.
  int64_t tokens = 0;
  // Quantize-store slots: distinct random slots of a cache twice as large (decode-like scatter),
  // or consecutive slots from 0 (a prefill chunk filling whole pages).
  bool consecutive_slots = false;

  std::optional<double> flashmla_us;  // FlashMLA's time on H200 (targets.md), when it has a row
  // How targets.md timed that figure: with CUDA events around the call (its s_q = 1 and imbalanced
  // tables), or else as the span of the call's kernels (a profiler: the s_q = 2, peak and dense
  // tables). The speedup compares our time taken the same way.
  bool flashmla_timed_by_events = false;
  std::string flashmla_note;  // e.g. "padded to h_q=64"
  bool quick = false;         // part of --quick
};

// Every case, in a stable order.
std::vector<Case> all_cases();

// Cases matching a comma-separated filter: each term is a suite name, or a substring (or '*'
// wildcard pattern) of the case name; a term starting with '-' removes matches. Empty: all.
std::vector<Case> select_cases(const std::vector<Case>& cases, const std::string& filter,
                               bool quick_only);

// Work of one call, counted as targets.md says: FLOPs = 2 * h_q * attended * (d_qk + d_v); bytes =
// q + o (bf16) + the bytes of every distinct cache slot read (576 per MODEL1 row, 656 per V32 row,
// 2 * 576 * h_kv per bf16/fp16 token). KV kernels: bytes read + written.
struct Work {
  double flops = 0;
  double bytes = 0;
  double attended_per_query = 0;  // mean attended tokens per (request, query token)
};

}  // namespace sparse_mla::tools::bench
