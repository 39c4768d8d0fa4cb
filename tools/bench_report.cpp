#include "tools/bench_report.h"

#include <unistd.h>

#include <cmath>
#include <limits>
#include <map>
#include <sstream>

namespace sparse_mla::tools::bench {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string num(double v, int prec = 4) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", prec, v);
  return buf;
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

std::string cell(double v, const char* f) {
  if (!std::isfinite(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Three significant digits without an exponent for the sizes a table shows.
std::string sig3(double v) {
  if (!std::isfinite(v)) return "-";
  const double a = std::fabs(v);
  return cell(v, a >= 100 ? "%.0f" : a >= 10 ? "%.1f" : a >= 1 ? "%.2f" : "%.3f");
}

// The check column: PASS (compared with the reference), FINITE (--verify off on attention: only
// the finite check ran; KV kernels are always compared), FAIL, or the status (error, skipped).
std::string check_label(const Result& res) {
  if (res.status == "ok") return res.verdict.compared ? "PASS" : "FINITE";
  return res.status == "failed" ? "FAIL" : res.status;
}

}  // namespace

Metrics metrics(const Record& r, const Result& res) {
  Metrics m{kNaN, kNaN, kNaN, kNaN, kNaN, ""};
  if (res.status != "ok" || res.time.runs == 0) return m;
  m.us = res.time.median_us;
  const double s = m.us * 1e-6;
  if (r.work.flops > 0) m.tflops = r.work.flops / s * 1e-12;
  if (r.work.bytes > 0) m.gbps = r.work.bytes / s * 1e-9;
  if (res.ceilings && res.ceilings->gbps > 0 &&
      (r.work.flops == 0 || res.ceilings->bf16_tflops > 0)) {
    double floor_s = r.work.bytes / (res.ceilings->gbps * 1e9);
    if (r.work.flops > 0)
      floor_s = std::max(floor_s, r.work.flops / (res.ceilings->bf16_tflops * 1e12));
    m.roofline_pct = 100.0 * floor_s / s;
  }
  if (r.c.flashmla_us && res.on_gpu) {
    const bool span = !r.c.flashmla_timed_by_events && res.span_time;
    m.speedup_vs_flashmla = *r.c.flashmla_us / (span ? res.span_time->median_us : m.us);
    m.speedup_basis = span ? "kernel span" : "events";
  }
  return m;
}

void print_header(FILE* to) {
  std::fprintf(to, "%-32s %-6s %10s %8s %8s %8s %8s %6s %9s %7s  %s\n", "case", "backend", "us",
               "spread", "span us", "TFLOP/s", "GB/s", "roof%", "FlashMLA", "speedup", "check");
}

void print_result(FILE* to, const Record& r, const Result& res) {
  const Metrics m = metrics(r, res);
  std::string spread = "-";
  if (res.status == "ok" && res.time.median_us > 0) {
    spread =
        "+-" + cell(50.0 * (res.time.p90_us - res.time.p10_us) / res.time.median_us, "%.1f") + "%";
  }
  const std::string check = check_label(res);
  std::fprintf(to, "%-32s %-6s %10s %8s %8s %8s %8s %6s %9s %7s  %s", r.c.name.c_str(),
               res.backend.c_str(), cell(m.us, "%.1f").c_str(), spread.c_str(),
               cell(res.span_time ? res.span_time->median_us : kNaN, "%.1f").c_str(),
               sig3(m.tflops).c_str(), sig3(m.gbps).c_str(), sig3(m.roofline_pct).c_str(),
               cell(r.c.flashmla_us.value_or(kNaN), "%.1f").c_str(),
               cell(m.speedup_vs_flashmla, "%.2fx").c_str(), check.c_str());
  if (res.graph_time) std::fprintf(to, "  graph %.1f us", res.graph_time->median_us);
  if (res.status != "ok" && !res.message.empty()) std::fprintf(to, "  %s", res.message.c_str());
  std::fprintf(to, "\n");
}

void print_summary(FILE* to, const std::vector<Record>& records) {
  struct Acc {
    int ok = 0, finite_only = 0, failed = 0, error = 0, skipped = 0;
    double log_sum = 0, worst = kNaN;
    int n = 0;
    double model1_log_sum = 0, model1_events_log_sum = 0;
    int model1_n = 0;
  };
  std::map<std::string, Acc> by;
  for (const auto& r : records) {
    for (const auto& res : r.results) {
      Acc& a = by[res.backend];
      if (res.status == "ok" && !res.verdict.compared)
        ++a.finite_only;
      else if (res.status == "ok")
        ++a.ok;
      else if (res.status == "failed")
        ++a.failed;
      else if (res.status == "skipped")
        ++a.skipped;
      else
        ++a.error;
      const Metrics m = metrics(r, res);
      if (std::isfinite(m.speedup_vs_flashmla)) {
        a.log_sum += std::log(m.speedup_vs_flashmla);
        ++a.n;
        if (!(a.worst <= m.speedup_vs_flashmla)) a.worst = m.speedup_vs_flashmla;
        if (r.c.suite == "model1") {
          a.model1_log_sum += std::log(m.speedup_vs_flashmla);
          a.model1_events_log_sum += std::log(*r.c.flashmla_us / m.us);
          ++a.model1_n;
        }
      }
    }
  }
  std::fprintf(to, "\nsummary per backend:\n");
  for (const auto& [backend, a] : by) {
    std::fprintf(to, "  %-6s %d passed, %d failed, %d errors, %d skipped", backend.c_str(), a.ok,
                 a.failed, a.error, a.skipped);
    if (a.finite_only > 0) {
      std::fprintf(to, ", %d finite only (not compared with the reference)", a.finite_only);
    }
    if (a.n > 0) {
      std::fprintf(to, "; vs FlashMLA: geomean %.2fx over %d cases (worst %.2fx)",
                   std::exp(a.log_sum / a.n), a.n, a.worst);
    }
    if (a.model1_n > 0) {
      std::fprintf(to,
                   "; MODEL1 production rows: geomean %.3fx over %d of 48 (%.3fx by events alone)",
                   std::exp(a.model1_log_sum / a.model1_n), a.model1_n,
                   std::exp(a.model1_events_log_sum / a.model1_n));
    }
    std::fprintf(to, "\n");
  }
}

std::string to_json(const RunInfo& info, const std::vector<Record>& records) {
  std::ostringstream o;
  o << "{\n  \"schema\": \"sparse-mla-bench/1\",\n  \"run\": {"
    << "\"date\": " << quote(info.date) << ", \"commit\": " << quote(info.commit)
    << ", \"command\": " << quote(info.command) << ", \"host\": " << quote(info.host)
    << ", \"suite\": " << quote(info.suite) << ", \"verify\": " << quote(info.verify)
    << ", \"runs\": " << info.runs << ", \"warmup\": " << info.warmup
    << ", \"graph\": " << (info.graph ? "true" : "false") << ", \"torch\": " << quote(info.torch)
    << "},\n  \"devices\": [";
  for (size_t i = 0; i < info.devices.size(); ++i) {
    const DeviceInfo& d = info.devices[i];
    o << (i ? ",\n" : "\n") << "    {\"kind\": " << quote(d.kind) << ", \"name\": " << quote(d.name)
      << ", \"detail\": " << quote(d.detail) << ", \"driver\": " << quote(d.driver)
      << ", \"runtime\": " << quote(d.runtime) << ", \"clocks\": " << quote(d.clocks)
      << ", \"ceilings\": {\"bf16_tflops\": "
      << num(d.ceilings.bf16_tflops > 0 ? d.ceilings.bf16_tflops : kNaN)
      << ", \"fp8_tflops\": " << num(d.ceilings.fp8_tflops > 0 ? d.ceilings.fp8_tflops : kNaN)
      << ", \"gbps\": " << num(d.ceilings.gbps > 0 ? d.ceilings.gbps : kNaN)
      << ", \"source\": " << quote(d.ceilings.source) << "}}";
  }
  o << "\n  ],\n  \"cases\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    const Case& c = r.c;
    o << (i ? ",\n" : "\n") << "    {\"name\": " << quote(c.name)
      << ", \"suite\": " << quote(c.suite) << ", \"config\": " << quote(c.config)
      << ", \"op\": " << quote(op_name(c.op)) << ", \"format\": " << quote(kv_format_name(c.format))
      << ", \"b\": " << c.b << ", \"s_q\": " << c.s_q << ", \"h_q\": " << c.h_q;
    if (c.op == OpKind::kSparseDecode) {
      o << ", \"topk\": " << c.topk << ", \"page_size\": " << c.page_size
        << ", \"extra_topk\": " << c.extra_topk
        << ", \"extra_page_size\": " << (c.extra_topk ? c.extra_page_size : 0)
        << ", \"extra_random_length\": " << (c.extra_random_length ? "true" : "false")
        << ", \"context\": " << c.context << ", \"sink\": " << (c.sink ? "true" : "false");
    } else if (c.op == OpKind::kDenseDecode) {
      o << ", \"page_size\": " << c.page_size << ", \"h_kv\": " << c.h_kv
        << ", \"causal\": " << (c.causal ? "true" : "false") << ", \"seqlens\": [";
      if (c.seqlens.empty()) {
        o << c.context;
      } else {
        for (size_t k = 0; k < c.seqlens.size(); ++k) o << (k ? ", " : "") << c.seqlens[k];
      }
      o << "]";
    } else if (c.op == OpKind::kQuantizeStore) {
      o << ", \"tokens\": " << c.tokens << ", \"page_size\": " << c.page_size << ", \"slots\": \""
        << (c.consecutive_slots ? "consecutive" : "random") << "\"";
    } else {
      o << ", \"context\": " << c.context << ", \"page_size\": " << c.page_size
        << ", \"dst_page_size\": " << c.extra_page_size;
    }
    o << ", \"flashmla_us\": " << num(c.flashmla_us.value_or(kNaN), 6)
      << ", \"flashmla_note\": " << quote(c.flashmla_note) << ", \"flashmla_timing\": "
      << quote(!c.flashmla_us               ? ""
               : c.flashmla_timed_by_events ? "events"
                                            : "kernel span")
      << ", \"flops\": " << num(r.work.flops, 8) << ", \"bytes\": " << num(r.work.bytes, 8)
      << ", \"attended_per_query\": " << num(r.work.attended_per_query, 6)
      << ", \"verified\": " << quote(r.verified) << ", \"build_s\": " << num(r.build_s, 3)
      << ",\n     \"results\": [";
    for (size_t k = 0; k < r.results.size(); ++k) {
      const Result& res = r.results[k];
      const Metrics m = metrics(r, res);
      const TimingStats& t = res.time;
      const bool timed = res.status == "ok" && t.runs > 0;
      o << (k ? ",\n       " : "\n       ") << "{\"backend\": " << quote(res.backend)
        << ", \"status\": " << quote(res.status) << ", \"check\": " << quote(check_label(res))
        << ", \"message\": " << quote(res.message) << ", \"runs\": " << t.runs
        << ", \"median_us\": " << num(timed ? t.median_us : kNaN, 6)
        << ", \"mean_us\": " << num(timed ? t.mean_us : kNaN, 6)
        << ", \"min_us\": " << num(timed ? t.min_us : kNaN, 6)
        << ", \"max_us\": " << num(timed ? t.max_us : kNaN, 6)
        << ", \"p10_us\": " << num(timed ? t.p10_us : kNaN, 6)
        << ", \"p90_us\": " << num(timed ? t.p90_us : kNaN, 6)
        << ", \"stdev_us\": " << num(timed ? t.stdev_us : kNaN, 4)
        << ", \"graph_median_us\": " << num(res.graph_time ? res.graph_time->median_us : kNaN, 6)
        << ", \"span_median_us\": " << num(res.span_time ? res.span_time->median_us : kNaN, 6)
        << ", \"span_p10_us\": " << num(res.span_time ? res.span_time->p10_us : kNaN, 6)
        << ", \"span_p90_us\": " << num(res.span_time ? res.span_time->p90_us : kNaN, 6)
        << ", \"span_kernels\": " << res.span_kernels << ", \"tflops\": " << num(m.tflops)
        << ", \"gbps\": " << num(m.gbps) << ", \"roofline_pct\": " << num(m.roofline_pct, 3)
        << ", \"speedup_vs_flashmla\": " << num(m.speedup_vs_flashmla)
        << ", \"speedup_basis\": " << quote(m.speedup_basis)
        << ", \"max_abs_err\": " << num(res.verdict.max_abs_err, 3)
        << ", \"max_cos_diff\": " << num(res.verdict.max_cos_diff, 3)
        << ", \"max_lse_err\": " << num(res.verdict.max_lse_err, 3) << "}";
    }
    o << "]}";
  }
  o << "\n  ]\n}\n";
  return o.str();
}

std::string to_csv(const RunInfo& info, const std::vector<Record>& records) {
  std::ostringstream o;
  o << "case,suite,config,op,format,b,s_q,h_q,backend,status,check,median_us,p10_us,p90_us,runs,"
       "graph_median_us,span_median_us,tflops,gbps,roofline_pct,flashmla_us,speedup_vs_flashmla,"
       "speedup_basis,flops,bytes,max_abs_err,message,device,commit,date,command\n";
  std::string device;
  for (const auto& d : info.devices) device += (device.empty() ? "" : " + ") + d.name;
  auto n = [](double v) { return std::isfinite(v) ? num(v, 6) : std::string(); };
  for (const auto& r : records) {
    for (const auto& res : r.results) {
      const Metrics m = metrics(r, res);
      const bool timed = res.status == "ok" && res.time.runs > 0;
      o << csv_field(r.c.name) << ',' << r.c.suite << ',' << csv_field(r.c.config) << ','
        << op_name(r.c.op) << ',' << kv_format_name(r.c.format) << ',' << r.c.b << ',' << r.c.s_q
        << ',' << r.c.h_q << ',' << res.backend << ',' << res.status << ',' << check_label(res)
        << ',' << n(m.us) << ',' << n(timed ? res.time.p10_us : kNaN) << ','
        << n(timed ? res.time.p90_us : kNaN) << ',' << res.time.runs << ','
        << n(res.graph_time ? res.graph_time->median_us : kNaN) << ','
        << n(res.span_time ? res.span_time->median_us : kNaN) << ',' << n(m.tflops) << ','
        << n(m.gbps) << ',' << n(m.roofline_pct) << ',' << n(r.c.flashmla_us.value_or(kNaN)) << ','
        << n(m.speedup_vs_flashmla) << ',' << m.speedup_basis << ',' << n(r.work.flops) << ','
        << n(r.work.bytes) << ',' << n(res.verdict.max_abs_err) << ',' << csv_field(res.message)
        << ',' << csv_field(device) << ',' << info.commit << ',' << info.date << ','
        << csv_field(info.command) << '\n';
    }
  }
  return o.str();
}

Progress::Progress(size_t total, bool enabled)
    : total_(total), enabled_(enabled), tty_(isatty(fileno(stderr)) != 0) {}

void Progress::update(size_t done, const std::string& what, double fraction) {
  if (!enabled_) return;
  const int width = 24;
  const double f = total_ ? (static_cast<double>(done) + (fraction >= 0 ? fraction : 0)) /
                                static_cast<double>(total_)
                          : 1.0;
  const int fill = static_cast<int>(f * width + 0.5);
  std::string bar = "[" + std::string(static_cast<size_t>(fill), '#') +
                    std::string(static_cast<size_t>(width - fill), '.') + "] " +
                    std::to_string(done) + "/" + std::to_string(total_) + " " + what;
  if (fraction >= 0) bar += " " + std::to_string(static_cast<int>(fraction * 100)) + "%";
  if (tty_) {
    std::string line = "\r" + bar;
    if (bar.size() < last_len_) line += std::string(last_len_ - bar.size(), ' ');
    last_len_ = bar.size();
    std::fputs(line.c_str(), stderr);
    std::fflush(stderr);
  } else if (what != last_plain_) {  // logs: one line per stage, no percentages
    last_plain_ = what;
    std::fprintf(stderr, "[%zu/%zu] %s\n", done, total_, what.c_str());
  }
}

void Progress::clear() {
  if (!enabled_ || !tty_ || last_len_ == 0) return;
  std::fprintf(stderr, "\r%s\r", std::string(last_len_, ' ').c_str());
  last_len_ = 0;
}

}  // namespace sparse_mla::tools::bench
